"""The Responses API's shapes over the chat route's (deployments/http/responses.py): input items
as chat messages, options as a chat request, errors naming the Responses field, and the output
items that the stream's typed events and the whole answer share."""

from __future__ import annotations

import json

import pytest

from deployments.http.openai import ApiError, ChatCompletionRequest
from deployments.http.responses import ResponseRequest
from deployments.http.responses_conversion import chat_body, input_items, messages_of, responses_error
from deployments.http.responses_events import ResponseEvents
from deployments.http.validation import parse

TOOL = {"type": "function", "name": "weather", "description": "the weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_input_items_are_the_chat_messages_a_client_would_send():
    items = input_items([
        {"role": "user", "content": [{"type": "input_text", "text": "weather in "}, {"type": "input_text", "text": "Oslo"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "weather", "arguments": "{\"city\": \"Bergen\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It rains."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "and this?"},
                                     {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]},
    ])
    assert all(item["id"] for item in items)
    assert messages_of(items) == [
        {"role": "user", "content": "weather in Oslo"},
        {"role": "assistant", "content": None, "tool_calls": [  # calls in a row: one assistant turn
            {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}},
            {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Bergen\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        {"role": "assistant", "content": "It rains."},
        {"role": "user", "content": [{"type": "text", "text": "and this?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA",
                                                                         "detail": "auto"}}]}]
    (only,) = input_items("hi")  # a text's parts, as OpenAI lists input items; the same chat message
    assert (only["type"], only["role"], only["content"]) == ("message", "user", [{"type": "input_text", "text": "hi"}])
    said = input_items([{"role": "assistant", "content": "yes"}])
    assert said[0]["content"] == [{"type": "output_text", "text": "yes", "annotations": []}]
    assert messages_of([only] + said) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]


@pytest.mark.parametrize("item, param", [
    ({"type": "item_reference", "id": "x"}, "input.0.type"),
    ({"role": "robot", "content": "x"}, "input.0.role"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input.0.content.0.type"),
    ({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}, "input.0.content.0.image_url"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input.0.call_id"),
    ({"type": "function_call_output", "call_id": "c", "output": 3}, "input.0.output"),
])
def test_an_item_the_server_cannot_take_is_named(item, param):
    with pytest.raises(ApiError) as e:
        messages_of(input_items([item]))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_options_become_the_chat_request_fields():
    request = ResponseRequest(model="m", input="x", max_output_tokens=5, temperature=0, tools=[TOOL],
                              tool_choice={"type": "function", "name": "weather"}, parallel_tool_calls=False,
                              top_logprobs=2, seed=3, top_k=4)
    chat = parse(ChatCompletionRequest, chat_body(request, [{"role": "user", "content": "x"}]))
    assert chat.max_completion_tokens == 5 and chat.temperature == 0 and chat.seed == 3 and chat.top_k == 4
    assert chat.tools == [{"type": "function", "function": {k: TOOL[k] for k in ("name", "description", "parameters")}}]
    assert chat.tool_choice.function.name == "weather" and chat.parallel_tool_calls is False
    assert chat.logprobs is True and chat.top_logprobs == 2
    request = ResponseRequest(model="m", input="x", text={"format": {"type": "json_schema", "name": "out", "strict": True,
                                                                    "schema": {"type": "object"}}})
    chat = parse(ChatCompletionRequest, chat_body(request, [{"role": "user", "content": "x"}]))
    assert chat.response_format.json_schema.schema_ == {"type": "object"} and chat.response_format.json_schema.strict


@pytest.mark.parametrize("field, instead", [("messages", "input"), ("max_tokens", "max_output_tokens"),
                                            ("response_format", "text.format"), ("n", None)])
def test_a_chat_field_is_refused_naming_the_responses_one(field, instead):
    for body in ({"model": "m", "input": "x", field: 1}, {"model": "m", field: 1}):  # input missing: still the field
        with pytest.raises(ApiError) as e:
            parse(ResponseRequest, body)
        assert e.value.param == field and e.value.message.startswith(f"{field}: not a field of /v1/responses")
        assert instead is None or instead in e.value.message


@pytest.mark.parametrize("body, param", [
    ({"max_output_tokens": 10, "input": "x", "temperature": 3}, "temperature"),
    ({"input": [{"role": "user", "content": "x"}] * 3000}, "input"),
    ({"input": "x", "tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
])
def test_the_chat_validation_speaks_of_the_responses_fields(body, param):
    with pytest.raises(ApiError) as e:
        request = parse(ResponseRequest, {"model": "m", **body})
        try:
            parse(ChatCompletionRequest, chat_body(request, messages_of(input_items(request.input))))
        except ApiError as error:
            raise responses_error(error) from None
    assert e.value.param.startswith(param), e.value.param
    assert e.value.message.startswith(param) and "messages" not in e.value.message


def test_a_decoder_refusal_names_the_responses_field():
    error = responses_error(ApiError(400, "max_completion_tokens is 9999, over the context", param="max_completion_tokens",
                                     predicate=" is 9999, over the context"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens is 9999, over the context")
    same = ApiError(400, "top_k: x", param="top_k")
    assert responses_error(same) is same


def _events(pieces):
    return [json.loads(p.split("data: ", 1)[1]) for p in pieces]


def test_events_open_and_close_each_item_in_order():
    events = ResponseEvents({"id": "resp_x"})
    pieces = events.start() + events.reasoning("thinking ") + events.reasoning("hard") + events.text("the ")
    pieces += events.text("answer") + events.finish([{"id": "call_1", "type": "function", "function": {
        "name": "f", "arguments": "{}"}}], "completed")
    kinds = [e["type"] for e in _events(pieces)]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done"]
    assert [e["sequence_number"] for e in _events(pieces)] == list(range(len(pieces)))
    reasoning, message, call = events.output
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "thinking hard"}]
    assert message["content"][0]["text"] == "the answer" and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == ("call_1", "f", "{}", "completed")
    done = [e for e in _events(pieces) if e["type"] == "response.output_item.done"]
    assert [e["item"] for e in done] == events.output


def test_an_answer_with_nothing_said_still_has_its_message():
    events = ResponseEvents({"id": "resp_x"})
    events.finish(None, "incomplete")
    (message,) = events.output
    assert message["type"] == "message" and message["content"][0]["text"] == "" and message["status"] == "incomplete"
