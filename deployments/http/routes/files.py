"""/v1/files (OpenAI's Files API, for batches): upload a batch's requests (a multipart form, purpose
batch, at most the server's file size limit), list, retrieve, read and delete files, the batches'
output and error files among them (http/batches.py; the files are the Records deployment's)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query, Request

from ..batches import FILE_FORM, DeletedFile, FileList, FileObject
from ..edge import answers, body_of
from ..ingress_state import IngressState, guarded

router = APIRouter()
ID = Path(max_length=256)
STORED = (400, 401, 404, 500, 503)


@router.post("/v1/files", openapi_extra=body_of(None, "multipart/form-data", FILE_FORM),
             responses=answers(FileObject, 400, 401, 413, 500, 503))
async def create_file(request: Request, state: IngressState = Depends(guarded)):
    return await state.batches.upload(request)


@router.get("/v1/files", responses=answers(FileList, *STORED))
async def list_files(request: Request, purpose: Literal["batch", "batch_output"] | None = None,
                     after: str | None = Query(None, max_length=256), limit: int = Query(10000, ge=1, le=10000),
                     order: Literal["asc", "desc"] = "desc", state: IngressState = Depends(guarded)):
    return await state.batches.file_page(purpose, after, limit, order)


@router.get("/v1/files/{file_id}", responses=answers(FileObject, *STORED))
async def retrieve_file(file_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.batches.file(file_id)


@router.get("/v1/files/{file_id}/content", responses=answers(None, *STORED, binary=True))
async def file_content(file_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.batches.content(file_id)


@router.delete("/v1/files/{file_id}", responses=answers(DeletedFile, *STORED))
async def delete_file(file_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.batches.delete_file(file_id)
