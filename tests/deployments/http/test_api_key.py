"""The docs' claim about the API key (docs/serving.md), over every route the app has (the routes in this process,
the fake engine): with a key, every route but /health answers 401 in OpenAI's error shape to a
request without it or with a wrong one, before it reads the body or touches a store. A route
added later is held to it without a line here."""

from __future__ import annotations

import asyncio
import re

import pytest
from app_routes import app_routes
from fastapi.routing import APIRoute

from deployments.http.routes import ROUTERS  # what deployments.app's `api` includes

OPEN = {("GET", "/health")}


@pytest.fixture
def keyed():
    with app_routes(dict(engine="fake", name="fake", slots=2, step_seconds=0.002, api_key="sesame")) as (client, _):
        yield client


def every_route() -> list[tuple[str, str]]:
    found = {(method, route.path) for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)
             for method in route.methods}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/files"), ("GET", "/v1/responses/{response_id}"),
            ("GET", "/openapi.json"), ("GET", "/metrics")} <= found  # guard: the routes were read
    return sorted(found)


def test_every_route_but_health_asks_for_the_key(keyed):
    async def go():
        async with keyed() as client:
            for method, path in every_route():
                url = re.sub(r"\{[^}]+\}", "x", path) + ("?stream=true&starting_after=0" if method == "GET" else "")
                for headers in ({}, {"authorization": "Bearer wrong"}):
                    answer = await client.request(method, url, headers=headers, json={})
                    if (method, path) in OPEN:
                        assert answer.status_code == 200, (method, path)
                        continue
                    assert answer.status_code == 401, (method, path, answer.status_code, answer.text[:200])
                    assert answer.json()["error"]["type"] == "authentication_error", (method, path)
            keyed_in = await client.get("/v1/models", headers={"authorization": "Bearer sesame"})
            assert keyed_in.status_code == 200  # guard: the key itself is taken

    asyncio.run(go())
