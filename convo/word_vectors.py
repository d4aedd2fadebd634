"""A process-wide and on-disk cache of single words' vectors, per embedding model.

A word's vector does not depend on the session it came from, so a retrieval vocabulary
(:class:`~convo.retrieval.expansion.Vocabulary`: thousands of words per session) needs
each word embedded once per model, not once per session and process.
:class:`~convo.embeddings.Embedder` answers single words from a :class:`WordVectorCache`:

- in the process, one cache per model identity (every ``Embedder`` of that model shares it);
- on disk, under ``convo.paths.cache_dir() / "word-vectors" / <identity hash>/``, as small
  ``.npz`` segments (no pickle), each written to a temporary name and renamed into place,
  so concurrent processes never read half a file. Segments are merged once there are
  more than :data:`MAX_SEGMENTS`; at most ``max_words`` words are kept (the newest).

Only single words (no whitespace, at most :data:`MAX_WORD_CHARS` characters) are cached,
never a message or a query. The folder can be deleted at any time (it is rebuilt as
words are embedded); ``$CONVO_WORD_CACHE=0`` (or ``Embedder(word_cache=False)``) keeps
the cache in the process only.
"""

from __future__ import annotations

import atexit
import hashlib
import io
import logging
import os
import tempfile
import threading
import time
import zipfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from convo.paths import cache_dir

logger = logging.getLogger(__name__)

#: Most words a cache keeps, in the process and on disk (the newest win). 50,000 MiniLM
#: vectors are about 77 MB; one LongMemEval history has about 4,000 words.
DEFAULT_MAX_WORDS = 50_000
#: Longest text, in characters, that counts as a single word and is cached.
MAX_WORD_CHARS = 40
#: New words held in the process before they are written to disk as one segment (the
#: rest are written when the process exits).
FLUSH_WORDS = 256
#: Segments on disk above which they are merged into one.
MAX_SEGMENTS = 32
#: Environment variable: ``0`` / ``false`` / ``off`` keeps word caches in the process only.
WORD_CACHE_ENV = "CONVO_WORD_CACHE"

_SUFFIX = ".npz"


def is_word(text: str) -> bool:
    """Whether ``text`` is cached as a single word: non-empty, at most
    :data:`MAX_WORD_CHARS` characters, no whitespace."""
    return 0 < len(text) <= MAX_WORD_CHARS and not any(c.isspace() for c in text)


def disk_enabled() -> bool:
    """Whether word caches write to disk (``$CONVO_WORD_CACHE`` is not ``0``/``false``/``off``)."""
    return os.environ.get(WORD_CACHE_ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def default_folder(identity: str) -> Path:
    """The folder of the words of the model named ``identity``."""
    digest = hashlib.sha1(identity.encode("utf-8")).hexdigest()[:16]
    return cache_dir() / "word-vectors" / digest


class WordVectorCache:
    """Vectors of single words for one embedding model, in memory and (optionally) on disk.

    Args:
        identity: what names the model and how its vectors are computed (path, precision);
            recorded in every file and checked on reading.
        dim: vector length; files of another length are ignored.
        folder: where segments are kept; ``None``: in the process only.
        max_words: the most words kept (LRU in memory; newest on disk). Default
            :data:`DEFAULT_MAX_WORDS`.

    Thread-safe; safe for several processes sharing ``folder`` (atomic renames, and a
    file that disappears while read is skipped: it is only a cache).
    """

    def __init__(
        self, identity: str, dim: int, *, folder: Path | None, max_words: int = DEFAULT_MAX_WORDS
    ) -> None:
        if not isinstance(max_words, int) or max_words < 1:
            raise ValueError(f"WordVectorCache.max_words must be an int >= 1, got {max_words!r}")
        self.identity = identity
        self.dim = dim
        self.folder = folder
        self.max_words = max_words
        self._vecs: OrderedDict[str, np.ndarray] = OrderedDict()
        self._pending: dict[str, np.ndarray] = {}
        self._loaded = folder is None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._vecs)

    def get_many(self, words: Iterable[str]) -> dict[str, np.ndarray]:
        """The cached vectors of ``words`` (those not cached are left out)."""
        with self._lock:
            self._load()
            out = {}
            for w in words:
                v = self._vecs.get(w)
                if v is not None:
                    self._vecs.move_to_end(w)
                    out[w] = v
            return out

    def put_many(self, vectors: Mapping[str, np.ndarray]) -> None:
        """Cache ``vectors`` (word -> vector); written to disk once :data:`FLUSH_WORDS`
        are pending (or when the process exits)."""
        fresh = {w: np.asarray(v, dtype=np.float32) for w, v in vectors.items() if is_word(w)}
        if not fresh:
            return
        with self._lock:
            self._load()
            for w, v in fresh.items():
                self._vecs[w] = v
                self._vecs.move_to_end(w)
            while len(self._vecs) > self.max_words:
                self._vecs.popitem(last=False)
            if self.folder is not None:
                self._pending.update(fresh)
                if len(self._pending) >= FLUSH_WORDS:
                    self._flush()

    def flush(self) -> None:
        """Write pending words to disk now (nothing without a folder)."""
        with self._lock:
            self._flush()

    # -- disk ------------------------------------------------------------------------------
    def _segments(self) -> list[Path]:
        assert self.folder is not None
        try:
            return sorted(
                p for p in self.folder.iterdir() if p.name.endswith(_SUFFIX) and not p.name.startswith(".")
            )
        except OSError:
            return []

    def _read(self, path: Path) -> dict[str, np.ndarray]:
        try:
            with np.load(path, allow_pickle=False) as data:
                words, vecs, ident = data["words"], data["vectors"], str(data["identity"])
        except FileNotFoundError:
            return {}  # merged away by another process meanwhile
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            logger.warning("word cache file %s cannot be read (%s); it is skipped", path, exc)
            return {}
        if ident != self.identity or vecs.ndim != 2 or vecs.shape != (len(words), self.dim):
            logger.warning("word cache file %s is of another model or shape; it is skipped", path)
            return {}
        if words.dtype.kind != "U" or vecs.dtype != np.float32 or not np.isfinite(vecs).all():
            logger.warning("word cache file %s holds values of the wrong kind; it is skipped", path)
            return {}
        return dict(zip(words.tolist(), vecs, strict=True))

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        disk: dict[str, np.ndarray] = {}
        for path in self._segments():
            disk.update(self._read(path))  # later segments (newer names) win
        for w, v in list(disk.items())[-self.max_words :]:
            self._vecs.setdefault(w, v)

    def _write(self, words: Sequence[str], vecs: np.ndarray) -> Path:
        assert self.folder is not None
        self.folder.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        np.savez(
            buf,
            words=np.asarray(list(words), dtype=str),
            vectors=np.ascontiguousarray(vecs, dtype=np.float32).reshape(len(words), self.dim),
            identity=np.asarray(self.identity, dtype=str),
        )
        name = f"{time.time_ns():020d}-{os.getpid()}-{os.urandom(4).hex()}{_SUFFIX}"
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(buf.getvalue())
            os.replace(tmp, self.folder / name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return self.folder / name

    def _flush(self) -> None:
        if self.folder is None or not self._pending:
            return
        words = list(self._pending)
        try:
            self._write(words, np.stack([self._pending[w] for w in words]))
            self._pending.clear()
            segments = self._segments()
            if len(segments) > MAX_SEGMENTS:
                self._merge(segments)
        except OSError as exc:  # a read-only or full disk: the cache stays in the process
            logger.warning(
                "word cache %s cannot be written (%s); it is kept in memory only", self.folder, exc
            )
            self._pending.clear()
            self.folder = None

    def _merge(self, segments: Sequence[Path]) -> None:
        """Merge ``segments`` into one of at most ``max_words`` words (the newest), then
        remove them (a segment another process removed first is skipped)."""
        merged: dict[str, np.ndarray] = {}
        for path in segments:
            merged.update(self._read(path))
        words = list(merged)[-self.max_words :]
        if words:
            self._write(words, np.stack([merged[w] for w in words]))
        for path in segments:
            try:
                path.unlink()
            except FileNotFoundError:
                pass


_SHARED: dict[tuple[str, int, str], WordVectorCache] = {}
_SHARED_LOCK = threading.Lock()


def shared_cache(identity: str, dim: int, *, on_disk: bool = True) -> WordVectorCache:
    """The process-wide cache of the model named ``identity`` (one per identity, dimension
    and folder), on disk in :func:`default_folder` unless ``on_disk`` is false or
    ``$CONVO_WORD_CACHE`` turns disk caches off."""
    folder = default_folder(identity) if on_disk and disk_enabled() else None
    key = (identity, dim, str(folder))
    with _SHARED_LOCK:
        cache = _SHARED.get(key)
        if cache is None:
            cache = _SHARED[key] = WordVectorCache(identity, dim, folder=folder)
        return cache


@atexit.register
def _flush_all() -> None:
    for cache in list(_SHARED.values()):
        try:
            cache.flush()
        except Exception as exc:  # never fail an exit over a cache
            logger.debug("word cache flush at exit failed: %s", exc)
