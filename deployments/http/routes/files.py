"""/v1/files (OpenAI's Files API, for batches): upload a batch's requests (a multipart form, purpose
batch, at most the server's file size limit), list, retrieve, read and delete files, the batches'
output and error files among them (http/batches.py; the files are the Batches deployment's)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from ..batches import FILE_FORM, DeletedFile, FileList, FileObject
from ..edge import answers, body_of
from ..ingress_state import IngressState, replica_state

router = APIRouter()
ID = Path(max_length=256)
STORED = (400, 401, 404, 500, 503)


@router.post("/v1/files", openapi_extra=body_of(None, "multipart/form-data", FILE_FORM),
             responses=answers(FileObject, 400, 401, 413, 500, 503))
async def create_file(request: Request, state: IngressState = Depends(replica_state)):
    with state.counted(request):
        state.authorize(request)
        return await state.batches.upload(request)


@router.get("/v1/files", responses=answers(FileList, *STORED))
async def list_files(request: Request, purpose: Literal["batch", "batch_output"] | None = None,
                     after: str | None = Query(None, max_length=256), limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", state: IngressState = Depends(replica_state)):
    with state.counted(request):
        state.authorize(request)
        return await state.batches.call(state.batches.service.file_page.remote(purpose, after, limit, order))


@router.get("/v1/files/{file_id}", responses=answers(FileObject, *STORED))
async def retrieve_file(request: Request, file_id: str = ID, state: IngressState = Depends(replica_state)):
    with state.counted(request, "/v1/files/{id}"):
        state.authorize(request)
        return await state.batches.call(state.batches.service.file.remote(file_id))


@router.get("/v1/files/{file_id}/content", responses=answers(None, *STORED, binary=True))
async def file_content(request: Request, file_id: str = ID, state: IngressState = Depends(replica_state)):
    with state.counted(request, "/v1/files/{id}/content"):
        state.authorize(request)
        return await state.batches.content(file_id)


@router.delete("/v1/files/{file_id}", responses=answers(DeletedFile, *STORED))
async def delete_file(request: Request, file_id: str = ID, state: IngressState = Depends(replica_state)):
    with state.counted(request, "/v1/files/{id}"):
        state.authorize(request)
        return await state.batches.call(state.batches.service.delete_file.remote(file_id))
