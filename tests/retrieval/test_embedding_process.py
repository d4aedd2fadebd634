"""``Embedder(process=True)``: the embedding model in a child process of its own, so that a
busy Python thread of the parent (the server's engine loop) does not hold it up at every
operation (issue 24). Real default model; each test starts real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from convo.embeddings import Embedder
from convo.errors import ConfigError, ModelLoadError

pytestmark = pytest.mark.slow

TEXTS = [
    "tram",
    "I moved to Lisbon in March with my sister, and the tram up the hill is my favourite part.",
    "My sister found a job at the aquarium. " * 20,
    "",
]


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Embedder, Embedder]]:
    here = Embedder(cache_size=0, word_cache=False, precision="float32")
    there = Embedder(cache_size=0, word_cache=False, precision="float32", process=True, threads=1)
    yield here, there
    there.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not reaped yet) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][0] != "Z"


def test_the_child_gives_the_vectors_the_model_gives_in_this_process(pair: tuple[Embedder, Embedder]) -> None:
    here, there = pair
    assert there.dim == here.dim == 384
    assert there.identity == here.identity
    assert there.model_id == here.model_id
    np.testing.assert_allclose(there.encode(TEXTS), here.encode(TEXTS), atol=1e-5)
    np.testing.assert_allclose(there.encode([TEXTS[1]]), here.encode([TEXTS[1]]), atol=1e-5)
    assert there._model.pid != os.getpid()


def test_threads_calling_at_once_each_get_their_own_vectors(pair: tuple[Embedder, Embedder]) -> None:
    here, there = pair
    texts = [f"message {i}: the boat's engine and the harbour in winter" for i in range(24)]
    want = here.encode(texts)
    got: dict[int, np.ndarray] = {}

    def call(i: int) -> None:
        got[i] = there.encode([texts[i], texts[(i + 1) % len(texts)]])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(len(texts)):
        np.testing.assert_allclose(got[i], want[[i, (i + 1) % len(texts)]], atol=1e-5)


def test_a_killed_child_is_started_again_by_the_next_call(pair: tuple[Embedder, Embedder]) -> None:
    here, there = pair
    there.encode(["warm"])
    proc = there._model
    first, starts = proc.pid, proc.starts
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _alive(first) and time.monotonic() < deadline:
        time.sleep(0.05)
    np.testing.assert_allclose(there.encode(TEXTS[:2]), here.encode(TEXTS[:2]), atol=1e-5)
    assert proc.starts == starts + 1 and proc.pid != first


def test_close_stops_the_child_and_a_later_call_starts_another(pair: tuple[Embedder, Embedder]) -> None:
    _, there = pair
    there.encode(["warm"])
    pid = there._model.pid
    there.close()
    assert not _alive(pid)
    assert there.encode(["again"]).shape == (1, 384)
    assert there._model.pid != pid


def test_the_child_exits_when_its_parent_is_killed() -> None:
    script = textwrap.dedent(
        """
        import sys, time
        from convo.embeddings import Embedder
        e = Embedder(cache_size=0, word_cache=False, process=True, threads=1)
        e.encode(["hello"])
        print(e._model.pid, flush=True)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()  # kill -9: no atexit, no close()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        parent.kill()


def test_a_model_that_cannot_load_is_a_model_load_error_and_leaves_no_child(tmp_path: object) -> None:
    broken = Embedder(str(tmp_path), process=True, threads=1)
    with pytest.raises(ModelLoadError, match="could not load embedding model"):
        broken.encode(["x"])
    assert broken._model is None


def test_threads_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="threads"):
        Embedder(process=True, threads=0)
