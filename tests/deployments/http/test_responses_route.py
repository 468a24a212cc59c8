"""/v1/responses through the openai client, on the ingress's routes in this process (the fake
engine: its outputs are known; deployments/fake.py): whole, streamed as typed events and in
the background; a next turn equal to the chat with the whole conversation; GET, DELETE,
input_items and cancel; every unknown id a 404 naming its field. The Ray Serve layout (two
ingress replicas sharing the store, the real model) is tests/deployments/app/test_serve_responses.py."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from fastapi import Request

from deployments.fake import fake_tokens

FAKE = dict(engine="fake", name="fake", slots=4, step_seconds=0.002)


@pytest.fixture
def routes():
    """The app's routes over a fake decoder and a store of their own, with an openai client."""
    from deployments.app import Decoder, api
    from deployments.http.decoder_calls import DecoderCalls
    from deployments.http.ingress_state import IngressState, replica_state
    from deployments.http.media import Media
    from deployments.local_handle import LocalHandle

    decoder = Decoder.func_or_class(FAKE)
    state = IngressState(DecoderCalls(LocalHandle(decoder), None, None, Media(False, 2**20)), None, 2**20)

    async def this_state():
        return state

    api.dependency_overrides[replica_state] = this_state
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=api), base_url="http://test")
    client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)
    yield client, state, decoder
    api.dependency_overrides.pop(replica_state)
    decoder.__del__()


class Skewed:
    """The store's clock: this machine's, `skew` seconds ahead (a test moves time on)."""

    def __init__(self):
        self.skew = 0.0

    def __call__(self):
        return time.time() + self.skew


@pytest.fixture
def replicas(tmp_path):
    """Two ingress replicas' routes over one fake decoder and one store (kept in a folder, on a
    clock a test moves), as Serve lays them out, served by uvicorn on a thread of its own (httpx's
    ASGI transport answers a stream only once it ended): the header x-replica picks the replica.
    (clients, states, decoder, clock, folder, on_server: runs a function on the server's loop)."""
    from deployments.app import Decoder, api
    from deployments.http.decoder_calls import DecoderCalls
    from deployments.http.ingress_state import IngressState, replica_state
    from deployments.http.media import Media
    from deployments.local_handle import LocalHandle
    from deployments.services.response_store import ResponseStore

    decoder, clock = Decoder.func_or_class(FAKE), Skewed()
    store = LocalHandle(ResponseStore(2**24, 3600, folder=str(tmp_path / "responses"), clock=clock))
    states = [IngressState(DecoderCalls(LocalHandle(decoder), None, None, Media(False, 2**20)), None, 2**20, store)
              for _ in range(2)]

    async def this_state(request: Request):
        return states[int(request.headers.get("x-replica", "0"))]

    api.dependency_overrides[replica_state] = this_state
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server, loop = uvicorn.Server(uvicorn.Config(api, log_level="warning")), asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    clients = [openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, default_headers={"x-replica": str(k)})
               for k in range(2)]
    yield clients, states, decoder, clock, tmp_path / "responses", loop.call_soon_threadsafe
    server.should_exit = True
    thread.join(10)
    loop.run_until_complete(cancelled_all())  # a killed owner's decoder call
    loop.close()
    sock.close()
    api.dependency_overrides.pop(replica_state)
    decoder.__del__()


async def cancelled_all():
    left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)


def killed(state):
    """The ingress replica's background runs gone with its process: cancelled, nothing more written."""
    def kill():
        for task in list(state.responses.background):
            task.cancel()
    return kill


async def started(client, response_id: str):
    """Once the response is in progress (its owner's task has begun)."""
    for _ in range(400):
        if (await client.responses.retrieve(response_id)).status == "in_progress":
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{response_id} never started")


async def ended(client, response_id: str):
    """The response once it has left queued and in_progress."""
    for _ in range(400):
        found = await client.responses.retrieve(response_id)
        if found.status not in ("queued", "in_progress"):
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"{response_id} still {found.status}")


def expected(messages: list[dict], max_new: int = 8) -> str:
    """The fake engine's answer to a chat (its template: 'role: content' lines, then 'assistant: ')."""
    prompt = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return "".join(map(chr, fake_tokens([ord(c) for c in prompt], 0, {"max_new_tokens": max_new})))


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_response_and_its_next_turn_equal_the_chats_with_that_history(routes):
    client, _, _ = routes

    async def go():
        first = await client.responses.create(model="fake", input="hello", instructions="be brief",
                                              max_output_tokens=6)
        assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
        assert first.output_text == expected([{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": "hello"}], 6)
        chat = await client.chat.completions.create(model="fake", max_tokens=6, messages=[
            {"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}])
        assert first.output_text == chat.choices[0].message.content
        assert first.usage.input_tokens == chat.usage.prompt_tokens and first.usage.output_tokens == 6
        # the next turn: the conversation without the old instructions (OpenAI's rule), then the new input
        second = await client.responses.create(model="fake", input=[{"role": "user", "content": [
            {"type": "input_text", "text": "again"}]}], previous_response_id=first.id, instructions="new rules")
        history = [{"role": "system", "content": "new rules"}, {"role": "user", "content": "hello"},
                   {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "again"}]
        assert second.output_text == expected(history) and second.previous_response_id == first.id
        third = await client.responses.create(model="fake", input="more", previous_response_id=second.id)
        assert third.output_text == expected(history[1:] + [{"role": "assistant", "content": second.output_text},
                                                            {"role": "user", "content": "more"}])
        items = await client.responses.input_items.list(second.id)
        assert [i.content[0].text for i in items.data] == ["again"] and not items.has_more
        assert (await client.responses.retrieve(third.id)).output_text == third.output_text

    run(go())


def test_the_stream_is_typed_events_ending_in_the_stored_response(routes):
    client, _, _ = routes

    async def go():
        events = [e async for e in await client.responses.create(model="fake", input="stream me", stream=True)]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]  # the fake engine runs to its 8 tokens: max_output_tokens
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == expected([{"role": "user", "content": "stream me"}])
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1].response
        assert final.output_text == text and final.usage.output_tokens == 8
        assert (await client.responses.retrieve(final.id)).model_dump() == final.model_dump()

    run(go())


def test_unknown_deleted_and_unstored_ids_are_404s_naming_the_field(routes):
    client, _, _ = routes

    async def go():
        kept = await client.responses.create(model="fake", input="a")
        unstored = await client.responses.create(model="fake", input="b", store=False)
        assert unstored.store is False
        await client.responses.delete(kept.id)
        for gone in (kept.id, unstored.id, "resp_unknown"):
            with pytest.raises(openai.NotFoundError) as e:
                await client.responses.create(model="fake", input="c", previous_response_id=gone)
            assert e.value.body["param"] == "previous_response_id" and gone in e.value.body["message"]
            with pytest.raises(openai.NotFoundError) as e:
                await client.responses.retrieve(gone)
            assert e.value.body["param"] == "response_id"
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(kept.id)

    run(go())


def test_a_background_response_runs_without_its_client_and_cancels(routes):
    client, state, decoder = routes

    async def go():
        queued = await client.responses.create(model="fake", input="later", background=True, max_output_tokens=20)
        assert queued.status == "queued" and queued.background
        await client.close()  # its client gone: the response runs on
        other = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", max_retries=0,
                                   http_client=httpx.AsyncClient(transport=client._client._transport,
                                                                 base_url="http://test"))
        for _ in range(200):
            found = await other.responses.retrieve(queued.id)
            if found.status not in ("queued", "in_progress"):
                break
            await asyncio.sleep(0.02)
        assert found.status == "incomplete"  # ran to its max_output_tokens
        assert found.output_text == expected([{"role": "user", "content": "later"}], 20)

        long = await other.responses.create(model="fake", input="forever", background=True, max_output_tokens=4000)
        await asyncio.sleep(0.2)
        assert (await other.responses.cancel(long.id)).status == "cancelled"
        for _ in range(100):
            found = await other.responses.retrieve(long.id)
            if decoder.generator.front.batcher.running == 0 and found.output:
                break
            await asyncio.sleep(0.05)
        assert found.status == "cancelled" and 0 < len(found.output_text) < 4000
        assert decoder.generator.front.batcher.running == 0  # its row freed
        done = await other.responses.cancel(queued.id)  # a finished one stays as it was
        assert done.status == "incomplete"
        with pytest.raises(openai.BadRequestError) as e:
            await other.responses.create(model="fake", input="x", background=True, store=False)
        assert e.value.body["param"] == "background"
        plain = await other.responses.create(model="fake", input="x")
        with pytest.raises(openai.BadRequestError) as e:
            await other.responses.cancel(plain.id)
        assert e.value.body["param"] == "response_id"
        await other.close()

    run(go())


def test_errors_name_the_responses_fields(routes):
    client, _, _ = routes

    async def go():
        cases = [(dict(input="x", max_output_tokens=-1), "max_output_tokens"),
                 (dict(input="x", max_output_tokens=10**6), "max_output_tokens"),  # over the context
                 (dict(input="x" * 5000), "input"),  # over the fake engine's 4096-token context
                 (dict(input=[{"role": "user", "content": "x"}, {"type": "web_search_call", "id": "w"}]), "input.1.type"),
                 (dict(input="x", extra_body={"max_tokens": 3}), "max_tokens"),
                 (dict(input="x", extra_body={"top_k": -5}), "top_k")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as e:
                await client.responses.create(model="fake", **kwargs)
            assert e.value.body["param"] == param and e.value.body["message"].startswith(param), e.value.body
            assert "messages" not in e.value.body["message"]

    run(go())


def test_a_long_text_input_runs_and_input_items_are_parts(routes):
    """A text `input` is one message of any length the context takes (it was held to 2,048
    characters, as a list of items is); input_items lists a message's text as its parts
    (input_text, an assistant's output_text), as OpenAI does and its SDK's types read."""
    client, _, _ = routes

    async def go():
        long = await client.responses.create(model="fake", input="x" * 3000)
        assert long.output_text == expected([{"role": "user", "content": "x" * 3000}])
        items = await client.responses.input_items.list(long.id)
        assert [i.model_dump(exclude_none=True) for i in items.data] == [
            {"id": items.data[0].id, "type": "message", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": "x" * 3000}]}]
        said = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
        turns = await client.responses.create(model="fake", input=said + [
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]}])
        assert turns.output_text == expected(said + [{"role": "user", "content": "again"}])
        listed = (await client.responses.input_items.list(turns.id, order="asc")).data
        assert [(i.role, i.content[0].type, i.content[0].text) for i in listed] == [
            ("user", "input_text", "hi"), ("assistant", "output_text", "hello"), ("user", "input_text", "again")]

    run(go())


def test_errors_name_the_field_the_request_sent(routes):
    client, _, _ = routes

    async def go():
        with pytest.raises(openai.BadRequestError) as e:  # past the context: most of it is the instructions
            await client.responses.create(model="fake", input="x", instructions="y" * 200_000)
        assert e.value.body["param"] == "instructions" and e.value.body["message"].startswith("instructions: ")
        for body in ({"model": "fake", "messages": [{"role": "user", "content": "x"}]},
                     {"model": "fake", "input": "x", "messages": [{"role": "user", "content": "x"}]}):
            answer = await client._client.post("http://test/v1/responses", json=body)
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == "messages", error
            assert error["message"] == "messages: not a field of /v1/responses; it takes input"

    run(go())


def test_a_background_stream_resumes_after_any_event_on_any_replica(replicas):
    """background with stream: the events as they come; the response runs on when its client
    leaves, and GET ?stream=true&starting_after=N (any replica: the store keeps the events)
    gives the events after N to the end, as OpenAI does."""
    (one, two), *_ = replicas

    async def go():
        head = []
        async for event in await one.responses.create(model="fake", input="go on", background=True, stream=True,
                                                      max_output_tokens=400):
            head.append(event)
            if event.sequence_number == 5:
                break  # the client's connection lost
        assert head[0].type == "response.created" and head[0].response.status == "queued"
        rid = head[0].response.id
        assert (await two.responses.retrieve(rid)).status == "in_progress"  # resumed while it runs
        rest = [e async for e in await two.responses.retrieve(rid, stream=True, starting_after=5)]
        events = head + rest
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.incomplete" and events[-1].response.id == rid
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == expected([{"role": "user", "content": "go on"}], 400) == events[-1].response.output_text
        again = [e async for e in await one.responses.retrieve(rid, stream=True)]  # from the start, once it ended
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
        assert (await two.responses.retrieve(rid)).model_dump() == events[-1].response.model_dump()
        polled = await one.responses.create(model="fake", input="x", background=True)
        with pytest.raises(openai.BadRequestError) as e:  # only a background stream's events are kept
            await two.responses.retrieve(polled.id, stream=True)
        assert e.value.body["param"] == "stream"
        await ended(two, polled.id)

    run(go())


def test_a_response_deleted_while_it_runs_stays_deleted(replicas):
    """DELETE of a running background response: gone for good, the run stopped, and its end not
    written back (in memory or in --response-folder)."""
    (one, two), states, decoder, _, folder, _ = replicas

    async def go():
        running = await one.responses.create(model="fake", input="forever", background=True, max_output_tokens=4000)
        await started(two, running.id)
        deleted = await two.responses.with_raw_response.delete(running.id)
        assert deleted.http_response.json() == {"id": running.id, "object": "response", "deleted": True}
        for _ in range(100):
            if not states[0].responses.background and decoder.generator.front.batcher.running == 0:
                break
            await asyncio.sleep(0.05)
        assert not states[0].responses.background and decoder.generator.front.batcher.running == 0  # stopped
        for client in (one, two):
            with pytest.raises(openai.NotFoundError):
                await client.responses.retrieve(running.id)
        assert not list(folder.iterdir())

    run(go())


def test_a_background_response_whose_owner_stopped_is_failed_everywhere(replicas):
    """The replica running a background response dies (its task gone, no end written): once its
    heartbeat is older than STALE_SECONDS, GET, cancel and previous_response_id all read it failed
    (it stayed in_progress until its TTL, a day)."""
    from deployments.services.response_store import STALE_SECONDS

    (one, two), states, _, clock, _, on_server = replicas

    async def go():
        running = await one.responses.create(model="fake", input="forever", background=True, max_output_tokens=1000)
        await started(two, running.id)
        on_server(killed(states[0]))
        await asyncio.sleep(0.1)
        assert (await two.responses.retrieve(running.id)).status == "in_progress"
        clock.skew += STALE_SECONDS + 1
        found = await two.responses.retrieve(running.id)
        assert found.status == "failed" and "stopped" in found.error.message
        assert (await two.responses.cancel(running.id)).status == "failed"
        after = await two.responses.create(model="fake", input="and now?", previous_response_id=running.id)
        assert after.status == "incomplete"  # continued, as any failed response is

    run(go())


def test_a_resumed_stream_of_a_stopped_owner_ends_failed(replicas):
    """A resumed stream of a background response whose owner stopped: the events it kept, then
    response.failed (its owner never wrote its end)."""
    from deployments.services.response_store import STALE_SECONDS

    (one, two), states, _, clock, _, on_server = replicas

    async def go():
        stream = await one.responses.create(model="fake", input="forever", background=True, stream=True,
                                            max_output_tokens=1000)
        first = await stream.__anext__()
        await asyncio.sleep(0.8)  # a beat or more: some of its events in the store
        on_server(killed(states[0]))
        await stream.close()
        clock.skew += STALE_SECONDS + 1
        events = [e async for e in await two.responses.retrieve(first.response.id, stream=True, starting_after=0)]
        assert [e.sequence_number for e in events] == list(range(1, len(events) + 1)) and len(events) > 3
        assert events[-1].type == "response.failed" and "stopped" in events[-1].response.error.message

    run(go())

