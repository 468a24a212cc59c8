"""The app's routes in this process over one Decoder (no Ray): an httpx client on the ASGI app, as
a client meets the server. Shared by the route tests that need a real model behind them (the
fake engine's are in test_responses_route.py)."""

from __future__ import annotations

import contextlib
import json

import httpx


@contextlib.contextmanager
def app_routes(config: dict, max_body: int = 2**20):
    """(a maker of httpx.AsyncClients on the routes, its keywords httpx's; the Decoder) for a
    Decoder of `config` (AppConfig's fields), the ingress taking bodies of at most `max_body` and
    asking for config's api_key where it has one."""
    from deployments.app import Decoder, api
    from deployments.http.decoder_calls import DecoderCalls
    from deployments.http.ingress_state import IngressState, replica_state
    from deployments.http.media import Media
    from deployments.local_handle import LocalHandle

    decoder = Decoder.func_or_class(config)
    state = IngressState(DecoderCalls(LocalHandle(decoder), None, None, Media(False, max_body)), config.get("api_key"),
                         max_body)

    async def this_state():
        return state

    api.dependency_overrides[replica_state] = this_state
    try:
        yield (lambda **options: httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test",
                                                   **options)), decoder
    finally:
        api.dependency_overrides.pop(replica_state, None)
        decoder.__del__()


def strict_json(text: str):
    """`text` as a strict JSON parser reads it: -Infinity, Infinity and NaN are no JSON (RFC 8259)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def events(body: str) -> list:
    """A server-sent event stream's data lines, each read by `strict_json` ([DONE] left out)."""
    return [strict_json(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]
