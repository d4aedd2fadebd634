"""The prefix ledger (pure logic, no torch): novel prompt tokens against what each key's KV
last held, forgetting, and the bound on what it remembers."""

from __future__ import annotations

import pytest

from convo.errors import ConfigError
from convo.fast.prefix_ledger import MAX_LEDGER_TOKENS, PrefixLedger


def test_unknown_or_no_key_is_all_novel() -> None:
    ledger = PrefixLedger()
    assert ledger.novel(None, [1, 2, 3]) == 3
    assert ledger.novel("a", [1, 2, 3]) == 3
    assert ledger.novel("a", []) == 0
    ledger.remember("a", [1, 2, 3])
    assert ledger.novel(None, [1, 2, 3]) == 3  # no key: nothing to share with


def test_novel_counts_the_tokens_past_the_common_prefix() -> None:
    ledger = PrefixLedger()
    ledger.remember("a", [1, 2, 3, 4])
    assert ledger.novel("a", [1, 2, 3, 4, 5, 6]) == 2  # extends what the KV held
    assert ledger.novel("a", [1, 2, 3, 4]) == 0
    assert ledger.novel("a", [1, 2]) == 0  # a prefix of it
    assert ledger.novel("a", [1, 9, 3, 4, 5]) == 4  # changed at the second token: the rest is new
    assert ledger.novel("a", [9, 2, 3]) == 3
    assert ledger.novel("b", [1, 2, 3, 4]) == 4  # keys are apart


def test_remember_replaces_and_forget_drops() -> None:
    ledger = PrefixLedger()
    ledger.remember("a", [1, 2, 3])
    ledger.remember("a", [7, 8])
    assert (len(ledger), ledger.tokens) == (1, 2)
    assert ledger.novel("a", [1, 2, 3]) == 3 and ledger.novel("a", [7, 8, 9]) == 1
    ledger.forget("a")
    ledger.forget("never")  # no-op
    assert (len(ledger), ledger.tokens) == (0, 0)
    assert ledger.novel("a", [7, 8, 9]) == 3  # forgotten: unknown


def test_the_bound_drops_the_least_recently_used_key_which_then_counts_as_unknown() -> None:
    ledger = PrefixLedger(max_tokens=10)
    ledger.remember("a", [1] * 4)
    ledger.remember("b", [2] * 4)
    assert ledger.novel("a", [1] * 5) == 1  # "a" is used again: "b" is now the oldest
    ledger.remember("c", [3] * 4)  # 12 > 10: "b" goes
    assert (len(ledger), ledger.tokens) == (2, 8)
    assert ledger.novel("b", [2] * 5) == 5  # dropped: all novel (the floor reads high)
    assert ledger.novel("a", [1] * 5) == 1 and ledger.novel("c", [3] * 5) == 1
    ledger.remember("d", [4] * 11)  # longer than the bound alone: it goes too
    assert ledger.tokens <= 10 and ledger.novel("d", [4] * 11) == 11


def test_the_bound_is_exact_and_validated() -> None:
    ledger = PrefixLedger(max_tokens=8)
    ledger.remember("a", [1] * 4)
    ledger.remember("b", [2] * 4)  # exactly the bound: both kept
    assert (len(ledger), ledger.tokens) == (2, 8)
    assert PrefixLedger().max_tokens == MAX_LEDGER_TOKENS
    with pytest.raises(ConfigError):
        PrefixLedger(max_tokens=-1)
