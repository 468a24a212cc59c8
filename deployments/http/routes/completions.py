"""POST /v1/completions and /v1/chat/completions: a request's prompts (or its messages) times `n`
as the decoder's GenerateRequests, answered whole or as server-sent events (assembly.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from ..assembly import event_stream, whole_answer
from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded
from ..openai import ApiError, ChatCompletionRequest, CompletionRequest
from ..openai_replies import ChatCompletion, Completion
from ..to_decoder import generate_request, typed

router = APIRouter()


@router.post("/v1/completions", openapi_extra=body_of(CompletionRequest),
             responses=answers(Completion, *ERRORS, stream=True))
async def completions(request: Request, state: IngressState = Depends(guarded)):
    return await _completion(state, request, CompletionRequest, chat=False)


@router.post("/v1/chat/completions", openapi_extra=body_of(ChatCompletionRequest),
             responses=answers(ChatCompletion, *ERRORS, stream=True))
async def chat_completions(request: Request, state: IngressState = Depends(guarded)):
    return await _completion(state, request, ChatCompletionRequest, chat=True)


async def _completion(state: IngressState, request: Request, kind, chat: bool):
    async def run(body, card, rid):
        jobs = _jobs(body, card, rid, chat)
        if body.stream:
            return await event_stream(state.calls, jobs, rid, card["id"], state.fingerprint, chat, body)
        return JSONResponse(await whole_answer(state.calls, request, jobs, rid, card["id"], state.fingerprint, chat,
                                               body))

    return await state.route(request, kind, run, "chatcmpl-" if chat else "cmpl-")


def _jobs(body, card: dict, rid: str, chat: bool) -> list:
    """(prompt index or None, GenerateRequest) per choice: choice j of prompt p is p * n + j."""
    prompts = [None] if chat else body.prompts()
    if not chat and body.echo and card["kind"] == "encoder-decoder":
        raise ApiError(400, "echo: an encoder-decoder model's prompt is its source, not the start of "
                            "the completion", param="echo")
    jobs = []
    for p, prompt in enumerate(prompts):
        for j in range(body.n):
            fields = generate_request(body, prompt, j, card.get("adapter"), card.get("adapter_path"))
            fields.update(request_id=f"{rid}-{p * body.n + j}", echo=not chat and body.echo)
            jobs.append((p if len(prompts) > 1 else None, typed(fields)))
    return jobs
