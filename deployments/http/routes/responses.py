"""/v1/responses (OpenAI's Responses API): create a response (whole, streamed as typed events, or
in the background, streamed or not), and a stored one's GET (a background stream's events again:
?stream=true&starting_after=N), DELETE, input_items and cancel (http/response_runs.py; the store
is the Records deployment every ingress replica shares)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse

from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded
from ..openai import INT_MAX
from ..responses import DeletedResponse, ResponseItemList, ResponseObject, ResponseRequest

router = APIRouter()
INGRESS_HEADER = "x-raymuter-ingress"
ID = Path(max_length=256)
STORED = (400, 401, 404, 503)


@router.post("/v1/responses", openapi_extra=body_of(ResponseRequest),
             responses=answers(ResponseObject, *ERRORS, stream=True))
async def create_response(request: Request, state: IngressState = Depends(guarded)):
    async def run(body, card, rid):
        answer = await state.responses.create(request, body, card["id"], rid, card.get("adapter"),
                                             card.get("adapter_path"))
        answer = JSONResponse(answer) if isinstance(answer, dict) else answer
        answer.headers[INGRESS_HEADER] = state.replica  # which ingress replica took it (any can continue it)
        return answer

    return await state.route(request, ResponseRequest, run, "resp-")


@router.get("/v1/responses/{response_id}", responses=answers(ResponseObject, *STORED, stream=True))
async def get_response(request: Request, response_id: str = ID, stream: bool = False,
                       starting_after: int | None = Query(None, ge=0, le=INT_MAX),
                       state: IngressState = Depends(guarded)):
    if stream:
        return await state.responses.resume(response_id, starting_after)
    return await state.responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}", responses=answers(DeletedResponse, *STORED))
async def delete_response(response_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=answers(ResponseObject, *STORED))
async def cancel_response(response_id: str = ID, state: IngressState = Depends(guarded)):
    return await state.responses.cancel(response_id)


@router.get("/v1/responses/{response_id}/input_items", responses=answers(ResponseItemList, *STORED))
async def list_input_items(request: Request, response_id: str = ID, after: str | None = Query(None, max_length=256),
                           limit: int = Query(20, ge=1, le=100), order: Literal["asc", "desc"] = "desc",
                           state: IngressState = Depends(guarded)):
    return await state.responses.input_items(response_id, after, limit, order)
