"""The Ray Serve application end to end: HTTP routes, SSE, the openai client, Python handles,
continuous batching through the server, backpressure, bad input, API keys, metrics, and a
killed decoder replica. One Ray instance for the session (conftest.serve_apps).

The real app serves the tiny llama-genai model, and its outputs are compared with the engine's
for the same request alone; the fake apps (deployments.fake) have outputs known in advance.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

import generation
from deployments.fake import fake_tokens
from deployments.schema import Delta, Finish, GenerateRequest, GenerateResponse

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def fake_text(prompt: str, seed: int = 0, **settings) -> str:
    return "".join(map(chr, fake_tokens([ord(c) for c in prompt], seed, settings)))


def alone(engine, prompt: str, seed: int, **settings) -> str:
    model, tokenizer = engine
    ctx = generation.context(model, **{"max_new_tokens": 16, **settings})
    tokens = generation.generate(ctx, [tokenizer.encode(prompt).ids], seeds=[seed])[0]
    return cut(tokenizer.decode(tokens), settings.get("stop_strings"))


def cut(text, stops):
    from generation.core.stop_strings import cut_at_stop

    return cut_at_stop(text, stops)


def sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


# -- routes ------------------------------------------------------------------------------------
def test_health_and_models(serve_apps):
    assert httpx.get(serve_apps.real + "/health").json() == {"status": "ok"}
    models = httpx.get(serve_apps.real + "/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["slots"] == 4


def test_http_goes_through_haproxy_and_streams_through_it(serve_apps):
    """The session runs what `raymuter serve` runs: HAProxy in front (its stats page answers on
    the port serving_environment chose) and Serve's Python proxy out of the request path."""
    stats = os.environ.get("RAY_SERVE_HAPROXY_STATS_PORT")
    if os.environ.get("RAYMUTER_TEST_PROXY", "haproxy") == "ray":
        pytest.skip("RAYMUTER_TEST_PROXY=ray runs the session through Serve's Python proxy")
    assert os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1" and stats
    serve_apps.app("real")
    page = httpx.get(f"http://127.0.0.1:{stats}/stats", timeout=10)
    assert page.status_code == 200 and "HAProxy" in page.text and "real" in page.text  # the app's backend
    with httpx.stream("POST", serve_apps.fake + "/v1/completions", timeout=30,
                      json=dict(model="fake", prompt="abcd", max_tokens=4, stream=True)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and "".join(json.loads(l[6:])["choices"][0]["text"] for l in lines[:-1]) == "dcba"


def test_completion_equals_the_engine_alone(serve_apps, engine):
    body = dict(model="tiny", prompt="The list", max_tokens=12, seed=3, temperature=0.8, top_k=20)
    out = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()
    assert out["choices"][0]["text"] == alone(engine, "The list", 3, max_new_tokens=12, do_sample=True,
                                              temperature=0.8, top_k=20)
    assert out["usage"]["completion_tokens"] <= 12 and out["object"] == "text_completion"


def test_streamed_completion_equals_the_whole_one(serve_apps, engine):
    body = dict(model="tiny", prompt="Once upon", max_tokens=14, repetition_penalty=1.3)
    whole = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()
    streamed = httpx.post(serve_apps.real + "/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse(streamed.text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert whole["choices"][0]["text"] == alone(engine, "Once upon", 0, max_new_tokens=14, repetition_penalty=1.3)


def test_logprobs_equal_the_engines(serve_apps, engine):
    model, tokenizer = engine
    body = dict(model="tiny", prompt="The", max_tokens=6, logprobs=True, top_logprobs=3)
    out = httpx.post(serve_apps.real + "/v1/chat/completions",
                     json=dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                               logprobs=True, top_logprobs=3), timeout=60).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"] and all(len(c["top_logprobs"]) == 3 for c in content)
    legacy = httpx.post(serve_apps.real + "/v1/completions", json={**body, "logprobs": 2, "top_logprobs": None},
                        timeout=60).json()["choices"][0]["logprobs"]
    ctx = generation.context(model, max_new_tokens=6, token_logprobs=True)
    expected = generation.generate(ctx, [tokenizer.encode("The").ids], seeds=[0])[0]
    np.testing.assert_allclose(legacy["token_logprobs"], expected.logprobs, rtol=1e-5, atol=1e-6)
    assert legacy["tokens"] == [tokenizer.decode([t], skip_special_tokens=False) for t in expected.tokens]
    assert all(len(top) <= 2 for top in legacy["top_logprobs"])


def test_chat_uses_the_models_template(serve_apps, engine):
    model, tokenizer = engine
    from transformers import AutoTokenizer

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"}]
    ids = AutoTokenizer.from_pretrained(model.folder).apply_chat_template(messages, add_generation_prompt=True)
    ctx = generation.context(model, max_new_tokens=10)
    expected = tokenizer.decode(generation.generate(ctx, [list(ids)], seeds=[0])[0])
    out = httpx.post(serve_apps.real + "/v1/chat/completions",
                     json=dict(model="tiny", messages=messages, max_tokens=10), timeout=60).json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": expected}
    assert out["usage"]["prompt_tokens"] == len(ids)


def test_the_openai_client_works_unchanged(serve_apps, engine):
    import openai

    client = openai.OpenAI(base_url=serve_apps.real + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="The list", max_tokens=8, seed=5, temperature=0.7)
    assert done.choices[0].text == alone(engine, "The list", 5, max_new_tokens=8, do_sample=True, temperature=0.7)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=8, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    n = client.completions.create(model="tiny", prompt="The", max_tokens=6, n=3, seed=1, temperature=1.0)
    assert [c.index for c in n.choices] == [0, 1, 2]
    assert [c.text for c in n.choices] == [alone(engine, "The", 1 + i, max_new_tokens=6, do_sample=True,
                                                 temperature=1.0) for i in range(3)]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)


def test_stop_strings_end_the_text_before_them(serve_apps, engine):
    free = alone(engine, "The", 0)
    stop = free[len(free) // 2: len(free) // 2 + 2]
    body = dict(model="tiny", prompt="The", max_tokens=16, stop=[stop])
    out = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert out["text"] == cut(free, [stop]) and out["finish_reason"] == "stop"
    streamed = sse(httpx.post(serve_apps.real + "/v1/completions", json={**body, "stream": True}, timeout=60).text)
    assert "".join(c["choices"][0]["text"] for c in streamed) == out["text"]  # never streamed past the stop


def test_beam_search_through_the_server(serve_apps, engine):
    model, tokenizer = engine
    ctx = generation.context(model, max_new_tokens=8, num_beams=3)
    expected = generation.beam_search(ctx, [tokenizer.encode("The list").ids], [0])[0][0]
    out = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt="The list", max_tokens=8,
                                                                   num_beams=3), timeout=60).json()
    assert out["choices"][0]["text"] == tokenizer.decode(expected.tokens)


def test_beam_searches_of_different_widths_share_the_batch_with_sampling(serve_apps, engine):
    """Two searches (2 and 3 beams would overfill the app's 4 slots: 2 and 2 here, then a third
    of 3 once they leave) and sampling requests, sent at once: each equals what the engine
    gives it alone."""
    from concurrent.futures import ThreadPoolExecutor

    model, tokenizer = engine
    jobs = [("The list", dict(num_beams=2)), ("A tuple", dict(num_beams=2, length_penalty=0.5)),
            ("The dict", dict(num_beams=3)), ("Sets", dict(temperature=0.8, seed=5)),
            ("Strings", dict(temperature=0.9, top_k=20, seed=6))]

    def expected(prompt, fields):
        ids = tokenizer.encode(prompt).ids
        settings = {k: v for k, v in fields.items() if k != "seed"}
        if "temperature" in settings:
            settings["do_sample"] = True
        ctx = generation.context(model, max_new_tokens=8, **settings)
        if settings.get("num_beams", 1) > 1:
            return tokenizer.decode(generation.beam_search(ctx, [ids], [0])[0][0].tokens)
        return tokenizer.decode(generation.generate(ctx, [ids], seeds=[fields["seed"]])[0])

    def send(job):
        prompt, fields = job
        return httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt=prompt, max_tokens=8,
                                                                         **fields), timeout=120).json()

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(send, jobs))
    for (prompt, fields), out in zip(jobs, answers):
        assert out["choices"][0]["text"] == expected(prompt, fields), (prompt, fields, out)


# -- handles -----------------------------------------------------------------------------------
def test_python_handles_typed_and_streaming(serve_apps):
    serve_apps.app("fake")
    check_handles("fake")


def check_handles(app: str) -> None:
    """The fake-engine app `app`'s handle API: typed replies, streams, a refused setting."""
    from ray import serve

    handle = serve.get_app_handle(app)
    response = handle.generate.remote(GenerateRequest(prompt="abc", settings={"max_new_tokens": 5})).result()
    assert isinstance(response, GenerateResponse) and response.text == fake_text("abc", max_new_tokens=5)
    chunks = list(handle.options(stream=True).generate_stream.remote(GenerateRequest(prompt="abcd", seed=2,
                                                                                     settings={"do_sample": True})))
    assert all(isinstance(c, Delta) for c in chunks[:-1]) and isinstance(chunks[-1], Finish)  # the front's events
    assert "".join(c.text for c in chunks) == fake_text("abcd", 2, do_sample=True)
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 8
    with pytest.raises(Exception, match="max_new_tokens must be an integer >= 0"):
        handle.generate.remote(GenerateRequest(prompt="abc", settings={"max_new_tokens": -1})).result()


# -- batching through the server ---------------------------------------------------------------
SETTINGS = [dict(), dict(temperature=0.9, top_k=30), dict(repetition_penalty=1.2), dict(temperature=0.7, top_p=0.8),
            dict(no_repeat_ngram_size=2, max_tokens=10)]
WORDS = ["The list", "A tuple is", "Strings", "def f", "import os", "The dict type", "x", "Once upon a time there"]


def openai_to_engine(settings: dict) -> dict:
    out = {k: v for k, v in settings.items() if k != "max_tokens"}
    if "temperature" in out:
        out["do_sample"] = True
    if "max_tokens" in settings:
        out["max_new_tokens"] = settings["max_tokens"]
    return out


def test_64_concurrent_seeded_requests_each_equal_the_engine_alone(serve_apps, engine):
    cases = [(WORDS[i % len(WORDS)], i, SETTINGS[i % len(SETTINGS)]) for i in range(64)]

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            async def one(prompt, seed, settings):
                body = dict(model="tiny", prompt=prompt, seed=seed, **settings)
                return (await client.post(serve_apps.real + "/v1/completions", json=body)).json()
            return await asyncio.gather(*(one(*c) for c in cases))

    results = asyncio.run(run())
    assert len({r["id"] for r in results}) == 64  # each completed exactly once
    for (prompt, seed, settings), result in zip(cases, results):
        assert result["choices"][0]["text"] == alone(engine, prompt, seed, **openai_to_engine(settings)), (prompt, seed)


def test_a_late_request_starts_before_the_running_ones_finish(serve_apps):
    body = dict(model="fake", prompt="abcdefgh", max_tokens=150, stream=True)
    with httpx.Client(timeout=60) as client, client.stream("POST", serve_apps.fake + "/v1/completions", json=body) as long:
        lines = long.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # the long one runs
        started = time.perf_counter()
        short = client.post(serve_apps.fake + "/v1/completions", json=dict(model="fake", prompt="xy", max_tokens=3))
        assert short.json()["choices"][0]["text"] == fake_text("xy", max_new_tokens=3)
        assert time.perf_counter() - started < 150 * 0.005  # well before the long one's 150 steps
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        after = "".join(json.loads(line[6:])["choices"][0]["text"] for line in rest[:-1])
        assert len(after) > 100  # most of the long one's 150 tokens came after the short one had finished


def test_a_client_that_goes_away_frees_its_slot(serve_apps):
    assert check_client_gone_frees_slots(serve_apps.fake)["choices"][0]["text"] == "ko"


def test_twenty_alternatives_a_token_by_default(serve_apps):
    """As OpenAI and vLLM take: top_logprobs and logprobs up to 20 (--max-logprobs 20)."""
    with httpx.Client(timeout=60) as client:
        chat = client.post(serve_apps.real + "/v1/chat/completions", json=dict(
            model="tiny", messages=[{"role": "user", "content": "The list"}], max_tokens=2, logprobs=True,
            top_logprobs=20))
        completion = client.post(serve_apps.real + "/v1/completions", json=dict(
            model="tiny", prompt="The list", max_tokens=2, logprobs=20))
    assert chat.status_code == completion.status_code == 200, (chat.text, completion.text)
    tokens = chat.json()["choices"][0]["logprobs"]["content"]
    assert tokens and all(len(t["top_logprobs"]) == 20 for t in tokens)
    # /v1/completions keys the alternatives by their text (OpenAI's legacy shape): tokens that decode alike share one
    assert all(5 < len(top) <= 20 for top in completion.json()["choices"][0]["logprobs"]["top_logprobs"])


def test_clients_that_leave_whole_answers_free_their_slots(serve_apps):
    """Through HAProxy (its client's close reaches the ingress) and the ingress to the decoder."""
    check_abandoned_whole_answers_free_slots(serve_apps.fake)


def check_client_gone_frees_slots(url: str, model: str = "fake", streams: int = 4, **long) -> dict:
    """`streams` streams (4: each slot of the fake-engine app at `url`) that go away after their
    first event: every slot is free again; the answer to a new 2-token request. `long`: the
    streams' body (default: 2000 tokens of "ab")."""
    slow = {"model": model, "prompt": "ab", "max_tokens": 2000, **long, "stream": True}
    with httpx.Client(timeout=60) as client:
        for _ in range(streams):
            with client.stream("POST", url + "/v1/completions", json=slow) as response:
                next(line for line in response.iter_lines() if line.startswith("data: "))
        deadline = time.time() + 10
        while time.time() < deadline and running(client, url) > 0:
            time.sleep(0.1)
        assert running(client, url) == 0
        return client.post(url + "/v1/completions", json=dict(model=model, prompt="ok", max_tokens=2)).json()


def check_abandoned_whole_answers_free_slots(url: str, model: str = "fake", count: int = 4, leave_after: float = 1.0,
                                             headers: dict | None = None, **long) -> None:
    """`count` whole (non-streamed) answers sent at once by one client whose timeout
    (`leave_after` seconds) closes their connections, as a user's timeout does: every slot is free
    again within a few seconds, and the rows made at most a fraction of their tokens. `long`: the
    body (default: 2000 tokens). Through HAProxy, a body sent apart from its headers (as httpx
    sends it) once went to the replica spliced, and HAProxy missed most of the closes."""
    body = {"model": model, "prompt": "ab", "max_tokens": 2000, **long}

    async def leave():
        # the client leaves `leave_after` s after its request went out; connecting is not leaving (on a
        # loaded machine a connect took over 1 s once, and the requests never reached the server)
        timeout = httpx.Timeout(leave_after, connect=30)
        async with httpx.AsyncClient(timeout=timeout, headers=headers) as client:
            return await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(count)),
                                        return_exceptions=True)

    with httpx.Client(timeout=60, headers=headers) as client:
        before = metric(client.get(url + "/metrics").text, "raymuter:generation_tokens_total")
        left = asyncio.run(leave())
        assert all(isinstance(e, httpx.ReadTimeout) for e in left), left  # none ended before its client left
        deadline = time.time() + 5
        while time.time() < deadline and running(client, url) > 0:
            time.sleep(0.05)
        assert running(client, url) == 0
        made = metric(client.get(url + "/metrics").text, "raymuter:generation_tokens_total") - before
        assert made < count * body["max_tokens"] / 2, made


def running(client, url) -> float:
    return metric(client.get(url + "/metrics").text, "raymuter:num_requests_running")


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- limits and errors -------------------------------------------------------------------------
@pytest.mark.parametrize("body, status, param", [
    (dict(model="nope", prompt="a"), 404, "model"),
    (dict(model="fake", prompt="a", temperature=3), 400, "temperature"),
    (dict(model="fake", prompt="a", top_p=0), 400, "top_p"),
    (dict(model="fake", prompt="a", max_tokens=-1), 400, "max_tokens"),
    (dict(model="fake", prompt="a", max_tokens=10**6), 400, "max_tokens"),
    (dict(model="fake", prompt="a", frobnicate=1), 400, "frobnicate"),
    (dict(model="fake", prompt="a", presence_penalty=2.5), 400, "presence_penalty"),
    (dict(model="fake", prompt=[10**6]), 400, "prompt"),
    (dict(model="fake", prompt=""), 400, "prompt"),
    (dict(model="fake"), 400, "prompt"),
    (dict(model="fake", prompt="a", logprobs=True, top_logprobs=9), 400, "logprobs"),
])
def test_each_bad_completion_gets_its_4xx_naming_the_field(serve_apps, body, status, param):
    out = httpx.post(serve_apps.fake + "/v1/completions", json=body, timeout=30)
    assert out.status_code == status, out.text
    error = out.json()["error"]
    assert error["param"] == param and error["message"]
    assert httpx.post(serve_apps.fake + "/v1/completions", json=dict(model="fake", prompt="ok", max_tokens=2),
                      timeout=30).json()["choices"][0]["text"] == "ko"  # still serving


def test_bad_chat_and_bodies(serve_apps):
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}
    out = httpx.post(serve_apps.fake + "/v1/chat/completions", json=dict(model="fake", messages=[image]), timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "messages.0.content.0.image_url"
    out = httpx.post(serve_apps.fake + "/v1/chat/completions", json=dict(model="fake", messages=[]), timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "messages"
    out = httpx.post(serve_apps.fake + "/v1/completions", content=b"{not json", timeout=30)
    assert out.status_code == 400 and "not JSON" in out.json()["error"]["message"]
    out = httpx.post(serve_apps.real + "/v1/chat/completions", json=dict(model="tiny", messages=[
        {"role": "user", "content": "x"}], max_tokens=10**5), timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "max_tokens"


def test_api_key_guards_every_route_but_health(serve_apps):
    url = serve_apps.guarded
    assert httpx.get(url + "/health").status_code == 200
    for method, route in [("GET", "/v1/models"), ("GET", "/metrics"), ("POST", "/v1/completions")]:
        out = httpx.request(method, url + route, json=dict(model="fake", prompt="a"))
        assert out.status_code == 401 and out.json()["error"]["type"] == "authentication_error"
    key = {"Authorization": "Bearer sesame"}
    out = httpx.post(url + "/v1/completions", json=dict(model="fake", prompt="ab", max_tokens=2), headers=key,
                     timeout=30)
    assert out.json()["choices"][0]["text"] == "ba"
    big = httpx.post(url + "/v1/completions", json=dict(model="fake", prompt="a" * 5000), headers=key, timeout=30)
    assert big.status_code == 413 and "4096" in big.json()["error"]["message"]


def test_a_full_queue_answers_503_with_retry_after(serve_apps):
    key = {"Authorization": "Bearer sesame"}

    async def run():
        async with httpx.AsyncClient(timeout=60, headers=key) as client:
            body = dict(model="fake", prompt="abc", max_tokens=20)
            return await asyncio.gather(*(client.post(serve_apps.guarded + "/v1/completions", json=body)
                                          for _ in range(12)))

    results = asyncio.run(run())
    busy = [r for r in results if r.status_code == 503]
    assert busy and all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "server_overloaded"
                        for r in busy)
    assert all(r.json()["choices"][0]["text"] == fake_text("abc", max_new_tokens=20)
               for r in results if r.status_code == 200)
    assert len(busy) < 12


# -- metrics -----------------------------------------------------------------------------------
def test_metrics_count_the_requests_sent(serve_apps):
    names = ["raymuter:time_to_first_token_seconds_count", "raymuter:e2e_request_latency_seconds_count",
             "raymuter:request_queue_time_seconds_count", "raymuter:request_generation_tokens_count"]
    with httpx.Client(timeout=30) as client:
        before = client.get(serve_apps.fake + "/metrics").text
        for i in range(5):
            client.post(serve_apps.fake + "/v1/completions", json=dict(model="fake", prompt="abc", max_tokens=4))
        sse(client.post(serve_apps.fake + "/v1/completions", json=dict(model="fake", prompt="abc", max_tokens=4,
                                                                     stream=True)).text)
        after = client.get(serve_apps.fake + "/metrics").text
    for name in names:
        assert metric(after, name) - metric(before, name) == 6, name
    assert metric(after, "raymuter:generation_tokens_total") - metric(before, "raymuter:generation_tokens_total") == 24
    assert metric(after, "raymuter:inter_token_latency_seconds_count") - \
        metric(before, "raymuter:inter_token_latency_seconds_count") == 18
    for gauge in ["raymuter:num_requests_running", "raymuter:num_requests_waiting", "raymuter:batch_occupancy",
                  "raymuter:kv_cache_usage_perc"]:
        assert re.search(rf'^{re.escape(gauge)}{{model_name="fake"}} ', after, re.M), gauge
    assert 'raymuter:http_requests_total{route="/fake/v1/completions",status="200"}' in after \
        or 'raymuter:http_requests_total{route="/v1/completions",status="200"}' in after


def test_each_replica_reports_its_startup_time(serve_apps):
    """raymuter:replica_startup_seconds: the real model's decoder (its load and warm-up), the
    fake one's, and an encoder-decoder app's encoder, each a positive time."""
    real = httpx.get(serve_apps.real + "/metrics", timeout=30).text
    fake = httpx.get(serve_apps.fake + "/metrics", timeout=30).text
    speech = httpx.get(serve_apps.speech + "/metrics", timeout=30).text
    assert 0 < metric(real, 'raymuter:replica_startup_seconds{model_name="tiny"}') < 300
    assert 0 < metric(fake, 'raymuter:replica_startup_seconds{model_name="fake"}')
    assert len(re.findall(r"^raymuter:replica_startup_seconds\{", speech, re.M)) == 2  # decoder and encoder
    assert metric(real, 'raymuter:replica_startup_seconds{model_name="tiny"}') > \
        metric(fake, 'raymuter:replica_startup_seconds{model_name="fake"}')  # a model to load, not a fake


# -- faults (last: the fake app's decoder restarts) --------------------------------------------
def test_killing_the_decoder_fails_held_requests_fast_and_a_new_replica_serves(serve_apps):
    from ray import serve

    pid = serve.get_deployment_handle("Decoder", app_name="fake").pid.remote().result()
    outcomes: list = []
    streaming = threading.Event()  # a stream's first token reached its client

    def held(i):
        started = time.perf_counter()
        try:
            with httpx.stream("POST", serve_apps.fake + "/v1/completions", json=dict(
                    model="fake", prompt="abc", max_tokens=3000, stream=bool(i % 2)), timeout=60) as out:
                text = ""
                for piece in out.iter_text():
                    text += piece
                    if i % 2 and '"text"' in text:
                        streaming.set()
            outcomes.append((out.status_code, text, time.perf_counter() - started))
        except httpx.HTTPError as e:  # a cut stream
            outcomes.append((None, repr(e), time.perf_counter() - started))

    threads = [threading.Thread(target=held, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    deadline = time.time() + 30
    while time.time() < deadline:  # all six held by the decoder (4 running, 2 waiting), a stream under way
        text = httpx.get(serve_apps.fake + "/metrics", timeout=10).text
        if metric(text, "raymuter:num_requests_running") + metric(text, "raymuter:num_requests_waiting") >= 6 \
                and streaming.is_set():  # 3 streams, 2 waiting places: one runs; its first token out, it cannot move
            break
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    killed = time.perf_counter()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert len(outcomes) == 6
    for status, text, seconds in outcomes:
        if status == 200 and '"error"' in text:  # a stream that had started: cut with an error event, no [DONE]
            assert "[DONE]" not in text, text[-300:]
        elif status == 200:  # not started when the replica died: moved to the new one, whole
            assert text.endswith("data: [DONE]\n\n") or json.loads(text)["usage"]["completion_tokens"] == 3000, \
                text[-300:]
        else:
            assert status in (500, 503, None), (status, text)
            if status:
                assert "decoder" in json.loads(text)["error"]["message"]
            assert seconds < 30
    assert sum(1 for status, text, _ in outcomes if status == 200 and '"error"' in text) >= 1, \
        [(status, text[-160:], round(seconds, 1)) for status, text, seconds in outcomes]  # the running streams
    assert time.perf_counter() - killed < 45  # failures at once; a moved request's 3000 tokens take 15 s
    deadline = time.time() + 60
    while True:
        out = httpx.post(serve_apps.fake + "/v1/completions", json=dict(model="fake", prompt="ab", max_tokens=2),
                         timeout=30)
        if out.status_code == 200 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert out.json()["choices"][0]["text"] == "ba"
    assert serve.get_deployment_handle("Decoder", app_name="fake").pid.remote().result() != pid
