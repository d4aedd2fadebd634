"""A FAISS inner-product index with stable int64 ids, exact then approximate when large.

faiss is imported on first use; without it a :class:`~convo.errors.MissingDependency`
names ``pip install 'convo[retrieval]'``.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from convo.errors import ConfigError, MissingDependency
from convo.retrieval._io import FORMAT, damaged, read_json, write_json

#: Above this many vectors a :class:`VectorIndex` becomes approximate (IVF). Exact search
#: over 20,000 MiniLM vectors takes about a millisecond per query on one core.
DEFAULT_EXACT_MAX = 20_000
#: IVF lists probed per query (of about sqrt(n) lists).
DEFAULT_NPROBE = 16
#: :meth:`VectorIndex.vectors` finds rows through an array indexed by id while every id
#: is below this many times the count of vectors (plus 4,096): a store's growing ids. A
#: larger id (a caller's own sparse ids) turns the array off for that index: rows are then
#: found through a dictionary, a thousand ids in about 0.1 ms more.
DENSE_IDS_FACTOR = 4


def faiss_module() -> Any:
    """The ``faiss`` module, imported on first use.

    Raises:
        MissingDependency: faiss is not installed (the message names the extra).
    """
    try:
        import faiss
    except ImportError:
        raise MissingDependency("faiss is not installed; run: pip install 'convo[retrieval]'") from None
    return faiss


class VectorIndex:
    """Inner-product FAISS index with stable int64 ids: exact, then approximate when large.

    Up to ``exact_max`` vectors it is an ``IndexIDMap2`` over ``IndexFlatIP`` (exact). When
    an :meth:`add` takes it past ``exact_max`` it is rebuilt once as an ``IndexIVFFlat``
    (inner product, about ``sqrt(n)`` lists trained on the vectors it holds, ``nprobe``
    lists searched per query). IVF was chosen over HNSW because it deletes natively. With
    normalized vectors the scores are cosine similarities.

    Args:
        dim: vector length.
        exact_max: the most vectors kept in the exact index. Default 20,000.
        nprobe: IVF lists searched per query once approximate. Default 16.

    Raises:
        ConfigError: ``dim < 1``, ``exact_max < 1`` or ``nprobe < 1``.

    Example:
        >>> index = VectorIndex(384)                              # doctest: +SKIP
        >>> index.add([7], vectors)                               # doctest: +SKIP
        >>> scores, ids = index.search(queries, k=5)              # doctest: +SKIP
    """

    def __init__(self, dim: int, *, exact_max: int = DEFAULT_EXACT_MAX, nprobe: int = DEFAULT_NPROBE) -> None:
        for name, value in (("dim", dim), ("exact_max", exact_max), ("nprobe", nprobe)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"VectorIndex.{name} must be an int >= 1, got {value!r}")
        faiss = faiss_module()
        self.dim = dim
        self.exact_max = exact_max
        self.nprobe = nprobe
        self._index: Any = faiss.IndexIDMap2(faiss.IndexFlatIP(dim))
        self._ids: set[int] = set()
        # A copy of every vector, one row per id: the second retrieval hop and MMR read
        # stored vectors (a thousand a query), and an IVF index cannot hand them back by
        # id. Rows of removed ids are reused.
        self._mat = np.zeros((0, dim), dtype=np.float32)
        self._row: dict[int, int] = {}
        self._free: list[int] = []
        # The same map as an array (id -> row, -1: none), while ids stay small; None: off.
        self._row_of: np.ndarray | None = np.full(0, -1, np.int64)

    @property
    def kind(self) -> str:
        """``"flat"`` (exact) or ``"ivf"`` (approximate)."""
        return "flat" if isinstance(self._index, faiss_module().IndexIDMap2) else "ivf"

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, vid: object) -> bool:
        return vid in self._ids

    @property
    def ids(self) -> frozenset[int]:
        """Every id the index holds."""
        return frozenset(self._ids)

    def _check(self, vectors: np.ndarray) -> np.ndarray:
        arr = np.ascontiguousarray(vectors, dtype=np.float32)
        if arr.ndim != 2 or arr.shape[1] != self.dim:
            raise ConfigError(f"expected vectors of shape (n, {self.dim}), got {arr.shape}")
        return arr

    def add(self, ids: Sequence[int], vectors: np.ndarray) -> None:
        """Add (or replace) vectors under ``ids``.

        Args:
            ids: one int id per row; an id already present is replaced.
            vectors: ``(len(ids), dim)`` array, normalized for cosine scores.
        """
        arr = self._check(vectors)
        id_arr = np.asarray(list(ids), dtype=np.int64)
        if len(id_arr) != len(arr):
            raise ConfigError(f"{len(id_arr)} ids for {len(arr)} vectors")
        if len(set(id_arr.tolist())) != len(id_arr):
            raise ConfigError("duplicate ids in one add()")
        if not len(arr):
            return
        self.remove([i for i in id_arr.tolist() if i in self._ids])
        if self.kind == "flat" and len(self._ids) + len(arr) > self.exact_max:
            old_ids, old_vecs = self._dump()
            self._build_ivf(np.concatenate([old_ids, id_arr]), np.concatenate([old_vecs, arr]))
        else:
            self._index.add_with_ids(arr, id_arr)
        self._ids.update(id_arr.tolist())
        self._keep(id_arr.tolist(), arr)

    def _keep(self, ids: Sequence[int], arr: np.ndarray) -> None:
        """Copy ``arr``'s rows into the store of vectors, under ``ids`` (not yet in it)."""
        need = len(ids) - len(self._free)
        if need > 0:
            n = len(self._mat)
            grown = np.zeros((max(2 * n, n + need, 64), self.dim), dtype=np.float32)
            grown[:n] = self._mat
            self._mat = grown
            used = len(self._row) + len(self._free)
            self._free.extend(range(len(self._mat) - 1, used - 1, -1))
        rows = [self._free.pop() for _ in ids]
        self._mat[rows] = arr
        self._row.update(zip(ids, rows, strict=True))
        if self._row_of is not None and len(ids):
            lo, hi = min(ids), max(ids)
            if lo < 0 or hi >= DENSE_IDS_FACTOR * (len(self._row) + 4096):
                self._row_of = None
            else:
                if hi >= len(self._row_of):
                    grown = np.full(max(hi + 1, 2 * len(self._row_of)), -1, np.int64)
                    grown[: len(self._row_of)] = self._row_of
                    self._row_of = grown
                self._row_of[list(ids)] = rows

    def _dump(self) -> tuple[np.ndarray, np.ndarray]:
        faiss = faiss_module()
        n = self._index.ntotal
        ids = faiss.vector_to_array(self._index.id_map).astype(np.int64)
        vecs = self._index.index.reconstruct_n(0, n) if n else np.zeros((0, self.dim), np.float32)
        return ids, np.asarray(vecs, dtype=np.float32)

    def _build_ivf(self, ids: np.ndarray, vecs: np.ndarray) -> None:
        faiss = faiss_module()
        nlist = max(1, min(int(math.sqrt(len(vecs))), len(vecs) // 39))
        quantizer = faiss.IndexFlatIP(self.dim)
        index = faiss.IndexIVFFlat(quantizer, self.dim, nlist, faiss.METRIC_INNER_PRODUCT)
        index.train(vecs)
        index.nprobe = min(self.nprobe, nlist)
        index.add_with_ids(vecs, ids)
        self._quantizer = quantizer  # the IVF index does not own it: keep it alive
        self._index = index

    def remove(self, ids: Iterable[int]) -> int:
        """Remove ``ids`` (unknown ids are ignored). Returns how many were removed."""
        present = [int(i) for i in ids if int(i) in self._ids]
        if not present:
            return 0
        removed = int(self._index.remove_ids(np.asarray(present, dtype=np.int64)))
        self._ids.difference_update(present)
        for i in present:
            self._free.append(self._row.pop(i))
        if self._row_of is not None:
            self._row_of[present] = -1
        return removed

    def vectors(self, ids: Sequence[int]) -> np.ndarray:
        """The stored vectors of ``ids`` as a ``(len(ids), dim)`` array.

        Raises:
            KeyError: an id is not in the index.
        """
        if not len(ids):
            return np.zeros((0, self.dim), np.float32)
        if self._row_of is not None:
            at = np.asarray(ids, dtype=np.int64)
            if at.min() >= 0 and at.max() < len(self._row_of):
                rows = self._row_of[at]
                if rows.min() >= 0:
                    return self._mat[rows]
        row = self._row  # also where an id is missing: the KeyError names it
        return self._mat[[row[int(i)] for i in ids]]

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The ``k`` best ids for each query row.

        Args:
            vectors: ``(m, dim)`` queries.
            k: results per query.

        Returns:
            ``(scores, ids)``, both ``(m, k')`` with ``k' = min(k, len(self))``, best first;
            an id of ``-1`` marks a missing result (possible with IVF).
        """
        arr = self._check(vectors)
        k = min(int(k), len(self._ids))
        if k <= 0:
            return np.zeros((len(arr), 0), np.float32), np.zeros((len(arr), 0), np.int64)
        scores, ids = self._index.search(arr, k)
        return scores, ids

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the index to ``path`` (FAISS format) and its settings to ``path.json``.

        Both files are written to temporary names and moved into place atomically.
        """
        faiss = faiss_module()
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        os.close(fd)
        try:
            faiss.write_index(self._index, tmp)
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        meta = {
            "format": FORMAT,
            "dim": self.dim,
            "exact_max": self.exact_max,
            "nprobe": self.nprobe,
            "kind": self.kind,
            "count": len(self),
        }
        write_json(target.with_name(target.name + ".json"), meta)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> VectorIndex:
        """Read an index written by :meth:`save`.

        Raises:
            StoreError: the files are missing, unreadable or disagree with each other.
        """
        faiss = faiss_module()
        target = Path(path)
        meta_path = target.with_name(target.name + ".json")
        meta = read_json(meta_path)
        try:
            dim, exact_max, nprobe, count = (int(meta[k]) for k in ("dim", "exact_max", "nprobe", "count"))
            kind = meta["kind"]
            out = cls(dim, exact_max=exact_max, nprobe=nprobe)
        except (KeyError, TypeError, ValueError) as exc:  # ConfigError is a ValueError
            raise damaged(meta_path, f"damaged index settings ({exc!r})") from exc
        try:
            raw = faiss.read_index(str(target))
        except Exception as exc:
            raise damaged(target, f"cannot read the FAISS index ({exc})") from exc
        want = {"flat": faiss.IndexIDMap2, "ivf": faiss.IndexIVFFlat}.get(kind)
        if want is None or not isinstance(raw, want):
            raise damaged(target, f"the index is not of the kind its settings name ({kind!r})")
        # read_index returns the concrete, owning type; a downcast view would dangle.
        out._index = raw
        if kind == "flat":
            ids, vecs = out._dump()
        else:
            raw.nprobe = min(out.nprobe, raw.nlist)
            invlists = raw.invlists
            lists = [i for i in range(raw.nlist) if invlists.list_size(i)]
            chunks = [faiss.rev_swig_ptr(invlists.get_ids(i), invlists.list_size(i)).copy() for i in lists]
            # IVFFlat codes are the raw float32 vectors.
            codes = [
                faiss.rev_swig_ptr(invlists.get_codes(i), invlists.list_size(i) * raw.code_size)
                .copy()
                .view(np.float32)
                .reshape(-1, out.dim)
                for i in lists
            ]
            ids = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
            vecs = np.concatenate(codes) if codes else np.zeros((0, out.dim), np.float32)
        out._ids = {int(i) for i in ids}
        out._keep([int(i) for i in ids], np.asarray(vecs, dtype=np.float32).reshape(len(ids), out.dim))
        if out._index.d != out.dim or len(out._ids) != count:
            raise damaged(target, "the index and its settings disagree (a partial save)")
        return out
