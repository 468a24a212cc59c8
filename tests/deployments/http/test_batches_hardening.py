"""/v1/files and /v1/batches at their edges, through the routes in this process (the `served`
fixture of test_batches_route.py: the fake engine, a BatchService of its own).

Invariants: a batch whose every line failed for a server error is `completed` with every line
counted failed, no output file and an error file (OpenAI's report of one); a DELETE between two
pieces of a content read leaves that read whole (its Content-Length is what comes); an upload
with no Content-Length is refused (413) once its file passes the limit, and the server reads,
and the store keeps, no more of it than the limit; the runner reads a batch's input a block at a
time (a file of 8 MB never becomes its size in Python objects); the folder given is the server
user's alone (0700, files 0600); files expire as OpenAI's (`expires_at`: 30 days, or as the
upload or the batch says) and ended batch records go after the same 30 days or beyond
MAX_ENDED_BATCHES; a batch's lines never take an interactive request's place in the decoder's
queue (`max_waiting`).
"""

from __future__ import annotations

import asyncio
import json
import stat
import tracemalloc

import openai
import pytest

from test_batches_route import LIMIT, finished, jsonl, lines_of, served  # noqa: F401 - served: the fixture

DAY = 24 * 3600


def completions(count: int, max_tokens: int = 4, prompt: str = "ab") -> list[dict]:
    return [{"custom_id": f"l{k}", "url": "/v1/completions",
             "body": {"model": "fake", "prompt": prompt, "max_tokens": max_tokens}} for k in range(count)]


def test_a_batch_whose_every_line_failed_is_completed_with_every_line_counted_failed(served):
    """OpenAI's Batch API: `failed` is a batch whose input failed validation; one that ran to
    its end is `completed`, its lines' fate in request_counts and the error file (a batch whose
    every request failed reads completed, completed 0, failed N, output_file_id null)."""
    server = served()

    async def broken(custom_id, url, body):
        raise ModuleNotFoundError("No module named 'jinja2'")

    server.service.send = broken

    async def go():
        client = server.client()
        upload = await client.files.create(file=("r.jsonl", jsonl(completions(3))), purpose="batch")
        batch = await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id)
        assert batch.status == "completed" and batch.errors is None and batch.failed_at is None
        assert batch.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
        assert batch.output_file_id is None and batch.error_file_id is not None
        errors = await lines_of(client, batch.error_file_id)
        assert sorted(errors) == ["l0", "l1", "l2"]
        assert all(e["response"] is None and e["error"]["code"] == "server_error"
                   and "ModuleNotFoundError" in e["error"]["message"] for e in errors.values())

    asyncio.run(go())


def test_a_delete_between_two_pieces_of_a_content_read_leaves_that_read_whole(served, monkeypatch):
    from deployments.http import batches

    monkeypatch.setattr(batches, "PIECE_BYTES", 64)
    server = served()
    data = jsonl(completions(20))
    deleted = []
    piece = server.service.file_piece

    async def piece_then_delete(*args):
        out = await piece(*args)
        if not deleted:  # the race forced: a DELETE lands between the first piece and the second
            deleted.append(await server.service.delete_file(upload.id))
        return out

    server.service.file_piece = piece_then_delete

    async def go():
        nonlocal upload
        client = server.client()
        upload = await client.files.create(file=("r.jsonl", data), purpose="batch")
        async with server.http() as http:
            read = await http.get(f"/v1/files/{upload.id}/content")
            assert read.status_code == 200 and deleted
            assert int(read.headers["content-length"]) == len(data) and read.content == data
            assert (await http.get(f"/v1/files/{upload.id}/content")).status_code == 404  # gone for the next read
        assert server.service.files.reads == {}  # the read was closed

    upload = None
    asyncio.run(go())


def multipart(fields: dict[str, str], filename: str, chunks, boundary: str = "b0undary"):
    """A multipart body as an async iterator of its pieces (httpx sends it chunked, no
    Content-Length): the fields, then the file's `chunks`."""
    async def body():
        for name, value in fields.items():
            yield (f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n').encode()
        yield (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
               f"Content-Type: application/octet-stream\r\n\r\n").encode()
        for chunk in chunks:
            yield chunk
        yield f"\r\n--{boundary}--\r\n".encode()
    return body(), {"content-type": f"multipart/form-data; boundary={boundary}"}


def test_a_chunked_upload_past_the_limit_is_refused_before_the_rest_is_read_or_stored(served):
    server = served()
    appended = []
    append = server.service.append_file

    async def counted(file_id, piece):
        appended.append(len(piece))
        await append(file_id, piece)

    server.service.append_file = counted
    sent, chunk = [], b"x" * 1024

    def chunks(count):
        for _ in range(count):
            sent.append(len(chunk))
            yield chunk

    async def go():
        async with server.http() as http:
            body, headers = multipart({"purpose": "batch"}, "big.jsonl", chunks(100 * LIMIT // 1024))
            refused = await http.post("/v1/files", content=body, headers=headers)
            assert "content-length" not in refused.request.headers
            assert refused.status_code == 413, refused.text
            assert refused.json()["error"]["param"] == "file" and str(LIMIT) in refused.json()["error"]["message"]
            assert sum(sent) <= LIMIT + 2 * len(chunk)  # read no further than the limit (and the chunk in flight)
            assert sum(appended) <= LIMIT  # the store never got more than the limit
            body, headers = multipart({"purpose": "batch"}, "edge.jsonl", [b"y" * LIMIT])
            kept = await http.post("/v1/files", content=body, headers=headers)
            assert kept.status_code == 200 and kept.json()["bytes"] == LIMIT, kept.text
            body, headers = multipart({"purpose": "batch", "expires_after[anchor]": "created_at",
                                       "expires_after[seconds]": "60"}, "r.jsonl", [b"{}"])
            early = await http.post("/v1/files", content=body, headers=headers)
            assert early.status_code == 400 and early.json()["error"]["param"] == "expires_after.seconds"
        files = server.service.files
        assert [r["bytes"] for r in files.records.values()] == [LIMIT] and not files.uploads  # nothing half-kept
        assert sorted(p.suffix for p in files.folder.iterdir()) == [".data", ".json"]

    asyncio.run(go())


def test_the_runner_reads_a_batch_input_a_block_at_a_time(served):
    """An 8 MB input file of 8,000 requests: validating it and running its lines holds a block of
    lines (and the custom_ids), never the file's requests all at once."""
    server = served(limit=16 * 2**20, step_seconds=0.05)
    lines = completions(8000, prompt="a" * 900)

    async def go():
        client = server.client()
        upload = await client.files.create(file=("big.jsonl", jsonl(lines)), purpose="batch")
        tracemalloc.start()
        try:
            batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                completion_window="24h")
            for _ in range(2000):
                batch = await client.batches.retrieve(batch.id)
                if batch.status == "in_progress" and batch.request_counts.completed >= 4:
                    break
                await asyncio.sleep(0.01)
            assert batch.request_counts.total == 8000
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        await client.batches.cancel(batch.id)
        assert (await finished(client, batch.id)).status == "cancelled"
        assert peak < 3 * 2**20, f"{peak / 2**20:.1f} MiB traced while an 8 MB input ran"

    asyncio.run(go())


def test_the_folder_given_and_what_it_holds_are_the_server_users_alone(served, tmp_path):
    given = tmp_path / "given"
    given.mkdir(mode=0o755)
    given.chmod(0o755)
    server = served(folder=given)

    async def go():
        client = server.client()
        upload = await client.files.create(file=("r.jsonl", jsonl(completions(2))), purpose="batch")
        await finished(client, (await client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")).id)

    asyncio.run(go())
    folders = [given, *[p for p in given.rglob("*") if p.is_dir()]]
    files = [p for p in given.rglob("*") if p.is_file()]
    assert len(folders) == 3 and len(files) == 5  # the input and the output: data and record each; the batch's record
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in folders} == {"0o700"}
    assert {oct(stat.S_IMODE(p.stat().st_mode)) for p in files} == {"0o600"}, {p.name: oct(p.stat().st_mode)
                                                                            for p in files}


def test_files_expire_as_openai_s_and_ended_batches_go_after_them_or_past_the_count(served, monkeypatch):
    from deployments.services import batches

    now = [1_000_000.0]
    server = served(clock=lambda: now[0])

    async def go():
        client = server.client()
        kept = await client.files.create(file=("a.jsonl", jsonl(completions(2))), purpose="batch")
        brief = await client.files.create(file=("b.jsonl", jsonl(completions(1))), purpose="batch",
                                          expires_after={"anchor": "created_at", "seconds": 3600})
        assert kept.expires_at == kept.created_at + 30 * DAY and brief.expires_at == brief.created_at + 3600
        batch = await finished(client, (await client.batches.create(
            input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 7200})).id)
        output = await client.files.retrieve(batch.output_file_id)
        assert output.expires_at == output.created_at + 7200
        with pytest.raises(openai.BadRequestError) as e:
            await client.batches.create(input_file_id=kept.id, endpoint="/v1/completions", completion_window="24h",
                                        output_expires_after={"anchor": "created_at", "seconds": 10})
        assert e.value.body["param"] == "output_expires_after.seconds"

        now[0] += 3601
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(brief.id)
        assert (await client.files.content(batch.output_file_id)).content  # its 2 hours not over yet
        now[0] += 3600
        with pytest.raises(openai.NotFoundError):
            await client.files.content(batch.output_file_id)
        assert (await client.batches.retrieve(batch.id)).status == "completed"
        now[0] += 30 * DAY
        for call, gone in ((client.files.retrieve, kept.id), (client.batches.retrieve, batch.id)):
            with pytest.raises(openai.NotFoundError):
                await call(gone)
        assert (await client.files.list()).data == [] and (await client.batches.list()).data == []
        assert list(server.service.folder.iterdir()) == [] and list(server.service.files.folder.iterdir()) == []

        monkeypatch.setattr(batches, "MAX_ENDED_BATCHES", 2)
        source = await client.files.create(file=("c.jsonl", jsonl(completions(1))), purpose="batch")
        made = [(await finished(client, (await client.batches.create(
            input_file_id=source.id, endpoint="/v1/completions", completion_window="24h")).id)).id for _ in range(3)]
        now[0] += batches.SWEEP_SECONDS
        assert [b.id for b in (await client.batches.list()).data] == made[:0:-1]  # the two newest

    asyncio.run(go())


def test_a_batch_s_lines_never_take_an_interactive_request_s_place_in_the_queue(served):
    """max_waiting 2 and one slot: a batch keeps 8 lines in flight (7 waiting in the decoder),
    and two interactive requests sent beside them are both answered, not 503."""
    server = served(step_seconds=0.01, concurrency=8, slots=1, max_waiting=2)

    async def go():
        client = server.client()
        upload = await client.files.create(file=("r.jsonl", jsonl(completions(16, max_tokens=20))), purpose="batch")
        batch = await client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                            completion_window="24h")
        batcher = server.decoder.generator.batcher
        for _ in range(500):
            if batcher.waiting >= 6:
                break
            await asyncio.sleep(0.01)
        assert batcher.waiting >= 6  # the lines wait past max_waiting
        async with server.http() as http:
            answers = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "fake", "prompt": "now", "max_tokens": 2}) for _ in range(2)))
        assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
        batch = await finished(client, batch.id)
        assert batch.request_counts.completed == 16

    asyncio.run(go())


def test_an_upload_without_a_file_or_with_two_is_refused_by_name(served):
    server = served()

    async def go():
        async with server.http() as http:
            body, headers = multipart({"purpose": "batch"}, "r.jsonl", [b"{}"])
            text = b"".join([piece async for piece in body])
            twice = text.replace(b"--b0undary--", b'--b0undary\r\nContent-Disposition: form-data; name="file"; '
                                                  b'filename="s"\r\n\r\n{}\r\n--b0undary--')
            refused = await http.post("/v1/files", content=twice, headers=headers)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "file"
            cut = await http.post("/v1/files", content=text[:-30], headers=headers)
            assert cut.status_code == 400 and cut.json()["error"]["param"] == "file", cut.text
            plain = await http.post("/v1/files", content=json.dumps({"purpose": "batch"}),
                                    headers={"content-type": "application/json"})
            assert plain.status_code == 400
        assert not server.service.files.records and not server.service.files.uploads

    asyncio.run(go())
