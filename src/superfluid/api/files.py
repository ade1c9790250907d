"""OpenAI's files: `POST /v1/files` (multipart `file` and `purpose`), `GET /v1/files`,
`GET /v1/files/{id}`, `GET /v1/files/{id}/content` and `DELETE /v1/files/{id}`.

The daemon keeps them (`Daemon.files`, `store/files.py`) under `<sessions>/files`, written
durably before the upload is answered. An upload over `FILE_LIMIT` bytes is refused with 413
as it arrives (a body that states a larger length is refused before, by the listener). The
files a batch writes have purpose `batch_output`. Under a key policy each key sees only its
own files; a file that an unfinished batch reads cannot be deleted (409).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Literal

from fastapi import APIRouter, Query
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from ..core.daemon import Daemon
from .chat_http import owner
from .openai import error

FILE_LIMIT = 100 << 20  # as the listener's body limit (transports/http.py)
PURPOSES = ("batch", "user_data", "assistants", "vision", "fine-tune", "evals")
OUTPUT_PURPOSE = "batch_output"  # what a batch writes; never uploaded


class TooLarge(Exception):
    """An upload went past FILE_LIMIT."""


def file_object(meta: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's file object of a file's metadata."""
    return {name: value for name, value in meta.items() if name != "owner"}


def page(items: list[dict[str, Any]], limit: int, after: str | None, descending: bool) -> dict[str, Any]:
    """A page of OpenAI's cursor lists: up to `limit` of `items` (in order, by ids that sort by
    age) past the id `after`."""
    if after is not None:
        items = [item for item in items if (item["id"] < after if descending else item["id"] > after)]
    shown = items[:limit]
    return {
        "object": "list",
        "data": shown,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
        "has_more": len(items) > limit,
    }


async def _limited(stream: AsyncIterator[bytes]) -> AsyncGenerator[bytes, None]:
    """`stream`, until it goes past FILE_LIMIT bytes: then TooLarge."""
    seen = 0
    async for chunk in stream:
        seen += len(chunk)
        if seen > FILE_LIMIT:
            raise TooLarge
        yield chunk


def not_found(file_id: str) -> Response:
    return error(f"no file {file_id}", 404, "not_found", "file_id")


def router(daemon: Daemon, reading: Callable[[str], str | None]) -> APIRouter:
    """The routes; `reading` names the unfinished batch that reads a file, if one does."""
    api = APIRouter()

    async def visible(file_id: str, http: Request) -> dict[str, Any] | None:
        meta = await asyncio.to_thread(daemon.files.get, file_id)
        return meta if meta is not None and meta.get("owner") == owner(http) else None

    @api.post("/v1/files")
    async def upload(http: Request) -> Response:
        if not http.headers.get("content-type", "").startswith("multipart/form-data"):
            return error("POST /v1/files takes a multipart/form-data body with the fields file and purpose")
        try:
            form = await MultiPartParser(http.headers, _limited(http.stream()), max_files=1).parse()
        except TooLarge:
            return error(f"the upload is over the {FILE_LIMIT}-byte limit of a file", 413, "payload_too_large")
        except MultiPartException as e:
            return error(f"the multipart body does not parse: {e.message}")
        try:
            sent, purpose = form.get("file"), form.get("purpose")
            if not isinstance(sent, UploadFile):
                return error("no file: send the file's bytes as the multipart field file", param="file")
            if purpose not in PURPOSES:
                return error(f"purpose {purpose!r} is not one of {', '.join(PURPOSES)}", param="purpose")
            name = sent.filename or "upload"
            meta = await asyncio.to_thread(daemon.files.add, sent.file, name, purpose, owner(http))
        finally:
            await form.close()
        return JSONResponse(file_object(meta))

    @api.get("/v1/files")
    async def listed(
        http: Request,
        purpose: str | None = None,
        limit: int = Query(10000, ge=1, le=10000),
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
    ) -> dict[str, Any]:
        mine = owner(http)
        metas = await asyncio.to_thread(daemon.files.all)
        files = [
            file_object(meta)
            for meta in metas
            if meta.get("owner") == mine and (purpose is None or meta["purpose"] == purpose)
        ]
        descending = order == "desc"
        return page(files[::-1] if descending else files, limit, after, descending)

    @api.get("/v1/files/{file_id}")
    async def retrieve(file_id: str, http: Request) -> Response:
        meta = await visible(file_id, http)
        return JSONResponse(file_object(meta)) if meta is not None else not_found(file_id)

    @api.get("/v1/files/{file_id}/content")
    async def content(file_id: str, http: Request) -> Response:
        path = daemon.files.content(file_id) if await visible(file_id, http) is not None else None
        if path is None:
            return not_found(file_id)
        return FileResponse(path, media_type="application/octet-stream")

    @api.delete("/v1/files/{file_id}")
    async def delete(file_id: str, http: Request) -> Response:
        if await visible(file_id, http) is None:
            return not_found(file_id)
        batch = reading(file_id)
        if batch is not None:
            return error(
                f"file {file_id} is the input of {batch}, which has not ended: cancel it or let it end first",
                409,
                "file_in_use",
                "file_id",
            )
        if not await asyncio.to_thread(daemon.files.delete, file_id):
            return not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    return api
