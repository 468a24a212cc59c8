"""The server's own routes: GET /health (no key), /version, /metrics (Prometheus: the ingress's,
the decoder's, the encoder's or vision's), /openapi.json and /docs (Swagger UI)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse

from ..edge import answers, openapi_document
from ..ingress_state import IngressState, authorized
from ..openai import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest, TokenizeRequest
from ..openai_replies import VersionResponse
from ..batches import BatchCreateRequest
from ..responses import ResponseRequest

router = APIRouter()
# What /openapi.json lists as request bodies (the routes read their bodies themselves).
REQUEST_MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest,
                  ResponseRequest, BatchCreateRequest]


@router.get("/health", responses=answers(None))
async def health() -> dict:
    return {"status": "ok"}


@router.get("/version", responses=answers(VersionResponse, 401))
async def version(request: Request, state: IngressState = Depends(authorized)):
    return {"version": request.app.version}


@router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request, state: IngressState = Depends(authorized)):
    if state.openapi is None:
        document = openapi_document(request.app, REQUEST_MODELS)
        document["servers"] = [{"url": request.scope.get("root_path") or "/"}]
        state.openapi = document
    return JSONResponse(state.openapi)


@router.get("/docs", include_in_schema=False)
async def docs(request: Request, state: IngressState = Depends(authorized)):
    return get_swagger_ui_html(openapi_url=(request.scope.get("root_path") or "") + "/openapi.json",
                               title="Raymuter")


@router.get("/metrics", responses=answers(None, 401, text=True))
async def metrics(state: IngressState = Depends(authorized)):
    parts = [state.metrics.text(), *await state.calls.metrics()]
    return PlainTextResponse("".join(parts), media_type="text/plain; version=0.0.4")
