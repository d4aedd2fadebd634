"""The text of a reply as it is decoded token by token: incremental detokenizing and stop strings.

Both cost O(reply) over a whole reply, whatever its length and whatever the stop strings:

* :class:`IncrementalDecoder` decodes only the tokens since the last complete piece of text
  (a few tokens), not the whole reply again on every token;
* :class:`StopMatcher` searches each new piece together with the last ``longest stop - 1``
  characters before it, never the whole reply again, and keeps no more than that.

A model's tokenizer is the only collaborator (``decode(ids, skip_special_tokens=True)``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

#: Tokens decoded again before the newest ones, so that a token whose text depends on its
#: left neighbour (SentencePiece's leading space, a byte-level merge) decodes as it does in
#: the whole reply.
CONTEXT_TOKENS = 4


class IncrementalDecoder:
    """The reply's text, extended one token at a time.

    ``add(ids)`` returns the new text those tokens complete (``""`` while a multi-byte
    character is still incomplete). The sum of the pieces equals
    ``tokenizer.decode(all_ids, skip_special_tokens=True)`` for the tokenizers transformers
    ships (byte-level BPE, SentencePiece, WordPiece), checked in the tests.

    Example:
        >>> dec = IncrementalDecoder(tokenizer)        # doctest: +SKIP
        >>> "".join(dec.add([t]) for t in ids) == tokenizer.decode(ids, skip_special_tokens=True)

    Args:
        tokenizer: the model's tokenizer.
        keep_special: ``None`` (default): special tokens are skipped. Else the text keeps
            them, less the ids given here (the end-of-turn tokens), for tool-call markers
            that are special tokens.
    """

    def __init__(self, tokenizer: Any, *, keep_special: Sequence[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self._drop = frozenset(keep_special) if keep_special is not None else None
        self.ids: list[int] = []
        self._prefix = 0  # first token of the window decoded again for context
        self._read = 0  # first token whose text is not emitted yet
        self._parts: list[str] = []

    @property
    def text(self) -> str:
        """All the text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def _decode(self, ids: Sequence[int]) -> str:
        if self._drop is None:
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        kept = [i for i in ids if i not in self._drop]
        return str(self.tokenizer.decode(kept, skip_special_tokens=False))

    def add(self, ids: Iterable[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        done = self._decode(self.ids[self._prefix : self._read])
        whole = self._decode(self.ids[self._prefix :])
        if whole.endswith("\ufffd") or len(whole) <= len(done) or not whole.startswith(done):
            # An incomplete character, or nothing new yet: wait for the next token.
            return ""
        piece = whole[len(done) :]
        self._parts.append(piece)
        self._read = len(self.ids)
        self._prefix = max(self._read - CONTEXT_TOKENS, 0)
        return piece

    def flush(self) -> str:
        """The text still held back at the end of the reply (an incomplete character is
        decoded as the tokenizer decodes it)."""
        done = self._decode(self.ids[self._prefix : self._read])
        whole = self._decode(self.ids[self._prefix :])
        if len(whole) > len(done) and whole.startswith(done):
            piece = whole[len(done) :]
            self._parts.append(piece)
            self._read = len(self.ids)
            return piece
        return ""


class StopMatcher:
    """Finds where the first stop string starts in a reply that grows piece by piece.

    Args:
        stops: the stop strings (empty ones are ignored).

    ``feed(piece)`` returns the offset in the whole reply where the earliest stop string
    begins, once one has appeared, else ``None``. Each call searches only the new piece and
    the ``max(len(stop)) - 1`` characters before it: O(len(piece) + longest stop) per call.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._keep = max((len(s) for s in self.stops), default=1) - 1
        self._tail = ""  # the last ``_keep`` characters fed
        self._seen = 0  # characters fed so far
        self.found: int | None = None

    def feed(self, piece: str) -> int | None:
        if self.found is not None or not self.stops or not piece:
            return self.found
        window = self._tail + piece
        base = self._seen - len(self._tail)
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.found = base + min(hits)
        self._seen += len(piece)
        self._tail = window[-self._keep :] if self._keep else ""
        return self.found
