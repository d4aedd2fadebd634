"""The word-vector cache (convo.word_vectors) and what the Embedder does with it (issue 24:
a LongMemEval history's ~4,000 vocabulary words were embedded again by every session)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from convo import word_vectors
from convo.errors import ConfigError
from convo.retrieval.hashing import HashingEncoder
from convo.word_vectors import WordVectorCache, is_word, shared_cache

DIM = 16


def vecs(words: list[str]) -> dict[str, np.ndarray]:
    return dict(zip(words, HashingEncoder(DIM).encode(words), strict=True))


def test_words_written_by_one_process_are_read_by_the_next(tmp_path: Path) -> None:
    words = [f"word{i}" for i in range(10)]
    first = WordVectorCache("model-a", DIM, folder=tmp_path)
    first.put_many(vecs(words))
    first.flush()
    again = WordVectorCache("model-a", DIM, folder=tmp_path)  # a new process: nothing in memory
    got = again.get_many([*words, "unknown"])
    assert sorted(got) == sorted(words)
    for w in words:
        assert np.array_equal(got[w], vecs(words)[w])


def test_only_single_words_are_cached() -> None:
    assert is_word("painting") and is_word("don't") and is_word("x" * word_vectors.MAX_WORD_CHARS)
    assert not is_word("two words") and not is_word("") and not is_word("x" * 41) and not is_word("a\nb")
    cache = WordVectorCache("m", DIM, folder=None)
    cache.put_many(vecs(["kept", "not kept at all"]))
    assert list(cache.get_many(["kept", "not kept at all"])) == ["kept"]


def test_another_model_or_length_is_not_read(tmp_path: Path) -> None:
    a = WordVectorCache("model-a", DIM, folder=tmp_path)
    a.put_many(vecs(["cat"]))
    a.flush()
    assert WordVectorCache("model-b", DIM, folder=tmp_path).get_many(["cat"]) == {}
    assert WordVectorCache("model-a", DIM * 2, folder=tmp_path).get_many(["cat"]) == {}


def test_a_damaged_file_is_skipped_not_fatal(tmp_path: Path) -> None:
    a = WordVectorCache("m", DIM, folder=tmp_path)
    a.put_many(vecs(["cat"]))
    a.flush()
    (tmp_path / "99999999999999999999-1-bad.npz").write_bytes(b"not a zip file")
    assert list(WordVectorCache("m", DIM, folder=tmp_path).get_many(["cat", "dog"])) == ["cat"]


def test_the_cache_is_bounded_in_memory_and_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(word_vectors, "MAX_SEGMENTS", 3)
    cache = WordVectorCache("m", DIM, folder=tmp_path, max_words=25)
    for batch in range(6):  # 6 segments of 10 words: merged past 3, newest 25 kept
        cache.put_many(vecs([f"w{batch}_{i}" for i in range(10)]))
        cache.flush()
        assert len(cache) <= 25
    segments = [p for p in tmp_path.iterdir() if p.suffix == ".npz"]
    assert len(segments) <= 3
    reread = WordVectorCache("m", DIM, folder=tmp_path, max_words=25)
    newest = [f"w5_{i}" for i in range(10)]
    assert sorted(reread.get_many(newest)) == sorted(newest)
    assert len(reread) <= 25
    assert reread.get_many(["w0_0"]) == {}  # the oldest went
    with pytest.raises(ValueError):
        WordVectorCache("m", DIM, folder=None, max_words=0)


def test_writers_in_parallel_lose_no_word(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Several writers (processes, here caches of their own) share one folder: each file is
    # renamed into place whole, and a merge never drops a file's words.
    monkeypatch.setattr(word_vectors, "MAX_SEGMENTS", 2)

    def writer(k: int) -> None:
        cache = WordVectorCache("m", DIM, folder=tmp_path)
        for batch in range(5):
            cache.put_many(vecs([f"t{k}_{batch}_{i}" for i in range(4)]))
            cache.flush()

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = [f"t{k}_{b}_{i}" for k in range(4) for b in range(5) for i in range(4)]
    got = WordVectorCache("m", DIM, folder=tmp_path).get_many(everything)
    assert len(got) == len(everything)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_pending_words_are_written_once_enough_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(word_vectors, "FLUSH_WORDS", 5)
    cache = WordVectorCache("m", DIM, folder=tmp_path)
    cache.put_many(vecs(["a1", "a2"]))
    assert not list(tmp_path.glob("*.npz"))  # not yet
    cache.put_many(vecs(["a3", "a4", "a5"]))
    assert len(list(tmp_path.glob("*.npz"))) == 1


def test_env_turns_the_disk_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(word_vectors.WORD_CACHE_ENV, "0")
    cache = shared_cache("env-off-model", DIM)
    assert cache.folder is None
    monkeypatch.setenv(word_vectors.WORD_CACHE_ENV, "1")
    on = shared_cache("env-off-model", DIM)
    assert on.folder is not None and on.folder.is_relative_to(tmp_path)
    assert shared_cache("env-off-model", DIM) is on  # one per model in the process


def test_embedder_precision_is_checked() -> None:
    from convo.embeddings import Embedder

    with pytest.raises(ConfigError):
        Embedder(precision="float8")


@pytest.fixture
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CONVO_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_minilm_words_come_back_from_disk_in_a_new_embedder(cache_home: Path) -> None:
    from convo.embeddings import Embedder

    words = ["painting", "guitar", "marathon", "pottery"]
    first = Embedder(cache_size=0)
    before = first.encode(words)
    word_vectors._flush_all()
    assert list((cache_home / "word-vectors").rglob("*.npz"))
    word_vectors._SHARED.clear()  # as a new process: only the disk knows the words
    second = Embedder(cache_size=0)
    assert np.array_equal(second.encode(words), before)
    plain = Embedder(cache_size=0, word_cache=False, precision=second.precision_in_use)
    assert np.allclose(plain.encode(words), before, atol=2e-3)


def test_minilm_bfloat16_is_near_float32_and_normalized(cache_home: Path) -> None:
    from convo.embeddings import Embedder

    texts = ["Where did Maria go camping last summer?", "I adopted a puppy.", " ".join(["word"] * 300)]
    exact = Embedder(precision="float32", cache_size=0).encode(texts)
    half = Embedder(precision="bfloat16", cache_size=0)
    assert half.precision_in_use == "bfloat16"
    for got in (half.encode(texts), np.stack([half.encode([t])[0] for t in texts])):
        assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
        assert ((got * exact).sum(axis=1) > 0.995).all()


def test_a_cache_turned_off_is_not_read_any_more() -> None:
    # cache_size=0 means "no cache": what it held before must not answer (a benchmark
    # timed cached queries as embedded ones).
    from convo.embeddings import Embedder

    class CountingModel:
        calls = 0

        def encode(self, texts: list[str], **_: object) -> np.ndarray:
            CountingModel.calls += len(texts)
            return HashingEncoder(DIM).encode(texts)

    emb = Embedder(cache_size=10, word_cache=False)
    emb._model, emb._dim = CountingModel(), DIM
    texts = ["a question about the garden", "another question about music"]
    emb.encode(texts)
    emb.encode(texts)
    assert CountingModel.calls == 2
    emb.cache_size = 0
    emb.encode(texts)
    assert CountingModel.calls == 4
