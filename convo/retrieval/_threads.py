"""One BLAS thread while a query is scored.

Scoring a query multiplies small matrices (a vocabulary of thousands of words, a thousand
candidate vectors) by one vector. A multi-threaded BLAS (OpenBLAS: one thread per core)
gains nothing on products that small, and where torch's own threads still spin after
the query embedding, or the CPU is shared, its threads wait for each other: on a 2-core
machine a query at 10,000 turns took twice as long (issue 24). :func:`one_blas_thread`
limits the BLAS to one thread for the duration of a ``with`` block, through
``threadpoolctl`` when it is installed (sentence-transformers brings it via
scikit-learn); without it the block runs unchanged.

The limit is process-wide while it lasts: a large product another thread runs at that
moment runs on one thread too.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

_lock = threading.Lock()
_controller: Any = None  # a threadpoolctl.ThreadpoolController, False: not installed
_limiter: Any = None  # the limit in force, while some block runs
_depth = 0  # blocks running


def _blas_controller() -> Any:
    """A cached ``threadpoolctl.ThreadpoolController`` (``False``: not installed). Made
    on first use, when numpy (and its BLAS) is loaded."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController

            _controller = ThreadpoolController()
        except Exception:  # not installed, or it cannot inspect the loaded libraries
            _controller = False
    return _controller


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """Run the block with the BLAS (OpenBLAS, MKL) limited to one thread; nested and
    concurrent blocks share one limit, lifted when the last of them ends."""
    global _depth, _limiter
    with _lock:
        controller = _blas_controller()
        if controller:
            _depth += 1
            if _depth == 1:
                _limiter = controller.limit(limits=1, user_api="blas")
    try:
        yield
    finally:
        if controller:
            with _lock:
                _depth -= 1
                if _depth == 0 and _limiter is not None:
                    _limiter.restore_original_limits()
                    _limiter = None
