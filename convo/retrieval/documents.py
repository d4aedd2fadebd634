"""Documents: :func:`chunk_text` cuts a text into overlapping token windows, and a
:class:`DocumentCollection` indexes the chunks so any session can retrieve them.

Each chunk is one passage and one unit (its nearest Markdown heading, then its text),
keyed ``"doc:<collection>:<source>:<start>-<end>"`` (token positions), so a passage cites
where it came from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from convo.embeddings import Embedder, TextEncoder
from convo.errors import ConfigError, StoreError
from convo.messages import Message
from convo.plan import Passage
from convo.retrieval._io import FORMAT, damaged, read_json, write_json
from convo.retrieval.config import RetrievalConfig
from convo.retrieval.indexes.vector import DEFAULT_EXACT_MAX, DEFAULT_NPROBE
from convo.retrieval.units import Record, UnitStore, passage_of
from convo.tokens import TiktokenCounter, TokenCounter

__all__ = ["DEFAULT_CHUNK_TOKENS", "DEFAULT_OVERLAP_TOKENS", "Chunk", "DocumentCollection", "chunk_text"]

#: Document chunk size and overlap, in tokens of the collection's counter.
DEFAULT_CHUNK_TOKENS = 200
DEFAULT_OVERLAP_TOKENS = 40


@dataclass(frozen=True, kw_only=True)
class Chunk:
    """A piece of a document, with where it came from.

    Attributes:
        text: the chunk text (decoded from its tokens).
        source: the document's name (a file path or a label).
        start_token: index of its first token in the document's token sequence.
        end_token: one past its last token.
        heading: the nearest Markdown heading above it (``""`` if none).
    """

    text: str
    source: str
    start_token: int
    end_token: int
    heading: str = ""

    @property
    def citation(self) -> str:
        """``"source:start-end"`` (token positions)."""
        return f"{self.source}:{self.start_token}-{self.end_token}"


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def chunk_text(
    text: str,
    counter: TokenCounter,
    *,
    source: str = "",
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
) -> list[Chunk]:
    """Cut ``text`` into chunks of ``chunk_tokens`` tokens, consecutive chunks sharing
    ``overlap_tokens`` tokens.

    Args:
        text: the document.
        counter: its ``encode``/``decode`` define the tokens.
        source: the document's name, kept for citation.
        chunk_tokens: tokens per chunk (the last may be shorter). Default 200.
        overlap_tokens: tokens repeated at the start of the next chunk. Default 40.

    Returns:
        Chunks in document order; ``chunks[i].start_token == i * (chunk_tokens -
        overlap_tokens)``.

    Raises:
        ConfigError: ``chunk_tokens < 1`` or ``overlap_tokens`` not in ``[0, chunk_tokens)``.
    """
    if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be an int >= 1, got {chunk_tokens!r}")
    if not isinstance(overlap_tokens, int) or not 0 <= overlap_tokens < chunk_tokens:
        raise ConfigError(
            f"overlap_tokens must be in [0, chunk_tokens={chunk_tokens}), got {overlap_tokens!r}"
        )
    ids = counter.encode(text)
    headings: list[tuple[int, str]] = []
    for m in _HEADING.finditer(text):
        headings.append((len(counter.encode(text[: m.start()])), m.group(1)))
    step = chunk_tokens - overlap_tokens
    out: list[Chunk] = []
    start = 0
    while start < len(ids):
        end = min(start + chunk_tokens, len(ids))
        heading = ""
        for pos, title in headings:
            if pos <= start:
                heading = title
            else:
                break
        out.append(
            Chunk(
                text=counter.decode(ids[start:end]),
                source=source,
                start_token=start,
                end_token=end,
                heading=heading,
            )
        )
        if end == len(ids):
            break
        start += step
    return out


class DocumentCollection:
    """A named, shareable collection of document chunks, searchable by meaning and words.

    Attach it to a :class:`RetrievalMemory` (for every session, or one session) to make it
    retrievable; one collection can serve many memories and sessions.

    Args:
        name: the collection's name (also its key prefix: ``"doc:<name>:..."``).
        embedder: the text encoder (default :class:`~convo.embeddings.Embedder`).
        counter: the token counter used for chunking (default cl100k via tiktoken).
        chunk_tokens: tokens per chunk. Default 200.
        overlap_tokens: tokens shared by consecutive chunks. Default 40.
        exact_max: see :class:`VectorIndex`. Default 20,000.

    Example:
        >>> docs = DocumentCollection("manual", embedder=Embedder())      # doctest: +SKIP
        >>> docs.add_file("README.md")                                    # doctest: +SKIP
        >>> docs.search("how do I install it", k=3)[0].source             # doctest: +SKIP
        'README.md:0-200'
    """

    def __init__(
        self,
        name: str,
        *,
        embedder: TextEncoder | None = None,
        counter: TokenCounter | None = None,
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        overlap_tokens: int = DEFAULT_OVERLAP_TOKENS,
        exact_max: int = DEFAULT_EXACT_MAX,
        config: RetrievalConfig | None = None,
    ) -> None:
        if not name or not isinstance(name, str):
            raise ConfigError("a DocumentCollection needs a non-empty name")
        chunk_text("", _NullCounter(), chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)
        self.name = name
        self.embedder: TextEncoder = embedder if embedder is not None else Embedder()
        self._counter = counter
        self.chunk_tokens = chunk_tokens
        self.overlap_tokens = overlap_tokens
        self.config = config or RetrievalConfig()
        self._store = UnitStore(self.embedder, exact_max=exact_max, nprobe=DEFAULT_NPROBE)

    @property
    def counter(self) -> TokenCounter:
        """The chunking counter (cl100k by default, loaded on first use)."""
        if self._counter is None:
            self._counter = TiktokenCounter("cl100k_base")
        return self._counter

    def __len__(self) -> int:
        return len(self._store)

    def add_text(self, text: str, *, source: str) -> list[Chunk]:
        """Chunk ``text`` and index the chunks (replacing an earlier text of ``source``).

        Args:
            text: plain text or Markdown.
            source: its name for citations; re-adding the same source replaces it.

        Returns:
            The chunks indexed.
        """
        if not source:
            raise ConfigError("add_text needs a source name for citations")
        self.remove_source(source)
        chunks = chunk_text(
            text,
            self.counter,
            source=source,
            chunk_tokens=self.chunk_tokens,
            overlap_tokens=self.overlap_tokens,
        )
        items = []
        for c in chunks:
            key = f"doc:{self.name}:{c.citation}"
            unit = f"{c.heading}\n{c.text}" if c.heading else c.text
            meta = {
                "collection": self.name,
                "document": source,
                "start_token": c.start_token,
                "end_token": c.end_token,
                "heading": c.heading,
            }
            items.append((Record(text=c.text, source=c.citation, key=key, meta=meta), [unit], [unit]))
        self._store.add(items)
        return chunks

    def add_file(self, path: str | os.PathLike[str], *, source: str | None = None) -> list[Chunk]:
        """Read a UTF-8 text or Markdown file and :meth:`add_text` it.

        Args:
            path: the file.
            source: its citation name (default: the path as given).
        """
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as exc:
            raise StoreError(f"cannot read {p}: {exc}") from exc
        return self.add_text(text, source=source or str(path))

    def remove_source(self, source: str) -> int:
        """Remove every chunk of ``source``. Returns how many were removed."""
        pids = [p for p, r in self._store.records.items() if r.meta.get("document") == source]
        for pid in pids:
            self._store.remove(pid)
        return len(pids)

    def search(self, query: str, k: int, *, query_vector: np.ndarray | None = None) -> list[Passage]:
        """The ``k`` best chunks for ``query``, best first, as passages."""
        qvec = query_vector if query_vector is not None else self.embedder.encode([query])[0]
        hits = self._store.search(qvec, query, k, self.config)
        return [passage_of(self._store.records[h.pid], h) for h in hits]

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the collection to folder ``path`` (FAISS + JSON, atomically per file)."""
        folder = Path(path)
        self._store.save(folder, owner=f"collection:{self.name}")
        write_json(
            folder / "collection.json",
            {
                "format": FORMAT,
                "name": self.name,
                "chunk_tokens": self.chunk_tokens,
                "overlap_tokens": self.overlap_tokens,
                "exact_max": self._store.exact_max,
                "config": self.config.to_dict(),
            },
        )

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        embedder: TextEncoder | None = None,
        counter: TokenCounter | None = None,
    ) -> DocumentCollection:
        """Read a collection written by :meth:`save`.

        Raises:
            StoreError: a file is missing or damaged, or its chunks are another
                collection's.
        """
        folder = Path(path)
        meta_path = folder / "collection.json"
        meta = read_json(meta_path)
        try:
            if not isinstance(meta, dict):
                raise TypeError(f"expected a JSON object, got {type(meta).__name__}")
            if not isinstance(meta["name"], str):
                raise TypeError("the name is not a string")
            out = cls(
                meta["name"],
                embedder=embedder,
                counter=counter,
                chunk_tokens=int(meta["chunk_tokens"]),
                overlap_tokens=int(meta["overlap_tokens"]),
                exact_max=int(meta["exact_max"]),
                config=RetrievalConfig(**meta["config"]),
            )
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
            raise damaged(meta_path, f"the file is damaged ({exc!r})") from exc
        out._store = UnitStore.load(
            folder,
            out.embedder,
            exact_max=out._store.exact_max,
            nprobe=DEFAULT_NPROBE,
            owner=f"collection:{out.name}",
        )
        return out


class _NullCounter(TokenCounter):
    """Only used to validate chunking parameters without loading a tokenizer."""

    def encode(self, text: str) -> list[int]:
        return []

    def decode(self, ids: Sequence[int]) -> str:
        return ""

    def _message_cost(self, message: Message) -> int:
        return 0

    def count_prompt(self, messages: Sequence[Message]) -> int:
        return 0

    def _overhead_cost(self, starts_with_system: bool) -> int:
        return 0
