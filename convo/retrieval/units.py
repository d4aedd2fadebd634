"""A store of passages split into index units, with a dense and a BM25 index over the units.

A *passage* (:class:`Record`: a turn, a document chunk) is what retrieval hands back; a
*unit* is what the indexes hold (a message of the turn, the chunk itself). Both get int
ids that only grow, so a unit id names one piece of text for the life of the store. A
passage scores as its best unit (:meth:`UnitStore.hits`).

Saved as ``passages.json`` (records and units) and ``vectors.faiss`` (+ ``.json``), each
file written atomically.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from convo.embeddings import TextEncoder
from convo.plan import Passage
from convo.retrieval._io import FORMAT, damaged, read_json, write_json
from convo.retrieval.config import Fusion, RetrievalConfig
from convo.retrieval.indexes.bm25 import BM25Index
from convo.retrieval.indexes.vector import VectorIndex
from convo.retrieval.ranking import fuse


@dataclass(kw_only=True)
class Record:
    """One passage: its text, citation (``source``), key, metadata and unit ids.

    Metadata keys starting with ``_`` are for the ranking only (a turn's ``_lines`` and
    ``_speakers``); :func:`passage_of` leaves them out of a passage.
    """

    text: str
    source: str
    key: str
    meta: dict[str, Any] = field(default_factory=dict)
    units: list[int] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Hit:
    """A passage found: its score (that of its best unit) and that unit's evidence."""

    pid: int
    score: float
    unit: int  # position of the best unit in its passage
    cosine: float | None
    bm25: float


class UnitStore:
    """Passages split into index units; dense and BM25 indexes over the units.

    Args:
        encoder: embeds the units' dense texts.
        exact_max: see :class:`~convo.retrieval.VectorIndex`.
        nprobe: see :class:`~convo.retrieval.VectorIndex`.
    """

    def __init__(self, encoder: TextEncoder, *, exact_max: int, nprobe: int) -> None:
        self.encoder = encoder
        self.exact_max = exact_max
        self.nprobe = nprobe
        self.records: dict[int, Record] = {}
        self.by_key: dict[str, int] = {}
        self.unit_owner: dict[int, int] = {}
        self.unit_text: dict[int, str] = {}
        self.unit_lex: dict[int, str] = {}
        self.lexical = BM25Index()
        self.vectors: VectorIndex | None = None
        self._next_pid = 0
        self._next_uid = 0
        self.version = 0  # bumped by every change, for caches derived from the store

    def __len__(self) -> int:
        return len(self.records)

    def add(
        self,
        items: Sequence[tuple[Record, Sequence[str], Sequence[str]]],
        *,
        vectors: np.ndarray | None = None,
    ) -> list[int]:
        """Add passages. Each item: (record, dense unit texts, lexical unit texts).

        ``vectors``: the units' vectors, one row per dense text in order, when the caller
        computed them (:class:`~convo.retrieval.RetrievalMemory` mixes a line's vector with
        its context's); ``None`` (default): the dense texts are encoded here.
        """
        for rec, _, _ in items:
            if rec.key and rec.key in self.by_key:
                self.remove(self.by_key[rec.key])
        self.version += 1
        uids: list[int] = []
        dense_texts: list[str] = []
        pids = []
        for rec, dense, lexical in items:
            pid = self._next_pid
            self._next_pid += 1
            pids.append(pid)
            self.records[pid] = rec
            if rec.key:
                self.by_key[rec.key] = pid
            for d, lx in zip(dense, lexical, strict=True):
                uid = self._next_uid
                self._next_uid += 1
                rec.units.append(uid)
                self.unit_owner[uid] = pid
                self.unit_text[uid] = d
                self.unit_lex[uid] = lx
                self.lexical.add(uid, lx)
                uids.append(uid)
                dense_texts.append(d)
        if uids:
            vecs = self.encoder.encode(dense_texts) if vectors is None else np.asarray(vectors, np.float32)
            if vecs.shape[0] != len(uids):
                raise ValueError(f"{len(uids)} units but {vecs.shape[0]} vectors")
            if self.vectors is None:
                self.vectors = VectorIndex(vecs.shape[1], exact_max=self.exact_max, nprobe=self.nprobe)
            self.vectors.add(uids, vecs)
        return pids

    def remove(self, pid: int) -> bool:
        rec = self.records.pop(pid, None)
        if rec is None:
            return False
        self.version += 1
        if rec.key and self.by_key.get(rec.key) == pid:
            del self.by_key[rec.key]
        for uid in rec.units:
            self.unit_owner.pop(uid, None)
            self.unit_text.pop(uid, None)
            self.unit_lex.pop(uid, None)
            self.lexical.remove(uid)
        if self.vectors is not None:
            self.vectors.remove(rec.units)
        return True

    def unit_scores(
        self, qvec: np.ndarray, query: str, k: int, config: RetrievalConfig, extra_terms: Sequence[str] = ()
    ) -> tuple[dict[int, float], dict[int, float], dict[int, float]]:
        """``(fused, cosine, bm25)`` per unit for the best ``k`` units of each index."""
        dense: dict[int, float] = {}
        if config.fusion is not Fusion.LEXICAL and self.vectors is not None:
            scores, ids = self.vectors.search(qvec[None, :], k)
            dense = {int(u): float(s) for s, u in zip(scores[0], ids[0], strict=True) if u >= 0}
        lexical: dict[int, float] = {}
        if config.fusion is not Fusion.DENSE:
            lexical = dict(self.lexical.search(query, k, extra_terms))
        return fuse(dense, lexical, config), dense, lexical

    def hits(
        self, fused: Mapping[int, float], dense: Mapping[int, float], lexical: Mapping[int, float], n: int
    ) -> list[Hit]:
        """The best ``n`` passages by unit scores, best first; a passage scores as its best unit."""
        best: dict[int, Hit] = {}
        for uid, score in fused.items():
            pid = self.unit_owner[uid]
            hit = best.get(pid)
            if hit is None or score > hit.score:
                best[pid] = Hit(
                    pid=pid,
                    score=score,
                    unit=self.records[pid].units.index(uid),
                    cosine=dense.get(uid),
                    bm25=lexical.get(uid, 0.0),
                )
        return sorted(best.values(), key=lambda h: (-h.score, h.pid))[:n]

    def search(self, qvec: np.ndarray, query: str, n: int, config: RetrievalConfig) -> list[Hit]:
        """The best ``n`` passages, best first; a passage scores as its best unit."""
        if not self.records:
            return []
        fused, dense, lexical = self.unit_scores(qvec, query, max(config.unit_candidates, 4 * n), config)
        return self.hits(fused, dense, lexical, n)

    # -- persistence ------------------------------------------------------------------------
    def save(self, folder: Path, *, owner: str) -> None:
        """Write the store to ``folder`` (``passages.json``, ``vectors.faiss``), recording
        ``owner`` (``"session:<id>"``, ``"collection:<name>"``) so that :meth:`load` can
        tell a file copied in from another store."""
        folder.mkdir(parents=True, exist_ok=True)
        if self.vectors is not None:
            self.vectors.save(folder / "vectors.faiss")
        data = {
            "format": FORMAT,
            "owner": owner,
            "next_pid": self._next_pid,
            "next_uid": self._next_uid,
            "has_vectors": self.vectors is not None,
            "records": [
                {
                    "pid": pid,
                    "text": r.text,
                    "source": r.source,
                    "key": r.key,
                    "meta": r.meta,
                    "units": [[u, self.unit_text[u], self.unit_lex[u]] for u in r.units],
                }
                for pid, r in self.records.items()
            ],
        }
        write_json(folder / "passages.json", data)

    @classmethod
    def load(
        cls, folder: Path, encoder: TextEncoder, *, exact_max: int, nprobe: int, owner: str
    ) -> UnitStore:
        """Read the store :meth:`save` wrote to ``folder`` for ``owner``.

        Checked, not trusted: ids are ints that grow through the file and stay below the
        next ids (a new turn never takes an id in use), keys are unique, every unit has
        its vector, and a recorded owner must be ``owner`` (files saved before owners were
        recorded have none).

        Raises:
            StoreError: a file is missing or damaged, or belongs to another owner.
        """
        path = folder / "passages.json"
        data = read_json(path)
        if isinstance(data, dict) and data.get("owner", owner) != owner:
            raise damaged(path, f"it belongs to {data['owner']!r}, not {owner!r} (copied in from another)")
        store = cls(encoder, exact_max=exact_max, nprobe=nprobe)
        try:
            has_vectors = store._read_records(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise damaged(path, f"the file is damaged ({exc!r})") from exc
        if has_vectors:
            store.vectors = VectorIndex.load(folder / "vectors.faiss")
            if set(store.unit_owner) != store.vectors.ids:
                raise damaged(
                    folder, "its vectors and passages disagree (a partial save, or a file copied in)"
                )
        return store

    def _read_records(self, data: Any) -> bool:
        """Fill this empty store from ``passages.json``'s content; returns ``has_vectors``.

        Raises:
            KeyError, TypeError, ValueError: the content is not what :meth:`save` writes.
        """
        if not isinstance(data, dict):
            raise TypeError(f"expected a JSON object, got {type(data).__name__}")
        if data["format"] != FORMAT:
            raise ValueError(f"unknown format {data['format']!r}")
        self._next_pid, self._next_uid = _id(data["next_pid"]), _id(data["next_uid"])
        if not isinstance(data["has_vectors"], bool):
            raise TypeError("has_vectors is not a boolean")
        last_pid = last_uid = -1
        for item in data["records"]:
            rec = Record(
                text=_text(item["text"]),
                source=_text(item["source"]),
                key=_text(item["key"]),
                meta=item["meta"],
            )
            if not isinstance(rec.meta, dict):
                raise TypeError(f"the meta of record {item['pid']!r} is not an object")
            pid = last_pid = _id(item["pid"], after=last_pid, below=self._next_pid)
            if rec.key and rec.key in self.by_key:
                raise ValueError(f"two records are keyed {rec.key!r}")
            self.records[pid] = rec
            if rec.key:
                self.by_key[rec.key] = pid
            for uid, text, lx in item["units"]:
                uid = last_uid = _id(uid, after=last_uid, below=self._next_uid)
                rec.units.append(uid)
                self.unit_owner[uid] = pid
                self.unit_text[uid] = _text(text)
                self.unit_lex[uid] = _text(lx)
                self.lexical.add(uid, lx)
        return bool(data["has_vectors"])


def _id(value: Any, *, after: int = -1, below: int | None = None) -> int:
    """``value`` as a saved id: an int above ``after`` (ids grow through the file) and
    below ``below``; else ``ValueError``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"id {value!r} is not an int")
    if value <= after or (below is not None and value >= below):
        raise ValueError(f"id {value} is out of order or past the next id ({after} < id < {below})")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def passage_of(rec: Record, hit: Hit, text: str | None = None) -> Passage:
    """``rec`` found by ``hit`` as a passage (``text`` instead of the record's, if given);
    its metadata without the ranking's ``_`` keys, plus the hit's cosine and BM25 score."""
    meta = {k: v for k, v in rec.meta.items() if not k.startswith("_")}
    meta["cosine"] = None if hit.cosine is None else round(hit.cosine, 4)
    meta["bm25"] = round(hit.bm25, 4)
    return Passage(
        text=rec.text if text is None else text,
        score=float(hit.score),
        source=rec.source,
        key=rec.key,
        meta=meta,
    )
