"""benchmarks/locomo.py on a tiny conversation in LoCoMo's format (no LoCoMo data needed).

The real evaluation reads the non-commercial LoCoMo file by path; the last test runs on it
only when it is present (``/work/shared/data/locomo`` or ``$LOCOMO_DATA``) and is slow.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import HashEncoder

from benchmarks import locomo
from convo.retrieval import RetrievalConfig, RetrievalMemory
from convo.tokens import TiktokenCounter

FILLER = ["How was your day?", "Fine, thanks.", "Any news?", "Not much.", "Nice weather.", "Indeed."]


def tiny_locomo(path: Path, sample_id: str = "conv-x") -> Path:
    sessions: dict[str, object] = {"speaker_a": "Ann", "speaker_b": "Bob"}
    n = 0
    for s in range(1, 7):
        turns = []
        for i, text in enumerate(FILLER * 3):
            if s == 2 and i == 4:
                text = "I adopted a grey cat named Miso last week."
            if s == 5 and i == 6:
                text = "Miso learned to open the fridge, unbelievable."
            turns.append({"speaker": "Ann" if i % 2 == 0 else "Bob", "dia_id": f"D{s}:{i + 1}", "text": text})
            n += 1
        sessions[f"session_{s}"] = turns
        sessions[f"session_{s}_date_time"] = f"1:00 pm on {s} May, 2023"
    qa = [
        {"question": "What is the name of Ann's cat?", "answer": "Miso", "category": 4, "evidence": ["D2:5"]},
        {
            "question": "What did Ann's cat named Miso learn, and when was it adopted?",
            "answer": "open the fridge",
            "category": 1,
            "evidence": ["D2:5", "D5:7"],
        },
    ]
    path.write_text(json.dumps([{"sample_id": sample_id, "conversation": sessions, "qa": qa}]))
    return path


def test_load_and_evaluate_a_tiny_conversation(tmp_path: Path) -> None:
    convs = locomo.load(tiny_locomo(tmp_path / "tiny.json"))
    assert len(convs) == 1 and len(convs[0].lines) == 6 * 18
    assert convs[0].needles["D2:5"] == "Ann: I adopted a grey cat named Miso last week."
    assert convs[0].questions[1].evidence == ("D2:5", "D5:7")

    def memory(_: str) -> RetrievalMemory:
        return RetrievalMemory(HashEncoder(), config=RetrievalConfig(min_score=0.0))

    results = locomo.evaluate(
        convs,
        strategies=["window", "window+retrieval", "full"],
        context_tokens=512,
        counter=TiktokenCounter("cl100k_base"),
        memory_factory=memory,
        planner="local",
    )
    assert results["full"]["recall_all"] == 1.0
    assert results["window"]["recall_all"] == 0.0  # the evidence left the window long ago
    assert results["window+retrieval"]["recall_all"] == 1.0  # both pieces, days apart
    assert results["window+retrieval"]["mean_prompt_tokens"] <= 512 - locomo.REPLY_TOKENS


def test_captions_are_opt_in(tmp_path: Path) -> None:
    path = tiny_locomo(tmp_path / "tiny.json")
    data = json.loads(path.read_text())
    data[0]["conversation"]["session_2"][4]["blip_caption"] = "a photo of a grey cat"
    path.write_text(json.dumps(data))
    assert locomo.load(path)[0].needles["D2:5"] == "Ann: I adopted a grey cat named Miso last week."
    with_captions = locomo.load(path, captions=True)[0]
    assert with_captions.needles["D2:5"] == (
        "Ann: I adopted a grey cat named Miso last week. [shares a photo of a grey cat]"
    )
    assert with_captions.needles["D2:4"] == "Bob: Not much."  # lines without a photo are unchanged


def test_default_embedding_cache_is_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONVO_CACHE_DIR", str(tmp_path / "cache"))
    path = locomo.default_embed_cache("/data/locomo-dev.json", None)
    assert path == tmp_path / "cache" / "locomo" / "locomo-dev-all-MiniLM-L6-v2.npz"


def test_folds_are_contiguous_and_cover_everything() -> None:
    ids = [f"c{i}" for i in range(6)]
    assert locomo.folds_of(ids, 2) == [["c0", "c1", "c2"], ["c3", "c4", "c5"]]
    with pytest.raises(ValueError):
        locomo.folds_of(ids, 7)


LOCOMO = Path(os.environ.get("LOCOMO_DATA", "/work/shared/data/locomo/locomo-dev.json"))


@pytest.mark.slow
@pytest.mark.skipif(not LOCOMO.exists(), reason="LoCoMo data is not present (it is never copied here)")
def test_real_locomo_first_conversation_keeps_its_recall() -> None:
    """Evidence recall of the default on the first development conversation (the
    model-free path, real MiniLM): a floor well under the measured value."""
    from convo.embeddings import Embedder

    convs = locomo.load(LOCOMO)[:1]
    embedder = Embedder()
    results = locomo.evaluate(
        convs,
        strategies=["window+retrieval"],
        context_tokens=2048,
        counter=TiktokenCounter("cl100k_base"),
        memory_factory=lambda _: RetrievalMemory(embedder),
        planner="session",
    )
    assert results["window+retrieval"]["recall_all"] >= 0.75
