"""Files and vector stores in OpenAI's shapes, kept in the session store, owned by API key.

``client.files.create(...)``, ``client.vector_stores.create(...)``,
``client.vector_stores.files.create(...)``, ``.list()`` and ``.delete()`` of the ``openai``
SDK work unchanged against ``convo serve`` (routes: :mod:`convo.server.files`). A chat
request names its stores with ``metadata.vector_store_ids`` (a list, or ids separated by
commas, since OpenAI's metadata values are strings); their chunks are ranked beside the
session's memory inside the same retrieval budget, and the reply's ``convo.passages`` cite
each one (``file_id``, token positions).

Text and Markdown are chunked (:func:`~convo.retrieval.chunk_text`) and embedded; PDF and
other binary files get 415. Everything is kept as memory rows of the store
(:meth:`Store.append_memory`, rows of no session), each object in a scope of its own, so
any replica serves them and a delete really removes the text::

    files/<key>                  which files the key has (create / delete marks, no text)
    file/<key>/<file id>         the file: name, bytes, text (one row)
    stores/<key>                 which vector stores the key has (create / delete marks)
    store/<key>/<store id>       the store: name, metadata, files added / removed
    chunks/<key>/<store>/<file>  one file's chunks in one store, with their vectors (one row)

(A ``/``, which no server session id holds, keeps these apart from sessions' own scopes.)

A write that must be whole is one row, and the row that makes it visible comes last (a
file's chunks are written, then the store's "added" mark), so a crash leaves nothing half
made. Limits (:class:`DocumentLimits`) are checked before anything is written.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import date
from typing import Any

import numpy as np

from convo.embeddings import TextEncoder
from convo.errors import ConfigError
from convo.plan import Passage, PreparesTurns, Retriever, Turn
from convo.retrieval.documents import DocumentCollection
from convo.retrieval.scopes import RecordingEncoder
from convo.server.errors import ApiError
from convo.stores import Store

__all__ = ["DocumentLimits", "Documents", "DocumentsView"]


@dataclass(frozen=True, kw_only=True)
class DocumentLimits:
    """What one API key may upload and index.

    Args:
        max_file_bytes: largest file, in bytes; larger gets 413. Default 4 MiB.
        max_chunks_per_store: most chunks one vector store holds; a file that would take
            it past gets 400 (``chunks_limit``) and is not added. Default 20,000.
        max_stores_per_key: most vector stores one key has; another gets 400. Default 100.
        max_files_per_key: most files one key has; another gets 400. Default 1,000.
        max_stores_per_request: most stores one chat request names. Default 8.
        cache_bytes: most bytes of store indexes one replica keeps (LRU; rebuilt from the
            store's rows on a miss, without the embedder). Default 128 MiB.
    """

    max_file_bytes: int = 4 << 20
    max_chunks_per_store: int = 20_000
    max_stores_per_key: int = 100
    max_files_per_key: int = 1_000
    max_stores_per_request: int = 8
    cache_bytes: int = 128 << 20

    def __post_init__(self) -> None:
        for name in (
            "max_file_bytes",
            "max_chunks_per_store",
            "max_stores_per_key",
            "max_files_per_key",
            "max_stores_per_request",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"DocumentLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_bytes < 0:
            raise ConfigError("DocumentLimits.cache_bytes must be >= 0")


#: Content types refused with 415 (binary documents we do not read).
_BINARY_TYPES = ("application/pdf", "application/octet-stream", "application/zip")
#: What a file name may end with to be read as text.
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst", ".csv", ".json", ".log")


def read_text_upload(data: bytes, filename: str, content_type: str, limits: DocumentLimits) -> str:
    """The text of an upload, or the OpenAI-style refusal: 413 past ``max_file_bytes``,
    415 for PDF and other binary files, 400 for an empty file or one not in UTF-8."""
    if len(data) > limits.max_file_bytes:
        raise ApiError(413, f"file over {limits.max_file_bytes} bytes", code="file_too_large", param="file")
    lowered = filename.lower()
    if lowered.endswith(".pdf") or data.startswith(b"%PDF") or content_type in _BINARY_TYPES[:1]:
        raise ApiError(
            415,
            "PDF files are not supported: upload the text (.txt or .md)",
            code="unsupported_file",
            param="file",
        )
    if not data.strip():
        raise ApiError(400, "the file is empty", code="empty_file", param="file")
    if b"\x00" in data:
        raise ApiError(
            415, "binary files are not supported: upload text or Markdown", code="unsupported_file"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ApiError(400, "the file is not UTF-8 text", code="invalid_encoding", param="file") from None
    controls = sum(1 for c in text if ord(c) < 32 and c not in "\n\r\t\f")
    if controls > len(text) // 100:
        raise ApiError(
            415, "binary files are not supported: upload text or Markdown", code="unsupported_file"
        )
    return text


def _folded(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """A list scope's live objects: each ``create`` mark, less those deleted since."""
    live: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("op") == "create":
            live[str(r["id"])] = dict(r)
        elif r.get("op") == "delete":
            live.pop(str(r["id"]), None)
    return live


def _vectors_row(tape: Mapping[str, np.ndarray]) -> dict[str, list[float]]:
    return {t: np.asarray(v, dtype=np.float32).round(7).tolist() for t, v in tape.items()}


class Documents:
    """Files and vector stores of every key, in ``store``; indexes cached per replica.

    Args:
        store: the session store (the rows are kept there).
        embedder: embeds the chunks and the questions.
        limits: :class:`DocumentLimits`.
    """

    def __init__(self, store: Store, embedder: TextEncoder, *, limits: DocumentLimits | None = None) -> None:
        self.store = store
        self.embedder = embedder
        self.limits = limits or DocumentLimits()
        self._cache: OrderedDict[str, tuple[DocumentCollection, int, int]] = OrderedDict()
        self._lock = threading.Lock()

    # -- files ---------------------------------------------------------------------------------
    def create_file(self, owner: str, filename: str, text: str, nbytes: int, purpose: str) -> dict[str, Any]:
        files = _folded(self.store.memory_log(f"files/{owner}").records)
        if len(files) >= self.limits.max_files_per_key:
            raise ApiError(400, f"this key has {len(files)} files, the most it may have", code="files_limit")
        fid = "file-" + uuid.uuid4().hex[:24]
        meta = {
            "id": fid,
            "filename": filename,
            "bytes": nbytes,
            "created_at": int(time.time()),
            "purpose": purpose,
        }
        self.store.append_memory(f"file/{owner}/{fid}", [{**meta, "text": text}], session_id=None)
        self.store.append_memory(f"files/{owner}", [{"op": "create", **meta}], session_id=None)  # now visible
        return self.file_json(meta)

    @staticmethod
    def file_json(meta: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": meta["id"],
            "object": "file",
            "bytes": meta["bytes"],
            "created_at": meta["created_at"],
            "filename": meta["filename"],
            "purpose": meta["purpose"],
            "status": "processed",
            "status_details": None,
        }

    def files(self, owner: str) -> list[dict[str, Any]]:
        live = _folded(self.store.memory_log(f"files/{owner}").records)
        return [self.file_json(m) for m in live.values()]

    def file(self, owner: str, fid: str) -> dict[str, Any]:
        live = _folded(self.store.memory_log(f"files/{owner}").records)
        if fid not in live:
            raise ApiError(404, f"no file {fid!r}", code="not_found", param="file_id")
        return live[fid]

    def delete_file(self, owner: str, fid: str) -> dict[str, Any]:
        self.file(owner, fid)
        self.store.append_memory(f"files/{owner}", [{"op": "delete", "id": fid}], session_id=None)
        self.store.delete_memory(f"file/{owner}/{fid}")  # the text is gone (stores keep their chunks)
        return {"id": fid, "object": "file", "deleted": True}

    # -- vector stores ------------------------------------------------------------------------------
    def create_store(
        self, owner: str, name: str | None, metadata: Mapping[str, str] | None, file_ids: Sequence[str]
    ) -> dict[str, Any]:
        stores = _folded(self.store.memory_log(f"stores/{owner}").records)
        if len(stores) >= self.limits.max_stores_per_key:
            raise ApiError(
                400,
                f"this key has {len(stores)} vector stores, the most it may have",
                code="vector_stores_limit",
            )
        for fid in file_ids:
            self.file(owner, fid)  # 404 before anything is written
        vsid = "vs_" + uuid.uuid4().hex[:24]
        meta = {
            "id": vsid,
            "name": name or "",
            "metadata": dict(metadata or {}),
            "created_at": int(time.time()),
        }
        self.store.append_memory(f"store/{owner}/{vsid}", [{"op": "meta", **meta}], session_id=None)
        self.store.append_memory(f"stores/{owner}", [{"op": "create", **meta}], session_id=None)
        for fid in file_ids:
            self.add_file(owner, vsid, fid)
        return self.store_json(owner, vsid)

    def _store_state(self, owner: str, vsid: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The store's meta and its files (file id -> its "added" mark), or 404."""
        if vsid not in _folded(self.store.memory_log(f"stores/{owner}").records):
            raise ApiError(404, f"no vector store {vsid!r}", code="not_found", param="vector_store_id")
        meta: dict[str, Any] = {}
        files: dict[str, dict[str, Any]] = {}
        for r in self.store.memory_log(f"store/{owner}/{vsid}").records:
            if r.get("op") == "meta":
                meta = dict(r)
            elif r.get("op") == "add":
                files[str(r["file_id"])] = dict(r)
            elif r.get("op") == "remove":
                files.pop(str(r["file_id"]), None)
        return meta, files

    def store_json(self, owner: str, vsid: str) -> dict[str, Any]:
        meta, files = self._store_state(owner, vsid)
        return {
            "id": vsid,
            "object": "vector_store",
            "created_at": meta.get("created_at", 0),
            "name": meta.get("name", ""),
            "usage_bytes": sum(int(f.get("bytes", 0)) for f in files.values()),
            "file_counts": {
                "in_progress": 0,
                "completed": len(files),
                "failed": 0,
                "cancelled": 0,
                "total": len(files),
            },
            "status": "completed",
            "last_active_at": meta.get("created_at", 0),
            "metadata": meta.get("metadata", {}),
            "expires_after": None,
            "expires_at": None,
        }

    def stores(self, owner: str) -> list[dict[str, Any]]:
        live = _folded(self.store.memory_log(f"stores/{owner}").records)
        return [self.store_json(owner, vsid) for vsid in live]

    def delete_store(self, owner: str, vsid: str) -> dict[str, Any]:
        _, files = self._store_state(owner, vsid)
        self.store.append_memory(f"stores/{owner}", [{"op": "delete", "id": vsid}], session_id=None)
        for fid in files:
            self.store.delete_memory(f"chunks/{owner}/{vsid}/{fid}")
        self.store.delete_memory(f"store/{owner}/{vsid}")
        self._forget(owner, vsid)
        return {"id": vsid, "object": "vector_store.deleted", "deleted": True}

    def add_file(self, owner: str, vsid: str, fid: str) -> dict[str, Any]:
        """Chunk and embed file ``fid`` into store ``vsid``: 400 past the store's chunk
        limit, with nothing written."""
        _, files = self._store_state(owner, vsid)
        meta = self.file(owner, fid)
        if fid in files:
            return self.store_file_json(vsid, files[fid])
        rows = self.store.memory_log(f"file/{owner}/{fid}").records
        if not rows:
            raise ApiError(404, f"no file {fid!r}", code="not_found", param="file_id")
        text = str(rows[0]["text"])
        encoder = RecordingEncoder(self.embedder)
        scratch = DocumentCollection(vsid, embedder=encoder)
        with encoder.taping() as tape:
            chunks = scratch.add_text(text, source=fid)
        held = sum(int(f.get("chunks", 0)) for f in files.values())
        if held + len(chunks) > self.limits.max_chunks_per_store:
            raise ApiError(
                400,
                f"the file has {len(chunks)} chunks; with the store's {held} that is over its limit of "
                f"{self.limits.max_chunks_per_store}",
                code="chunks_limit",
                param="file_id",
            )
        chunk_row = {
            "file_id": fid,
            "filename": meta["filename"],
            "text": text,
            "vectors": _vectors_row(tape),
        }
        self.store.append_memory(f"chunks/{owner}/{vsid}/{fid}", [chunk_row], session_id=None)
        mark = {
            "op": "add",
            "file_id": fid,
            "bytes": meta["bytes"],
            "chunks": len(chunks),
            "created_at": int(time.time()),
        }
        self.store.append_memory(f"store/{owner}/{vsid}", [mark], session_id=None)  # now visible
        self._forget(owner, vsid)
        return self.store_file_json(vsid, mark)

    @staticmethod
    def store_file_json(vsid: str, mark: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "id": mark["file_id"],
            "object": "vector_store.file",
            "created_at": mark.get("created_at", 0),
            "vector_store_id": vsid,
            "status": "completed",
            "usage_bytes": mark.get("bytes", 0),
            "last_error": None,
            "attributes": {},
            "chunking_strategy": {
                "type": "static",
                "static": {"max_chunk_size_tokens": 200, "chunk_overlap_tokens": 40},
            },
        }

    def store_files(self, owner: str, vsid: str) -> list[dict[str, Any]]:
        _, files = self._store_state(owner, vsid)
        return [self.store_file_json(vsid, m) for m in files.values()]

    def store_file(self, owner: str, vsid: str, fid: str) -> dict[str, Any]:
        _, files = self._store_state(owner, vsid)
        if fid not in files:
            raise ApiError(
                404, f"no file {fid!r} in vector store {vsid!r}", code="not_found", param="file_id"
            )
        return self.store_file_json(vsid, files[fid])

    def remove_file(self, owner: str, vsid: str, fid: str) -> dict[str, Any]:
        self.store_file(owner, vsid, fid)
        self.store.append_memory(f"store/{owner}/{vsid}", [{"op": "remove", "file_id": fid}], session_id=None)
        self.store.delete_memory(f"chunks/{owner}/{vsid}/{fid}")
        self._forget(owner, vsid)
        return {"id": fid, "object": "vector_store.file.deleted", "deleted": True}

    # -- retrieval ---------------------------------------------------------------------------------
    def collections(self, owner: str, vsids: Sequence[str]) -> list[DocumentCollection]:
        """The indexes of the named stores (404 for one that is not the key's), from the
        cache or rebuilt from the rows without the embedder."""
        if len(vsids) > self.limits.max_stores_per_request:
            raise ApiError(
                400,
                f"at most {self.limits.max_stores_per_request} vector stores per request",
                code="invalid_value",
                param="metadata.vector_store_ids",
            )
        return [self._collection(owner, vsid) for vsid in dict.fromkeys(vsids)]

    def _collection(self, owner: str, vsid: str) -> DocumentCollection:
        _, files = self._store_state(owner, vsid)
        key = f"{owner}:{vsid}"
        version = len(self.store.memory_log(f"store/{owner}/{vsid}").records)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and hit[1] == version:
                self._cache.move_to_end(key)
                return hit[0]
        encoder = RecordingEncoder(self.embedder)
        coll = DocumentCollection(vsid, embedder=encoder)
        nbytes = 0
        for fid in files:
            for row in self.store.memory_log(f"chunks/{owner}/{vsid}/{fid}").records:
                encoder.known.update({t: np.asarray(v, np.float32) for t, v in row["vectors"].items()})
                coll.add_text(str(row["text"]), source=fid)
                nbytes += 3 * len(str(row["text"])) + 2 * sum(4 * len(v) for v in row["vectors"].values())
                encoder.known.clear()
        with self._lock:
            self._cache[key] = (coll, version, nbytes)
            total = sum(n for _, _, n in self._cache.values())
            while len(self._cache) > 1 and total > self.limits.cache_bytes:
                _, (_, _, n) = self._cache.popitem(last=False)
                total -= n
        return coll

    def _forget(self, owner: str, vsid: str) -> None:
        with self._lock:
            self._cache.pop(f"{owner}:{vsid}", None)

    @property
    def cache_bytes(self) -> int:
        """Bytes of store indexes this replica holds."""
        with self._lock:
            return sum(n for _, _, n in self._cache.values())


class DocumentsView(Retriever):
    """A request's retriever: its session's memory (if any) and the named stores' chunks,
    one list by score (as :class:`~convo.retrieval.RetrievalMemory` ranks its collections)."""

    supports_today = True

    def __init__(self, collections: Sequence[DocumentCollection], inner: Retriever | None = None) -> None:
        self.collections = list(collections)
        self.inner = inner
        self.min_score = inner.min_score if inner is not None else float("-inf")
        self.defer_window_turns = isinstance(inner, PreparesTurns) and inner.defer_window_turns

    def remember_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> None:
        if self.inner is not None:
            self.inner.remember_turns(session_id, turns, dates=dates)

    def prepare_turns(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        if isinstance(self.inner, PreparesTurns):
            return self.inner.prepare_turns(session_id, turns, dates=dates)
        return 0

    def turns_ready(
        self, session_id: str, turns: Sequence[Turn], *, dates: Mapping[int, str] | None = None
    ) -> int:
        if isinstance(self.inner, PreparesTurns):
            return self.inner.turns_ready(session_id, turns, dates=dates)
        return len(turns)

    def retrieve(
        self, query: str, *, session_id: str, top_k: int, today: date | str | None = None
    ) -> list[Passage]:
        found: list[Passage] = []
        if self.inner is not None:
            extra = {"today": today} if today is not None and self.inner.supports_today else {}
            found.extend(self.inner.retrieve(query, session_id=session_id, top_k=top_k, **extra))
        if top_k > 0 and query.strip():
            n = top_k * 2
            for coll in self.collections:
                if len(coll):
                    found.extend(coll.search(query, n))
        found.sort(key=lambda p: -p.score)
        return found
