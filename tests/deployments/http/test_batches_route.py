"""/v1/files and /v1/batches through the openai client, on the ingress's routes in this process over
the fake engine (deployments/fake.py: its outputs are known) and a BatchService of its own whose
lines go back through the same routes (as deployments.app.Records sends them to answer_line).

Invariants: each output line is the answer the same request gets sent directly (status and body,
but for ids and times); a line the route refuses is an error line whose body names the field; the
lines reach the decoder at priority 1, direct requests at 0; statuses and request_counts follow the
batch; every unknown id is a 404 naming its field, a file over the limit a 413 naming `file`, a
purpose other than batch a 400 naming `purpose`; a batch whose runner stops resumes where it stopped
(every line answered once); a cancelled one stops its lines and keeps what it answered. The Ray
Serve layout (the runner beside an ingress that is killed) is tests/deployments/app/test_serve_batches.py.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import openai
import pytest

from deployments.fake import fake_tokens
from test_batch_run import same

FAKE = dict(engine="fake", name="fake", slots=4, step_seconds=0.002)
LIMIT = 4096  # the test server's file size limit, bytes


class Recording:
    """The decoder, noting the priority of every request it is given."""

    def __init__(self, decoder):
        self.decoder, self.priorities = decoder, []

    async def generate(self, request, *args):
        self.priorities.append(request.priority)
        return await self.decoder.generate(request, *args)

    async def stream(self, request, *args):
        self.priorities.append(request.priority)
        async for chunk in self.decoder.stream(request, *args):
            yield chunk

    def __getattr__(self, name):
        return getattr(self.decoder, name)


class Served:
    """The routes over a fake decoder and a BatchService in `folder`; `client()` an openai client
    on the loop that calls it (each test runs one loop: asyncio.run)."""

    def __init__(self, folder, step_seconds: float = 0.002, concurrency: int = 4, limit: int = LIMIT,
                 clock=time.time, **engine):
        from deployments.app import Decoder, api
        from deployments.batch.requests import BatchRequest
        from deployments.batch.route_client import RouteClient
        from deployments.http.batches import BatchCalls
        from deployments.http.decoder_calls import DecoderCalls
        from deployments.http.ingress_state import IngressState
        from deployments.http.media import Media
        from deployments.local_handle import LocalHandle
        from deployments.services.batches import BatchService

        self.api, self.folder = api, folder
        self.decoder = Decoder.func_or_class({**FAKE, "step_seconds": step_seconds, **engine})
        self.recording = Recording(self.decoder)
        lines = RouteClient(api)

        async def send(custom_id, url, body):
            self.sent += 1
            return await lines.answer(BatchRequest(custom_id, url, body))

        self.sent = 0
        self.service = BatchService(str(folder), concurrency, send, clock=clock)
        calls = DecoderCalls(LocalHandle(self.recording), None, None, Media(False, 2**20))
        self.state = IngressState(calls, None, 2**20, None, BatchCalls(LocalHandle(self.service), limit))

    def client(self) -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.api), base_url="http://test")
        return openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=http, max_retries=0)

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=self.api), base_url="http://test")


@pytest.fixture
def served(tmp_path):
    from deployments.app import api
    from deployments.http.ingress_state import replica_state

    made = []

    def make(step_seconds: float = 0.002, concurrency: int = 4, folder=None, **settings) -> Served:
        server = Served(folder or tmp_path, step_seconds, concurrency, **settings)
        made.append(server)

        async def this_state():
            return made[-1].state

        api.dependency_overrides[replica_state] = this_state
        return server

    yield make
    api.dependency_overrides.pop(replica_state, None)
    for server in made:
        server.decoder.__del__()


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines).encode()


async def finished(client, batch_id: str, seconds: float = 60):
    """The batch once it has ended (polled as a client does)."""
    for _ in range(int(seconds / 0.02)):
        batch = await client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"batch {batch_id} still {batch.status}")


async def lines_of(client, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    text = (await client.files.content(file_id)).text
    return {line["custom_id"]: line for line in map(json.loads, text.splitlines())}


def fake_text(prompt: str, seed: int = 0, **settings) -> str:
    return "".join(map(chr, fake_tokens([ord(c) for c in prompt], seed, settings)))


LINES = [
    {"custom_id": "greedy", "url": "/v1/completions", "body": {"model": "fake", "prompt": "The list", "temperature": 0}},
    {"custom_id": "seeded", "url": "/v1/completions",
     "body": {"model": "fake", "prompt": "A tuple", "seed": 5, "temperature": 0.9, "max_tokens": 12}},
    {"custom_id": "later", "url": "/v1/completions", "body": {"model": "fake", "prompt": "Mine", "priority": 3}},
    {"custom_id": "bad-field", "url": "/v1/completions", "body": {"model": "fake", "prompt": "x", "top_k": -9}},
    {"custom_id": "other-model", "url": "/v1/completions", "body": {"model": "gpt-4o", "prompt": "x"}},
]
CHAT = [{"custom_id": f"chat-{k}", "url": "/v1/chat/completions",
         "body": {"model": "fake", "messages": [{"role": "user", "content": f"hi {k}"}], "seed": k, "temperature": 1}}
        for k in range(3)]


def test_each_output_line_is_the_same_request_sent_directly(served):
    """The openai client's round trip: files.create, batches.create, batches.retrieve (polled),
    files.content; the 200s in the output file, the rest in the error file, each equal to the
    request sent directly; request_counts and the status times follow."""
    server = served()

    async def go():
        client = server.client()
        upload = await client.files.create(file=("requests.jsonl", jsonl(LINES)), purpose="batch")
        assert upload.purpose == "batch" and upload.bytes == len(jsonl(LINES)) and upload.filename == "requests.jsonl"
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        batch = await finished(client, batch.id)
        assert batch.status == "completed", batch.errors
        assert batch.request_counts.model_dump() == {"total": 5, "completed": 3, "failed": 2}
        assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
        assert batch.failed_at is None and batch.cancelled_at is None
        output, errors = await lines_of(client, batch.output_file_id), await lines_of(client, batch.error_file_id)
        assert set(output) == {"greedy", "seeded", "later"} and set(errors) == {"bad-field", "other-model"}
        async with server.http() as http:
            for line in LINES:
                got = {**output, **errors}[line["custom_id"]]
                direct = await http.post(line["url"], json=line["body"])
                assert got["error"] is None and got["response"]["status_code"] == direct.status_code, got
                same(got["response"]["body"], direct.json(), line["custom_id"])
        assert output["greedy"]["response"]["body"]["choices"][0]["text"] == fake_text("The list")
        assert output["seeded"]["response"]["body"]["choices"][0]["text"] == fake_text(
            "A tuple", 5, do_sample=True, max_new_tokens=12)
        assert errors["bad-field"]["response"]["status_code"] == 400
        assert errors["bad-field"]["response"]["body"]["error"]["param"] == "top_k"
        assert errors["other-model"]["response"]["status_code"] == 404
        for file_id, kind in ((batch.output_file_id, "output"), (batch.error_file_id, "error")):
            record = await client.files.retrieve(file_id)
            assert record.purpose == "batch_output" and record.filename == f"{batch.id}_{kind}.jsonl"
        assert [p.name for p in (server.folder / "batches").iterdir()] == [f"{batch.id}.json"]  # its answers: files

    asyncio.run(go())


def test_a_chat_batch_equals_the_chats_sent_directly(served):
    server = served()

    async def go():
        client = server.client()
        upload = await client.files.create(file=("chat.jsonl", jsonl(CHAT)), purpose="batch")
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")).id)
        assert batch.request_counts.completed == 3 and batch.error_file_id is None
        output = await lines_of(client, batch.output_file_id)
        async with server.http() as http:
            for line in CHAT:
                direct = (await http.post(line["url"], json=line["body"])).json()
                same(output[line["custom_id"]]["response"]["body"], direct, line["custom_id"])

    asyncio.run(go())


def test_batch_lines_reach_the_decoder_at_priority_one_and_direct_requests_at_zero(served):
    """GenerateRequest.priority: a batch line at 1 (one that asks a later priority keeps it), a
    request sent directly at 0, and vLLM's `priority` field of a request as it is given."""
    server = served()

    async def go():
        client = server.client()
        upload = await client.files.create(file=("p.jsonl", jsonl(LINES[:3])), purpose="batch")
        await finished(client, (await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                              completion_window="24h")).id)
        assert sorted(server.recording.priorities) == [1, 1, 3]
        server.recording.priorities.clear()
        await client.completions.create(model="fake", prompt="now")
        await client.completions.create(model="fake", prompt="now", extra_body={"priority": 7})
        assert server.recording.priorities == [0, 7]
        with pytest.raises(openai.BadRequestError) as e:
            await client.completions.create(model="fake", prompt="now", extra_body={"priority": -1})
        assert e.value.body["param"] == "priority"

    asyncio.run(go())


def test_files_list_retrieve_content_and_delete(served):
    server = served()

    async def go():
        client = server.client()
        made = [await client.files.create(file=(f"f{k}.jsonl", jsonl(LINES[k:k + 1])), purpose="batch")
                for k in range(3)]
        page = await client.files.list()
        assert [f.id for f in page.data] == [f.id for f in made[::-1]]  # newest first
        assert [f.id for f in (await client.files.list(order="asc", limit=2)).data] == [f.id for f in made[:2]]
        after = await client.files.list(order="asc", after=made[0].id)
        assert [f.id for f in after.data] == [f.id for f in made[1:]]
        async with server.http() as http:
            paged = (await http.get("/v1/files", params={"limit": 1})).json()
            assert paged["has_more"] and paged["first_id"] == made[2].id
            assert (await http.get("/v1/files", params={"purpose": "batch_output"})).json()["data"] == []
        assert (await client.files.retrieve(made[1].id)).filename == "f1.jsonl"
        assert (await client.files.content(made[1].id)).content == jsonl(LINES[1:2])
        deleted = await client.files.delete(made[1].id)
        assert deleted.deleted and deleted.id == made[1].id
        assert [f.id for f in (await client.files.list()).data] == [made[2].id, made[0].id]
        for call in (client.files.retrieve, client.files.content, client.files.delete):
            with pytest.raises(openai.NotFoundError) as e:
                await call(made[1].id)
            assert e.value.body["param"] == "file_id"

    asyncio.run(go())


def test_a_file_over_the_limit_or_of_another_purpose_is_refused_by_name(served):
    server = served()

    async def go():
        client = server.client()
        for size in (LIMIT + 1, 100 * LIMIT):  # just over (read, then refused), far over (refused by its length)
            with pytest.raises(openai.APIStatusError) as e:
                await client.files.create(file=("big.jsonl", b"x" * size), purpose="batch")
            assert e.value.status_code == 413 and e.value.body["param"] == "file"
            assert e.value.body["code"] == "file_too_large" and str(LIMIT) in e.value.body["message"]
        assert (await client.files.create(file=("edge.jsonl", b"x" * LIMIT), purpose="batch")).bytes == LIMIT
        with pytest.raises(openai.BadRequestError) as e:
            await client.files.create(file=("t.jsonl", b"{}"), purpose="fine-tune")
        assert e.value.body["param"] == "purpose"
        async with server.http() as http:
            none = await http.post("/v1/files", files={"file": ("t.jsonl", b"{}")})
            assert none.status_code == 400 and none.json()["error"]["param"] == "purpose"
            no_file = await http.post("/v1/files", data={"purpose": "batch"}, files={"other": ("t", b"")})
            assert no_file.status_code == 400 and no_file.json()["error"]["param"] == "file"
        assert len((await client.files.list()).data) == 1  # nothing half-kept

    asyncio.run(go())


def test_unknown_ids_are_404s_naming_the_field(served):
    server = served()

    async def go():
        client = server.client()
        for call, param in ((client.batches.retrieve, "batch_id"), (client.batches.cancel, "batch_id"),
                            (client.files.retrieve, "file_id"), (client.files.content, "file_id")):
            for unknown in ("batch_0123", "file-abc", "nothing here"):
                with pytest.raises(openai.NotFoundError) as e:
                    await call(unknown)
                assert e.value.body["param"] == param, (call, unknown)
        with pytest.raises(openai.NotFoundError) as e:
            await client.batches.create(input_file_id="file-0", endpoint="/v1/completions", completion_window="24h")
        assert e.value.body["param"] == "input_file_id"

    asyncio.run(go())


def test_a_create_names_its_bad_field(served):
    server = served()

    async def go():
        client = server.client()
        upload = await client.files.create(file=("r.jsonl", jsonl(LINES[:1])), purpose="batch")
        for fields, param in (({"endpoint": "/v1/audio/transcriptions"}, "endpoint"),
                              ({"completion_window": "1h"}, "completion_window"),
                              ({"metadata": {"k": "v" * 600}}, "metadata.k")):
            with pytest.raises(openai.BadRequestError) as e:
                await client.batches.create(**{"input_file_id": upload.id, "endpoint": "/v1/completions",
                                               "completion_window": "24h", **fields})
            assert e.value.body["param"] == param
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id)
        with pytest.raises(openai.BadRequestError) as e:  # an output file is no batch's input
            await client.batches.create(input_file_id=batch.output_file_id, endpoint="/v1/completions",
                                        completion_window="24h")
        assert e.value.body["param"] == "input_file_id"
        with pytest.raises(openai.BadRequestError) as e:  # a completed batch cannot be cancelled
            await client.batches.cancel(batch.id)
        assert e.value.body["param"] == "batch_id"
        listed = await client.batches.list()
        assert [b.id for b in listed.data] == [batch.id]

    asyncio.run(go())


def test_an_input_file_that_is_no_batch_fails_it_with_each_lines_error(served):
    server = served()
    text = (b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
            b"not json\n"
            b'{"method": "POST", "url": "/v1/completions", "body": {}}\n'
            b'{"custom_id": "b", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
            b"\n"
            b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}\n'
            b'{"custom_id": "c", "method": "GET", "url": "/v1/completions", "body": {}}\n')

    async def go():
        client = server.client()
        upload = await client.files.create(file=("bad.jsonl", text), purpose="batch")
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id)
        assert batch.status == "failed" and batch.failed_at is not None and batch.in_progress_at is None
        found = [(e.line, e.param) for e in batch.errors.data]
        assert found == [(2, None), (3, "custom_id"), (4, "url"), (6, "custom_id"), (7, "method")]
        assert batch.output_file_id is None and batch.error_file_id is None and server.sent == 0
        empty = await client.files.create(file=("empty.jsonl", b"\n"), purpose="batch")
        batch = await finished(client, (await client.batches.create(
            input_file_id=empty.id, endpoint="/v1/completions", completion_window="24h")).id)
        assert batch.status == "failed" and batch.errors.data[0].param == "input_file_id"

    asyncio.run(go())


def test_a_cancelled_batch_stops_its_lines_and_keeps_what_it_answered(served):
    server = served(step_seconds=0.01, concurrency=2)
    lines = [{"custom_id": f"c{k}", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": "ab", "max_tokens": 5 if k < 2 else 2000}} for k in range(12)]

    async def go():
        client = server.client()
        upload = await client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        for _ in range(500):  # the two short lines answered, two long ones running
            batch = await client.batches.retrieve(batch.id)
            if batch.request_counts.completed == 2 and server.decoder.generator.batcher.running == 2:
                break
            await asyncio.sleep(0.01)
        with pytest.raises(openai.BadRequestError):  # the input of a running batch stays
            await client.files.delete(upload.id)
        cancelling = await client.batches.cancel(batch.id)
        assert cancelling.status == "cancelling" and cancelling.cancelling_at is not None
        batch = await finished(client, batch.id)
        assert batch.status == "cancelled" and batch.completed_at is None
        assert batch.request_counts.model_dump() == {"total": 12, "completed": 2, "failed": 0}
        assert set(await lines_of(client, batch.output_file_id)) == {"c0", "c1"} and batch.error_file_id is None
        for _ in range(200):  # the long lines' rows freed at the next step
            if server.decoder.generator.batcher.running == 0:
                break
            await asyncio.sleep(0.01)
        assert server.decoder.generator.batcher.running == 0
        assert (await client.batches.cancel(batch.id)).status == "cancelled"
        assert (await client.files.delete(upload.id)).deleted

    asyncio.run(go())


def test_a_batch_resumes_where_its_stopped_runner_left_it(served, tmp_path):
    """A runner that stops midway (its replica replaced) leaves the batch in_progress on disk; the
    next one resumes it: each line answered once, a line cut short by the stop answered again."""
    lines = [{"custom_id": f"r{k}", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"p{k}", "max_tokens": 30}} for k in range(16)]
    first = served(step_seconds=0.01, concurrency=2)

    async def start():
        client = first.client()
        upload = await client.files.create(file=("r.jsonl", jsonl(lines)), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        while (await client.batches.retrieve(batch.id)).request_counts.completed < 4:
            await asyncio.sleep(0.01)
        first.service.close()  # stopped midway, as a replica that goes away
        return batch.id

    batch_id = asyncio.run(start())
    output = tmp_path / "batches" / f"{batch_id}.output.jsonl"
    kept = output.read_text().splitlines()
    assert 4 <= len(kept) < len(lines)
    with output.open("a") as out:  # the stop cut a line short
        out.write('{"id": "batch_req_x", "custom_id": "r15", "resp')
    second = served(folder=tmp_path)

    async def resume():
        second.service.start()
        client = second.client()
        batch = await finished(client, batch_id)
        assert batch.status == "completed" and batch.request_counts.model_dump() == {
            "total": 16, "completed": 16, "failed": 0}
        text = (await client.files.content(batch.output_file_id)).text
        ids = [json.loads(line)["custom_id"] for line in text.splitlines()]
        assert sorted(ids) == sorted(line["custom_id"] for line in lines)  # each once
        assert text.splitlines()[:len(kept)] == kept  # what the first runner answered, kept as it was
        assert second.sent == len(lines) - len(kept)

    asyncio.run(resume())


def test_without_a_folder_the_service_makes_a_temporary_one_when_first_used_and_removes_it():
    """An application whose Files and Batches API is never called makes no folder; one that is
    used keeps a temporary folder until the service closes (its replica stops)."""
    from deployments.services.batches import BatchService

    service = BatchService(None, 2, send=None)
    assert service.root is None
    assert asyncio.run(service.file_page(None, None, 10, "desc"))["data"] == []
    root = service.root
    assert root.is_dir() and (root / "files").is_dir() and (root / "batches").is_dir()
    service.close()
    assert not root.exists()


def test_the_priority_field_is_the_decoders():
    from deployments.http.openai import ChatCompletionRequest, CompletionRequest
    from deployments.http.to_decoder import generate_request
    from deployments.http.validation import parse

    assert generate_request(parse(CompletionRequest, dict(model="m", prompt="a")), "a")["priority"] == 0
    chat = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}], priority=2))
    assert generate_request(chat)["priority"] == 2
