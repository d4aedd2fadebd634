"""The routes of files and vector stores, in OpenAI's shapes (see :mod:`convo.server.documents`):

    POST   /v1/files                                   multipart upload (text, Markdown)
    GET    /v1/files, /v1/files/{id}    DELETE /v1/files/{id}
    POST   /v1/vector_stores                           {"name", "file_ids", "metadata"}
    GET    /v1/vector_stores, /v1/vector_stores/{id}   DELETE /v1/vector_stores/{id}
    POST   /v1/vector_stores/{id}/files                {"file_id"}
    GET    /v1/vector_stores/{id}/files[/{file_id}]    DELETE /v1/vector_stores/{id}/files/{file_id}

Another key's file or store is 404, as a missing one. A server without an embedder (or
``--no-memory``) answers 404 ``documents_off``.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from convo.server.documents import Documents, read_text_upload
from convo.server.errors import ERROR_RESPONSES, ApiError
from convo.server.security import caller, state_of
from convo.server.state import ServerState

router = APIRouter(responses=ERROR_RESPONSES)

State = Annotated[ServerState, Depends(state_of)]
Owner = Annotated[str, Depends(caller)]

#: Bytes a multipart upload may carry besides the file (boundaries, the purpose field).
MULTIPART_OVERHEAD_BYTES = 64 << 10


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class VectorStoreBody(_Strict):
    name: str | None = Field(None, max_length=256)
    file_ids: list[str] = Field(default_factory=list, max_length=100)
    metadata: dict[str, str] | None = None
    expires_after: dict[str, Any] | None = None
    chunking_strategy: dict[str, Any] | None = None


class VectorStoreFileBody(_Strict):
    file_id: str = Field(max_length=64)
    attributes: dict[str, Any] | None = None
    chunking_strategy: dict[str, Any] | None = None


def _documents(state: ServerState) -> Documents:
    if state.documents is None:
        raise ApiError(404, "this server has no embedder for documents (--no-memory)", code="documents_off")
    return state.documents


async def _json(request: Request, model: type[_Strict]) -> Any:
    _, data = await state_of(request).read_body(request)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise ApiError(
            400, f"{where}: {first.get('msg')}", code="invalid_value", param=where or None
        ) from None


def _listing(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": False,
    }


@router.post("/v1/files")
async def upload(request: Request, state: State, owner: Owner) -> dict[str, Any]:
    """A text or Markdown file (multipart ``file`` and ``purpose``): 413 past
    ``max_file_bytes``, 415 for PDF or binary, 400 when empty or not UTF-8; nothing is
    stored for a refused upload."""
    docs = _documents(state)
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind != "multipart/form-data":
        raise ApiError(415, "upload a file as multipart/form-data", code="invalid_content_type")
    limit = docs.limits.max_file_bytes + MULTIPART_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"file over {docs.limits.max_file_bytes} bytes", code="file_too_large", param="file"
        )
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit:
            raise ApiError(
                413, f"file over {docs.limits.max_file_bytes} bytes", code="file_too_large", param="file"
            )
        chunks.append(piece)
    request._body = b"".join(chunks)  # (Starlette's form parser reads the cached body)
    form = await request.form(max_files=1, max_fields=8)
    upload_file = form.get("file")
    if upload_file is None or isinstance(upload_file, str):
        raise ApiError(400, "the upload has no file part", code="invalid_value", param="file")
    purpose = form.get("purpose")
    if not isinstance(purpose, str) or not purpose:
        raise ApiError(400, "purpose: required (e.g. 'assistants')", code="invalid_value", param="purpose")
    data = await upload_file.read()
    name = upload_file.filename or "upload.txt"
    text = read_text_upload(data, name, (upload_file.content_type or "").lower(), docs.limits)
    result: dict[str, Any] = await state.in_thread(docs.create_file, owner, name, text, len(data), purpose)
    return result


@router.get("/v1/files")
async def list_files(state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    return _listing(await state.in_thread(docs.files, owner))


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    return docs.file_json(await state.in_thread(docs.file, owner, file_id))


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    result: dict[str, Any] = await state.in_thread(docs.delete_file, owner, file_id)
    return result


@router.post("/v1/vector_stores")
async def create_store(request: Request, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    body: VectorStoreBody = await _json(request, VectorStoreBody)
    result: dict[str, Any] = await state.in_thread(
        docs.create_store, owner, body.name, body.metadata, body.file_ids
    )
    return result


@router.get("/v1/vector_stores")
async def list_stores(state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    return _listing(await state.in_thread(docs.stores, owner))


@router.get("/v1/vector_stores/{store_id}")
async def get_store(store_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    result: dict[str, Any] = await state.in_thread(docs.store_json, owner, store_id)
    return result


@router.delete("/v1/vector_stores/{store_id}")
async def delete_store(store_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    result: dict[str, Any] = await state.in_thread(docs.delete_store, owner, store_id)
    return result


@router.post("/v1/vector_stores/{store_id}/files")
async def add_store_file(store_id: str, request: Request, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    body: VectorStoreFileBody = await _json(request, VectorStoreFileBody)
    result: dict[str, Any] = await state.in_thread(docs.add_file, owner, store_id, body.file_id)
    return result


@router.get("/v1/vector_stores/{store_id}/files")
async def list_store_files(store_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    return _listing(await state.in_thread(docs.store_files, owner, store_id))


@router.get("/v1/vector_stores/{store_id}/files/{file_id}")
async def get_store_file(store_id: str, file_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    result: dict[str, Any] = await state.in_thread(docs.store_file, owner, store_id, file_id)
    return result


@router.delete("/v1/vector_stores/{store_id}/files/{file_id}")
async def remove_store_file(store_id: str, file_id: str, state: State, owner: Owner) -> dict[str, Any]:
    docs = _documents(state)
    result: dict[str, Any] = await state.in_thread(docs.remove_file, owner, store_id, file_id)
    return result
