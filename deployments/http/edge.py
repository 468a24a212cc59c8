"""The HTTP edge of the ingress, free of Ray's deployments: bodies read within their limit,
errors in OpenAI's shape for every status (FastAPI's own 404, 405 and 422 included), server
errors logged with a request id and never shown, and the OpenAPI document with the request and
response schema of every route (body_of, answers: what each route in routes/ declares).
"""

from __future__ import annotations

import json
import logging
import os
import secrets

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .openai import ApiError
from .validation import check_json, validation_error

logger = logging.getLogger("ray.serve")  # into the replica's log, with Serve's request id
RETRY_AFTER_SECONDS = 1
# Ray Serve's gRPC between deployments refuses a message over RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH
# (4 MiB unless set); serving_environment, the cluster files and the chart set it to this, and
# the ingress takes no body that would not fit (body_limit: 413 naming the limit).
GRPC_MESSAGE_BYTES = 64 * 2**20


def body_limit(max_body_bytes: int) -> int:
    """The largest body the ingress takes: max_body_bytes, and no more than a message between
    deployments carries (a GenerateRequest is about its body's size; 1 MiB left for the rest)."""
    if os.environ.get("RAY_SERVE_USE_GRPC_BY_DEFAULT") != "1":
        return max_body_bytes
    grpc = int(os.environ.get("RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH") or 4 * 2**20)
    return min(max_body_bytes, grpc - 2**20)


def request_id(prefix: str = "req-") -> str:
    """The id of the request being served: Serve's (its x-request-id response header and its
    logs carry it; a client's x-request-id header sets it), after `prefix`; random elsewhere."""
    try:
        from ray.serve.context import _get_serve_request_context

        found = _get_serve_request_context().request_id
    except Exception:  # noqa: BLE001 - not inside a Serve request
        found = ""
    return prefix + (found[:128] if found else secrets.token_hex(12))


def replica_id() -> str | None:
    """The Serve replica this code runs in, by the unique id its request router knows (None
    outside a replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a Serve replica (a test's local object)
        return None


def server_error(request_id_: str, what: str, error: BaseException | str | None = None) -> ApiError:
    """A 500 whose details go to the log under the request id, and only the id to the client."""
    detail = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else error
    logger.error("request %s: %s%s", request_id_, what, f": {detail}" if detail else "")
    return ApiError(500, f"the server failed on this request ({what}); the server's log has the details "
                         f"under request id {request_id_}", kind="server_error", code=request_id_)


def error_response(error: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else {}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def install_error_handlers(api: FastAPI) -> None:
    """Every error the app answers in OpenAI's shape: ours, Starlette's 404 and 405 (unknown
    routes, wrong methods), FastAPI's 422, and anything unexpected as a logged 500."""

    @api.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError):
        return error_response(error)

    @api.exception_handler(HTTPException)
    async def _http_error(request: Request, error: HTTPException):
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            body = ApiError(404, f"no route {where}; this server's routes are listed at /openapi.json",
                            code="unknown_url")
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("allow") or (error.headers or {}).get("Allow")
            body = ApiError(405, f"{request.method} is not allowed on {request.url.path}"
                                 + (f"; use {allowed}" if allowed else ""), code="method_not_allowed")
        else:
            body = ApiError(error.status_code, str(error.detail))
        response = error_response(body)
        for name, value in (error.headers or {}).items():
            response.headers[name] = value
        return response

    @api.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError):
        where = ("body", "path", "query")  # FastAPI's parts of a request, not its fields
        return error_response(validation_error([{**e, "loc": [p for p in e["loc"] if p not in where]}
                                                for e in error.errors()]))

    @api.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        return error_response(server_error(request_id(), f"{request.method} {request.url.path}", error))


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, read no further than `limit` bytes (413 beyond it, before
    reading a body whose declared length is over it); strict JSON (no NaN or Infinity); no
    deeper than validation.MAX_DEPTH and valid Unicode throughout (check_json)."""
    check_length(request, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the body has more than {limit} bytes; this server takes at most {limit}",
                           code="body_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)

    def constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(raw, parse_constant=constant)
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    except ValueError as e:  # UnicodeDecodeError too: not UTF-8 (or -16, -32)
        raise ApiError(400, f"the body is not JSON: {e}"[:300]) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    check_json(body)
    return body


def check_length(request: Request, limit: int) -> None:
    """413 before reading a body whose declared length is over `limit`."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the body has {length} bytes; this server takes at most {limit}", code="body_too_large")


# -- the OpenAPI document ---------------------------------------------------------------------------
def body_of(model, content_type: str = "application/json", schema: dict | None = None) -> dict:
    """A route's openapi_extra: its request body (the routes read their bodies themselves, so
    FastAPI does not know them)."""
    schema = schema or {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {content_type: {"schema": schema}}}}


def answers(model, *statuses: int, stream: bool = False, text: bool = False, binary: bool = False) -> dict:
    """A route's `responses`: `model` for 200 (with server-sent events where it streams, plain
    text where it can answer text, bytes where it answers a file's), OpenAI's error body for each
    of `statuses`."""
    from .openai_replies import ErrorResponse

    ok: dict = {"description": "OK"}
    if model is not None:
        ok["model"] = model
    extra = {}
    if stream:  # each server-sent event: `data` is a chunk's JSON, the last one [DONE]
        extra["text/event-stream"] = {"schema": {"type": "object", "required": ["data"], "properties": {
            "data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"}}}}
    if text:
        extra["text/plain"] = {"schema": {"type": "string"}}
    if binary:
        extra["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    if extra:
        ok["content"] = extra
    out = {200: ok}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": _REASONS.get(status, "error")}
    return out


# What a route that reads a body may answer besides 200.
ERRORS = (400, 401, 404, 413, 500, 503)
_REASONS = {400: "bad request: param names the field", 401: "missing or wrong API key",
            404: "unknown model, file or batch", 413: "body (or file) over the limit", 422: "unprocessable",
            500: "server error: the log has the request id", 503: "busy or restarting: retry after Retry-After seconds"}


def openapi_document(api: FastAPI, request_models: list) -> dict:
    """FastAPI's document with the request models the routes name (body_of) among its schemas."""
    from fastapi.openapi.utils import get_openapi
    from pydantic.json_schema import models_json_schema

    doc = get_openapi(title=api.title, version=api.version, description=api.description, routes=api.routes)
    _, schemas = models_json_schema([(m, "validation") for m in request_models],
                                    ref_template="#/components/schemas/{model}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(schemas.get("$defs", {}))
    return doc
