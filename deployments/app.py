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
from .schema import GenerateChunk, GenerateRequest, GenerateResponse, Refusal, Transcription, TranscriptionRequest

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
    # a draft model (folder or hub id) with the model's tokenizer: every step verifies its
    # proposals (num_assistant_tokens, num_assistant_tokens_schedule in settings); text models
    draft: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # defaults for every request
    api_key: str | None = None  # a bearer token every route but /health requires; or RAYMUTER_API_KEY
    allow_remote_images: bool = False  # fetch http(s) image URLs of chat messages (data URLs always work)
    max_body_bytes: int = Field(default=25 * 2**20, ge=1024)
    stream_interval_ms: float = Field(default=10.0, ge=0, le=1000)  # a stream's chunks at most this often
    # (the first at once; the tokens made meanwhile travel together: fewer messages through Ray
    # when a fast model streams to many clients; 0: a chunk per token)
    step_seconds: float = Field(default=0.005, gt=0)  # fake engine only
    gpu: str = Field(default="auto", pattern="^(auto|yes|no)$")  # the decoder asks for num_gpus=1
    # Which deployments the application has (PARTS); auto: from the model folder. A Serve config
    # that names deployments (the Helm chart's) sets it, and a model of another kind is refused.
    kind: str = Field(default="auto", pattern="^(auto|text|encoder-decoder|vision)$")


# The deployments of each kind of model, the ingress first.
PARTS = {"text": ("Ingress", "Decoder"), "encoder-decoder": ("Ingress", "Decoder", "Encoder"),
         "vision": ("Ingress", "Decoder", "Vision")}


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
    if not isinstance(result, Refusal) and result.finish_reason != "rejected":
        return None
    if result.status == 503:
        return ApiError(503, f"the server is busy ({result.error}); retry after {RETRY_AFTER_SECONDS} s",
                        kind="server_overloaded")
    return ApiError(result.status or 400, result.error, param=result.field)


def _api_error_of(error: BaseException) -> ApiError:
    """What a failed decoder call means to the client."""
    from ray.exceptions import RayActorError, RayTaskError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    cause = error
    while isinstance(cause, RayTaskError) and getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause  # an encoder's failure reaches us through the decoder call that took its reply
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


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
class Encoder:
    """An encoder-decoder model's encoder (deployments.encoder.EncoderService): uploaded audio
    decoded to samples, Whisper windows or texts through the encoder. Its replies go to the
    decoder unopened."""

    def __init__(self, config: dict):
        from .encoder import EncoderService

        cfg = AppConfig(**config)
        self.service = EncoderService(cfg.model, cfg.name, threads=cfg.threads, provider=cfg.provider,
                                      variant=cfg.variant)

    def decode_audio(self, data: bytes, filename: str = "file"):
        return self.service.decode_audio(data, filename)

    def encode_features(self, windows):
        return self.service.encode_features(windows)

    def encode_text(self, sources: list):
        return self.service.encode_text(sources)

    def metrics(self) -> str:
        return self.service.metrics.text()


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
class Vision:
    """A vision-language model's image preprocessing and vision encoder
    (deployments.vision.VisionService), features cached by image content. Its replies go to the
    decoder unopened."""

    def __init__(self, config: dict):
        from .vision import VisionService

        cfg = AppConfig(**config)
        self.service = VisionService(cfg.model, cfg.name, threads=cfg.threads, provider=cfg.provider,
                                     variant=cfg.variant)

    def encode_image(self, data: bytes, name: str = "image"):
        return self.service.encode_image(data, name)

    def metrics(self) -> str:
        return self.service.metrics.text()


@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, health_check_period_s=2,
                  health_check_timeout_s=10)
class Decoder:
    """Owns the model and its continuous batching loop (deployments.decoder.TextGenerator). An
    encoder-decoder model's decoder gets its sources' encoder outputs from the Encoder
    deployment (through the ingress's calls, or `encoder` for Whisper's later windows)."""

    def __init__(self, config: dict, encoder: DeploymentHandle | None = None):
        cfg = AppConfig(**config)
        self.encoder = encoder
        if cfg.engine == "fake":
            from .fake import fake_generator

            self.generator = fake_generator(cfg.slots, cfg.step_seconds, cfg.max_waiting,
                                            cfg.name or (DEFAULT_MODEL_NAME if cfg.model is None else "fake"))
            self.generator.stream_interval = cfg.stream_interval_ms / 1000
        else:
            from .decoder import TextGenerator

            model = cfg.model
            if model is None:
                from generation.bundled import default_model_path

                model = str(default_model_path())
            self.generator = TextGenerator.from_model(
                model, name=cfg.name or (DEFAULT_MODEL_NAME if cfg.model is None else None), slots=cfg.slots, capacity=cfg.capacity, max_waiting=cfg.max_waiting,
                max_logprobs=cfg.max_logprobs, threads=cfg.threads, provider=cfg.provider, variant=cfg.variant,
                stream_interval=cfg.stream_interval_ms / 1000, draft=cfg.draft, **cfg.settings)

    async def generate(self, request: GenerateRequest, encoded=None, *images) -> GenerateResponse:
        try:
            return await self.generator.generate(request, encoded, images)
        except (RequestError, Overloaded) as e:  # the client's problem: an answer, not a replica error log
            return GenerateResponse(text="", token_ids=[], finish_reason="rejected", prompt_tokens=0,
                                    completion_tokens=0, **_refusal(e))

    async def stream(self, request: GenerateRequest, encoded=None, *images):
        try:
            async for chunk in self.generator.stream(request, encoded, images):
                yield chunk
        except (RequestError, Overloaded) as e:
            yield GenerateChunk(finish_reason="rejected", **_refusal(e))

    async def transcribe(self, samples, request: TranscriptionRequest):
        if self.encoder is None:
            return Refusal(**_refusal(RequestError(f"model: '{self.generator.name}' does not take audio", "model")))

        def encode(windows):  # on speech_to_text's worker thread
            return self.encoder.encode_features.remote(windows).result()

        try:
            return await self.generator.transcribe(samples, request, encode)
        except (RequestError, Overloaded) as e:
            return Refusal(**_refusal(e))

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


# Helpers the deployments call are defined above them: Serve pickles a deployment's class when
# its decorator runs, and a name defined further down is missing in the replica.
async def _merged(firsts: list, streams: list):
    """(choice index, chunk or ApiError) from the choices' streams as they come. One stream (n=1,
    the common case) is read directly: no task and queue between the decoder and the client."""
    if len(streams) == 1:
        try:
            yield 0, firsts[0]
            async for chunk in streams[0]:
                yield 0, chunk
        except ApiError as e:
            yield 0, e
        return
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
    open_ = len(tasks)
    try:
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=1024)
@serve.ingress(api)
class Ingress:
    """HTTP routes and the Python handle API over the decoder."""

    def __init__(self, decoder: DeploymentHandle, config: dict, encoder: DeploymentHandle | None = None,
                 vision: DeploymentHandle | None = None):
        cfg = AppConfig(**config)
        self.decoder, self.encoder, self.vision = decoder, encoder, vision
        self.allow_remote_images = cfg.allow_remote_images
        self._decoder_stream = decoder.options(stream=True)
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

    async def transcribe(self, audio: bytes, request: TranscriptionRequest | dict | None = None,
                         filename: str = "audio") -> Transcription:
        """Whisper over an audio file's bytes (handle.transcribe.remote(data, TranscriptionRequest(...)))."""
        if not isinstance(request, TranscriptionRequest):
            try:
                request = TranscriptionRequest.model_validate(request or {})
            except ValidationError as e:
                first = e.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or None
                raise ApiError(400, f"{field}: {first['msg']}", param=field) from None
        if self.encoder is None:
            card = await self._model_card()
            raise ApiError(400, f"model: '{card['id']}' does not take audio", param="model")
        samples = self.encoder.decode_audio.remote(audio, filename)  # stays in Ray's store: the decoder opens it
        result = await self._call(self.decoder.transcribe.remote(samples, request))
        if isinstance(result, Refusal):
            raise _refused(result)
        return result

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
        for name, handle in (("encoder", self.encoder), ("vision", self.vision)):
            if handle is not None:
                try:
                    parts.append(await asyncio.wait_for(handle.metrics.remote(), timeout=5))
                except Exception as e:  # noqa: BLE001
                    parts.append(f"# {name} metrics unavailable: {type(e).__name__}\n")
        return PlainTextResponse("".join(parts), media_type="text/plain; version=0.0.4")

    @api.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._openai(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request):
        return await self._openai(request, ChatCompletionRequest, chat=True)

    @api.post("/v1/audio/transcriptions")
    async def transcriptions(self, request: Request):
        return await self._audio(request, "transcribe")

    @api.post("/v1/audio/translations")
    async def translations(self, request: Request):
        return await self._audio(request, "translate")

    async def _audio(self, request: Request, task: str):
        route = request.url.path
        try:
            self._authorize(request)
            self._check_length(request)
            try:
                form = await request.form()
            except Exception as e:  # noqa: BLE001 - not multipart, or a broken one
                raise ApiError(400, f"the body must be multipart/form-data with a file: {e}") from None
            upload = form.get("file")
            if upload is None or not hasattr(upload, "read"):
                raise ApiError(400, "file: required (the audio file, as a multipart upload)", param="file")
            card = await self._model_card()
            model = form.get("model")
            if model != card["id"]:
                raise ApiError(404, f"model: '{model}' is not served here; this server serves '{card['id']}'",
                               param="model", kind="model_not_found")
            if form.get("prompt"):
                raise ApiError(400, "prompt: previous-text prompts are not supported", param="prompt")
            response_format = form.get("response_format") or "json"
            if response_format not in ("json", "text", "verbose_json"):
                raise ApiError(400, f"response_format: one of json, text, verbose_json, not '{response_format}'",
                               param="response_format")
            granularities = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
            if any(g != "segment" for g in granularities):
                raise ApiError(400, "timestamp_granularities: only 'segment' is supported",
                               param="timestamp_granularities")
            try:
                temperature = float(form.get("temperature") or 0)
                fields = TranscriptionRequest(language=form.get("language") or None, task=task,
                                              timestamps=response_format == "verbose_json", temperature=temperature,
                                              seed=int(form["seed"]) if form.get("seed") else None)
            except (ValueError, ValidationError) as e:
                raise ApiError(400, f"temperature: {e}", param="temperature") from None
            data = await upload.read()
            if len(data) > self.max_body:
                raise ApiError(413, f"the file has {len(data)} bytes; this server takes at most {self.max_body}")
            result = await self.transcribe(data, fields, getattr(upload, "filename", None) or "file")
            self.metrics.requests.labels(route=route, status="200").inc()
        except ApiError as e:
            self.metrics.requests.labels(route=route, status=str(e.status)).inc()
            raise
        if response_format == "text":
            return PlainTextResponse(result.text)
        if response_format == "verbose_json":
            return {"task": task, "language": result.language, "duration": result.duration, "text": result.text,
                    "segments": [s.model_dump() for s in result.segments or []]}
        return {"text": result.text}

    # -- internals ----------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    def _check_length(self, request: Request) -> None:
        """413 before reading a body whose declared length is over the limit."""
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            raise ApiError(413, f"the body has {length} bytes; this server takes at most {self.max_body}")

    async def _body(self, request: Request) -> dict:
        self._check_length(request)
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
        calls = [asyncio.ensure_future(self._generate(r)) for r in requests]
        try:
            results = await asyncio.gather(*calls)
        except BaseException:
            for call in calls:  # one choice failed: the others are not waited for
                call.cancel()
            raise
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
        try:
            firsts = await asyncio.gather(*(s.__anext__() for s in streams))  # errors before any byte: a 4xx/503
        except BaseException:
            for stream in streams:  # the other choices' decoder requests stop too
                await stream.aclose()
            raise
        created = int(time.time())
        usage = (body.stream_options or {}).get("include_usage")

        async def events():
            prompt_tokens, completion_tokens, started = 0, 0, set()
            merged = _merged(firsts, streams)
            try:
                async for i, item in merged:
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
                await merged.aclose()  # the pumps of the other choices stop
                for stream in streams:
                    await stream.aclose()

        return StreamingResponse(events(), media_type="text/event-stream")

    def _encoded(self, request: GenerateRequest):
        """An encoder-decoder model's source through the Encoder deployment (a reply the
        decoder opens), or None for a decoder-only model."""
        if self.encoder is None:
            return None
        if request.messages is not None:
            raise ApiError(400, "messages: this encoder-decoder model takes a prompt (the source text), not chat",
                           param="messages")
        return self.encoder.encode_text.remote([request.prompt])

    async def _images(self, request: GenerateRequest) -> list:
        """The Vision deployment's replies for the images of a chat request, in order (the
        decoder opens them). Data URLs always; http(s) URLs when allow_remote_images."""
        if request.messages is None:
            return []
        replies = []
        for i, message in enumerate(request.messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                if part.get("type") != "image_url":
                    continue
                field = f"messages.{i}.content.{j}.image_url"
                if self.vision is None:
                    raise ApiError(400, f"{field}: this model takes no images", param=field)
                url = (part.get("image_url") or {}).get("url") if isinstance(part.get("image_url"), dict) \
                    else part.get("image_url")
                data = await self._image_bytes(url, field)
                replies.append(self.vision.encode_image.remote(data, field))
        return replies

    async def _image_bytes(self, url, field: str) -> bytes:
        import base64
        import binascii

        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{field}: give the image as {{\"url\": \"data:image/png;base64,...\"}}", param=field)
        if url.startswith("data:"):
            head, _, payload = url.partition(",")
            if not head.endswith(";base64"):
                raise ApiError(400, f"{field}: a data URL must be base64 (data:image/...;base64,...)", param=field)
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"{field}: the data URL's base64 does not decode", param=field) from None
        if url.startswith(("http://", "https://")):
            if not self.allow_remote_images:
                raise ApiError(400, f"{field}: remote image URLs are off on this server (allow_remote_images); "
                                    "send the image as a data URL", param=field)
            import httpx

            try:
                async with httpx.AsyncClient(timeout=10, follow_redirects=True) as client:
                    response = await client.get(url)
                    response.raise_for_status()
            except httpx.HTTPError as e:
                raise ApiError(400, f"{field}: could not fetch the image: {e}", param=field) from None
            if len(response.content) > self.max_body:
                raise ApiError(413, f"{field}: the image has {len(response.content)} bytes; at most {self.max_body}")
            return response.content
        raise ApiError(400, f"{field}: an image URL is a data: URL or http(s)://, not {url[:40]!r}", param=field)

    async def _chunks(self, request: GenerateRequest):
        """The decoder's stream, its failures as ApiErrors."""
        stream = self._decoder_stream.stream.remote(request, self._encoded(request), *(await self._images(request)))
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
        result = await self._call(self.decoder.generate.remote(request, self._encoded(request),
                                                               *(await self._images(request))))
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
    return application(cfg, app_kind(cfg))


def app_kind(cfg: AppConfig) -> str:
    """The PARTS the application has: the model's kind; a kind given in the config must be it."""
    found = model_kind(cfg)
    if cfg.kind not in ("auto", found):
        raise ValueError(f"kind: '{cfg.kind}' was given, but the model {cfg.model or '(default)'} is '{found}'")
    return found


def model_kind(cfg: AppConfig) -> str:
    """text, encoder-decoder or vision: what the model folder (or hub repository) holds."""
    if cfg.engine != "onnx":
        return "text"
    if _is_encoder_decoder(cfg.model):
        return "encoder-decoder"
    if _has_vision_encoder(cfg.model):
        return "vision"
    return "text"


def application(cfg: AppConfig, kind: str):
    """The deployments of PARTS[kind], bound together (no model is read here)."""
    config = cfg.model_dump()
    decoder = Decoder
    if cfg.gpu == "yes" or (cfg.gpu == "auto" and _cluster_has_gpu()):
        decoder = Decoder.options(ray_actor_options={"num_cpus": 0.5, "num_gpus": 1})
    if kind == "encoder-decoder":
        encoder = Encoder.bind(config)
        return Ingress.bind(decoder.bind(config, encoder), config, encoder)
    if kind == "vision":
        return Ingress.bind(decoder.bind(config), config, None, Vision.bind(config))
    return Ingress.bind(decoder.bind(config), config)


def _has_vision_encoder(model: str | None) -> bool:
    """A vision-language folder (onnx-community layout): onnx/vision_encoder*.onnx."""
    from pathlib import Path

    if model is None:
        return False
    if not Path(model).is_dir():
        from huggingface_hub import list_repo_files

        return any(Path(f).name.startswith("vision_encoder") for f in list_repo_files(model))
    return any(Path(model).glob("onnx/vision_encoder*.onnx")) or any(Path(model).glob("vision_encoder*.onnx"))


def _is_encoder_decoder(model: str | None) -> bool:
    """config.json's is_encoder_decoder (for a hub id, config.json alone is fetched)."""
    if model is None:
        return False
    from pathlib import Path

    path = Path(model) / "config.json"
    if Path(model).is_dir():
        if not path.is_file():
            return False  # an onnxruntime-genai folder: decoder-only
    else:
        from huggingface_hub import hf_hub_download

        path = Path(hf_hub_download(model, "config.json"))
    return bool(json.loads(path.read_text()).get("is_encoder_decoder"))


def _cluster_has_gpu() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    except Exception:  # noqa: BLE001 - no cluster to ask: plan for CPU
        return False
