"""OpenAI's presence_penalty and frequency_penalty through the HTTP routes, as a client sends them:
the ingress's routes in this process over a decoder of the tiny llama-genai model.

Invariants: a completion or a chat with the penalties gives the engine's tokens with the settings
of the same names (greedy and seeded sampling, each of n choices with its seed), whole and
streamed alike, and they change the text; a Responses request takes them as the chat it runs as;
a server's default (`--set presence_penalty=...`) applies where a request leaves them out and 0
turns it off; a value outside [-2, 2] is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import openai
import pytest
from app_routes import app_routes

import generation

PENALTIES = dict(frequency_penalty=1.5, presence_penalty=0.5)
MESSAGES = [{"role": "user", "content": "What is a list?"}]


@contextlib.contextmanager
def served(folder, **config):
    """(httpx client, openai client) on the app's routes over a decoder of `folder`."""
    with app_routes(dict(model=str(folder), name="tiny", slots=4, threads=1, **config)) as (client, _):
        http = client(timeout=60)
        yield http, openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)


@pytest.fixture
def routes(test_models):
    with served(test_models["llama-genai"]) as clients:
        yield clients


@pytest.fixture(scope="module")
def engine(test_models, load_model):
    from generation.text.tokenizer import model_tokenizer

    model = load_model(test_models["llama-genai"])
    return model, model_tokenizer(model)


def engine_text(engine, ids, seed=0, **settings) -> str:
    model, tokenizer = engine
    tokens = generation.generate(generation.context(model, **{"max_new_tokens": 24, **settings}), [ids], seeds=[seed])
    return tokenizer.decode(tokens[0])


def chat_ids(engine) -> list[int]:
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(engine[0].folder).apply_chat_template(MESSAGES,
                                                                                  add_generation_prompt=True))


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.8, seed=3)], ids=["greedy", "sampling"])
def test_completions_whole_and_streamed_equal_the_engine(routes, engine, sampling):
    http, _ = routes
    ids = engine[1].encode("The list").ids
    settings = dict(do_sample=True, temperature=0.8) if sampling else {}
    expected = engine_text(engine, ids, 3, **settings, **PENALTIES)
    assert expected != engine_text(engine, ids, 3, **settings)  # the penalties change the text

    async def go():
        body = dict(model="tiny", prompt="The list", max_tokens=24, **sampling, **PENALTIES)
        whole = (await http.post("/v1/completions", json=body)).json()
        streamed = await http.post("/v1/completions", json={**body, "stream": True})
        return whole, streamed.text

    whole, streamed = run(go())
    assert whole["choices"][0]["text"] == expected
    chunks = [line[6:] for line in streamed.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(json.loads(c)["choices"][0]["text"] for c in chunks) == expected


def test_chat_through_the_openai_client_whole_and_streamed(routes, engine):
    _, client = routes
    ids = chat_ids(engine)
    settings = dict(frequency_penalty=2.0, presence_penalty=-1.0)
    expected = engine_text(engine, ids, 0, max_new_tokens=32, **settings)
    assert expected != engine_text(engine, ids, 0, max_new_tokens=32)

    async def go():
        whole = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=32, **settings)
        stream = await client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=32, stream=True,
                                                      **settings)
        parts = [chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices]
        return whole.choices[0].message.content, "".join(parts)

    assert run(go()) == (expected, expected)


def test_each_of_n_choices_with_its_own_seed(routes, engine):
    http, _ = routes
    ids = engine[1].encode("A tuple is").ids
    sampled = dict(do_sample=True, temperature=0.8, **PENALTIES)

    async def go():
        body = dict(model="tiny", prompt="A tuple is", max_tokens=24, n=2, seed=5, temperature=0.8, **PENALTIES)
        return (await http.post("/v1/completions", json=body)).json()

    out = run(go())
    assert [c["text"] for c in out["choices"]] == [engine_text(engine, ids, 5 + j, **sampled) for j in range(2)]


def test_a_response_takes_them_as_its_chat(routes, engine):
    """OpenAI's Responses API has no such fields; Raymuter's takes the chat route's settings under
    their names (as top_k), so they apply as in the chat the response runs as."""
    _, client = routes
    settings = dict(frequency_penalty=2.0, presence_penalty=-1.0)

    async def go():
        response = await client.responses.create(model="tiny", input="What is a list?", max_output_tokens=32,
                                                 store=False, extra_body=settings)
        return response.output_text

    assert run(go()) == engine_text(engine, chat_ids(engine), 0, max_new_tokens=32, **settings)


def test_a_server_default_applies_where_a_request_leaves_them_out(test_models, engine):
    ids = engine[1].encode("The list").ids

    async def go(http):
        body = dict(model="tiny", prompt="The list", max_tokens=24)
        default = (await http.post("/v1/completions", json=body)).json()["choices"][0]["text"]
        off = (await http.post("/v1/completions", json={**body, "presence_penalty": 0})).json()["choices"][0]["text"]
        return default, off

    with served(test_models["llama-genai"], settings={"frequency_penalty": 0.25, "presence_penalty": 2.0}) as (http, _):
        default, off = run(go(http))
    assert default == engine_text(engine, ids, frequency_penalty=0.25, presence_penalty=2.0)
    assert off == engine_text(engine, ids, frequency_penalty=0.25) != default


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, message", [
    ("presence_penalty", 2.5, "less than or equal to 2"), ("frequency_penalty", -2.01, "greater than or equal to -2"),
    ("presence_penalty", "a lot", "a valid number"),
])
def test_out_of_range_is_a_400_naming_the_field(routes, route, field, value, message):
    http, _ = routes
    body = dict(model="tiny", max_tokens=2, **{field: value})
    body.update(prompt="a") if route == "/v1/completions" else body.update(messages=MESSAGES)
    out = run(http.post(route, json=body))
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == field and message in error["message"], error
