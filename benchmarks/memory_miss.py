"""What a cache miss of the server's retrieval memory costs: a replica that has no index of
a session rebuilds it from the store's memory rows (no embedder call) before it answers.

For each size (default 1,000 and 10,000 turns) one session is indexed through
:class:`convo.server.memory.ServerMemory` into a SQLite store; then a second
``ServerMemory`` on the same file (a replica with an empty cache) answers one question
(the miss: read the rows, replay them, search) and a second one (a hit). Prints JSON:
seconds of the miss and of the hit, the rows' bytes in the store and the index's bytes in
the cache, per size.

The encoder is hashed (``--dim``, default 384 as MiniLM) so the run does not wait for a
model: a miss never calls the embedder for an indexed text, so its cost does not depend
on the model (only the question is embedded; that cost is the same on a hit). With
``--minilm`` the session is indexed with the real model (``index_s`` is then what a miss
would cost if it re-embedded), and the miss replays MiniLM's vectors (the question is
embedded by the hashed encoder there: only the replay is timed).

    python benchmarks/memory_miss.py --turns 1000,10000
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from convo.embeddings import Embedder
from convo.messages import Message, Role
from convo.plan import Turn
from convo.retrieval.hashing import HashingEncoder
from convo.server.memory import ServerMemory
from convo.stores import SessionState, SQLiteStore

WORDS = (
    "cat dog train weather bus garden coffee paris berlin piano guitar salary doctor birthday "
    "museum recipe tomato hiking marathon novel camera budget flight hotel sister brother cousin "
    "meeting deadline project laptop phone battery window kitchen painting violin tennis soccer"
).split()


def turn(i: int) -> Turn:
    a, b, c = WORDS[i % len(WORDS)], WORDS[(i * 7) % len(WORDS)], WORDS[(i * 13) % len(WORDS)]
    return Turn(
        index=i,
        messages=(
            Message(role=Role.USER, content=f"Turn {i}: I talked about the {a} and the {b} with word{i}."),
            Message(role=Role.ASSISTANT, content=f"Noted: the {c} matters to you (code {i * 31})."),
        ),
    )


def measure(n: int, dim: int, folder: str, minilm: bool = False) -> dict[str, float | int]:
    path = os.path.join(folder, f"miss-{n}.db")
    store = SQLiteStore(path)
    store.create(SessionState(session_id="s", owner="o"))
    writer = ServerMemory(store, Embedder() if minilm else HashingEncoder(dim))
    view = writer.view(owner="o")
    t0 = time.perf_counter()
    for start in range(0, n, 100):  # as a chat indexes: a few turns at a time
        view.remember_turns("s", [turn(i) for i in range(start, min(n, start + 100))])
    index_s = time.perf_counter() - t0
    rows_bytes = sum(len(json.dumps(r)) for r in store.memory_log("s").records)
    encoder = HashingEncoder(dim)  # (a replay must never need it: it counts what it is asked)
    replica = ServerMemory(SQLiteStore(path), encoder)
    question = "What did I say about the piano and word4242?"
    t0 = time.perf_counter()
    found = replica.view(owner="o").retrieve(question, session_id="s", top_k=6)
    miss_s = time.perf_counter() - t0
    texts_on_miss = encoder.texts_encoded
    t0 = time.perf_counter()
    replica.view(owner="o").retrieve(question, session_id="s", top_k=6)
    hit_s = time.perf_counter() - t0
    return {
        "turns": n,
        "index_s": round(index_s, 3),
        "miss_s": round(miss_s, 3),
        "hit_s": round(hit_s, 4),
        "texts_embedded_on_miss": texts_on_miss,  # the question only
        "store_rows_bytes": rows_bytes,
        "cache_bytes": replica.stats().bytes,
        "found": len(found),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", default="1000,10000", help="comma-separated session sizes")
    parser.add_argument("--dim", type=int, default=384, help="vector length (MiniLM: 384)")
    parser.add_argument(
        "--minilm", action="store_true", help="index with the real MiniLM (the miss replays its vectors)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        rows = [measure(int(n), args.dim, folder, args.minilm) for n in args.turns.split(",")]
    json.dump({"benchmark": "memory_miss", "cpus": os.cpu_count(), "rows": rows}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
