"""The child process of :class:`~convo.embeddings.EmbeddingProcess` (``Embedder(process=True)``).

``python -m convo.embedding_worker FD``: ``FD`` is its end of a socket pair. It reads the
settings (model, device, precision, batch size, torch threads), loads the model and answers
its dimension and precision (or ``{"error": ..., "kind": ...}``), then answers each list of
texts with their vectors, one float32 row each, computed as an :class:`~convo.embeddings.Embedder`
in one process computes them. It exits when the socket closes: when the parent closes it, or
dies.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from convo.embeddings import Embedder
from convo.errors import MissingDependency


def serve(conn: Connection) -> None:
    """Load the model the first message names, then answer requests until EOF."""
    settings: dict[str, Any] = conn.recv()
    try:
        import torch

        torch.set_num_threads(int(settings["threads"]))
        embedder = Embedder(
            settings["model"],
            device=settings["device"],
            precision=settings["precision"],
            batch_size=int(settings["batch_size"]),
            cache_size=0,
            word_cache=False,
        )
        conn.send({"dim": embedder.dim, "precision": embedder.precision_in_use})
    except Exception as exc:  # the parent raises it as its own
        kind = "missing" if isinstance(exc, (MissingDependency, ImportError)) else "load"
        conn.send({"error": str(exc), "kind": kind})
        return
    while True:
        try:
            texts: list[str] = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fresh = embedder._compute(texts)
            out: Any = np.stack([fresh[t] for t in texts]).astype(np.float32)
        except Exception as exc:  # this request fails, the process goes on
            out = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send(out)


def main(argv: list[str] | None = None) -> None:
    # Ctrl-C in a terminal reaches the whole process group: the parent decides, and closes
    # the socket, which ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    args = sys.argv[1:] if argv is None else argv
    with Connection(int(args[0])) as conn:
        serve(conn)


if __name__ == "__main__":
    main()
