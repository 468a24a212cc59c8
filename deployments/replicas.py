"""What each deployment's replica runs: plain classes, which deployments/app.py makes into Serve
deployments (their resources, scaling and draining) and binds together. Here, not there, so that
Serve pickles each by reference (a class its decorator wraps while the module is still being
read is pickled by value: every method, and the routes' app, into the deployment, in every
process that imports the module).

The Ingress's routes (deployments/http/routes/, a file per route group) are the app build_api
makes, in each replica (Serve's ingress takes the builder, not an app); they and the handle API
reach the decoder through http/decoder_calls.py, whose failures become OpenAI's error body (4xx
naming the field, 503 with Retry-After, 500 with only a request id). A client that goes away
cancels its request, streaming or not. The ingress never touches arrays.
"""

import asyncio
import inspect
import os
import time

from fastapi import FastAPI
from ray import serve
from ray.serve.handle import DeploymentHandle

from generation.cli import version
from generation.front import FIXED_SLOTS, Finish, Generation

from .autoscaling import RUNNING, SLOTS, WAITING
from .batch.requests import BatchRequest
from .batch.route_client import RouteClient
from .config import DEFAULT_MODEL_NAME, AppConfig
from .errors import Overloaded, RequestError, refusal
from .http.batches import BatchCalls
from .http.decoder_calls import DecoderCalls
from .http.edge import body_limit, install_error_handlers, replica_id
from .http.ingress_state import IngressState
from .http.media import Media
from .http.routes import ROUTERS as HTTP_ROUTERS
from .http.to_decoder import typed, with_id
from .local_handle import LocalHandle
from .http.openai import ApiError
from .schema import EmbedRequest, EmbedResponse, GenerateRequest, Transcription, TranscriptionRequest
from .services.adapter_names import AdapterNames
from .services.batches import BatchService
from .services.loading import decoder_service, encoding_service
from .services.response_store import ResponseStore


class _Encoding:
    """The one shape of the Encoder and Vision deployments: the service of their KIND
    (deployments/services/encoding.py) loaded from the config; each verb a call of it. Their
    replies go to the decoder unopened."""

    KIND: str  # "encoder" or "vision"

    def __init__(self, config: dict):
        started = time.perf_counter()
        self.service = encoding_service(self.KIND, AppConfig(**config))
        self.service.metrics.started(time.perf_counter() - started)

    def metrics(self) -> str:
        return self.service.metrics.text()



class Encoder(_Encoding):
    """An encoder-decoder model's encoder (deployments.services.encoder.EncoderService): uploaded audio
    decoded to samples, Whisper windows or texts through the encoder."""

    KIND = "encoder"

    def decode_audio(self, data: bytes, filename: str = "file"):
        return self.service.decode_audio(data, filename)

    def encode_features(self, windows):
        return self.service.encode_features(windows)

    def encode_text(self, sources: list):
        return self.service.encode_text(sources)



class Vision(_Encoding):
    """A vision-language model's image and video preprocessing and vision encoder
    (deployments.services.vision.VisionService), features cached by content."""

    KIND = "vision"

    def encode_image(self, data: bytes, name: str = "image"):
        return self.service.encode_image(data, name)

    def encode_video(self, data: bytes | list[bytes], name: str = "video"):
        return self.service.encode_video(data, name)


class Records:
    """What every ingress replica shares, in one replica (a Ray worker process idles at ~1% of a
    core and takes ~3 core-seconds to start: one, not one per store): the stored responses of
    /v1/responses (`responses`, deployments.services.response_store, bounded as the config says:
    response_store_bytes, response_ttl_seconds, response_folder) and the files and batches of
    /v1/files and /v1/batches (`batches`, deployments.services.batches), whose lines are sent to
    the routes of a replica of the deployment that serves HTTP (`settings["routes"]`: Ingress, or
    the colocated Server), which answers each as it answers the same request over HTTP
    (answer_line). Each store's verbs are this deployment's methods, by the same names (VERBS);
    the response store's are sync (Serve runs them on its thread pool), the batches' async; and the
    LoRA adapters requests may name (`adapters`, deployments.services.adapter_names)."""

    VERBS = {"responses": ("put", "update", "beat", "get", "events_after", "delete", "cancel_response", "stats"),
             "batches": ("begin_file", "append_file", "finish_file", "abort_file", "file", "open_file", "file_piece",
                         "close_file", "file_page", "delete_file", "create", "batch", "page", "cancel_batch"),
             "adapters": ("adapter_paths", "add_adapter", "remove_adapter")}

    async def __init__(self, settings: dict, local_routes=None, start: bool = True):
        self.responses = ResponseStore(settings["response_store_bytes"], settings["response_ttl_seconds"],
                                       settings["response_folder"])
        self.batches = BatchService(settings["batch_folder"], settings["batch_concurrency"], self._send)
        self.adapters = AdapterNames(settings.get("lora_modules"))
        self._routes_name, self._routes = settings["routes"], None
        self._local_routes = local_routes  # the Server's own answer_line, where it holds these records
        if start:  # the batches that had not ended resume (the Server starts them once its routes are up)
            self.batches.start()

    async def _send(self, custom_id: str, url: str, body: dict) -> dict | None:
        from ray.serve.exceptions import BackPressureError

        from .http.decoder_calls import cause_of, replica_lost

        if self._local_routes is not None:
            return await self._local_routes(custom_id, url, body)
        if self._routes is None:  # by name: the routes' deployment is bound to this one, not the other way
            self._routes = serve.get_deployment_handle(self._routes_name, _check_exists=False)
        reply = self._routes.answer_line.remote(custom_id, url, body)
        try:
            return await reply
        except asyncio.CancelledError:
            reply.cancel()  # the batch was cancelled: its row is freed at the next step
            raise
        except Exception as e:  # noqa: BLE001 - no replica took it (lost, restarting, busy): the line is sent again
            if replica_lost(cause_of(e)) or isinstance(cause_of(e), BackPressureError):
                return None
            raise

    def pid(self) -> int:
        return os.getpid()

    def __del__(self):
        self.batches.close()


def records_settings(cfg: AppConfig) -> dict:
    """Records' own settings (a redeploy that changes only the others leaves the records as they
    are where Serve can)."""
    return {"response_store_bytes": cfg.response_store_bytes, "response_ttl_seconds": cfg.response_ttl_seconds,
            "response_folder": cfg.response_folder, "batch_folder": cfg.batch_folder,
            "batch_concurrency": cfg.batch_concurrency or cfg.slots or FIXED_SLOTS, "routes": "Server" if cfg.colocate else "Ingress",
            "lora_modules": dict(cfg.lora_modules or {})}


def held_adapters(places: int):
    """A replica's LoRA adapters as Serve's model multiplexing sees them (`await held(name)` on each
    request that names one): the `places` most recently asked are reported to the routers, which
    send an adapter's requests to the replicas holding it. The engine keeps its own places
    (runtime.lora.registry): leaving this list forgets nothing."""
    @serve.multiplexed(max_num_models_per_replica=places)
    async def held(name: str) -> str:
        return name

    return held


def _verb(store: str, name: str, method):
    """Records' method `name`: the same call on its store, sync or async as the store's own."""
    if inspect.iscoroutinefunction(method):
        async def verb(self, *args, **kwargs):
            return await getattr(getattr(self, store), name)(*args, **kwargs)
    else:
        def verb(self, *args, **kwargs):
            return getattr(getattr(self, store), name)(*args, **kwargs)
    verb.__name__ = verb.__qualname__ = name
    verb.__doc__ = method.__doc__
    return verb


for _store, _class in (("responses", ResponseStore), ("batches", BatchService), ("adapters", AdapterNames)):
    for _name in Records.VERBS[_store]:
        setattr(Records, _name, _verb(_store, _name, getattr(_class, _name)))


class Decoder:
    """Owns the model and its continuous batching loop (deployments.services.generator.TextGenerator). An
    encoder-decoder model's decoder gets its sources' encoder outputs from the Encoder
    deployment (through the ingress's calls, or `encoder` for Whisper's later windows)."""

    def __init__(self, config: dict, encoder: DeploymentHandle | None = None):
        started = time.perf_counter()
        cfg = AppConfig(**config)
        self.encoder = encoder
        self.generator = decoder_service(cfg, DEFAULT_MODEL_NAME)
        # occupancy counts rows against a replica's share: its slots, or 32 where they follow the budget
        self.occupancy_slots = cfg.slots or FIXED_SLOTS
        self.replica = replica_id()  # a stored response's next turn asks for it (GenerateRequest.affinity)
        lora = cfg.options.lora()
        self.held_adapters = held_adapters(lora.max_loras) if lora is not None and self.replica else None
        self.generator.metrics.started(time.perf_counter() - started)

    async def know_adapter(self, request: GenerateRequest) -> None:
        """The LoRA adapter a request names known here, read from the path the ingress sent where
        this replica has not read it (a run-time load reached another replica); this replica then
        reported as holding it, so the router sends the adapter's next requests here."""
        name = request.settings.get("adapter")
        if name is None or request.adapter_path is None:
            return
        if not self.generator.knows_adapter(name, request.adapter_path):  # a read: off the event loop
            await asyncio.to_thread(self.generator.know_adapter, name, request.adapter_path)
        if self.held_adapters is not None:
            await self.held_adapters(name)

    async def generate(self, request: GenerateRequest, encoded=None, *images) -> Generation:
        try:
            await self.know_adapter(request)
            response = await self.generator.generate(request, encoded, images)
            response.finish.replica = self.replica
            return response
        except (RequestError, Overloaded) as e:  # the client's problem: an answer, not a replica error log
            return Generation.refused(refusal(e))

    async def stream(self, request: GenerateRequest, encoded=None, *images):
        try:
            await self.know_adapter(request)
            async for event in self.generator.stream(request, encoded, images):
                if isinstance(event, Finish):
                    event.replica = self.replica
                yield event
        except (RequestError, Overloaded) as e:
            yield refusal(e)

    # each verb's refusal is an answer: errors.refusal's Finish
    async def embed(self, request: EmbedRequest) -> EmbedResponse | Finish:
        embed = getattr(self.generator, "embed", None)
        if embed is None:
            return refusal(RequestError(
                f"model: '{self.generator.name}' gives no embeddings (an embedding model's ONNX graph gives "
                "last_hidden_state: optimum's --task feature-extraction)", "model"))
        try:
            return await embed(request)
        except (RequestError, Overloaded) as e:
            return refusal(e)

    async def transcribe(self, samples, request: TranscriptionRequest) -> Transcription | Finish:
        if self.encoder is None:
            return refusal(RequestError(f"model: '{self.generator.name}' does not take audio", "model"))

        def encode(windows):  # the first window, on the worker thread that prepares the clip
            return self.encoder.encode_features.remote(windows).result()

        async def aencode(windows):  # the later windows: awaited, no thread waits on the reply
            return await self.encoder.encode_features.remote(windows)

        try:
            return await self.generator.transcribe(samples, request, encode, aencode)
        except (RequestError, Overloaded) as e:
            return refusal(e)

    async def tokenize(self, text, messages, add_special_tokens, add_generation_prompt, variables, token_strs):
        try:
            return self.generator.tokenize(text, messages, add_special_tokens, add_generation_prompt, variables,
                                           token_strs)
        except RequestError as e:
            return refusal(e)

    async def detokenize(self, ids: list[int]):
        try:
            return self.generator.detokenize(ids)
        except RequestError as e:
            return refusal(e)

    def card(self):
        return self.generator.card()

    def load_adapter(self, name: str, path: str):
        """A LoRA adapter known from now on (its refusal: 400 naming lora_name or lora_path)."""
        return self._adapter_call("load_adapter", name, path)

    def unload_adapter(self, name: str):
        """A LoRA adapter forgotten (its refusal: 404 naming lora_name where it is not known)."""
        return self._adapter_call("unload_adapter", name)

    def _adapter_call(self, verb: str, *args):
        call = getattr(self.generator, verb, None)
        if call is None:  # an embedding model
            return refusal(RequestError("this model takes no LoRA adapters", "lora_name"))
        try:
            call(*args)
        except RequestError as e:
            return refusal(e)
        return None

    def metrics(self) -> str:
        return self.generator.metrics.text()

    def pid(self) -> int:
        return os.getpid()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """What the decoder's autoscaling policy reads (deployments.autoscaling.DecoderPolicy)."""
        batcher = getattr(self.generator, "batcher", None)
        if batcher is None:  # an embedding model: Ray's own rule (ongoing requests)
            return {}
        return {RUNNING: float(batcher.running), WAITING: float(batcher.waiting),
                SLOTS: float(min(batcher.slots, self.occupancy_slots))}

    def check_health(self) -> None:
        batcher = getattr(self.generator, "batcher", None)
        if batcher is not None and not batcher.alive:
            raise RuntimeError(f"the batching loop stopped ({getattr(batcher, '_stopped', None) or 'its thread ended'})")

    def __del__(self):
        generator = getattr(self, "generator", None)
        if generator is not None:
            generator.close()


def build_api() -> FastAPI:
    """The HTTP routes' app (a file per route group: deployments/http/routes/)."""
    api = FastAPI(title="Raymuter", version=version(), docs_url=None, redoc_url=None, openapi_url=None,
                  description="OpenAI-style generation over ONNX models on Ray Serve. Every route but /health "
                              "needs the API key (Authorization: Bearer KEY) when the server has one.")
    install_error_handlers(api)
    for router in HTTP_ROUTERS:
        api.include_router(router)
    return api


class Ingress:
    """HTTP routes (build_api's: deployments/http/routes/, each reaching this replica's `state`)
    and the Python handle API over the decoder."""

    def __init__(self, decoder: DeploymentHandle, config: dict, encoder: DeploymentHandle | None = None,
                 vision: DeploymentHandle | None = None, records: DeploymentHandle | None = None):
        cfg = AppConfig(**config)
        max_body = body_limit(cfg.max_body_bytes)
        calls = DecoderCalls(decoder, encoder, vision, Media(cfg.allow_remote_images, max_body))
        self.state = IngressState(calls, cfg.api_key or os.environ.get("RAYMUTER_API_KEY") or None, max_body,
                                  records, BatchCalls(records, cfg.file_size_limit), records)
        self.lines = None  # the Records deployment's lines, through these routes (answer_line)

    async def generate(self, request: GenerateRequest | dict) -> Generation:
        """One generation (handle.generate.remote(GenerateRequest(...)))."""
        return await self.state.calls.generate(await self.state.with_adapter_path(with_id(typed(request))))

    async def generate_stream(self, request: GenerateRequest | dict):
        """The front's events: an Echo (echo only), Deltas, then one Finish
        (handle.options(stream=True).generate_stream.remote(...))."""
        async for chunk in self.state.calls.chunks(await self.state.with_adapter_path(with_id(typed(request)))):
            yield chunk

    async def embed(self, request: EmbedRequest | dict) -> EmbedResponse:
        """Embeddings of texts or token ids (handle.embed.remote(EmbedRequest(inputs=[...]))); a
        refusal is an EmbedResponse with its error, status and field (the handle API's answer)."""
        try:
            return await self.state.calls.embed(request if isinstance(request, EmbedRequest) else EmbedRequest(**request))
        except ApiError as e:
            return EmbedResponse(error=e.message, status=e.status, field=e.param, predicate=e.predicate)

    async def transcribe(self, audio: bytes, request: TranscriptionRequest | dict | None = None,
                         filename: str = "audio") -> Transcription:
        """Whisper over an audio file's bytes (handle.transcribe.remote(data, TranscriptionRequest(...)))."""
        return await self.state.transcribe(audio, request, filename)

    async def models(self) -> list[dict]:
        return [await self.state.model_card()]

    async def answer_line(self, custom_id: str, url: str, body: dict) -> dict:
        """A batch line answered by this replica's routes as they answer the same request over
        HTTP (the Records deployment sends its lines here): its OpenAI batch output line."""
        if self.lines is None:
            key = self.state.api_key
            self.lines = RouteClient(build_api(), {"authorization": f"Bearer {key}"} if key else None)
        return await self.lines.answer(BatchRequest(custom_id, url, body))

    def pid(self) -> int:
        return os.getpid()


HTTPIngress = serve.ingress(build_api)(Ingress)  # the Ingress with its routes' app, built in each replica


# The routes and the decoder in one replica (AppConfig.colocate): the ingress's code over a
# LocalHandle of its own Decoder, so a request and each streamed chunk cost no Ray message.
class Server(HTTPIngress):
    """HTTP routes and the Python handle API with the model in the same process."""

    async def __init__(self, config: dict, encoder: DeploymentHandle | None = None,
                       vision: DeploymentHandle | None = None, records: DeploymentHandle | None = None):
        self.model = Decoder(config, encoder)
        self.records = None
        cfg = AppConfig(**config)
        if records is None and cfg.records == "server":  # the records in this replica
            self.records = Records.__new__(Records)  # its __init__ is async: Serve awaits it, so does this
            await self.records.__init__(records_settings(cfg), local_routes=self._own_line, start=False)
            records = LocalHandle(self.records, threaded=True)
        await super().__init__(LocalHandle(self.model), config, encoder, vision, records)
        if self.records is not None:
            self.records.batches.start()

    async def _own_line(self, custom_id: str, url: str, body: dict) -> dict:
        """A batch line of the records this replica holds, through its own routes: once Serve
        has this replica (the routes reach it through the replica context, set after __init__;
        a resumed batch starts before)."""
        while serve.get_replica_context().servable_object is None:
            await asyncio.sleep(0.05)
        return await self.answer_line(custom_id, url, body)

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self.model.record_autoscaling_stats()

    def check_health(self) -> None:
        self.model.check_health()

    def pid(self) -> int:
        return self.model.pid()

    async def __del__(self):  # Serve's shutdown of the replica: the routes, then the batching loop
        await super().__del__()
        if self.records is not None:
            self.records.__del__()
        self.model.__del__()
