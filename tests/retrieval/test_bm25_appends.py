"""BM25's per-term arrays take new documents by appending (issue 24: in a chat each new
message dropped the arrays of its common words, rebuilt from thousands of postings for
the next question); the scores must be those of an index built from scratch."""

from __future__ import annotations

import random

from convo.retrieval import BM25Index


def test_scores_after_adds_and_removes_match_a_fresh_index() -> None:
    rng = random.Random(7)
    words = [f"w{i}" for i in range(30)]
    live: dict[int, str] = {}
    index = BM25Index()
    for step in range(600):
        if rng.random() < 0.8 or not live:
            text = " ".join(rng.choices(words, k=rng.randint(1, 10)))
            index.add(step, text)
            live[step] = text
        else:
            doc = rng.choice(sorted(live))
            index.remove(doc)
            del live[doc]
        if step % 25 == 0:
            fresh = BM25Index()
            for doc, text in live.items():
                fresh.add(doc, text)
            query = " ".join(rng.choices(words, k=3))
            assert index.search(query, 15) == fresh.search(query, 15)
            got, want = index.scores(query), fresh.scores(query)
            assert got.keys() == want.keys()
            assert all(abs(got[k] - want[k]) < 1e-9 for k in want)
