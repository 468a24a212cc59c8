"""A forced tool call that the budget cut is the call it is: tool_choice "required" (or a named
function) with a small max_tokens answers tool_calls with the function's name and the arguments
written so far, finish_reason "length", as OpenAI does (it was content holding half-written JSON,
so langchain's with_structured_output(method="function_calling") returned None); streamed and
whole alike, and on /v1/responses a function_call item with status "incomplete".

The tiny llama model (its template writes the "json" tool format) behind the app's routes in this
process, greedy: the uncut call is the reference every cut one is a prefix of."""

from __future__ import annotations

import asyncio

import pytest
from app_routes import app_routes, events, strict_json

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"enum": ["Oslo", "Paris"]}}, "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {}}}
CHAT_TOOLS = [{"type": "function", "function": f} for f in (WEATHER, TIME)]
BUDGETS = (3, 14, 40)  # cut in the name, before the arguments, inside them (the tiny model: ~a token a character)
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client(test_models):
    with app_routes({"model": str(test_models["llama-optimum"]), "name": "tiny", "slots": 4, "threads": 1}) as (
            client, _):
        yield client


def chat(max_tokens: int, stream: bool = False, tool_choice=NAMED) -> dict:
    return dict(model="tiny", messages=[{"role": "user", "content": "weather in Oslo?"}], tools=CHAT_TOOLS,
                tool_choice=tool_choice, max_tokens=max_tokens, temperature=0, stream=stream)


def streamed_calls(body: str) -> tuple[list[dict], str, str]:
    """A chat stream's tool calls, its content and its finish_reason."""
    chunks = [c for c in events(body) if c.get("choices")]
    calls = [call for c in chunks for call in c["choices"][0]["delta"].get("tool_calls") or []]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    return calls, content, chunks[-1]["choices"][0]["finish_reason"]


def test_a_forced_call_cut_by_max_tokens_is_the_call_so_far(client):
    async def go():
        async with client() as http:
            whole = strict_json((await http.post("/v1/chat/completions", json=chat(200))).text)["choices"][0]
            assert whole["finish_reason"] == "tool_calls"
            reference = whole["message"]["tool_calls"][0]["function"]
            for budget in BUDGETS:
                answer = strict_json((await http.post("/v1/chat/completions", json=chat(budget))).text)["choices"][0]
                assert answer["finish_reason"] == "length" and answer["message"]["content"] is None, answer
                (call,) = answer["message"]["tool_calls"]
                assert call["type"] == "function" and call["id"].startswith("call_")
                assert call["function"]["name"] == "get_weather"
                assert reference["arguments"].startswith(call["function"]["arguments"]), (budget, call)
                streamed = await http.post("/v1/chat/completions", json=chat(budget, stream=True))
                calls, content, reason = streamed_calls(streamed.text)
                assert reason == "length" and content == ""
                assert [c["function"] for c in calls] == [call["function"]] and calls[0]["index"] == 0
            assert call["function"]["arguments"]  # the last budget cut inside the arguments

    asyncio.run(go())


def test_required_with_one_tool_names_it_from_the_first_token(client):
    async def go():
        async with client() as http:
            body = {**chat(3, tool_choice="required"), "tools": CHAT_TOOLS[:1]}
            answer = strict_json((await http.post("/v1/chat/completions", json=body)).text)["choices"][0]
            assert answer["finish_reason"] == "length" and answer["message"]["content"] is None
            assert [c["function"] for c in answer["message"]["tool_calls"]] == [
                {"name": "get_weather", "arguments": ""}]

    asyncio.run(go())


def test_a_response_cut_in_a_forced_call_ends_in_an_incomplete_function_call(client):
    async def go():
        async with client() as http:
            body = dict(model="tiny", input="weather in Oslo?", tools=[{"type": "function", **WEATHER}],
                        tool_choice="required", max_output_tokens=40, temperature=0)
            response = strict_json((await http.post("/v1/responses", json=body)).text)
            assert response["status"] == "incomplete"
            assert response["incomplete_details"] == {"reason": "max_output_tokens"}
            (item,) = response["output"]
            assert item["type"] == "function_call" and item["status"] == "incomplete"
            assert item["name"] == "get_weather" and item["arguments"]
            assert any(f'{{"city": "{city}"}}'.startswith(item["arguments"]) for city in ("Oslo", "Paris"))
            streamed = events((await http.post("/v1/responses", json={**body, "stream": True})).text)
            done = [e["item"] for e in streamed if e["type"] == "response.output_item.done"]
            assert [(i["type"], i["status"], i["arguments"]) for i in done] == [
                ("function_call", "incomplete", item["arguments"])]
            assert streamed[-1]["type"] == "response.incomplete"

    asyncio.run(go())
