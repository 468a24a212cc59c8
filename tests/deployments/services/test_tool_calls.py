"""Tool calling through the decoder service and the HTTP routes.

Invariants: tools go through the model's template (as transformers renders them) and, with
tool_choice "required" or a named function, the output is held to calls of those tools in the
template family's format: the calls come back as OpenAI tool_calls (finish_reason
"tool_calls"), their arguments following each tool's schema; streamed, the calls arrive as
deltas that reassemble to the whole call; "auto" reads calls out of free output (none from a
random model: its text comes back as content); "none" leaves the tools out; a bad tool or a
tool_choice naming no tool is a 400 naming its field.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import jsonschema
import pytest

import generation
from deployments.http.openai import ApiError
from deployments.schema import GenerateRequest
from deployments.services.generator import TextGenerator
from generation.front import Refused
from generation.text import tool_calls as T
from test_tools import TOOLS, WEATHER

MESSAGES = [{"role": "user", "content": "Oslo?"}]
# the tiny models' context is 256 tokens (and their tokenizer takes about a token a character of
# JSON): a Hermes-style template (the tools' names in <tools>, calls in <tool_call>), short tools
HERMES = ("{%- if tools %}<tools>{%- for t in tools %}{{ t.function.name }} {% endfor %}</tools>{%- endif %}"
          "{%- for m in messages %}{%- if m.tool_calls %}{%- for c in m.tool_calls %}<tool_call>"
          "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
          "{%- endfor %}{%- else %}{{ m.role }}: {{ m.content }}\n{%- endif %}{%- endfor %}"
          "{%- if add_generation_prompt %}assistant:{%- endif %}")
SHORT = [{"type": "function", "function": {"name": "f", "parameters": {
             "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["x"],
             "additionalProperties": False}}},
         {"type": "function", "function": {"name": "g", "parameters": {
             "type": "object", "properties": {"y": {"enum": ["a", "b"]}}, "required": ["y"],
             "additionalProperties": False}}}]


def collect(generator, **request):
    async def run():
        return [chunk async for chunk in generator.stream(GenerateRequest(**request))]
    return asyncio.run(run())


def check_calls(calls, only=None, tools=TOOLS):
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        tool = next(t for t in tools if t["function"]["name"] == call["function"]["name"])
        assert only in (None, tool["function"]["name"])
        jsonschema.validate(json.loads(call["function"]["arguments"]), tool["function"]["parameters"])


def prompt_ids(generator, request: GenerateRequest) -> list[int]:
    """The prompt ids the engine front makes of a request (its input processing)."""
    return generator.front.inputs.prompt_ids(request)


@pytest.fixture(scope="module")
def hermes(test_models, tmp_path_factory):
    """The tiny llama (onnxruntime-genai) with a Hermes-style template, served by a TextGenerator."""
    folder = tmp_path_factory.mktemp("hermes") / "model"
    shutil.copytree(test_models["llama-genai"], folder)
    (folder / "chat_template.jinja").write_text(HERMES)
    generator = TextGenerator.from_model(folder, slots=2, threads=1, max_new_tokens=120)
    yield generator
    generator.close()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "g"}}])
def test_required_and_named_calls_come_back_as_tool_calls(hermes, choice):
    only = choice["function"]["name"] if isinstance(choice, dict) else None
    finished = 0
    for seed in range(3):
        chunks = collect(hermes, messages=MESSAGES, tools=SHORT, tool_choice=choice, seed=seed,
                         parallel_tool_calls=False, settings={"do_sample": True} if seed else {})
        last = chunks[-1]
        if last.finish_reason == "length":
            continue  # the budget ran out inside a call
        finished += 1
        assert last.finish_reason == "tool_calls"
        check_calls(last.tool_calls, only, SHORT)
        assert "".join(c.text for c in chunks) == ""  # nothing but the calls
        assert len(last.tool_calls) == 1  # parallel_tool_calls false: one call
    assert finished >= 2


def test_the_prompt_holds_the_tools_as_the_template_renders_them(hermes):
    from generation.text.chat import render_chat

    text = render_chat(HERMES, MESSAGES, hermes.front.inputs.special_tokens, True, {"tools": SHORT})
    ids = hermes.front.tokenizer.encode(text, add_special_tokens=False).ids
    assert prompt_ids(hermes, GenerateRequest(messages=MESSAGES, tools=SHORT, tool_choice="auto")) == ids
    assert "<tools>f g </tools>" in text  # the tools are in the prompt
    plain = render_chat(HERMES, MESSAGES, hermes.front.inputs.special_tokens, True, None)
    assert prompt_ids(hermes, GenerateRequest(messages=MESSAGES, tools=SHORT, tool_choice="none")) == \
        hermes.front.tokenizer.encode(plain, add_special_tokens=False).ids  # none: no tools


def test_auto_reads_calls_out_of_free_output(hermes):
    chunks = collect(hermes, messages=MESSAGES, tools=SHORT, tool_choice="auto", seed=0)
    model = hermes.batcher.ctx.model
    from generation.text.chat import render_chat

    ids = hermes.front.tokenizer.encode(render_chat(HERMES, MESSAGES, hermes.front.inputs.special_tokens, True, {"tools": SHORT}),
                                  add_special_tokens=False).ids
    free = hermes.front.tokenizer.decode(generation.generate(generation.context(model, max_new_tokens=120), [ids],
                                                       seeds=[0])[0])
    assert chunks[-1].tool_calls is None and "".join(c.text for c in chunks) == free  # a random model calls nothing
    assert T.parse_calls("hermes", free + '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
                         ["f"]).calls  # what it would read, had the model written a call


def test_an_assistant_turn_with_calls_and_a_tool_result_render(hermes):
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                               "arguments": '{"city": "Oslo", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    ids = prompt_ids(hermes, GenerateRequest(messages=history, tools=SHORT, tool_choice="auto"))
    text = hermes.front.tokenizer.decode(ids)
    assert '"arguments": {"city": "Oslo", "days": 1}' in text.replace("\n", "") or '"city": "Oslo"' in text
    assert "sunny" in text

    broken = [*history[:1], {**history[1], "tool_calls": [{"id": "c", "type": "function",
                                                          "function": {"name": "get_weather", "arguments": "{x"}}]}]
    with pytest.raises(Refused) as e:
        prompt_ids(hermes, GenerateRequest(messages=broken, tools=SHORT, tool_choice="auto"))
    assert e.value.field == "messages.1.tool_calls.0.function.arguments"


def test_tool_calls_through_the_openai_client_streamed_and_not(serve_apps):
    import openai

    client = openai.OpenAI(base_url=serve_apps.real + "/v1", api_key="unused", max_retries=0)
    done = None
    for seed in range(4):
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=SHORT, tool_choice="required",
                                             max_tokens=100, seed=seed, parallel_tool_calls=False)
        if out.choices[0].finish_reason == "tool_calls":
            done = (seed, out)
            break
    assert done is not None, "no call finished within the budget"
    seed, out = done
    calls = [c.model_dump() for c in out.choices[0].message.tool_calls]
    check_calls(calls, tools=SHORT)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=SHORT, tool_choice="required",
                                            max_tokens=100, seed=seed, stream=True, parallel_tool_calls=False)
    assembled: dict = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                entry = assembled.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert [(e["name"], e["arguments"]) for _, e in sorted(assembled.items())] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert reasons[-1] == "tool_calls"
    named = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=SHORT, max_tokens=100, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": "g"}})
    assert named.choices[0].finish_reason in ("tool_calls", "length")
    if named.choices[0].finish_reason == "tool_calls":
        assert {c.function.name for c in named.choices[0].message.tool_calls} == {"g"}


@pytest.mark.parametrize("body, param", [
    (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "launch"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
])
def test_a_bad_tool_request_is_a_400_naming_its_field(serve_apps, body, param):
    out = httpx.post(serve_apps.real + "/v1/chat/completions",
                     json=dict(model="tiny", messages=MESSAGES, max_tokens=4, **body), timeout=60)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()


def test_tokenize_with_tools_is_the_chats_prompt(hermes):
    """/tokenize takes tools (vLLM's chat tokenize does): the ids a chat with them would run."""
    from deployments.http.openai import TokenizeRequest
    from deployments.http.validation import parse

    body = parse(TokenizeRequest, dict(messages=MESSAGES, tools=SHORT))
    tokens = hermes.tokenize(None, [m.model_dump(exclude_none=True) for m in body.messages], None, True,
                             body.template_variables(), False).tokens
    assert tokens == prompt_ids(hermes, GenerateRequest(messages=MESSAGES, tools=SHORT, tool_choice="auto"))
    assert tokens != hermes.tokenize(None, MESSAGES, None, True, None, False).tokens
    with pytest.raises(ApiError, match="tools: go with messages"):
        parse(TokenizeRequest, dict(prompt="x", tools=SHORT))
