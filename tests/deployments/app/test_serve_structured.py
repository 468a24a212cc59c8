"""Structured outputs through the server: OpenAI's response_format (json_object, json_schema, and
the openai client's `beta.chat.completions.parse` with a pydantic model), vLLM's
structured_outputs and guided_* fields.

Invariants: a constrained request gives what the engine gives with the same structured_outputs
setting (greedy, sampled, beams, streamed or not) and its output follows the constraint; a bad
schema, regex or grammar is a 400 naming the field the request gave it in; a constrained request
beside unconstrained ones leaves theirs as they are alone.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

import generation
from test_serve import alone, sse

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["word", "count"],
          "properties": {"word": {"type": "string", "maxLength": 5}, "count": {"type": "integer", "minimum": 0,
                                                                                "maximum": 99}}}


def constrained(engine, prompt: str, seed: int, structured, **settings) -> str:
    return alone(engine, prompt, seed, structured_outputs=structured, **{"max_new_tokens": 40, **settings})


def chat_text(engine, messages, seed, structured, **settings) -> str:
    """The engine's text for a chat request (the model's template, as transformers applies it)
    under the constraint."""
    from transformers import AutoTokenizer

    model, tokenizer = engine
    ids = AutoTokenizer.from_pretrained(model.folder).apply_chat_template(messages, add_generation_prompt=True)
    ctx = generation.context(model, max_new_tokens=40, structured_outputs=structured, **settings)
    return tokenizer.decode(generation.generate(ctx, [list(ids)], seeds=[seed])[0])


def test_response_format_json_schema_equals_the_engine_and_validates(serve_apps, engine):
    import jsonschema

    body = dict(model="tiny", prompt="The list", max_tokens=40, seed=3,
                response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA,
                                                                         "strict": True}})
    out = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert out["text"] == constrained(engine, "The list", 3, {"json": SCHEMA})
    jsonschema.validate(json.loads(out["text"]), SCHEMA)
    assert out["finish_reason"] == "stop"
    sampled = httpx.post(serve_apps.real + "/v1/completions", json={**body, "temperature": 1.2}, timeout=60).json()
    assert sampled["choices"][0]["text"] == constrained(engine, "The list", 3, {"json": SCHEMA}, do_sample=True,
                                                        temperature=1.2)
    streamed = sse(httpx.post(serve_apps.real + "/v1/completions", json={**body, "stream": True}, timeout=60).text)
    assert "".join(c["choices"][0]["text"] for c in streamed) == out["text"]


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": "[a-d]{2,5}"}, lambda t: re.fullmatch("[a-d]{2,5}", t)),
    ("structured_outputs", {"choice": ["red", "green", "blue"]}, lambda t: t in ("red", "green", "blue")),
    ("guided_regex", "[0-9]{3}", lambda t: re.fullmatch("[0-9]{3}", t)),
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("guided_json", SCHEMA, lambda t: json.loads(t)),
    ("guided_grammar", 'start: "(" /[a-c]/ ")"', lambda t: re.fullmatch(r"\([a-c]\)", t)),
])
def test_vllm_fields_constrain_the_output(serve_apps, engine, field, value, check):
    body = dict(model="tiny", prompt="The", max_tokens=40, **{field: value})
    text = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    setting = value if field == "structured_outputs" else {field.removeprefix("guided_"): value}
    assert text == constrained(engine, "The", 0, setting)
    assert check(text), text


def test_beams_under_a_constraint_equal_the_engines(serve_apps, engine):
    body = dict(model="tiny", prompt="The list", max_tokens=12, num_beams=3,
                structured_outputs={"regex": "[a-z ]{1,12}"})
    text = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert text == constrained(engine, "The list", 0, {"regex": "[a-z ]{1,12}"}, num_beams=3, max_new_tokens=12)


def test_the_openai_client_parses_into_a_pydantic_model(serve_apps, engine):
    import openai
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        word: str = Field(max_length=4)
        count: int = Field(ge=0, le=50)
        ok: bool

    client = openai.OpenAI(base_url=serve_apps.real + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "an item"}]
    done = client.beta.chat.completions.parse(model="tiny", messages=messages, response_format=Item, max_tokens=40)
    item = done.choices[0].message.parsed
    assert isinstance(item, Item) and len(item.word) <= 4 and 0 <= item.count <= 50
    mode = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40,
                                          response_format={"type": "json_object"})
    assert isinstance(json.loads(mode.choices[0].message.content), dict)
    assert mode.choices[0].message.content == chat_text(engine, messages, 0, {"json_object": True})


@pytest.mark.parametrize("body, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
     "response_format"),
    (dict(structured_outputs={"regex": "("}), "structured_outputs"),
    (dict(guided_grammar="start: missing"), "guided_grammar"),
    (dict(guided_json="{not json"), "guided_json"),
])
def test_a_bad_constraint_is_a_400_naming_its_field(serve_apps, body, param):
    out = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt="a", max_tokens=4, **body),
                     timeout=60)
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_a_constrained_request_leaves_the_others_as_they_are_alone(serve_apps, engine):
    import concurrent.futures

    def plain(seed):
        body = dict(model="tiny", prompt="The", max_tokens=16, seed=seed, temperature=0.9)
        return httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    def json_one(seed):
        body = dict(model="tiny", prompt="The list", max_tokens=40, seed=seed, guided_json=SCHEMA)
        return httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        plains = [pool.submit(plain, s) for s in range(3)]
        jsons = [pool.submit(json_one, s) for s in range(3)]
        for s, f in enumerate(plains):
            assert f.result() == alone(engine, "The", s, do_sample=True, temperature=0.9)
        for s, f in enumerate(jsons):
            assert f.result() == constrained(engine, "The list", s, {"json": SCHEMA})


def test_the_python_handle_takes_the_constraint_and_tools(serve_apps, engine):
    from ray import serve

    from deployments.schema import GenerateRequest

    serve_apps.app("real")
    handle = serve.get_app_handle("real")
    setting = {"regex": "[a-c]{3}"}
    out = handle.generate.remote(GenerateRequest(prompt="The", seed=0, settings={"structured_outputs": setting,
                                                                                 "max_new_tokens": 10})).result()
    assert out.text == constrained(engine, "The", 0, setting, max_new_tokens=10)
    assert re.fullmatch("[a-c]{3}", out.text)
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"], "additionalProperties": False}}}
    called = handle.generate.remote(GenerateRequest(messages=[{"role": "user", "content": "hi"}], tools=[tool],
                                                    tool_choice="required", parallel_tool_calls=False, seed=0,
                                                    settings={"max_new_tokens": 60})).result()
    assert called.finish_reason in ("tool_calls", "length")
    if called.finish_reason == "tool_calls":
        assert [c["function"]["name"] for c in called.tool_calls] == ["f"]
        assert json.loads(called.tool_calls[0]["function"]["arguments"])["x"] in (1, 2)
