"""Reasoning output over HTTP: a thinking model's chat answers with `message.reasoning` (and
vLLM's older `reasoning_content`) apart from `content`, whole and streamed as reasoning deltas,
through the openai client; a completion's text stays whole. The tiny model's template opens a
<think> block (tests/generation/front/test_reasoning.py has the same), its output held to a
thinking answer by a grammar."""

from __future__ import annotations

import shutil

import pytest

from test_reasoning import TEMPLATE

GRAMMAR = {"grammar": 'root ::= "ab c</think>the answer"'}


@pytest.fixture(scope="module")
def thinking_app(serve_apps, tmp_path_factory):
    from ray import serve

    from conftest import ServeApps
    from deployments.app import build

    folder = tmp_path_factory.mktemp("thinking-app") / "model"
    shutil.copytree(serve_apps.real_model, folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    serve.run(build({**ServeApps.REAL, "model": str(folder), "colocate": True, "settings": {"max_new_tokens": 40}}),
              name="thinking", route_prefix="/thinking")
    yield f"{serve_apps.url}/thinking"
    serve.delete("thinking", _blocking=False)


def test_a_chat_gives_reasoning_apart_from_content(thinking_app):
    import openai

    client = openai.OpenAI(base_url=thinking_app + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, extra_body={"structured_outputs": GRAMMAR})
    message = whole.choices[0].message
    assert message.content == "the answer"
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == "ab c"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                                 extra_body={"structured_outputs": GRAMMAR}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "the answer"
    assert "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas) == "ab c"
    assert not any("<" in (d.content or "") + ((d.model_extra or {}).get("reasoning") or "") for d in deltas)


def test_a_response_gives_its_reasoning_as_an_item(thinking_app):
    """/v1/responses on the colocated server: a reasoning item, then the message; streamed as
    reasoning_text deltas; a next turn's conversation holds the answer, as a chat client sends it."""
    import openai

    client = openai.OpenAI(base_url=thinking_app + "/v1", api_key="unused", max_retries=0)
    constrained = {"structured_outputs": GRAMMAR}
    whole = client.responses.create(model="tiny", input="hi", extra_body=constrained)
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == ["ab c"]
    assert message.type == "message" and whole.output_text == "the answer"
    events = list(client.responses.create(model="tiny", input="hi", stream=True, extra_body=constrained))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "ab c"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "the answer"
    assert [i.type for i in events[-1].response.output] == ["reasoning", "message"]
    second = client.responses.create(model="tiny", input="more", previous_response_id=whole.id,
                                     extra_body={"structured_outputs": {"grammar": 'root ::= "x</think>" [a-z ]{1,8}'}})
    chat = client.chat.completions.create(model="tiny", messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "the answer"},
        {"role": "user", "content": "more"}], extra_body={"structured_outputs": {"grammar": 'root ::= "x</think>" [a-z ]{1,8}'}})
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_a_completion_stays_text(thinking_app):
    import httpx

    out = httpx.post(thinking_app + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "x", "structured_outputs": {"grammar": 'root ::= "a</think>b"'}}).json()
    assert out["choices"][0]["text"] == "a</think>b"
