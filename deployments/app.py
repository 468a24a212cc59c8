"""The Ray Serve application: a Decoder deployment (the engine and its batching loop) behind an
Ingress deployment (OpenAI-style HTTP and the Python handle API).

    serve run deployments.app:build model=path/to/folder     # or cluster/serve.yaml
    handle = serve.get_app_handle("raymuter")
    await handle.generate.remote(GenerateRequest(prompt="Once"))

The ingress never touches arrays: it validates requests, hands typed requests to the decoder by
handle, and turns its chunks into OpenAI's bodies and server-sent events. Every failure becomes
OpenAI's error body: 4xx naming the field for bad input, 503 with Retry-After when the decoder's
queue is full or its replica is gone (the request is not retried: it may have been half done).
"""

import asyncio
import json
import os
import secrets
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.handle import DeploymentHandle

from .decoder import Overloaded, RequestError
from .metrics import IngressMetrics
from .openai_api import (ApiError, ChatCompletionRequest, CompletionRequest, completion_logprobs, completion_response,
                         finish_reason, generate_request, parse, stream_chunk)
from .schema import GenerateChunk, GenerateRequest, GenerateResponse

RETRY_AFTER_SECONDS = 1
DEFAULT_MODEL_NAME = "raymuter-default"  # the model id of the default model (no `model` given)


class AppConfig(BaseModel):
    """The application's arguments (`serve run deployments.app:build key=value ...`, or `args:`
    in cluster/serve.yaml). Resources and autoscaling of each deployment are Serve's own
    options, set in the config file's `deployments:` list."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None  # folder or hub id; None: the default model that ships with Raymuter
    name: str | None = None  # the model id clients send; default: the folder's name
    engine: str = Field(default="onnx", pattern="^(onnx|fake)$")  # fake: tests of the serving layer
    slots: int = Field(default=8, ge=1, le=1024)  # rows the decoder steps together
    capacity: int | None = Field(default=None, ge=2)  # tokens per slot (default: the model's context, <= 4096)
    max_waiting: int = Field(default=256, ge=0)  # decoder queue; beyond it, 503
    max_logprobs: int = Field(default=5, ge=-1, le=20)  # -1: no log-probabilities (the lean greedy loop)
    threads: int | None = Field(default=None, ge=1)  # onnxruntime intra-op threads per decoder replica
    provider: str | None = None  # cuda, cpu; default: CUDA where the replica has a GPU
    variant: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # defaults for every request
    api_key: str | None = None  # a bearer token every route but /health requires; or RAYMUTER_API_KEY
    max_body_bytes: int = Field(default=25 * 2**20, ge=1024)
    step_seconds: float = Field(default=0.005, gt=0)  # fake engine only
    gpu: str = Field(default="auto", pattern="^(auto|yes|no)$")  # the decoder asks for num_gpus=1


def _typed(request) -> GenerateRequest:
    if isinstance(request, GenerateRequest):
        return request
    try:
        return GenerateRequest.model_validate(request)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{field}: {first['msg']}" if field else first["msg"], param=field) from None


def _refusal(error: Exception) -> dict:
    if isinstance(error, Overloaded):
        return {"error": str(error), "status": 503}
    return {"error": str(error), "status": 400, "field": error.field}


def _refused(result) -> ApiError | None:
    """The ApiError of a decoder answer that refused the request, else None."""
    if result.finish_reason != "rejected":
        return None
    if result.status == 503:
        return ApiError(503, f"the server is busy ({result.error}); retry after {RETRY_AFTER_SECONDS} s",
                        kind="server_overloaded")
    return ApiError(result.status or 400, result.error, param=result.field)


def _api_error_of(error: BaseException) -> ApiError:
    """What a failed decoder call means to the client."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    cause = error.cause if isinstance(error, RayTaskError) and getattr(error, "cause", None) else error
    if isinstance(cause, ApiError):
        return cause
    if isinstance(cause, RequestError):
        return ApiError(400, str(cause), param=cause.field)
    if isinstance(cause, (Overloaded, BackPressureError)):
        return ApiError(503, f"the server is busy ({cause}); retry after {RETRY_AFTER_SECONDS} s",
                        kind="server_overloaded")
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return ApiError(503, f"the decoder replica serving this request failed ({type(cause).__name__}); "
                             "retry: a new replica takes over", kind="server_error")
    return ApiError(500, f"the decoder failed: {type(cause).__name__}: {cause}", kind="server_error")


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, health_check_period_s=2,
                  health_check_timeout_s=10)
class Decoder:
    """Owns the model and its continuous batching loop (deployments.decoder.TextGenerator)."""

    def __init__(self, config: dict):
        cfg = AppConfig(**config)
        if cfg.engine == "fake":
            from .fake import fake_generator

            self.generator = fake_generator(cfg.slots, cfg.step_seconds, cfg.max_waiting, cfg.name or "fake")
        else:
            from .decoder import TextGenerator

            model = cfg.model
            if model is None:
                from generation.bundled import default_model_path

                model = str(default_model_path())
            self.generator = TextGenerator.from_model(
                model, name=cfg.name or (DEFAULT_MODEL_NAME if cfg.model is None else None), slots=cfg.slots, capacity=cfg.capacity, max_waiting=cfg.max_waiting,
                max_logprobs=cfg.max_logprobs, threads=cfg.threads, provider=cfg.provider, variant=cfg.variant,
                **cfg.settings)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        try:
            return await self.generator.generate(request)
        except (RequestError, Overloaded) as e:  # the client's problem: an answer, not a replica error log
            return GenerateResponse(text="", token_ids=[], finish_reason="rejected", prompt_tokens=0,
                                    completion_tokens=0, **_refusal(e))

    async def stream(self, request: GenerateRequest):
        try:
            async for chunk in self.generator.stream(request):
                yield chunk
        except (RequestError, Overloaded) as e:
            yield GenerateChunk(finish_reason="rejected", **_refusal(e))

    def card(self):
        return self.generator.card()

    def metrics(self) -> str:
        return self.generator.metrics.text()

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> None:
        thread = getattr(self.generator.batcher, "_thread", None)
        if thread is not None and not thread.is_alive():
            raise RuntimeError("the batching loop stopped")

    def __del__(self):
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.close()


api = FastAPI(title="Raymuter", description="OpenAI-style generation over ONNX models on Ray Serve")


@api.exception_handler(ApiError)
async def _api_error(request: Request, error: ApiError):
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status == 503 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(api)
class Ingress:
    """HTTP routes and the Python handle API over the decoder."""

    def __init__(self, decoder: DeploymentHandle, config: dict):
        cfg = AppConfig(**config)
        self.decoder = decoder
        self.api_key = cfg.api_key or os.environ.get("RAYMUTER_API_KEY") or None
        self.max_body = cfg.max_body_bytes
        self.metrics = IngressMetrics()
        self._card = None

    # -- the Python handle API ----------------------------------------------------------------
    async def generate(self, request: GenerateRequest | dict) -> GenerateResponse:
        """One generation (handle.generate.remote(GenerateRequest(...)))."""
        request = _typed(request)
        return await self._generate(request)

    async def generate_stream(self, request: GenerateRequest | dict):
        """GenerateChunks (handle.options(stream=True).generate_stream.remote(...))."""
        request = _typed(request)
        async for chunk in self._chunks(request):
            yield chunk

    async def models(self) -> list[dict]:
        card = await self._model_card()
        return [card]

    # -- HTTP ---------------------------------------------------------------------------------
    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def list_models(self, request: Request):
        self._authorize(request)
        card = await self._model_card()
        return {"object": "list", "data": [card]}

    @api.get("/metrics")
    async def metrics_route(self, request: Request):
        self._authorize(request)
        parts = [self.metrics.text()]
        try:
            parts.append(await asyncio.wait_for(self.decoder.metrics.remote(), timeout=5))
        except Exception as e:  # noqa: BLE001 - the ingress's own metrics still come back
            parts.append(f"# decoder metrics unavailable: {type(e).__name__}\n")
        return PlainTextResponse("".join(parts), media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, ChatCompletionRequest, chat=True)

    # -- internals ----------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    async def _body(self, request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"the body has {length} bytes; this server takes at most {self.max_body}")
        raw = await request.body()
        if len(raw) > self.max_body:
            raise ApiError(413, f"the body has {len(raw)} bytes; this server takes at most {self.max_body}")
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ApiError(400, f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    async def _model_card(self) -> dict:
        if self._card is None:
            card = await self._call(self.decoder.card.remote())
            self._card = {"id": card.id, "object": "model", "created": int(time.time()), "owned_by": "raymuter",
                          "context_length": card.context_length, "slots": card.slots, "kind": card.kind}
        return self._card

    async def _openai(self, request: Request, kind, chat: bool):
        route = request.url.path
        try:
            self._authorize(request)
            body = parse(kind, await self._body(request))
            card = await self._model_card()
            if body.model != card["id"]:
                raise ApiError(404, f"model: '{body.model}' is not served here; this server serves '{card['id']}'",
                               param="model", kind="model_not_found")
            requests = [_typed(generate_request(body, i)) for i in range(body.n)]
            request_id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
            if body.stream:
                response = await self._sse(requests, request_id, card["id"], chat, body)
            else:
                response = await self._whole(requests, request_id, card["id"], chat, body)
            self.metrics.requests.labels(route=route, status="200").inc()
            return response
        except ApiError as e:
            self.metrics.requests.labels(route=route, status=str(e.status)).inc()
            raise

    async def _whole(self, requests, request_id, model, chat, body) -> dict:
        results = await asyncio.gather(*(self._generate(r) for r in requests))
        choices = []
        for i, result in enumerate(results):
            if result.finish_reason == "error":
                raise ApiError(500, f"generation failed: {result.error}", kind="server_error")
            text = result.text
            if not chat and getattr(body, "echo", False):
                text = (body.prompt if isinstance(body.prompt, str) else "") + text
            logprobs = None if result.logprobs is None else completion_logprobs(
                [t.model_dump() for t in result.logprobs], chat)
            choice = completion_response(request_id, model, text, result.finish_reason, 0, 0, chat, logprobs)["choices"][0]
            choices.append({**choice, "index": i})
        out = completion_response(request_id, model, "", "stop", results[0].prompt_tokens,
                                  sum(r.completion_tokens for r in results), chat)
        out["choices"] = choices
        return out

    async def _sse(self, requests, request_id, model, chat, body) -> StreamingResponse:
        streams = [self._chunks(r) for r in requests]
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))  # errors before any byte: a 4xx/503
        created = int(time.time())
        usage = (body.stream_options or {}).get("include_usage")

        async def events():
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i, first, stream):
                try:
                    await queue.put((i, first))
                    async for chunk in stream:
                        await queue.put((i, chunk))
                except ApiError as e:
                    await queue.put((i, e))
                finally:
                    await queue.put((i, None))

            tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
            open_, prompt_tokens, completion_tokens, started = len(tasks), 0, 0, set()
            try:
                while open_:
                    i, item = await queue.get()
                    if item is None:
                        open_ -= 1
                        continue
                    if isinstance(item, ApiError):
                        yield f"data: {json.dumps(item.body())}\n\n"
                        return
                    if item.finish_reason == "error":
                        yield f"data: {json.dumps(ApiError(500, f'generation failed: {item.error}', kind='server_error').body())}\n\n"
                        return
                    logprobs = None if item.logprobs is None else completion_logprobs(
                        [t.model_dump() for t in item.logprobs], chat)
                    if item.text or item.finish_reason or logprobs or (chat and i not in started):
                        yield "data: " + json.dumps(stream_chunk(request_id, model, created, i, item.text,
                                                                 item.finish_reason, chat, logprobs,
                                                                 first=i not in started)) + "\n\n"
                        started.add(i)
                    if item.finish_reason is not None:
                        prompt_tokens = item.prompt_tokens or 0
                        completion_tokens += item.completion_tokens or 0
                if usage:
                    yield "data: " + json.dumps({"id": request_id, "object": "chat.completion.chunk" if chat else
                                                 "text_completion", "created": created, "model": model, "choices": [],
                                                 "usage": {"prompt_tokens": prompt_tokens,
                                                           "completion_tokens": completion_tokens,
                                                           "total_tokens": prompt_tokens + completion_tokens}}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                for task in tasks:
                    task.cancel()
                for stream in streams:
                    await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _chunks(self, request: GenerateRequest):
        """The decoder's stream, its failures as ApiErrors."""
        stream = self.decoder.options(stream=True).stream.remote(request)
        try:
            while True:
                try:
                    chunk = await stream.__anext__()
                except StopAsyncIteration:
                    return
                refused = _refused(chunk)
                if refused is not None:
                    raise refused
                yield chunk
        except ApiError:
            raise
        except Exception as e:  # noqa: BLE001
            raise _api_error_of(e) from None
        finally:
            stream.cancel()

    async def _generate(self, request: GenerateRequest) -> GenerateResponse:
        result = await self._call(self.decoder.generate.remote(request))
        refused = _refused(result)
        if refused is not None:
            raise refused
        return result

    async def _call(self, response):
        try:
            return await response
        except Exception as e:  # noqa: BLE001
            raise _api_error_of(e) from None


def build(args: dict | None = None):
    """The application (Serve's app builder: `serve run deployments.app:build model=...`)."""
    cfg = AppConfig(**(args or {}))
    config = cfg.model_dump()
    decoder = Decoder
    if cfg.gpu == "yes" or (cfg.gpu == "auto" and _cluster_has_gpu()):
        decoder = Decoder.options(ray_actor_options={"num_cpus": 0.5, "num_gpus": 1})
    return Ingress.bind(decoder.bind(config), config)


def _cluster_has_gpu() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    except Exception:  # noqa: BLE001 - no cluster to ask: plan for CPU
        return False
