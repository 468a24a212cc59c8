"""/v1/responses on Ray Serve with two ingress replicas and two decoder replicas (the tiny real
model, `raymuter serve --split --autoscale ingress=2:2 --autoscale decoder=2:2`): the store is
one deployment both ingress replicas share, so a conversation continues through either; a next
turn goes to the decoder replica that ran the turn before (GenerateRequest.affinity), whose
prefix cache holds the conversation (cached_tokens > 0), and its text equals the chat with the
whole history. A background response outlives its client."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

INGRESS = "x-raymuter-ingress"


@pytest.fixture(scope="module")
def two_by_two(serve_apps):
    from ray import serve

    from conftest import ServeApps
    from deployments.app import build

    fixed = {"min_replicas": 2, "max_replicas": 2}
    serve.run(build({**ServeApps.REAL, "model": str(serve_apps.real_model),
                     "autoscaling": {"ingress": fixed, "decoder": fixed}}), name="responses", route_prefix="/responses")
    url = f"{serve_apps.url}/responses"
    yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60), url
    serve.delete("responses", _blocking=False)


def created(client, **fields):
    """(the response, the ingress replica that took it)."""
    raw = client.responses.with_raw_response.create(model="tiny", **fields)
    return raw.parse(), raw.headers[INGRESS]


def test_a_conversation_continues_through_either_ingress_replica_on_its_cache(two_by_two):
    client, _ = two_by_two
    crossed, ingresses = 0, set()
    for k in range(10):
        opening = f"Conversation {k}: tell me a long story about the sea and ships and storms, please."
        first, took_first = created(client, input=opening, temperature=0)
        second, took_second = created(client, input="And then?", previous_response_id=first.id, temperature=0)
        ingresses |= {took_first, took_second}
        history = [{"role": "user", "content": opening}, {"role": "assistant", "content": first.output_text},
                   {"role": "user", "content": "And then?"}]
        chat = client.chat.completions.create(model="tiny", messages=history, temperature=0)
        assert second.output_text == chat.choices[0].message.content  # the full-history chat's tokens
        assert second.usage.input_tokens == chat.usage.prompt_tokens
        # on the replica that ran turn 1: its prompt's blocks (16 tokens) found again, not just a template's start
        turn_one = first.usage.input_tokens // 16 * 16
        assert second.usage.input_tokens_details.cached_tokens >= turn_one - 16 > 0, (k, first.usage, second.usage)
        crossed += took_first != took_second
        if crossed >= 2:
            break
    assert len(ingresses) == 2 and crossed >= 2, "the proxy never sent a next turn to the other ingress replica"


def test_a_request_that_names_its_decoder_replica_runs_there(two_by_two):
    """What carries a next turn to its cache: GenerateRequest.affinity, honoured by the prefix
    router of whichever ingress replica routes it (new prompts alone spread over both replicas)."""
    from ray import serve

    from deployments.schema import GenerateRequest

    handle = serve.get_app_handle("responses")

    def replica(k, affinity=None):
        prompt = f"{k}: a prompt never seen before. " * 6  # blocks of 64 characters the routers count
        request = GenerateRequest(prompt=prompt, affinity=affinity,
                                  settings={"max_new_tokens": 1})
        return handle.generate.remote(request).result(timeout_s=60).replica

    spread = {replica(f"spread {k}") for k in range(8)}
    assert len(spread) == 2  # unseen prompts: both replicas
    target = sorted(spread)[0]
    assert {replica(f"pinned {k}", target) for k in range(8)} == {target}


def test_every_replica_reads_and_deletes_the_same_store(two_by_two):
    client, _ = two_by_two
    response, _ = created(client, input="remember me")
    seen = set()
    for _ in range(12):  # the proxy spreads these over both ingress replicas
        raw = client.responses.with_raw_response.retrieve(response.id)
        assert raw.parse().output_text == response.output_text
        items = client.responses.input_items.list(response.id)
        assert [[(part.type, part.text) for part in i.content] for i in items.data] == [[("input_text", "remember me")]]
        seen.add(raw.headers.get(INGRESS))
    client.responses.delete(response.id)
    for _ in range(4):
        with pytest.raises(openai.NotFoundError) as e:
            client.responses.create(model="tiny", input="x", previous_response_id=response.id)
        assert e.value.body["param"] == "previous_response_id"


def test_the_stream_ends_in_the_stored_response(two_by_two):
    client, _ = two_by_two
    events = list(client.responses.create(model="tiny", input="stream", stream=True, temperature=0))
    final = events[-1].response
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_background_response_outlives_its_client(two_by_two):
    client, url = two_by_two
    with httpx.Client(timeout=30) as gone:
        queued = gone.post(url + "/v1/responses", json={"model": "tiny", "input": "later", "background": True,
                                                         "temperature": 0}).json()
    assert queued["status"] == "queued"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = client.responses.retrieve(queued["id"])
        if found.status not in ("queued", "in_progress"):
            break
        time.sleep(0.1)
    alone = client.responses.create(model="tiny", input="later", temperature=0)
    assert found.status == alone.status and found.output_text == alone.output_text


CHOOSE = {"type": "function", "name": "g", "description": "pick one",  # short: the tiny model's context is 256
          "parameters": {"type": "object", "properties": {"y": {"enum": ["a", "b"]}}, "required": ["y"],
                         "additionalProperties": False}}


def test_a_function_call_and_its_output_continue_as_the_chat(two_by_two):
    """A named tool_choice holds the output to a call: a function_call item (its arguments
    streamed as deltas); its output as the next turn's function_call_output equals the chat whose
    messages carry that call and that tool result."""
    import json

    client, _ = two_by_two
    asked = dict(model="tiny", input="a or b?", tools=[CHOOSE], tool_choice={"type": "function", "name": "g"},
                 parallel_tool_calls=False,
                 max_output_tokens=100)
    for seed in range(6):  # a random model may not close the call within the budget
        called = client.responses.create(**asked, extra_body={"seed": seed})
        calls = [item for item in called.output if item.type == "function_call"]
        if calls:
            break
    (call,) = calls
    assert call.name == "g" and json.loads(call.arguments)["y"] in ("a", "b") and call.call_id.startswith("call_")
    events = list(client.responses.create(**asked, stream=True, extra_body={"seed": seed}))
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert [i.type for i in events[-1].response.output] == [i.type for i in called.output]
    answered = client.responses.create(model="tiny", previous_response_id=called.id, tools=[CHOOSE], temperature=0,
                                       input=[{"type": "function_call_output", "call_id": call.call_id, "output": "ok"}])
    chat_tools = [{"type": "function", "function": {k: CHOOSE[k] for k in ("name", "description", "parameters")}}]
    text_before = "".join(i.content[0].text for i in called.output if i.type == "message")
    chat = client.chat.completions.create(model="tiny", tools=chat_tools, temperature=0, messages=[
        {"role": "user", "content": "a or b?"},
        {"role": "assistant", "content": text_before or None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "g", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "ok"}])
    assert answered.usage.input_tokens == chat.usage.prompt_tokens
    assert answered.output_text == (chat.choices[0].message.content or "")


def test_text_format_holds_the_output_to_its_schema(two_by_two):
    import json

    client, _ = two_by_two
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    out = client.responses.create(model="tiny", input="a number", temperature=0, max_output_tokens=40, text={
        "format": {"type": "json_schema", "name": "number", "schema": schema, "strict": True}})
    assert out.status == "completed" and set(json.loads(out.output_text)) == {"n"}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", text={"format": {"type": "yaml"}})
    assert e.value.body["param"] == "text.format"


def test_a_background_response_whose_server_replica_dies_is_failed(serve_apps):
    """The colocated Server replica that runs a background response is killed: its record's
    heartbeat stops, and once STALE_SECONDS old every reader (GET, cancel, on the replica Serve
    starts in its place) says failed; it stayed in_progress until its TTL, a day."""
    import os
    import signal

    from ray import serve

    from conftest import ServeApps
    from deployments.app import build
    from deployments.services.response_store import STALE_SECONDS

    serve.run(build({**ServeApps.FAKE, "colocate": True, "step_seconds": 0.02}), name="dying", route_prefix="/dying")
    try:
        client = openai.OpenAI(base_url=serve_apps.url + "/dying/v1", api_key="unused", max_retries=0, timeout=30)
        running = client.responses.create(model="fake", input="forever", background=True, max_output_tokens=4000)
        while client.responses.retrieve(running.id).status == "queued":
            time.sleep(0.1)
        os.kill(serve.get_app_handle("dying").pid.remote().result(timeout_s=30), signal.SIGKILL)
        killed, found = time.monotonic(), None
        while time.monotonic() < killed + STALE_SECONDS + 60:
            try:
                found = client.responses.retrieve(running.id)
            except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
                pass  # no Server replica while Serve starts another
            if found is not None and found.status != "in_progress":
                break
            time.sleep(0.5)
        assert found.status == "failed" and "stopped" in found.error.message, found
        assert time.monotonic() - killed >= STALE_SECONDS - 1
        assert client.responses.cancel(running.id).status == "failed"
    finally:
        serve.delete("dying", _blocking=False)
