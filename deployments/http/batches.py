"""The Files and Batches API at the ingress: OpenAI's shapes (the body POST /v1/batches validates,
the objects the OpenAPI document names) and the calls of the Records deployment that holds the
files and runs the batches (deployments/services/batches.py): an upload read as it arrives and
sent to it a piece at a time, stopped at the size limit (multipart_upload.py), a file's content
streamed back a piece at a time from a read the Records replica holds open (a DELETE meanwhile
cannot cut it short), every refusal as OpenAI's error naming its field (404 for an unknown id,
413 for a file over the size limit).
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, Field

from ..errors import RequestError
from ..services.batches import ENDPOINTS
from ..services.files import EXPIRES_AFTER
from .decoder_calls import cause_of, replica_lost
from .edge import RETRY_AFTER_SECONDS, request_id, server_error
from .multipart_upload import read_upload
from .openai import ApiError, _Strict

PIECE_BYTES = 2**20  # the bytes of one message between the ingress and the Records replica
FORM_BYTES = 64 * 2**10  # what a multipart form holds beside its file (its boundaries, headers, purpose)
# The multipart form of POST /v1/files (the OpenAPI document's).
FILE_FORM = {"type": "object", "required": ["file", "purpose"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "a batch's requests: OpenAI's batch JSONL"},
    "purpose": {"type": "string", "enum": ["batch"]},
    "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
    "expires_after[seconds]": {"type": "integer", "minimum": EXPIRES_AFTER[0], "maximum": EXPIRES_AFTER[1],
                               "description": "the file expires this long after it was made (default: 30 days)"}}}


class ExpiresAfter(_Strict):
    """OpenAI's expiration policy of a file: `seconds` after it was made (its `created_at`)."""

    anchor: Literal["created_at"]
    seconds: int = Field(ge=EXPIRES_AFTER[0], le=EXPIRES_AFTER[1])


class BatchCreateRequest(_Strict):
    """POST /v1/batches: the requests of an uploaded file (purpose batch), each to `endpoint`."""

    input_file_id: str = Field(max_length=256)
    endpoint: Literal[ENDPOINTS]
    completion_window: Literal["24h"]
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    output_expires_after: ExpiresAfter | None = None  # the output and error files' (default: 30 days)


# -- the OpenAPI document's shapes (the Records deployment builds them as dicts) ---------------------
class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"]
    expires_at: int | None
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedFile(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class RequestCounts(BaseModel):
    total: int
    completed: int  # answered 200: in the output file
    failed: int  # answered otherwise: in the error file


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
                    "cancelled"]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    expires_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchCalls:
    """The Records deployment by handle (or a LocalHandle of a BatchService; None: this
    application has none, and every route of the API says so), with the largest file an
    upload may bring."""

    def __init__(self, service, file_size_limit: int):
        self._service, self.file_size_limit = service, file_size_limit

    @property
    def service(self):
        """The Records deployment's handle (404 where the application has none)."""
        if self._service is None:
            raise ApiError(404, "this application serves no Files and Batches API (it has no Records deployment)",
                           code="unknown_url")
        return self._service

    async def create(self, input_file_id: str, endpoint: str, window: str, metadata, output_expires: int | None):
        return await self.call(self.service.create.remote(input_file_id, endpoint, window, metadata, output_expires))

    async def page(self, after: str | None, limit: int) -> dict:
        return await self.call(self.service.page.remote(after, limit))

    async def batch(self, batch_id: str) -> dict:
        return await self.call(self.service.batch.remote(batch_id))

    async def cancel(self, batch_id: str) -> dict:
        return await self.call(self.service.cancel_batch.remote(batch_id))

    async def file_page(self, purpose: str | None, after: str | None, limit: int, order: str) -> dict:
        return await self.call(self.service.file_page.remote(purpose, after, limit, order))

    async def file(self, file_id: str) -> dict:
        return await self.call(self.service.file.remote(file_id))

    async def delete_file(self, file_id: str) -> dict:
        return await self.call(self.service.delete_file.remote(file_id))

    async def upload(self, request: Request) -> dict:
        """POST /v1/files: the multipart form's file (purpose batch) into the store a piece at a
        time as it arrives, never more than the size limit of it (multipart_upload.read_upload)."""
        service = self.service
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.file_size_limit + FORM_BYTES:  # refused before it is read
            raise self._too_large(f"the upload has {declared} bytes")
        started: list[str] = []  # the store's file id, once the file part began

        async def begin(filename: str) -> None:
            started.append(await self.call(service.begin_file.remote(filename[:256])))

        async def write(piece: bytes) -> None:
            await self.call(service.append_file.remote(started[0], piece))

        try:
            form = await read_upload(request, "file", self.file_size_limit, FORM_BYTES, begin, write, PIECE_BYTES,
                                     self._too_large)
            if form.filename is None:
                raise ApiError(400, "file: required (the batch's JSONL file, as a multipart upload)", param="file")
            purpose = form.get("purpose")
            if purpose != "batch":
                raise ApiError(400, f"purpose: this server keeps files for batches (purpose 'batch'), not "
                                    f"{str(purpose)[:40]!r}", param="purpose")
            return await self.call(service.finish_file.remote(started[0], purpose, expires_after(form)))
        except BaseException:  # refused, the client left, or the store failed: nothing half-kept
            if started:
                try:
                    await asyncio.shield(service.abort_file.remote(started[0]))
                except Exception:  # noqa: BLE001 - the store's replica is gone: its successor drops the upload
                    pass
            raise

    def _too_large(self, what: str) -> ApiError:
        return ApiError(413, f"file: {what}; this server takes files of at most {self.file_size_limit} bytes",
                        param="file", code="file_too_large")

    async def content(self, file_id: str) -> StreamingResponse:
        """GET /v1/files/{id}/content: the file's bytes, read from the store a piece at a time
        from a read it holds open (services/files.py FileStore.open_read): a DELETE meanwhile
        leaves this read whole, so the Content-Length sent first is always what comes."""
        service = self.service
        read = await self.call(service.open_file.remote(file_id))

        async def pieces():
            try:
                for offset in range(0, read["bytes"], PIECE_BYTES):
                    yield await self.call(service.file_piece.remote(read["read"], offset, PIECE_BYTES))
            finally:
                try:
                    await asyncio.shield(service.close_file.remote(read["read"]))
                except Exception:  # noqa: BLE001 - the store's replica is gone (it closes a read left idle)
                    pass

        return StreamingResponse(pieces(), media_type="application/octet-stream",
                                 headers={"content-length": str(read["bytes"])})

    async def call(self, response):
        """A Batches call's reply; its refusal as OpenAI's error naming the field (NotFound: 404,
        RequestError: 400), its replica gone as 503 with Retry-After, anything else a logged 500."""
        try:
            return await response
        except Exception as e:  # noqa: BLE001
            cause = cause_of(e)
            if isinstance(cause, RequestError):
                raise ApiError(cause.status, str(cause), param=cause.field,
                               code="not_found" if cause.status == 404 else None) from None
            if replica_lost(cause):
                raise ApiError(503, f"the Records replica is restarting; retry after {RETRY_AFTER_SECONDS} s",
                               kind="server_overloaded") from None
            raise server_error(request_id(), "the Batches call failed", cause) from None


def expires_after(fields) -> int | None:
    """The seconds of an upload's `expires_after` (OpenAI's form fields `expires_after[anchor]` and
    `expires_after[seconds]`), None where it gives none; 400 naming the field otherwise."""
    anchor, seconds = fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"expires_after.anchor: 'created_at', not {str(anchor)[:40]!r}",
                       param="expires_after.anchor")
    if not (seconds or "").isdigit() or not EXPIRES_AFTER[0] <= int(seconds) <= EXPIRES_AFTER[1]:
        raise ApiError(400, f"expires_after.seconds: an integer from {EXPIRES_AFTER[0]} to {EXPIRES_AFTER[1]}, "
                            f"not {str(seconds)[:40]!r}", param="expires_after.seconds")
    return int(seconds)
