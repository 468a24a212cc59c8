"""/v1/batches (OpenAI's Batch API): create a batch of an uploaded file's requests, retrieve, list
and cancel batches (http/batches.py; the Records deployment runs them at a priority below
interactive requests: deployments/services/batches.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Query, Request

from ..batches import BatchCreateRequest, BatchList, BatchObject
from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded

router = APIRouter()
ID = Path(max_length=256)
STORED = (400, 401, 404, 500, 503)


@router.post("/v1/batches", openapi_extra=body_of(BatchCreateRequest), responses=answers(BatchObject, *ERRORS))
async def create_batch(request: Request, state: IngressState = Depends(guarded)):
    async def run(body: BatchCreateRequest, card: dict, rid: str):
        expires = body.output_expires_after
        return await state.batches.create(body.input_file_id, body.endpoint, body.completion_window, body.metadata,
                                          expires and expires.seconds)

    return await state.route(request, BatchCreateRequest, run, "batch-")


@router.get("/v1/batches", responses=answers(BatchList, *STORED))
async def list_batches(request: Request, after: str | None = Query(None, max_length=256),
                       limit: int = Query(20, ge=1, le=100), state: IngressState = Depends(guarded)):
    return await state.batches.page(after, limit)


@router.get("/v1/batches/{batch_id}", responses=answers(BatchObject, *STORED))
async def retrieve_batch(batch_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.batches.batch(batch_id)


@router.post("/v1/batches/{batch_id}/cancel", responses=answers(BatchObject, *STORED))
async def cancel_batch(batch_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.batches.cancel(batch_id)
