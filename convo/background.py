"""Which work a thread is doing: a turn's own, or background work done ahead of need.

Shared resources serve a turn's own calls first. :class:`~convo.embeddings.Embedder` is one:
inside :func:`background_work` its ``encode`` calls yield the model to calls made outside it
(a turn's question) and run in small passes. The threads that embed turns ahead
(:mod:`convo.session.ahead`) run their jobs inside it.

This module imports nothing heavy, so the session can mark its work without loading the
embedder's dependencies.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_work = threading.local()


@contextmanager
def background_work() -> Iterator[None]:
    """Mark this thread's work inside the block as background work (nestable)."""
    was = in_background()
    _work.background = True
    try:
        yield
    finally:
        _work.background = was


def in_background() -> bool:
    """Whether this thread runs inside :func:`background_work`."""
    return bool(getattr(_work, "background", False))
