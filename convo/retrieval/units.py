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
from convo.errors import StoreError
from convo.plan import Passage
from convo.retrieval._io import FORMAT, read_json, write_json
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

    def add(self, items: Sequence[tuple[Record, Sequence[str], Sequence[str]]]) -> list[int]:
        """Add passages. Each item: (record, dense unit texts, lexical unit texts)."""
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
            vecs = self.encoder.encode(dense_texts)
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
    def save(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        if self.vectors is not None:
            self.vectors.save(folder / "vectors.faiss")
        data = {
            "format": FORMAT,
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
    def load(cls, folder: Path, encoder: TextEncoder, *, exact_max: int, nprobe: int) -> UnitStore:
        data = read_json(folder / "passages.json")
        store = cls(encoder, exact_max=exact_max, nprobe=nprobe)
        store._next_pid = int(data["next_pid"])
        store._next_uid = int(data["next_uid"])
        for item in data["records"]:
            rec = Record(text=item["text"], source=item["source"], key=item["key"], meta=item["meta"])
            pid = int(item["pid"])
            store.records[pid] = rec
            if rec.key:
                store.by_key[rec.key] = pid
            for uid, text, lx in item["units"]:
                rec.units.append(int(uid))
                store.unit_owner[int(uid)] = pid
                store.unit_text[int(uid)] = text
                store.unit_lex[int(uid)] = lx
                store.lexical.add(int(uid), lx)
        if data["has_vectors"]:
            store.vectors = VectorIndex.load(folder / "vectors.faiss")
            if set(store.unit_owner) != store.vectors.ids:
                raise StoreError(f"{folder}: vectors and passages disagree; the save was partial")
        return store


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
