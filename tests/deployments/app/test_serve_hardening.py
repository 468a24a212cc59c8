"""The HTTP surface under requests no client should send, and those that common clients do.

Invariants: every setting is bounded at the boundary (a value past its bound is a 400 whose
param is the request's own field, and a request in the same batch is untouched); every error of
every status is OpenAI's body; a 500 shows a request id and no internals; a client that goes
away frees its slot, streaming or not; the OpenAPI document (behind the key) carries every
route's request and response schemas; OpenAI's and vLLM's fields and routes work as they do
there. One Ray instance for the session (conftest.serve_apps).
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from deployments.fake import fake_tokens

from test_serve import alone, running, sse

KEY = {"Authorization": "Bearer sesame"}


def fake_text(prompt: str, seed: int = 0, **settings) -> str:
    return "".join(map(chr, fake_tokens([ord(c) for c in prompt], seed, settings)))


# -- bounds -------------------------------------------------------------------------------------------
HUGE = 2**64
# (field, a value at its bound that works, the first value past it); the vocabulary of the tiny
# model is 1000 tokens and its context 256
BOUNDS = [
    ("top_k", 1000, 1001),
    ("no_repeat_ngram_size", 32, 33),
    ("encoder_no_repeat_ngram_size", 32, 33),
    ("min_length", 200, HUGE),
    ("min_new_tokens", 4, HUGE),
    ("prompt_lookup_num_tokens", 32, 33),
    ("max_matching_ngram_size", 32, 33),
    ("exponential_decay_length_penalty", [250, 1.5], [HUGE, 1.5]),
    ("min_tokens", 4, HUGE),
    ("max_tokens", 8, 10**6),
    ("seed", 2**64 - 1, HUGE),
    ("n", 16, 17),
    ("num_beams", 4, 5),  # the real app has 4 slots
    ("top_logprobs", 5, 21),
    ("stop", ["x"] * 16, ["x"] * 17),
    ("logit_bias", {"999": 100}, {"1000": 1}),
    ("stop_token_ids", [999], [1000]),
    ("bad_words_ids", [[5] * 32], [[5] * 33]),
    ("repetition_penalty", 1e4, float("inf")),
]


def _field_of(param: str) -> str:
    return param.split(".")[0]


@pytest.mark.parametrize("field, ok, bad", BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_setting_past_its_bound_is_a_400_naming_it_and_the_batch_goes_on(serve_apps, engine, field, ok, bad):
    url = serve_apps.real + "/v1/completions"
    extra = {"logprobs": 5} if field == "top_logprobs" else {}
    stream_body = dict(model="tiny", prompt="The list", max_tokens=40, ignore_eos=True, stream=True, seed=3,
                       temperature=0.8)

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            async def stream():
                async with client.stream("POST", url, json=stream_body) as response:
                    return "".join([json.loads(line[6:])["choices"][0]["text"] async for line in response.aiter_lines()
                                    if line.startswith("data: {")])

            running_stream = asyncio.ensure_future(stream())
            # the bad value as JSON (inf is not JSON: sent as the text 1e999, which parses to inf)
            base = dict(model="tiny", prompt="The", max_tokens=4, **extra)
            payload = json.dumps({**base, field: bad}).replace("Infinity", "1e999")
            refused = await asyncio.gather(*(client.post(url, content=payload, headers={"content-type": "application/json"})
                                             for _ in range(3)))
            accepted = await client.post(url, json={**base, field: ok})
            return await running_stream, refused, accepted

    text, refused, accepted = asyncio.run(run())
    for out in refused:
        assert out.status_code == 400, out.text
        error = out.json()["error"]
        assert _field_of(error["param"]) == field and error["type"] == "invalid_request_error", error
        assert error["message"].startswith(error["param"]), error["message"]
    assert accepted.status_code == 200, accepted.text
    assert text == alone(engine, "The list", 3, max_new_tokens=40, eos_token_id=[], do_sample=True, temperature=0.8)


def test_a_stream_of_two_choices_refused_answers_json(serve_apps):
    out = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt=[99999], stream=True, n=2),
                     timeout=30)
    assert out.status_code == 400 and out.headers["content-type"].startswith("application/json")
    assert out.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("content, param", [
    (b'{"model": "fake", "prompt": "a", "metadata": ' + b'[' * 5000 + b']' * 5000 + b'}', None),
    ('{"model": "fake", "prompt": "a\\ud800"}'.encode(), "prompt"),
    (b'{"model": "fake", "prompt": "\xff\xfe"}', None),
    (b'{"model": "fake", "prompt": "a", "temperature": NaN}', None),
    (b'[1, 2]', None),
], ids=["deep", "lone-surrogate", "not-utf-8", "nan", "not-an-object"])
def test_bodies_no_parser_should_choke_on_get_a_400(serve_apps, content, param):
    out = httpx.post(serve_apps.fake + "/v1/completions", content=content,
                     headers={"content-type": "application/json"}, timeout=30)
    status, error = out.status_code, out.text[:500]
    assert status == 400, error
    assert out.json()["error"]["param"] == param, error


def test_a_five_mib_prompt_is_answered_at_once(serve_apps):
    started = time.perf_counter()
    out = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt="word " * (2**20 + 1)),
                     timeout=60)
    assert out.status_code == 400, out.text[:300]
    assert out.json()["error"]["param"] == "prompt" and "context" in out.json()["error"]["message"]
    assert time.perf_counter() - started < 10
    ids = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt=[5] * 300_000), timeout=60)
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "prompt"


# -- errors ---------------------------------------------------------------------------------------------
def test_unknown_routes_and_wrong_methods_answer_openais_shape(serve_apps):
    out = httpx.get(serve_apps.fake + "/v1/nowhere", timeout=10)
    assert out.status_code == 404 and set(out.json()["error"]) == {"message", "type", "param", "code"}
    out = httpx.get(serve_apps.fake + "/v1/completions", timeout=10)
    assert out.status_code == 405 and "POST" in out.json()["error"]["message"]


def test_a_server_error_shows_its_request_id_and_no_internals(serve_apps):
    for stream in (False, True):
        out = httpx.post(serve_apps.fake + "/v1/completions", timeout=30,
                         json=dict(model="fake", prompt="ab\x01", max_tokens=3, stream=stream))
        assert out.status_code == 500, out.text
        error = out.json()["error"]
        assert error["type"] == "server_error" and error["code"] and error["code"] in error["message"]
        assert "RuntimeError" not in out.text and "on purpose" not in out.text


def test_a_bad_seed_on_the_audio_route_names_seed(serve_apps):
    out = httpx.post(serve_apps.speech + "/v1/audio/transcriptions", data={"model": "whisper", "seed": "abc"},
                     files={"file": ("a.wav", b"RIFF", "audio/wav")}, timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "seed", out.text


# -- clients that leave ---------------------------------------------------------------------------------
def test_a_non_streaming_client_that_leaves_frees_its_slot(serve_apps):
    """The client closes its connection once its request runs (a raw socket: no client timeout
    races the request's start on a busy machine); the slot is free within a second."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(serve_apps.fake)
    body = json.dumps(dict(model="fake", prompt="ab", max_tokens=3000)).encode()
    head = (f"POST {url.path}/v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with httpx.Client(timeout=30) as client:
        assert running(client, serve_apps.fake) == 0
        leaving = socket.create_connection((url.hostname, url.port), timeout=30)
        leaving.sendall(head + body)
        sent = time.perf_counter()
        while running(client, serve_apps.fake) == 0 and time.perf_counter() - sent < 30:
            time.sleep(0.05)
        assert running(client, serve_apps.fake) == 1  # it runs
        leaving.close()  # gone: its connection closes
        left = time.perf_counter()
        while running(client, serve_apps.fake) > 0 and time.perf_counter() - left < 5:
            time.sleep(0.05)
        assert running(client, serve_apps.fake) == 0 and time.perf_counter() - left < 1.0  # within a second


# -- the OpenAPI document ---------------------------------------------------------------------------
def test_the_openapi_document_is_behind_the_key_and_has_every_schema(serve_apps):
    for route in ("/openapi.json", "/docs"):
        assert httpx.get(serve_apps.guarded + route, timeout=10).status_code == 401
    doc = httpx.get(serve_apps.guarded + "/openapi.json", headers=KEY, timeout=10).json()
    schemas = doc["components"]["schemas"]
    for path, method in [("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/tokenize", "post"),
                         ("/detokenize", "post"), ("/v1/models", "get"), ("/v1/models/{model_id}", "get")]:
        operation = doc["paths"][path][method]
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]
        assert ok["$ref"].split("/")[-1] in schemas, (path, ok)
        assert operation["responses"]["400" if method == "post" else "401"]
        if method == "post":
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            assert body["$ref"].split("/")[-1] in schemas
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["n"]["maximum"] == 16
    assert [s.get("maximum") for s in completion["no_repeat_ngram_size"]["anyOf"]] == [32, None]
    assert doc["servers"] == [{"url": "/guarded"}]
    assert httpx.get(serve_apps.guarded + "/docs", headers=KEY, timeout=10).status_code == 200


# -- what OpenAI and vLLM clients send ------------------------------------------------------------------
def test_fields_that_change_nothing_are_accepted(serve_apps):
    body = dict(model="fake", messages=[{"role": "user", "content": "ab"}], max_tokens=3, store=False,
                metadata={"k": "v"}, user="u-1", service_tier="auto", parallel_tool_calls=True,
                response_format={"type": "text"})
    out = httpx.post(serve_apps.fake + "/v1/chat/completions", json=body, timeout=30)
    assert out.status_code == 200, out.text
    assert out.json()["system_fingerprint"].startswith("fp_")
    assert out.json()["id"] == "chatcmpl-" + out.headers["x-request-id"]  # Serve's request id, in its logs too
    refused = httpx.post(serve_apps.fake + "/v1/chat/completions", json={**body, "response_format": {
        "type": "json_object"}}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format"


@pytest.mark.parametrize("prompt", [["abc", "de"], [[97, 98, 99], [100, 101]]], ids=["texts", "ids"])
def test_a_list_of_prompts_numbers_its_choices_as_openai(serve_apps, prompt):
    body = dict(model="fake", prompt=prompt, n=2, max_tokens=3, seed=4, temperature=1.0)
    out = httpx.post(serve_apps.fake + "/v1/completions", json=body, timeout=30).json()
    assert "choices" in out, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    expected = [fake_text(p, 4 + j, max_new_tokens=3, do_sample=True) for p in ("abc", "de") for j in range(2)]
    assert [c["text"] for c in out["choices"]] == expected
    assert out["usage"]["prompt_tokens"] == 5 and out["usage"]["completion_tokens"] == 12
    streamed = sse(httpx.post(serve_apps.fake + "/v1/completions", json={**body, "stream": True}, timeout=30).text)
    joined = {}
    for chunk in streamed:
        for choice in chunk["choices"]:
            joined[choice["index"]] = joined.get(choice["index"], "") + choice["text"]
    assert [joined[i] for i in range(4)] == expected


def test_models_tokenize_detokenize_and_version(serve_apps, engine):
    model, tokenizer = engine
    card = httpx.get(serve_apps.real + "/v1/models/tiny", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    missing = httpx.get(serve_apps.real + "/v1/models/other", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    out = httpx.post(serve_apps.real + "/tokenize", json=dict(model="tiny", prompt="The list", return_token_strs=True),
                     timeout=10).json()
    assert out["tokens"] == tokenizer.encode("The list").ids and out["count"] == len(out["tokens"])
    assert len(out["token_strs"]) == out["count"] and out["max_model_len"] > 0
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "What is a list?"}]
    chat = httpx.post(serve_apps.real + "/tokenize", json=dict(model="tiny", messages=messages), timeout=10).json()
    assert chat["tokens"] == AutoTokenizer.from_pretrained(model.folder).apply_chat_template(
        messages, add_generation_prompt=True)
    text = httpx.post(serve_apps.real + "/detokenize", json=dict(model="tiny", tokens=out["tokens"]), timeout=10)
    assert text.json()["prompt"] == tokenizer.decode(out["tokens"], skip_special_tokens=False)
    bad = httpx.post(serve_apps.real + "/detokenize", json=dict(model="tiny", tokens=[1, 5000]), timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens.1"
    assert httpx.get(serve_apps.real + "/version", timeout=10).json()["version"]


def test_stop_token_ids_and_min_tokens_end_as_eos_tokens_do(serve_apps, engine):
    import generation

    model, tokenizer = engine
    ctx = generation.context(model, max_new_tokens=12, eos_token_id=[])
    ids = generation.generate(ctx, [tokenizer.encode("The").ids], seeds=[0])[0]
    stop_at = next(t for k, t in enumerate(ids) if k >= 2 and t not in ids[:k])
    eos = list(generation.context(model).settings.eos_token_id)
    for extra, settings in [(dict(stop_token_ids=[stop_at]), dict(eos_token_id=[*eos, stop_at])),
                            (dict(stop_token_ids=[ids[0]], min_tokens=3),
                             dict(eos_token_id=[*eos, ids[0]], min_new_tokens=3)),
                            (dict(stop_token_ids=[stop_at], ignore_eos=True), dict(eos_token_id=[stop_at]))]:
        out = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt="The", max_tokens=12,
                                                                        **extra), timeout=30).json()
        assert out["choices"][0]["text"] == alone(engine, "The", 0, max_new_tokens=12, **settings), extra


def test_chat_template_kwargs_reach_the_template(serve_apps):
    url = serve_apps.fake + "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    plain = httpx.post(url, json=dict(model="fake", messages=messages, max_tokens=3), timeout=10).json()
    given = httpx.post(url, json=dict(model="fake", messages=messages, max_tokens=3,
                                      chat_template_kwargs={"prefix": "xyz"}), timeout=10).json()
    # the fake answers with its prompt reversed: the template's last words first
    assert plain["choices"][0]["message"]["content"] == " :t" and given["choices"][0]["message"]["content"] == "zyx"
    refused = httpx.post(url, json=dict(model="fake", messages=messages, chat_template_kwargs={"messages": []}),
                         timeout=10)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template_kwargs"


def test_echo_with_logprobs_streams_and_token_id_prompts(serve_apps):
    body = dict(model="fake", prompt=[97, 98, 99], max_tokens=2, echo=True, logprobs=1)
    whole = httpx.post(serve_apps.fake + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    assert whole["text"] == "abc" + fake_text("abc", max_new_tokens=2)
    logprobs = whole["logprobs"]
    assert logprobs["tokens"] == list("abccb") and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.5] * 4 and logprobs["text_offset"] == [0, 1, 2, 3, 4]
    assert logprobs["top_logprobs"][0] is None and all(logprobs["top_logprobs"][1:])
    chunks = sse(httpx.post(serve_apps.fake + "/v1/completions", json={**body, "stream": True}, timeout=30).text)
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    offsets = [o for c in chunks if c["choices"][0]["logprobs"] for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == [0, 1, 2, 3, 4]  # they run on across chunks


def test_echo_is_refused_by_name_where_the_prompt_is_not_the_completions_start(serve_apps):
    out = httpx.post(serve_apps.translate + "/v1/completions", json=dict(model="marian", prompt="a b", echo=True),
                     timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "echo"
    out = httpx.post(serve_apps.vision + "/v1/completions", json=dict(model="qwen", prompt="a b", echo=True,
                                                                      logprobs=1, max_tokens=2), timeout=30)
    assert out.status_code == 400 and out.json()["error"]["param"] == "echo", out.text
    assert "echo with logprobs" in out.json()["error"]["message"]
