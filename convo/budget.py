"""The token budget of a session: how the context window is shared between prompt parts.

::

    |<------------------------------- context_tokens ------------------------------->|
    | system (pinned) | summary | retrieved | recent turns          | reserve for reply |
    |<- pinned_tokens>|<-cap--->|<-cap----->|<- >= recent_min_tokens>|<-max_new_tokens-->|

The reply reserve is always held back, so a rendered prompt plus ``max_new_tokens`` never
exceeds ``context_tokens``. The recent turns are guaranteed ``recent_min_tokens`` (when they
need that much) before the summary and retrieved passages take anything; whatever those
two leave unused goes back to the recent turns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from convo.errors import ConfigError


class OversizePolicy(enum.StrEnum):
    """What to do with a single message too large for the room the budget leaves it.

    ``TRUNCATE`` keeps the head and the tail of the message in the prompt and puts a
    marker in the middle (the stored message is never changed). ``RAISE`` refuses with a
    :class:`~convo.errors.BudgetError` before anything is stored.
    """

    TRUNCATE = "truncate"
    RAISE = "raise"


@dataclass(frozen=True, kw_only=True)
class Budget:
    """Token limits of one session. All values are in tokens of the model's tokenizer.

    Args:
        context_tokens: the whole window: rendered prompt + reply. Default 2048.
        max_new_tokens: tokens reserved for (and the cap on) each reply. Default 256.
        window_turns: the most recent turns shown verbatim (a turn is a user message and
            everything that answered it). Default 8.
        summary_tokens: hard cap on the rolling summary of older turns. Default 256;
            0 disables summarizing. The model summarizer lowers it to what one summary
            call holds in the model's context (``(context - instructions) // 3``, ~150
            in a 512-token context; see
            :class:`~convo.summarize.ModelSummarizer` and ``Session.summary_cap``); a
            context that holds no summary is refused when the session is made.
        summarize_batch_turns: fold evicted turns into the summary only once this many
            are waiting, so the model is not asked to re-summarize every turn. Default 4.
        retrieval_tokens: cap on retrieved passages; 0 disables retrieval. Default
            ``None``: no cap of its own, memory takes what the pinned part, the summary
            and the recent turns' guaranteed share (``recent_min_tokens``) leave
            (:attr:`retrieval_cap`), and what it leaves unused goes back to the recent
            turns. Only a session with a retriever uses it. (It was 384 with top-k 6,
            which starved memory: on LongMemEval's development questions a session with
            memory on got 0.27 of the evidence into the prompt at 2,048 tokens where plain
            BM25 given the room got 0.73; see ``benchmarks/longmemeval.py``.)
        retrieval_top_k: at most this many passages. Default 40 (a chat's lines are short:
            a line of LoCoMo is ~30 tokens, so the tokens bind first at these budgets).
        pinned_tokens: cap on the pinned part (system prompt, pinned facts). Default
            ``None``: a quarter of the prompt room (:attr:`pinned_cap`).
        recent_min_tokens: share guaranteed to the recent turns before the summary and
            retrieval take theirs. Default ``None``: half of what the reserve and the
            pinned cap leave (:attr:`recent_min`).
        retrieval_min_tokens: share retrieval keeps in a session with memory while the
            turns inside the window hold their place. Those turns are shown until the
            window slides, so that each turn's prompt extends the last one (its KV is
            reused); retrieval takes what they leave, but at least this much. Default
            ``None``: a quarter of what the pinned cap leaves of the prompt room
            (:attr:`retrieval_min`; 372 at 2,048 tokens with a 64-token reply). Without
            it, memory filled the room every turn, every turn pushed a turn out, and the
            whole prompt after the summary was prefilled again every turn (issue 24).
        margin_tokens: safety margin kept free, for counters that are not exact (e.g. a
            tiktoken count for a remote model). Default 0.
        oversize: policy for a single message too large to fit. Default ``TRUNCATE``.

    Raises:
        ConfigError: a value is out of range or the parts cannot fit together.

    Example:
        >>> Budget(context_tokens=2048, max_new_tokens=256).available_prompt_tokens
        1792
    """

    context_tokens: int = 2048
    max_new_tokens: int = 256
    window_turns: int = 8
    summary_tokens: int = 256
    summarize_batch_turns: int = 4
    retrieval_tokens: int | None = None
    retrieval_top_k: int = 40
    pinned_tokens: int | None = None
    recent_min_tokens: int | None = None
    retrieval_min_tokens: int | None = None
    margin_tokens: int = 0
    oversize: OversizePolicy = OversizePolicy.TRUNCATE

    def __post_init__(self) -> None:
        for name in (
            "context_tokens",
            "max_new_tokens",
            "window_turns",
            "summary_tokens",
            "summarize_batch_turns",
            "retrieval_tokens",
            "retrieval_top_k",
            "retrieval_min_tokens",
            "margin_tokens",
        ):
            value = getattr(self, name)
            if name in ("retrieval_tokens", "retrieval_min_tokens") and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"Budget.{name} must be an int, got {value!r}")
            if value < 0:
                raise ConfigError(f"Budget.{name} must be >= 0, got {value}")
        if self.context_tokens <= 0:
            raise ConfigError("Budget.context_tokens must be > 0 (an empty budget holds nothing)")
        if self.max_new_tokens < 1:
            raise ConfigError("Budget.max_new_tokens must be >= 1")
        if self.max_new_tokens >= self.context_tokens:
            raise ConfigError(
                f"Budget.max_new_tokens ({self.max_new_tokens}) must be smaller than "
                f"context_tokens ({self.context_tokens}): nothing would be left for the prompt"
            )
        if self.window_turns < 1:
            raise ConfigError("Budget.window_turns must be >= 1")
        if self.summarize_batch_turns < 1:
            raise ConfigError("Budget.summarize_batch_turns must be >= 1")
        try:
            object.__setattr__(self, "oversize", OversizePolicy(self.oversize))
        except ValueError:
            valid = ", ".join(p.value for p in OversizePolicy)
            raise ConfigError(f"Budget.oversize must be one of: {valid}; got {self.oversize!r}") from None
        room = self.context_tokens - self.max_new_tokens - self.margin_tokens
        if room <= 0:
            raise ConfigError("Budget.margin_tokens leaves no room for the prompt")
        pinned = self.pinned_cap
        if not isinstance(pinned, int) or isinstance(pinned, bool) or pinned < 0 or pinned > room:
            raise ConfigError(f"Budget.pinned_tokens must be in [0, {room}], got {pinned!r}")
        recent = self.recent_min
        if not isinstance(recent, int) or isinstance(recent, bool) or recent < 0 or pinned + recent > room:
            raise ConfigError(
                f"Budget.recent_min_tokens ({recent!r}) + pinned_tokens ({pinned}) must fit in "
                f"the {room} prompt tokens the reply reserve leaves"
            )

    @property
    def available_prompt_tokens(self) -> int:
        """Tokens a rendered prompt may use: context minus reply reserve and margin."""
        return self.context_tokens - self.max_new_tokens - self.margin_tokens

    @property
    def retrieval_cap(self) -> int:
        """The retrieved passages' cap: ``retrieval_tokens``, or the whole prompt room when
        it is ``None`` (the recent turns' guaranteed share and the other parts bound it
        first; derived on every read)."""
        if self.retrieval_tokens is not None:
            return self.retrieval_tokens
        return self.available_prompt_tokens

    @property
    def pinned_cap(self) -> int:
        """The pinned part's cap: ``pinned_tokens``, or a quarter of the prompt room when it is
        ``None`` (derived on every read, so ``dataclasses.replace`` never keeps a stale cap)."""
        if self.pinned_tokens is not None:
            return self.pinned_tokens
        return self.available_prompt_tokens // 4

    @property
    def recent_min(self) -> int:
        """The recent turns' guaranteed share: ``recent_min_tokens``, or half of what the
        pinned cap leaves of the prompt room when it is ``None`` (derived on every read)."""
        if self.recent_min_tokens is not None:
            return self.recent_min_tokens
        return (self.available_prompt_tokens - self.pinned_cap) // 2

    @property
    def retrieval_min(self) -> int:
        """Retrieval's share beside a window that holds its place: ``retrieval_min_tokens``,
        or a quarter of what the pinned cap leaves of the prompt room when it is ``None``
        (derived on every read)."""
        if self.retrieval_min_tokens is not None:
            return self.retrieval_min_tokens
        return (self.available_prompt_tokens - self.pinned_cap) // 4

    def to_dict(self) -> dict[str, object]:
        """JSON-safe settings (what a store persists with the session)."""
        return {
            "context_tokens": self.context_tokens,
            "max_new_tokens": self.max_new_tokens,
            "window_turns": self.window_turns,
            "summary_tokens": self.summary_tokens,
            "summarize_batch_turns": self.summarize_batch_turns,
            "retrieval_tokens": self.retrieval_tokens,
            "retrieval_top_k": self.retrieval_top_k,
            "pinned_tokens": self.pinned_tokens,
            "recent_min_tokens": self.recent_min_tokens,
            "retrieval_min_tokens": self.retrieval_min_tokens,
            "margin_tokens": self.margin_tokens,
            "oversize": self.oversize.value,
        }

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Budget:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)  # type: ignore[arg-type]
