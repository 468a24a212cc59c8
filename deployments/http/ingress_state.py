"""What the routes (routes/) and the ingress's Python handle API share, free of Ray's deployments:
the decoder calls, the API key, the model card, and each request counted by route and status.

A route reaches the IngressState of the replica serving it through FastAPI's dependency `replica_state`
(the ingress deployment holds it as `.state`), as Serve reaches the replica of a class-based route.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import secrets
import time
from contextlib import contextmanager

from fastapi import Depends, Request

from generation.front import Refused

from ..metrics import IngressMetrics
from ..schema import Transcription, TranscriptionRequest
from .batches import BatchCalls
from .decoder_calls import DecoderCalls
from .edge import read_json, replica_id, request_id
from .openai import ApiError
from .response_runs import ResponseRuns
from .validation import parse


ADAPTER_NAMES_SECONDS = 1.0  # how long an ingress replica trusts the LoRA adapter names it asked


class IngressState:
    """The ingress's state behind its routes: `calls` (the decoder and its helpers by handle), the
    API key (None: open), the largest body, the metrics, the model card once asked."""

    def __init__(self, calls: DecoderCalls, api_key: str | None, max_body: int, responses=None,
                 batches: BatchCalls | None = None, adapters=None):
        self.calls, self.api_key, self.max_body = calls, api_key, max_body
        # /v1/responses: its runs, over the shared store (a handle to deployments.app.Records)
        self.responses = ResponseRuns(calls, responses if responses is not None else _local_store())
        # /v1/files and /v1/batches: the Records deployment's calls (none: the API is not served here)
        self.batches = batches if batches is not None else BatchCalls(None, 0)
        self.metrics = IngressMetrics()
        self.openapi: dict | None = None  # the OpenAPI document once built (routes/meta.py)
        self.replica = replica_id() or "local"  # this ingress replica's id ("local" outside Serve)
        self._card = None
        # the LoRA adapters requests may name, shared by every ingress replica (the Records
        # deployment's, deployments.services.adapter_names); None: the decoder's own (one replica)
        self.adapters = adapters
        self._adapter_paths: dict | None = None
        self._adapter_paths_at = 0.0

    def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise ApiError(401, "missing or wrong API key (Authorization: Bearer ...)", kind="authentication_error")

    async def model_card(self) -> dict:
        """The served model as /v1/models lists it (asked of the decoder once)."""
        if self._card is None:
            card = await self.calls.call(self.calls.decoder.card.remote(), request_id())
            self._card = {"id": card.id, "object": "model", "created": int(time.time()), "owned_by": "raymuter",
                          "context_length": card.context_length, "slots": card.slots, "kind": card.kind,
                          "fingerprint": card.fingerprint, "adapters": list(card.adapters)}
        return {k: v for k, v in self._card.items() if k != "fingerprint"}

    def forget_card(self) -> None:
        """The card is asked again at its next use (its adapters changed)."""
        self._card = None

    async def served_as(self, model, param: str = "model") -> dict:
        """The card of what a request's `model` names: the base model's, or a LoRA adapter's (its
        id the adapter's name, `adapter` set, `parent` the base); 404 naming `param` for anything
        else. An adapter loaded since the names were asked is found by asking again."""
        card = await self.model_card()
        if model == card["id"]:
            return card
        paths = await self.adapter_paths(wanted=model)
        self.check_model(model, {**card, "adapters": list(paths)}, param)
        return self.adapter_card(card, model, paths[model])

    async def adapter_paths(self, fresh: bool = False, wanted=None) -> dict:
        """The LoRA adapters a request may name -> where each lives: the shared names (asked again
        after ADAPTER_NAMES_SECONDS, or now where `fresh`: an unload through another ingress replica
        reaches this one within that time), or the decoder's own card's (paths None: that decoder
        knows them) where this ingress has no shared names. `wanted`: a name asked again at once
        where the names at hand lack it (loaded since)."""
        if wanted is not None and not fresh:
            paths = await self.adapter_paths()
            return paths if wanted in paths else await self.adapter_paths(fresh=True)
        if self.adapters is None:
            if fresh:
                self.forget_card()
            return dict.fromkeys((await self.model_card())["adapters"])
        if fresh or self._adapter_paths is None or time.monotonic() - self._adapter_paths_at > ADAPTER_NAMES_SECONDS:
            self._adapter_paths = await self.calls.call(self.adapters.adapter_paths.remote(), request_id())
            self._adapter_paths_at = time.monotonic()
        return self._adapter_paths

    async def load_adapter(self, name: str, path: str) -> None:
        """vLLM's /v1/load_lora_adapter: read and checked by a decoder replica (400 naming lora_path,
        or lora_name for a name taken), then one of the shared names, which every ingress replica
        finds and sends with the adapter's requests (the other decoder replicas read it then)."""
        rid = request_id("lora-")
        if name in await self.adapter_paths(fresh=True):
            raise ApiError(400, f"lora_name: '{name!s:.200}' is loaded already (unload it first)", param="lora_name")
        try:
            await self.calls.load_adapter(name, path, rid)
            if self.adapters is not None:
                await self.calls.call(self.adapters.add_adapter.remote(name, path), rid)
        finally:
            self.forget_adapters()

    async def unload_adapter(self, name: str) -> None:
        """vLLM's /v1/unload_lora_adapter: the name no longer served (404 naming lora_name where it
        is not); the decoder replica reached forgets it at once, the others keep what they read
        (no request names it any more; rows running with it finish with it)."""
        rid = request_id("lora-")
        try:
            if self.adapters is None:
                await self.calls.unload_adapter(name, rid)
                return
            await self.calls.call(self.adapters.remove_adapter.remote(name), rid)
            with contextlib.suppress(ApiError):  # a replica that never read it
                await self.calls.unload_adapter(name, rid)
        finally:
            self.forget_adapters()

    async def with_adapter_path(self, request):
        """A handle API request naming a LoRA adapter, with where the adapter lives (as the routes
        send it); an unknown name goes as it came (the decoder refuses it by name)."""
        name = request.settings.get("adapter")
        if name is None or request.adapter_path is not None or self.adapters is None:
            return request
        paths = await self.adapter_paths(wanted=name)
        return request if paths.get(name) is None else dataclasses.replace(request, adapter_path=paths[name])

    def forget_adapters(self) -> None:
        self._card, self._adapter_paths = None, None

    @staticmethod
    def adapter_card(card: dict, name: str, path: str | None = None) -> dict:
        """The card of LoRA adapter `name` of the base model's `card`: its id the adapter's name,
        `adapter` set (the engine's setting) and `adapter_path` (where a decoder replica that does
        not know it reads it), `parent` and `root` the base."""
        return {**card, "id": name, "adapter": name, "adapter_path": path, "parent": card["id"], "root": card["id"]}

    @property
    def fingerprint(self) -> str:
        """The model's system_fingerprint (after model_card)."""
        return self._card["fingerprint"]

    @staticmethod
    def check_model(model, card: dict, param: str = "model") -> None:
        if model != card["id"] and model not in card.get("adapters", ()):
            also = f" and the LoRA adapters {', '.join(card['adapters'])}" if card.get("adapters") else ""
            raise ApiError(404, f"{param}: '{model!s:.200}' is not served here; this server serves '{card['id']}'"
                                f"{also}", param=param, kind="invalid_request_error", code="model_not_found")

    async def route(self, request: Request, kind, run, prefix: str = "req-"):
        """A JSON route's work (authorized and counted by its dependency, `guarded`): its body
        validated into `kind`, the model checked when named, then `run(body, card, request id)`."""
        body = parse(kind, await read_json(request, self.max_body))
        card = await self.model_card()
        if getattr(body, "model", None) is not None:
            card = await self.served_as(body.model)
        return await run(body, card, request_id(prefix))

    @contextmanager
    def counted(self, request: Request, route: str | None = None):
        """The request in raymuter:http_requests_total by route (`route`, or the route's path as
        declared, its parameters as {id}: a series per route, not per id) and status (an
        ApiError's, else 200)."""
        route = route or route_label(request)
        try:
            yield
        except ApiError as e:
            self.metrics.requests.labels(route=route, status=str(e.status)).inc()
            raise
        self.metrics.requests.labels(route=route, status="200").inc()

    async def transcribe(self, audio: bytes, request: TranscriptionRequest | dict | None = None,
                         filename: str = "audio") -> Transcription:
        """Whisper over an audio file's bytes: the Encoder deployment decodes them, the decoder
        transcribes (handle.transcribe.remote, and the audio routes)."""
        if not isinstance(request, TranscriptionRequest):
            try:
                request = TranscriptionRequest.checked(request or {})
            except Refused as e:
                raise ApiError(400, str(e), param=e.field, predicate=e.predicate) from None
        if self.calls.encoder is None:
            card = await self.model_card()
            raise ApiError(400, f"model: '{card['id']}' does not take audio", param="model")
        samples = self.calls.encoder.decode_audio.remote(audio, filename)  # stays in Ray's store: the decoder opens it
        rid = request_id("audio-")
        return await self.calls.answer(self.calls.decoder.transcribe.remote(samples, request), rid)


def _local_store():
    """A response store of this replica's own (an IngressState built without the shared one:
    the handle API's tests); every method called as through a handle."""
    from ..local_handle import LocalHandle
    from ..services.response_store import ResponseStore

    return LocalHandle(ResponseStore(64 * 2**20, 3600))


async def replica_state() -> IngressState:
    """The IngressState of the ingress replica serving the request (a route's FastAPI dependency)."""
    from ray import serve

    return serve.get_replica_context().servable_object.state


def route_label(request: Request) -> str:
    """The route's path as declared, each parameter as {id} (`/v1/files/{id}`); the request's path
    where no route matched."""
    route = request.scope.get("route")
    path = getattr(route, "path", None)
    return re.sub(r"\{[^}]+\}", "{id}", path) if path else request.url.path


async def authorized(request: Request, state: IngressState = Depends(replica_state)) -> IngressState:
    """A route's dependency: the API key checked (401 without it), the replica's state given."""
    state.authorize(request)
    return state


async def guarded(request: Request, state: IngressState = Depends(replica_state)):
    """A route's dependency: authorized, and counted by route and status once it has answered
    (an ApiError it raises comes back through here)."""
    with state.counted(request):
        state.authorize(request)
        yield state
