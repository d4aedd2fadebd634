"""VectorIndex keeps a copy of every vector in one matrix (rows reused after removal), so
the second hop and MMR read a thousand stored vectors per query in one indexing step
(issue 24); what it hands back must stay each id's own vector through adds, removals,
replacements, the switch to IVF and a save and load."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from convo.retrieval import VectorIndex


def unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_stored_vectors_follow_their_ids(tmp_path: Path) -> None:
    dim = 8
    index = VectorIndex(dim, exact_max=120, nprobe=4)
    truth: dict[int, np.ndarray] = {}
    a = unit_rows(100, dim, 0)
    index.add(range(100), a)
    truth.update(zip(range(100), a, strict=True))
    index.remove(range(0, 100, 3))  # free rows, then reuse them
    for i in range(0, 100, 3):
        del truth[i]
    b = unit_rows(80, dim, 1)
    index.add(range(100, 180), b)  # past exact_max: rebuilt as IVF
    truth.update(zip(range(100, 180), b, strict=True))
    c = unit_rows(5, dim, 2)
    index.add([1, 2, 4, 5, 7], c)  # replaced in place
    truth.update(zip([1, 2, 4, 5, 7], c, strict=True))
    assert index.kind == "ivf" and index.ids == frozenset(truth)
    ids = sorted(truth)
    assert np.array_equal(index.vectors(ids), np.stack([truth[i] for i in ids]))
    index.save(tmp_path / "v.faiss")
    again = VectorIndex.load(tmp_path / "v.faiss")
    assert np.array_equal(again.vectors(ids[::-1]), np.stack([truth[i] for i in ids[::-1]]))
    assert again.vectors([]).shape == (0, dim)
