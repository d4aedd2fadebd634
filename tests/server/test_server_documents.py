"""Files and vector stores through the official openai client against a live server:
upload, index, chat with retrieval (passages cited, streaming too), delete, another key's
404, limits, and bad uploads refused with nothing stored."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from conftest import HashEncoder, serve

from convo import Budget, SQLiteStore
from convo.server.app import create_app
from convo.server.documents import DocumentLimits, Documents
from convo.server.memory import ServerMemory
from convo.stores import Store
from convo.testing import EchoEngine

BUDGET = Budget(
    context_tokens=2048, max_new_tokens=64, window_turns=2, summarize_batch_turns=1, summary_tokens=0
)
MANUAL = b"""# Pump manual

## Reset
To reset the pump, hold the blue button for ten seconds until the light blinks twice.

## Cleaning
Rinse the filter with warm water once a week; never use soap on the membrane.
"""


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = SQLiteStore(tmp_path / "s.db")
    yield s
    s.close()


LIMITS = DocumentLimits(max_file_bytes=4096, max_chunks_per_store=3, max_stores_per_key=3)


@pytest.fixture
def url(store: Store) -> Iterator[str]:
    encoder = HashEncoder()
    memory = ServerMemory(store, encoder)
    docs = Documents(store, encoder, limits=LIMITS)
    app = create_app(
        EchoEngine(), store=store, api_key=["k1", "k2"], budget=BUDGET, memory=memory, documents=docs
    )
    with serve(app) as base:
        yield base


def client(url: str, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def ask(c: openai.OpenAI, text: str, stores: list[str], sid: str | None = "s", **kw: Any) -> Any:
    meta: dict[str, Any] = {"vector_store_ids": ",".join(stores)}
    if sid is not None:
        meta["session_id"] = sid
    return c.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": text}], metadata=meta, **kw
    )


def test_upload_index_chat_cite_and_delete(url: str) -> None:
    with client(url) as c:
        f = c.files.create(file=("manual.md", MANUAL, "text/markdown"), purpose="assistants")
        assert f.object == "file" and f.bytes == len(MANUAL) and f.filename == "manual.md"
        vs = c.vector_stores.create(name="pumps")
        added = c.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id)
        assert added.status == "completed"
        assert [x.id for x in c.vector_stores.files.list(vector_store_id=vs.id)] == [f.id]
        assert [x.id for x in c.vector_stores.list()] == [vs.id]
        assert c.vector_stores.retrieve(vs.id).file_counts.completed == 1
        reply = ask(c, "How do I reset the pump?", [vs.id])
        cited = (reply.model_extra or {})["convo"]["passages"]
        assert (
            cited and cited[0]["source"].startswith(f.id) and "blue button" not in str(cited)
        )  # no text, a citation
        stream = ask(c, "How do I reset the pump?", [vs.id], sid=None, stream=True)
        last = list(stream)[-1]
        assert (last.model_extra or {})["convo"]["passages"][0]["source"].startswith(f.id)
        assert c.vector_stores.files.delete(file_id=f.id, vector_store_id=vs.id).deleted
        assert (ask(c, "How do I reset the pump?", [vs.id]).model_extra or {})["convo"]["passages"] == []
        assert c.vector_stores.delete(vs.id).deleted
        assert c.files.delete(f.id).deleted
        assert list(c.files.list()) == [] and list(c.vector_stores.list()) == []


def test_another_keys_files_and_stores_are_404(url: str) -> None:
    with client(url) as c:
        f = c.files.create(file=("m.md", MANUAL, "text/markdown"), purpose="assistants")
        vs = c.vector_stores.create(name="mine", file_ids=[f.id])
    with client(url, "k2") as other:
        with pytest.raises(openai.NotFoundError):
            other.files.retrieve(f.id)
        with pytest.raises(openai.NotFoundError):
            other.vector_stores.retrieve(vs.id)
        with pytest.raises(openai.NotFoundError):
            other.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id)
        with pytest.raises(openai.NotFoundError):
            ask(other, "reset?", [vs.id], sid="theirs")
        assert list(other.vector_stores.list()) == []


@pytest.mark.parametrize(
    ("name", "data", "kind", "error", "code"),
    [
        ("m.pdf", b"%PDF-1.7 binary", "application/pdf", openai.APIStatusError, 415),
        ("blob.bin", bytes(range(256)) * 4, "application/octet-stream", openai.APIStatusError, 415),
        ("big.txt", b"word " * 2000, "text/plain", openai.APIStatusError, 413),
        ("empty.txt", b"  \n", "text/plain", openai.BadRequestError, 400),
        ("latin.txt", "caf\xe9 cr\xe8me".encode("latin-1"), "text/plain", openai.BadRequestError, 400),
    ],
)
def test_bad_uploads_are_refused_with_nothing_stored(
    url: str, name: str, data: bytes, kind: str, error: type[Exception], code: int
) -> None:
    with client(url) as c:
        with pytest.raises(error) as refused:
            c.files.create(file=(name, data, kind), purpose="assistants")
        assert refused.value.status_code == code  # type: ignore[attr-defined]
        assert list(c.files.list()) == []


def test_limits_refuse_with_nothing_half_written(url: str) -> None:
    with client(url) as c:
        long = ("The pump has many parts and every part has a name. " * 60).encode()
        f = c.files.create(file=("long.txt", long, "text/plain"), purpose="assistants")
        vs = c.vector_stores.create(name="small")
        with pytest.raises(openai.BadRequestError) as refused:
            c.vector_stores.files.create(vector_store_id=vs.id, file_id=f.id)
        assert "chunks" in str(refused.value)
        assert list(c.vector_stores.files.list(vector_store_id=vs.id)) == []
        for i in range(2):
            c.vector_stores.create(name=f"more {i}")
        with pytest.raises(openai.BadRequestError):
            c.vector_stores.create(name="one too many")
        assert len(list(c.vector_stores.list())) == 3
