"""/v1/responses through the openai client, on the ingress's routes in this process (the fake
engine: its outputs are known; deployments/fake.py): whole, streamed as typed events and in
the background; a next turn equal to the chat with the whole conversation; GET, DELETE,
input_items and cancel; every unknown id a 404 naming its field. The Ray Serve layout (two
ingress replicas sharing the store, the real model) is tests/deployments/app/test_serve_responses.py."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

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
