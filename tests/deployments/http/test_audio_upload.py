"""The audio routes' upload at its edge, through the routes in this process (the fake engine,
which takes no audio): a body with no Content-Length is refused (413 naming `file`) once its
file passes the body limit, and no more of it than the limit is read (Starlette's form parser
spooled it whole first); the form's fields are read as before, a repeated one whole
(`timestamp_granularities[]`)."""

from __future__ import annotations

import asyncio

import pytest
from app_routes import app_routes
from test_batches_hardening import multipart

LIMIT = 64 * 1024


@pytest.fixture
def http():
    with app_routes(dict(engine="fake", name="fake", slots=2, step_seconds=0.002), max_body=LIMIT) as (client, _):
        yield client


def test_a_chunked_audio_upload_past_the_limit_is_refused_before_the_rest_is_read(http):
    sent, chunk = [], b"\0" * 1024

    def chunks(count):
        for _ in range(count):
            sent.append(len(chunk))
            yield chunk

    async def go():
        async with http() as client:
            body, headers = multipart({"model": "fake"}, "long.wav", chunks(100 * LIMIT // len(chunk)))
            refused = await client.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert "content-length" not in refused.request.headers
            assert refused.status_code == 413, refused.text
            error = refused.json()["error"]
            assert error["param"] == "file" and error["code"] == "body_too_large" and str(LIMIT) in error["message"]
            assert sum(sent) <= LIMIT + 2 * len(chunk)  # read no further than the limit (and the chunk in flight)

    asyncio.run(go())


def test_the_audio_form_s_fields_are_read_as_they_come(http):
    async def go():
        async with http() as client:
            body, headers = multipart({"model": "fake", "timestamp_granularities[]": "segment"}, "a.wav",
                                      [b"\0" * 100])
            answer = await client.post("/v1/audio/transcriptions", content=body, headers=headers)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "timestamp_granularities"
            assert "verbose_json" in answer.json()["error"]["message"]
            body, headers = multipart({"model": "fake"}, "a.wav", [b"\0" * 100])
            answer = await client.post("/v1/audio/translations", content=body, headers=headers)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "model", answer.text
            assert "does not take audio" in answer.json()["error"]["message"]
            no_file = await client.post("/v1/audio/transcriptions", data={"model": "fake"},
                                        files={"other": ("x.txt", b"x")})
            assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
            not_a_form = await client.post("/v1/audio/transcriptions", json={"model": "fake"})
            assert not_a_form.status_code == 400 and not_a_form.json()["error"]["param"] == "file"

    asyncio.run(go())
