"""The Ray Serve application: a Decoder deployment (the engine and its batching loop) behind an
Ingress deployment (OpenAI-style HTTP and the Python handle API).

    serve run deployments.app:build model=path/to/folder     # or cluster/serve.yaml
    handle = serve.get_app_handle("raymuter")
    await handle.generate.remote(GenerateRequest(prompt="Once"))

The ingress never touches arrays: it validates requests, hands typed requests to the decoder by
handle, and turns its chunks into OpenAI's bodies and server-sent events. Every failure becomes
OpenAI's error body (deployments.http.edge): 4xx naming the request's field for bad input, 503 with
Retry-After when the decoder's queue is full or its replica is gone (the request is not retried:
it may have been half done), and 500 with only a request id, the details in the log. A client
that goes away cancels its request, streaming or not.
"""

import asyncio
import json
import os
import secrets
import time
from contextlib import contextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from generation.cli import version

from .autoscaling import RUNNING, SLOTS, WAITING, Autoscaling
from .errors import Overloaded, RequestError
from .http.edge import (
    RETRY_AFTER_SECONDS,
    EventStream,
    LastPiece,
    answers,
    body_limit,
    body_of,
    check_length,
    client_gone,
    install_error_handlers,
    merged_streams,
    openapi_document,
    read_json,
    request_id,
    server_error,
)
from .http.openai import (
    ApiError,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    EmbeddingList,
    EmbeddingRequest,
    ModelInfo,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
    completion_choice,
    completion_logprobs,
    completion_response,
    embedding_response,
    for_request,
    generate_request,
    parse,
    stream_chunk,
    subtitles,
    usage,
    validation_error,
)
from .http.openai import Transcription as TranscriptionBody
from .local_handle import LocalHandle
from .metrics import IngressMetrics
from .schema import (
    EmbedRequest,
    EmbedResponse,
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    Refusal,
    Transcription,
    TranscriptionRequest,
)
from .services.routing import ROUTERS

ROUTER_ON_LOOP = {"RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}
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
    # prompt prefixes kept per decoder replica (KV rows, bytes; 0: off): a prompt that starts as one
    # seen before runs only its rest (generation/cache/prefix.py)
    prefix_cache_bytes: int = Field(default=256 * 2**20, ge=0, le=2**40)
    max_logprobs: int = Field(default=20, ge=-1, le=20)  # -1: no log-probabilities (the lean greedy loop)
    threads: int | None = Field(default=None, ge=1)  # onnxruntime intra-op threads per decoder replica
    spin: bool = True  # the decoder's idle onnxruntime threads spin between runs (False: they sleep)
    provider: str | None = None  # cuda, cpu; default: CUDA where the replica has a GPU
    variant: str | None = None
    fuse: bool = True  # run an Optimum / transformers.js Llama-family decoder as its fused rewrite (generation.load)
    # a draft model (folder or hub id) with the model's tokenizer: every step verifies its
    # proposals (num_assistant_tokens, num_assistant_tokens_schedule in settings); text models
    draft: str | None = None
    settings: dict[str, Any] = Field(default_factory=dict)  # defaults for every request
    api_key: str | None = None  # a bearer token every route but /health requires; or RAYMUTER_API_KEY
    allow_remote_images: bool = False  # fetch http(s) image URLs of chat messages (data URLs always work)
    max_body_bytes: int = Field(default=25 * 2**20, ge=1024)
    stream_interval_ms: float = Field(default=10.0, ge=0, le=1000)  # a stream's chunks at most this often
    # (the first at once; the tokens made meanwhile travel together: fewer messages through Ray
    # when a fast model streams to many clients; stretched while many rows run, about 200 chunks a
    # second in all, at most one every 100 ms: generator.CHUNKS_PER_SECOND; 0: a chunk per token)
    step_seconds: float = Field(default=0.005, gt=0)  # fake engine only: a step's cost, plus
    step_seconds_per_row: float = Field(default=0.0, ge=0)  # this for each row in it (bench/fleet.py)
    gpu: str = Field(default="auto", pattern="^(auto|yes|no)$")  # the decoder asks for num_gpus=1
    # Which deployments the application has (PARTS); auto: from the model folder. A Serve config
    # that names deployments (the Helm chart's) sets it, and a model of another kind is refused.
    kind: str = Field(default="auto", pattern="^(auto|text|encoder-decoder|vision)$")
    # Each deployment's autoscaling (deployments/autoscaling.py), by part: ingress, decoder,
    # encoder, vision; a part not named keeps one replica (or what a Serve config gives it).
    # The decoder scales on its rows and waiting requests against its slots (policy occupancy).
    autoscaling: dict[Literal["ingress", "decoder", "encoder", "vision"], Autoscaling] = Field(default_factory=dict)
    # The HTTP routes in the decoder's replica (deployments.app.Server): no Ray message per request
    # and streamed chunk between an ingress and the decoder; the routes then scale with the decoder
    # (its autoscaling, one proxy spreading requests) and the prefix router does not apply.
    colocate: bool = False
    # The decoder's batching loop in a child process of its replica (services/engine_process.py):
    # the routes' event loop and the engine's host Python then hold no GIL in common
    # (decoder-only text models; the weights are in the child's memory only).
    engine_process: bool = False
    # What one request's constraint (structured outputs, tool_choice's grammar, each tool's parameters)
    # may cost, by field of generation.logits.constraints.GrammarBudget (seconds to compile it, and
    # llguidance's limits: max_grammar_size, initial_lexer_fuel, ...); a field not given keeps its default
    grammar_budget: dict[str, int | float] = Field(default_factory=dict)


# Seconds a stopping replica (scaled down, redeployed, its node drained) may take to finish the
# requests it holds before Serve stops it anyway (Serve's default: 20).
DRAIN_SECONDS = 300

# The deployments of each kind of model, the ingress first.
PARTS = {"text": ("Ingress", "Decoder"), "encoder-decoder": ("Ingress", "Decoder", "Encoder"),
         "vision": ("Ingress", "Decoder", "Vision")}
# The same with the routes and the decoder in one Server deployment (AppConfig.colocate).
COLOCATED_PARTS = {kind: ("Server", *names[2:]) for kind, names in PARTS.items()}


def _typed(request) -> GenerateRequest:
    if isinstance(request, GenerateRequest):
        return request
    try:
        return GenerateRequest.model_validate(request)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


def _refusal(error: Exception) -> dict:
    if isinstance(error, Overloaded):
        return {"error": str(error), "status": 503}
    return {"error": str(error), "status": 400, "field": error.field}


def _busy(reason) -> ApiError:
    return ApiError(503, f"the server is busy ({reason}); retry after {RETRY_AFTER_SECONDS} s",
                    kind="server_overloaded")


def _refused(result, request_id_: str) -> ApiError | None:
    """The ApiError of a decoder answer that refused or failed the request, else None."""
    if isinstance(result, Refusal) or result.finish_reason == "rejected":
        return _busy(result.error) if result.status == 503 else ApiError(result.status or 400, result.error,
                                                                         param=result.field)
    if result.finish_reason == "error":
        if result.status == 503:  # its engine went away (a new one is starting): the client may retry
            return _busy(result.error)
        if result.status and result.status < 500:  # the batch refused it while admitting it: its own fault
            return ApiError(result.status, result.error, param=result.field)
        return server_error(request_id_, "the generation failed in the batch", result.error)
    return None


# A request whose decoder replica is lost before it answered is sent again, to another replica
# (Serve's router drops the lost one within a moment): at most RETRIES times, after a pause.
RETRIES, RETRY_SECONDS = 2, 0.5


def _replica_lost(error: BaseException) -> bool:
    """The call failed because its replica (or its node) went away, not because of the request."""
    from ray.exceptions import ActorUnavailableError, RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    return isinstance(error, (RayActorError, ActorUnavailableError, DeploymentUnavailableError))


def _api_error_of(error: BaseException, request_id_: str) -> ApiError:
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
        return _busy(cause)
    if isinstance(cause, (RayActorError, DeploymentUnavailableError)):
        return ApiError(503, f"the decoder replica serving this request failed ({type(cause).__name__}); "
                             "retry: a new replica takes over", kind="server_error")
    return server_error(request_id_, "the decoder call failed", cause)


@serve.deployment(ray_actor_options={"num_cpus": 0.25}, max_ongoing_requests=64)
class Encoder:
    """An encoder-decoder model's encoder (deployments.services.encoder.EncoderService): uploaded audio
    decoded to samples, Whisper windows or texts through the encoder. Its replies go to the
    decoder unopened."""

    def __init__(self, config: dict):
        from .services.encoder import EncoderService

        started = time.perf_counter()
        cfg = AppConfig(**config)
        self.service = EncoderService(cfg.model, cfg.name, threads=cfg.threads, provider=cfg.provider,
                                      variant=cfg.variant)
        self.service.metrics.started(time.perf_counter() - started)

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
    """A vision-language model's image and video preprocessing and vision encoder
    (deployments.services.vision.VisionService), features cached by content. Its replies go to the
    decoder unopened."""

    def __init__(self, config: dict):
        from .services.vision import VisionService

        started = time.perf_counter()
        cfg = AppConfig(**config)
        self.service = VisionService(cfg.model, cfg.name, threads=cfg.threads, provider=cfg.provider,
                                     variant=cfg.variant)
        self.service.metrics.started(time.perf_counter() - started)

    def encode_image(self, data: bytes, name: str = "image"):
        return self.service.encode_image(data, name)

    def encode_video(self, data: bytes | list[bytes], name: str = "video"):
        return self.service.encode_video(data, name)

    def metrics(self) -> str:
        return self.service.metrics.text()



# The ingress sends a request to the decoder replica that most likely holds its prompt's prefix
# (deployments/services/routing.py); a Serve config's request_router_config replaces it (ROUTERS).
# A replica that is scaled down or replaced by a redeploy takes no new request and finishes the
# rows it holds, up to DRAIN_SECONDS (a long generation at a slow model's pace), so no stream is cut.
@serve.deployment(ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=1024, health_check_period_s=2,
                  health_check_timeout_s=10, request_router_config=RequestRouterConfig(request_router_class=ROUTERS["prefix"]),
                  graceful_shutdown_timeout_s=DRAIN_SECONDS, graceful_shutdown_wait_loop_s=1)
class Decoder:
    """Owns the model and its continuous batching loop (deployments.services.generator.TextGenerator). An
    encoder-decoder model's decoder gets its sources' encoder outputs from the Encoder
    deployment (through the ingress's calls, or `encoder` for Whisper's later windows)."""

    def __init__(self, config: dict, encoder: DeploymentHandle | None = None):
        started = time.perf_counter()
        cfg = AppConfig(**config)
        self.encoder = encoder
        self._load(cfg)
        self.generator.metrics.started(time.perf_counter() - started)

    def _load(self, cfg: AppConfig) -> None:
        if cfg.engine == "fake":
            from .fake import fake_generator

            self.generator = fake_generator(cfg.slots, cfg.step_seconds, cfg.max_waiting,
                                            cfg.name or (DEFAULT_MODEL_NAME if cfg.model is None else "fake"),
                                            step_seconds_per_row=cfg.step_seconds_per_row)
            self.generator.stream_interval = cfg.stream_interval_ms / 1000
        else:
            from generation.core.embed import is_embedding_folder
            from generation.runtime.model import resolve_folder

            from .services.embeddings import EmbeddingService
            from .services.generator import TextGenerator

            model = cfg.model
            if model is None:
                from generation.default_model import default_model_path

                model = str(default_model_path())
            if is_embedding_folder(resolve_folder(model, cfg.variant)):
                self.generator = EmbeddingService.from_model(model, name=cfg.name, threads=cfg.threads,
                                                             provider=cfg.provider, variant=cfg.variant)
                return
            self.generator = TextGenerator.from_model(
                model, name=cfg.name or (DEFAULT_MODEL_NAME if cfg.model is None else None), slots=cfg.slots, capacity=cfg.capacity, max_waiting=cfg.max_waiting,
                prefix_cache_bytes=cfg.prefix_cache_bytes,
                max_logprobs=cfg.max_logprobs, threads=cfg.threads, provider=cfg.provider, variant=cfg.variant,
                fuse=cfg.fuse, stream_interval=cfg.stream_interval_ms / 1000, draft=cfg.draft,
                grammar_budget=cfg.grammar_budget,
                engine_process=cfg.engine_process, spin=cfg.spin, **cfg.settings)

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

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        embed = getattr(self.generator, "embed", None)
        if embed is None:
            return EmbedResponse(**_refusal(RequestError(
                f"model: '{self.generator.name}' gives no embeddings (an embedding model's ONNX graph gives "
                "last_hidden_state: optimum's --task feature-extraction)", "model")))
        try:
            return await embed(request)
        except (RequestError, Overloaded) as e:
            return EmbedResponse(**_refusal(e))

    async def transcribe(self, samples, request: TranscriptionRequest):
        if self.encoder is None:
            return Refusal(**_refusal(RequestError(f"model: '{self.generator.name}' does not take audio", "model")))

        def encode(windows):  # on speech_to_text's worker thread
            return self.encoder.encode_features.remote(windows).result()

        try:
            return await self.generator.transcribe(samples, request, encode)
        except (RequestError, Overloaded) as e:
            return Refusal(**_refusal(e))

    async def tokenize(self, text, messages, add_special_tokens, add_generation_prompt, variables, token_strs):
        try:
            return self.generator.tokenize(text, messages, add_special_tokens, add_generation_prompt, variables,
                                           token_strs)
        except RequestError as e:
            return Refusal(**_refusal(e))

    async def detokenize(self, ids: list[int]):
        try:
            return self.generator.detokenize(ids)
        except RequestError as e:
            return Refusal(**_refusal(e))

    def card(self):
        return self.generator.card()

    def metrics(self) -> str:
        return self.generator.metrics.text()

    def pid(self) -> int:
        return os.getpid()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the decoder's autoscaling policy reads (deployments.autoscaling.DecoderPolicy)."""
        batcher = getattr(self.generator, "batcher", None)
        if batcher is None:  # an embedding model: Ray's own rule (ongoing requests)
            return {}
        return {RUNNING: float(batcher.running), WAITING: float(batcher.waiting), SLOTS: float(batcher.slots)}

    def check_health(self) -> None:
        batcher = getattr(self.generator, "batcher", None)
        if batcher is not None and not batcher.alive:
            raise RuntimeError(f"the batching loop stopped ({getattr(batcher, '_stopped', None) or 'its thread ended'})")

    def __del__(self):
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.close()




api = FastAPI(title="Raymuter", version=version(), docs_url=None, redoc_url=None, openapi_url=None,
              description="OpenAI-style generation over ONNX models on Ray Serve. Every route but /health "
                          "needs the API key (Authorization: Bearer KEY) when the server has one.")
install_error_handlers(api)
# What /openapi.json lists as request bodies (the routes read their bodies themselves).
REQUEST_MODELS = [CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest, EmbeddingRequest]
ERRORS = (400, 401, 404, 413, 500, 503)
AUDIO_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")  # OpenAI's
AUDIO_FORM = {"type": "object", "required": ["file", "model"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "WAV, FLAC, OGG or MP3"},
    "model": {"type": "string"}, "language": {"type": "string", "maxLength": 64},
    "prompt": {"type": "string", "maxLength": 4096,
               "description": "previous text the transcription continues (Whisper's prompt_ids)"},
    "response_format": {"type": "string", "enum": list(AUDIO_FORMATS)},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment"]},
                                  "description": "with response_format verbose_json"},
    "compression_ratio_threshold": {"type": "number", "minimum": 0, "maximum": 1e6},
    "logprob_threshold": {"type": "number", "minimum": -1e6, "maximum": 0},
    "no_speech_threshold": {"type": "number", "minimum": 0, "maximum": 1},
    "condition_on_prev_tokens": {"type": "boolean"}}}


def _form_text(form, name: str, most: int) -> str | None:
    value = form.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > most):
        raise ApiError(400, f"{name}: a text of at most {most} characters", param=name)
    return value


def _form_number(form, name: str, kind, low, high):
    """A number field of a multipart form, or None; 400 naming it when it is not one in [low, high]."""
    value = form.get(name)
    if value in (None, ""):
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not low <= number <= high:
        raise ApiError(400, f"{name}: {'an integer' if kind is int else 'a number'} from {low} to {high}, "
                            f"not {str(value)[:40]!r}", param=name)
    return number


# The ingress's handles route on its own event loop (Serve's default: a router thread, which every
# streamed chunk hopped through); only here, as a handle built outside a running loop (a driver's
# sync `.remote().result()`) needs the router thread. See deployments.cli.SAME_LOOP.
@serve.deployment(ray_actor_options={"num_cpus": 0.25, "runtime_env": {"env_vars": ROUTER_ON_LOOP}},
                  max_ongoing_requests=1024, graceful_shutdown_timeout_s=DRAIN_SECONDS,
                  graceful_shutdown_wait_loop_s=1)
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
        self.max_body = body_limit(cfg.max_body_bytes)
        self.metrics = IngressMetrics()
        self._card = None
        self._openapi = None

    # -- the Python handle API ----------------------------------------------------------------
    async def generate(self, request: GenerateRequest | dict) -> GenerateResponse:
        """One generation (handle.generate.remote(GenerateRequest(...)))."""
        return await self._generate(self._with_id(_typed(request)))

    async def generate_stream(self, request: GenerateRequest | dict):
        """GenerateChunks (handle.options(stream=True).generate_stream.remote(...))."""
        async for chunk in self._chunks(self._with_id(_typed(request))):
            yield chunk

    async def embed(self, request: EmbedRequest | dict) -> EmbedResponse:
        """Embeddings of texts or token ids (handle.embed.remote(EmbedRequest(inputs=[...]))); a
        refusal is an EmbedResponse with its error, status and field."""
        request = request if isinstance(request, EmbedRequest) else EmbedRequest(**request)
        return await self._call(self.decoder.embed.remote(request), request.request_id or request_id("embd-"))

    async def transcribe(self, audio: bytes, request: TranscriptionRequest | dict | None = None,
                         filename: str = "audio") -> Transcription:
        """Whisper over an audio file's bytes (handle.transcribe.remote(data, TranscriptionRequest(...)))."""
        if not isinstance(request, TranscriptionRequest):
            try:
                request = TranscriptionRequest.model_validate(request or {})
            except ValidationError as e:
                raise validation_error(e.errors(include_url=False)) from None
        if self.encoder is None:
            card = await self._model_card()
            raise ApiError(400, f"model: '{card['id']}' does not take audio", param="model")
        samples = self.encoder.decode_audio.remote(audio, filename)  # stays in Ray's store: the decoder opens it
        rid = request_id("audio-")
        result = await self._call(self.decoder.transcribe.remote(samples, request), rid)
        if isinstance(result, Refusal):
            raise _refused(result, rid)
        return result

    async def models(self) -> list[dict]:
        card = await self._model_card()
        return [card]

    # -- HTTP ---------------------------------------------------------------------------------
    @api.get("/health", responses=answers(None))
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/version", responses=answers(VersionResponse, 401))
    async def version(self, request: Request):
        self._authorize(request)
        return {"version": api.version}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request):
        self._authorize(request)
        if self._openapi is None:
            document = openapi_document(api, REQUEST_MODELS)
            document["servers"] = [{"url": request.scope.get("root_path") or "/"}]
            self._openapi = document
        return JSONResponse(self._openapi)

    @api.get("/docs", include_in_schema=False)
    async def docs(self, request: Request):
        self._authorize(request)
        return get_swagger_ui_html(openapi_url=(request.scope.get("root_path") or "") + "/openapi.json",
                                   title="Raymuter")

    @api.get("/v1/models", responses=answers(ModelList, 401))
    async def list_models(self, request: Request):
        self._authorize(request)
        card = await self._model_card()
        return {"object": "list", "data": [card]}

    @api.get("/v1/models/{model_id:path}", responses=answers(ModelInfo, 401, 404))
    async def get_model(self, model_id: str, request: Request):
        self._authorize(request)
        card = await self._model_card()
        self._check_model(model_id, card, "model_id")
        return card

    @api.get("/metrics", responses=answers(None, 401, text=True))
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

    @api.post("/v1/completions", openapi_extra=body_of(CompletionRequest),
              responses=answers(Completion, *ERRORS, stream=True))
    async def completions(self, request: Request):
        return await self._openai(request, CompletionRequest, chat=False)

    @api.post("/v1/chat/completions", openapi_extra=body_of(ChatCompletionRequest),
              responses=answers(ChatCompletion, *ERRORS, stream=True))
    async def chat_completions(self, request: Request):
        return await self._openai(request, ChatCompletionRequest, chat=True)

    @api.post("/tokenize", openapi_extra=body_of(TokenizeRequest), responses=answers(TokenizeResponse, *ERRORS))
    async def tokenize(self, request: Request):
        async def run(body: TokenizeRequest, card: dict, rid: str):
            messages = None if body.messages is None else [m.model_dump(exclude_none=True) for m in body.messages]
            out = await self._call(self.decoder.tokenize.remote(
                body.prompt, messages, body.add_special_tokens, body.add_generation_prompt, body.chat_template_kwargs,
                body.return_token_strs), rid)
            if isinstance(out, Refusal):
                raise _refused(out, rid)
            return {"count": len(out.tokens), "max_model_len": card["context_length"], "tokens": out.tokens,
                    "token_strs": out.token_strs}
        return await self._route(request, TokenizeRequest, run)

    @api.post("/detokenize", openapi_extra=body_of(DetokenizeRequest), responses=answers(DetokenizeResponse, *ERRORS))
    async def detokenize(self, request: Request):
        async def run(body: DetokenizeRequest, card: dict, rid: str):
            out = await self._call(self.decoder.detokenize.remote(body.tokens), rid)
            if isinstance(out, Refusal):
                raise _refused(out, rid)
            return {"prompt": out}
        return await self._route(request, DetokenizeRequest, run)

    @api.post("/v1/embeddings", openapi_extra=body_of(EmbeddingRequest), responses=answers(EmbeddingList, *ERRORS))
    async def embeddings(self, request: Request):
        async def run(body: EmbeddingRequest, card: dict, rid: str):
            out = await self._call(self.decoder.embed.remote(EmbedRequest(
                inputs=body.inputs(), dimensions=body.dimensions, request_id=rid)), rid)
            if out.error is not None:
                raise _busy(out.error) if out.status == 503 else ApiError(out.status or 400, out.error,
                                                                           param=out.field)
            return embedding_response(card["id"], out.embeddings, out.prompt_tokens, body.encoding_format)
        return await self._route(request, EmbeddingRequest, run, prefix="embd-")

    @api.post("/v1/audio/transcriptions", openapi_extra=body_of(None, "multipart/form-data", AUDIO_FORM),
              responses=answers(TranscriptionBody, *ERRORS, text=True))
    async def transcriptions(self, request: Request):
        return await self._audio(request, "transcribe")

    @api.post("/v1/audio/translations", openapi_extra=body_of(None, "multipart/form-data", AUDIO_FORM),
              responses=answers(TranscriptionBody, *ERRORS, text=True))
    async def translations(self, request: Request):
        return await self._audio(request, "translate")

    async def _audio(self, request: Request, task: str):
        with self._counted(request):
            self._authorize(request)
            check_length(request, self.max_body)
            try:
                form = await request.form()
            except Exception as e:  # noqa: BLE001 - not multipart, or a broken one
                raise ApiError(400, f"the body must be multipart/form-data with a file: {e}"[:300]) from None
            upload = form.get("file")
            if upload is None or not hasattr(upload, "read"):
                raise ApiError(400, "file: required (the audio file, as a multipart upload)", param="file")
            card = await self._model_card()
            self._check_model(form.get("model"), card)
            response_format = form.get("response_format") or "json"
            if response_format not in AUDIO_FORMATS:
                raise ApiError(400, f"response_format: one of {', '.join(AUDIO_FORMATS)}, not '{response_format!s:.40}'",
                               param="response_format")
            granularities = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
            if any(g != "segment" for g in granularities):
                raise ApiError(400, "timestamp_granularities: only 'segment' is supported",
                               param="timestamp_granularities")
            if granularities and response_format != "verbose_json":
                raise ApiError(400, "timestamp_granularities: needs response_format verbose_json",
                               param="timestamp_granularities")
            condition = form.get("condition_on_prev_tokens")
            if condition not in (None, "", "true", "false"):
                raise ApiError(400, "condition_on_prev_tokens: true or false", param="condition_on_prev_tokens")
            fields = TranscriptionRequest(language=_form_text(form, "language", 64) or None, task=task,
                                          timestamps=response_format in ("verbose_json", "srt", "vtt"),
                                          temperature=_form_number(form, "temperature", float, 0, 2) or 0.0,
                                          prompt=_form_text(form, "prompt", 4096) or None,
                                          compression_ratio_threshold=_form_number(
                                              form, "compression_ratio_threshold", float, 0, 1e6),
                                          logprob_threshold=_form_number(form, "logprob_threshold", float, -1e6, 0),
                                          no_speech_threshold=_form_number(form, "no_speech_threshold", float, 0, 1),
                                          condition_on_prev_tokens=None if not condition else condition == "true",
                                          seed=_form_number(form, "seed", int, 0, 2**63 - 1))
            data = await upload.read()
            if len(data) > self.max_body:
                raise ApiError(413, f"the file has {len(data)} bytes; this server takes at most {self.max_body}",
                               code="body_too_large")
            result = await self.transcribe(data, fields, getattr(upload, "filename", None) or "file")
        if response_format == "text":
            return PlainTextResponse(result.text)
        if response_format in ("srt", "vtt"):
            return PlainTextResponse(subtitles(result.segments or [], response_format))
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

    async def _model_card(self) -> dict:
        if self._card is None:
            card = await self._call(self.decoder.card.remote(), request_id())
            self._card = {"id": card.id, "object": "model", "created": int(time.time()), "owned_by": "raymuter",
                          "context_length": card.context_length, "slots": card.slots, "kind": card.kind,
                          "fingerprint": card.fingerprint}
        return {k: v for k, v in self._card.items() if k != "fingerprint"}

    @staticmethod
    def _check_model(model, card: dict, param: str = "model") -> None:
        if model != card["id"]:
            raise ApiError(404, f"{param}: '{model!s:.200}' is not served here; this server serves '{card['id']}'",
                           param=param, kind="invalid_request_error", code="model_not_found")

    def _with_id(self, request: GenerateRequest) -> GenerateRequest:
        return request if request.request_id else request.model_copy(update={"request_id": request_id()})

    async def _route(self, request: Request, kind, run, prefix: str = "req-"):
        """A JSON route: authorized, its body validated into `kind`, the model checked when
        named, then `run(body, card, request id)`; counted in the metrics."""
        with self._counted(request):
            self._authorize(request)
            body = parse(kind, await read_json(request, self.max_body))
            card = await self._model_card()
            if getattr(body, "model", None) is not None:
                self._check_model(body.model, card)
            return await run(body, card, request_id(prefix))

    @contextmanager
    def _counted(self, request: Request):
        """The request in raymuter:http_requests_total by route and status (an ApiError's, else 200)."""
        route = request.url.path
        try:
            yield
        except ApiError as e:
            self.metrics.requests.labels(route=route, status=str(e.status)).inc()
            raise
        self.metrics.requests.labels(route=route, status="200").inc()

    async def _openai(self, request: Request, kind, chat: bool):
        async def run(body, card, rid):
            prompts = [None] if chat else body.prompts()
            if not chat and body.echo and card["kind"] == "encoder-decoder":
                raise ApiError(400, "echo: an encoder-decoder model's prompt is its source, not the start of "
                                    "the completion", param="echo")
            jobs = []
            for p, prompt in enumerate(prompts):
                for j in range(body.n):
                    fields = generate_request(body, prompt, j)
                    fields.update(request_id=f"{rid}-{p * body.n + j}", echo=not chat and body.echo)
                    jobs.append((p if len(prompts) > 1 else None, _typed(fields)))
            fingerprint = self._card["fingerprint"]
            if body.stream:
                response = await self._sse(jobs, rid, card["id"], fingerprint, chat, body)
            else:
                response = JSONResponse(await self._whole(request, jobs, rid, card["id"], fingerprint, chat, body))
            return response

        return await self._route(request, kind, run, "chatcmpl-" if chat else "cmpl-")

    async def _choice(self, request: GenerateRequest, body, prompt_index: int | None):
        """One choice's generation; a refusal names the OpenAI request's field."""
        try:
            return await self._generate(request)
        except ApiError as e:
            raise for_request(e, body, prompt_index) from None

    async def _whole(self, http: Request, jobs, rid, model, fingerprint, chat, body) -> dict:
        calls = [asyncio.ensure_future(self._choice(r, body, p)) for p, r in jobs]
        gathered = asyncio.gather(*calls)
        gone = asyncio.ensure_future(client_gone(http))
        try:
            done, _ = await asyncio.wait([gathered, gone], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            gathered.cancel()
            raise
        finally:
            gone.cancel()
        if gathered not in done:  # the client left first: its choices stop and free their slots
            gathered.cancel()
            await asyncio.gather(gathered, return_exceptions=True)
            raise ApiError(499, "the client closed the connection")
        try:
            results = gathered.result()
        except BaseException:
            for call in calls:  # one choice failed: the others are not waited for
                call.cancel()
            raise
        choices, prompt_tokens, cached_tokens = [], 0, 0
        for k, ((p, _), result) in enumerate(zip(jobs, results)):
            text, tokens = result.text, [t.model_dump() for t in result.logprobs or []]
            if result.prompt_text is not None:  # echo: the prompt, then the completion
                text = result.prompt_text + text
                tokens = [t.model_dump() for t in result.prompt_logprobs or []] + tokens
            logprobs = None if result.logprobs is None else completion_logprobs(tokens, chat)
            choices.append(completion_choice(k, text, result.finish_reason, logprobs, chat, result.tool_calls))
            if k % body.n == 0:  # a prompt's n choices: its tokens once
                prompt_tokens += result.prompt_tokens
                cached_tokens += result.cached_tokens
        return completion_response(rid, model, choices, usage(prompt_tokens, sum(r.completion_tokens for r in results),
                                                              cached_tokens), fingerprint, chat)

    async def _sse(self, jobs, rid, model, fingerprint, chat, body) -> StreamingResponse:
        streams = [self._chunks(r, body, p) for p, r in jobs]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        try:
            await asyncio.gather(*firsts)  # errors before any byte: a 4xx/503
        except BaseException:
            for first in firsts:  # the other choices' decoder requests stop too
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            for stream in streams:
                await stream.aclose()
            raise
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def event(data: dict) -> str:
            return f"data: {json.dumps(data)}\n\n"

        async def events():
            prompt_tokens, completion_tokens, cached_tokens, started, ended = 0, 0, 0, set(), 0
            offsets = [0] * len(jobs)  # each choice's characters so far: its logprobs' text_offset runs on
            merged = merged_streams([f.result() for f in firsts], streams)
            tail = ""  # the last choice's last event: it goes with the usage, [DONE] and the body's end
            try:
                async for i, item in merged:
                    if isinstance(item, ApiError):
                        yield event(item.body())
                        return
                    if item.logprobs is None and item.prompt_logprobs is None and not item.prompt_text:
                        tokens, text, logprobs = (), item.text, None  # the common chunk: its text only
                    else:
                        tokens = [t.model_dump() for t in item.prompt_logprobs or []] + \
                            [t.model_dump() for t in item.logprobs or []]
                        text = (item.prompt_text or "") + item.text
                        wants = item.logprobs is not None or item.prompt_logprobs is not None
                        logprobs = completion_logprobs(tokens, chat, offsets[i]) if wants else None
                    if not chat and tokens:
                        offsets[i] += sum(len(t["text"]) for t in tokens)
                    if item.finish_reason is not None:
                        ended += 1
                    if text or item.finish_reason or logprobs or (chat and i not in started):
                        piece = event(stream_chunk(rid, model, created, i, text, item.finish_reason, chat, fingerprint,
                                                   logprobs, first=i not in started, tool_calls=item.tool_calls))
                        started.add(i)
                        if ended == len(jobs):
                            tail = piece
                        else:
                            yield piece
                    if item.finish_reason is not None:
                        if i % body.n == 0:
                            prompt_tokens += item.prompt_tokens or 0
                            cached_tokens += item.cached_tokens or 0
                        completion_tokens += item.completion_tokens or 0
                if include_usage:
                    tail += event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": created, "model": model, "system_fingerprint": fingerprint,
                                   "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
                yield LastPiece(tail + "data: [DONE]\n\n")
            finally:
                await merged.aclose()  # the pumps of the other choices stop
                for stream in streams:
                    await stream.aclose()

        return EventStream(events(), media_type="text/event-stream")

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
        """The Vision deployment's replies for the images and videos of a chat request, in order
        (the decoder opens them): image_url parts; video_url parts (a video file) and video parts
        (a list of frames as image URLs, or a video file's URL). Data URLs always; http(s) URLs
        when allow_remote_images."""
        if request.messages is None:
            return []
        replies = []
        for i, message in enumerate(request.messages):
            if not isinstance(message.content, list):
                continue
            for j, part in enumerate(message.content):
                kind = part.get("type")
                if kind not in ("image_url", "video_url", "video"):
                    continue
                field = f"messages.{i}.content.{j}.{kind}"
                what = "image" if kind == "image_url" else "video"
                if self.vision is None:
                    raise ApiError(400, f"{field}: this model takes no {what}s", param=field)
                value = part.get(kind)
                if isinstance(value, list):  # a video's frames
                    frames = [await self._media_bytes(url, f"{field}.{k}", "image") for k, url in enumerate(value)]
                    replies.append(self.vision.encode_video.remote(frames, field))
                    continue
                data = await self._media_bytes(value.get("url") if isinstance(value, dict) else value, field, what)
                encode = self.vision.encode_image if what == "image" else self.vision.encode_video
                replies.append(encode.remote(data, field))
        return replies

    async def _media_bytes(self, url, field: str, what: str = "image") -> bytes:
        """The bytes of an image or video URL (`what`): a base64 data URL's, or a fetched one's."""
        import base64
        import binascii

        example = "data:image/png;base64,..." if what == "image" else "data:video/mp4;base64,..."
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{field}: give the {what} as {{\"url\": \"{example}\"}}", param=field)
        if url.startswith("data:"):
            head, _, payload = url.partition(",")
            if not head.endswith(";base64"):
                raise ApiError(400, f"{field}: a data URL must be base64 (data:{what}/...;base64,...)", param=field)
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"{field}: the data URL's base64 does not decode", param=field) from None
        if url.startswith(("http://", "https://")):
            if not self.allow_remote_images:
                raise ApiError(400, f"{field}: remote {what} URLs are off on this server (allow_remote_images); "
                                    f"send the {what} as a data URL", param=field)
            import httpx

            try:
                async with httpx.AsyncClient(timeout=10, follow_redirects=True) as client:
                    response = await client.get(url)
                    response.raise_for_status()
            except httpx.HTTPError as e:
                raise ApiError(400, f"{field}: could not fetch the {what}: {e}", param=field) from None
            if len(response.content) > self.max_body:
                raise ApiError(413, f"{field}: the {what} has {len(response.content)} bytes; at most {self.max_body}",
                               param=field, code="body_too_large")
            return response.content
        raise ApiError(400, f"{field}: {'an image' if what == 'image' else 'a video'} URL is a data: URL or http(s)://, "
                            f"not {url[:40]!r}", param=field)

    async def _chunks(self, request: GenerateRequest, body=None, prompt_index: int | None = None):
        """The decoder's stream, its failures as ApiErrors (naming the OpenAI request's field
        where `body` is one). A request whose replica is lost before its first chunk (it was
        queued there, or its node went away) moves to another replica (RETRIES times); once a
        chunk has gone out, the loss ends the stream with its error."""
        images = await self._images(request)
        for attempt in range(RETRIES + 1):
            stream = self._decoder_stream.stream.remote(request, self._encoded(request), *images)
            sent = False
            try:
                while True:
                    try:
                        chunk = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    refused = _refused(chunk, request.request_id)
                    if refused is not None:
                        raise refused
                    sent = True
                    yield chunk
            except ApiError as e:
                raise e if body is None else for_request(e, body, prompt_index) from None
            except Exception as e:  # noqa: BLE001
                if sent or attempt == RETRIES or not _replica_lost(e):
                    raise _api_error_of(e, request.request_id) from None
                await asyncio.sleep(RETRY_SECONDS * (attempt + 1))  # Serve drops the lost replica meanwhile
            finally:
                stream.cancel()

    async def _generate(self, request: GenerateRequest) -> GenerateResponse:
        """The whole generation; a replica lost before it answered: moved to another (RETRIES times)."""
        images = await self._images(request)
        for attempt in range(RETRIES + 1):
            try:
                result = await self._call(self.decoder.generate.remote(request, self._encoded(request), *images),
                                          request.request_id, raw=attempt < RETRIES)
                break
            except Exception as e:  # noqa: BLE001 - only a lost replica comes back raw
                if not _replica_lost(e):
                    raise _api_error_of(e, request.request_id) from None
                await asyncio.sleep(RETRY_SECONDS * (attempt + 1))
        refused = _refused(result, request.request_id)
        if refused is not None:
            raise refused
        return result

    async def _call(self, response, request_id_: str, raw: bool = False):
        """The decoder call's reply, its failure as an ApiError (`raw`: a lost replica's failure as
        it came, for the caller to retry)."""
        try:
            return await response
        except asyncio.CancelledError:
            response.cancel()  # the decoder stops the request and frees its slot
            raise
        except Exception as e:  # noqa: BLE001
            if raw and _replica_lost(e):
                raise
            raise _api_error_of(e, request_id_) from None


# The routes and the decoder in one replica (AppConfig.colocate): the ingress's code over a
# LocalHandle of its own Decoder, so a request and each streamed chunk cost no Ray message.
@serve.deployment(ray_actor_options={"num_cpus": 0.5, "runtime_env": {"env_vars": ROUTER_ON_LOOP}},
                  max_ongoing_requests=1024, health_check_period_s=2, health_check_timeout_s=10,
                  graceful_shutdown_timeout_s=DRAIN_SECONDS, graceful_shutdown_wait_loop_s=1,
                  logging_config={"enable_access_log": False})
class Server(Ingress.func_or_class):
    """HTTP routes and the Python handle API with the model in the same process."""

    async def __init__(self, config: dict, encoder: DeploymentHandle | None = None,
                       vision: DeploymentHandle | None = None):
        self.model = Decoder.func_or_class(config, encoder)
        await super().__init__(LocalHandle(self.model), config, encoder, vision)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.model.record_autoscaling_stats()

    def check_health(self) -> None:
        self.model.check_health()

    def pid(self) -> int:
        return self.model.pid()

    async def __del__(self):  # Serve's shutdown of the replica: the routes, then the batching loop
        await super().__del__()
        self.model.__del__()


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
    """text, encoder-decoder or vision: what the model folder (or hub repository) is, as its
    family says (generation.families.kind); the fake engine and the default model: text."""
    if cfg.engine != "onnx" or cfg.model is None:
        return "text"
    from generation import families

    return families.kind(cfg.model)


def application(cfg: AppConfig, kind: str):
    """The deployments of PARTS[kind] (COLOCATED_PARTS[kind] with colocate), bound together (no
    model is read here)."""
    config = cfg.model_dump()
    if cfg.colocate and "ingress" in cfg.autoscaling:
        raise ValueError("autoscaling: with colocate the routes run in the decoder's replicas; "
                         "scale them with autoscaling.decoder, not autoscaling.ingress")
    decoder = Server if cfg.colocate else Decoder  # the Server takes the decoder's resources and autoscaling
    if cfg.gpu == "yes" or (cfg.gpu == "auto" and _cluster_has_gpu()):
        decoder = decoder.options(ray_actor_options={**decoder.ray_actor_options, "num_gpus": 1})
    parts = {"ingress": Ingress, "decoder": decoder, "encoder": Encoder, "vision": Vision}
    for part, settings in cfg.autoscaling.items():
        parts[part] = parts[part].options(autoscaling_config=settings.serve_config(part))
    ingress, decoder = parts["ingress"], parts["decoder"]
    if cfg.colocate:
        if kind == "encoder-decoder":
            return decoder.bind(config, parts["encoder"].bind(config))
        if kind == "vision":
            return decoder.bind(config, None, parts["vision"].bind(config))
        return decoder.bind(config)
    if kind == "encoder-decoder":
        encoder = parts["encoder"].bind(config)
        return ingress.bind(decoder.bind(config, encoder), config, encoder)
    if kind == "vision":
        return ingress.bind(decoder.bind(config), config, None, parts["vision"].bind(config))
    return ingress.bind(decoder.bind(config), config)


def _cluster_has_gpu() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) >= 1
    except Exception:  # noqa: BLE001 - no cluster to ask: plan for CPU
        return False
