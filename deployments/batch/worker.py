"""One engine replica's worth of a batch: the server's application in this process (its routes
over a Decoder, and an Encoder or Vision where the model has them, called directly), each
request sent to its route as the server would get it (route_client.py), so an output line is what
the server answers the same request (same engine path, same seeds).
"""

from __future__ import annotations

import asyncio
import json

from .requests import answered_ok, output_line, parsed_line, server_failed
from .route_client import RouteClient


class _Reply:
    """A call done at once, as a Serve reply: awaited, or .result() from a worker thread."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value

    def __await__(self):
        return self._value().__await__()

    async def _value(self):
        return self.value

    def cancel(self) -> None:
        pass


class _Method:
    def __init__(self, method):
        self._method = method

    def remote(self, *args, **kwargs) -> _Reply:
        return _Reply(self._method(*args, **kwargs))


class DirectHandle:
    """An Encoder's or Vision's object in this process, called as through a Serve handle (their
    methods are plain functions; a reply passed on is opened as Serve opens one)."""

    def __init__(self, target):
        self._target = target

    def options(self, **_) -> "DirectHandle":
        return self

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name))


class BatchWorker:
    """Ray Data's callable class for map_batches: `{"line"}` batches in, `{"output", "ok",
    "server_failed"}` out (each output a JSON line; ok: it was answered 200; server_failed: the
    server's failure, requests.server_failed). Its batches run concurrently on the actor's event
    loop, so the decoder's slots stay full across them."""

    def __init__(self, config: dict):
        from ..app import AppConfig, Decoder, Encoder, Vision, api, app_kind
        from ..http.decoder_calls import DecoderCalls
        from ..http.edge import body_limit
        from ..http.ingress_state import IngressState, replica_state
        from ..http.media import Media
        from ..local_handle import LocalHandle

        cfg = AppConfig(**config)
        kind = app_kind(cfg)
        encoder = DirectHandle(Encoder.func_or_class(config)) if kind == "encoder-decoder" else None
        vision = DirectHandle(Vision.func_or_class(config)) if kind == "vision" else None
        self.decoder = Decoder.func_or_class(config, encoder)
        max_body = body_limit(cfg.max_body_bytes)
        calls = DecoderCalls(LocalHandle(self.decoder), encoder, vision, Media(cfg.allow_remote_images, max_body))
        self.state = IngressState(calls, None, max_body)

        async def this_state():
            return self.state

        api.dependency_overrides[replica_state] = this_state
        self.routes = RouteClient(api, local_files=True)

    async def __call__(self, batch: dict) -> dict:
        outputs = await asyncio.gather(*(self.answer(str(line)) for line in batch["line"]))
        return {"output": [json.dumps(o) for o in outputs],
                "ok": [answered_ok(o) for o in outputs], "server_failed": [server_failed(o) for o in outputs]}

    async def answer(self, line: str) -> dict:
        """The output line of one input line."""
        request = parsed_line(line)
        if request.error is not None:
            return output_line(request.custom_id, error=request.error)
        return await self.routes.answer(request)

    def __del__(self):
        decoder = getattr(self, "decoder", None)
        if decoder is not None:
            decoder.__del__()
