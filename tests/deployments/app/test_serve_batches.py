"""The Files and Batches API on Ray Serve, apps on the session's Ray (conftest.serve_apps).

`batches`: what `raymuter serve` runs for a text model (the tiny real model, the routes, the
decoder and the records in one Server replica, its batching loop in a child process), with a batch folder: the
openai client's round trip (files.create, batches.create, batches.retrieve polled,
files.content), each output line equal to the same request sent directly to the same server,
greedy and seeded, completions, chat and responses, a line refused by name in the error file.

`batches-fake`: the fake engine (outputs known) in the two-deployment layout: the Records
replica runs its lines through the ingress's routes, so a batch outlives an ingress replica that
is killed, a redeploy that replaces the ingress and the decoder, and a Records replica that is
killed (the next one resumes it from the folder): every line answered once, as it would be alone.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import pytest

from conftest import ServeApps
from test_batch_run import LINES, same
from test_serve import fake_text

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
FAKE = {**ServeApps.FAKE, "step_seconds": 0.01}


@pytest.fixture(scope="module")
def apps(serve_apps, tmp_path_factory):
    from ray import serve

    from deployments.app import build

    real = {**ServeApps.REAL, "model": str(serve_apps.real_model), "colocate": True, "engine_process": True,
            "records": "server", "batch_folder": str(tmp_path_factory.mktemp("real-batches"))}
    fake = {**FAKE, "batch_folder": str(tmp_path_factory.mktemp("fake-batches"))}
    serve.run(build(real), name="batches", route_prefix="/batches")
    serve.run(build(fake), name="batches-fake", route_prefix="/batches-fake")
    yield {"real": serve_apps.url + "/batches", "fake": serve_apps.url + "/batches-fake", "fake_config": fake}
    serve.delete("batches", _blocking=False)
    serve.delete("batches-fake", _blocking=False)


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines).encode()


def finished(client, batch_id: str, seconds: float = 300, seen: list | None = None):
    """The batch once it has ended, polled as a client does (through a restarting replica: its
    503s and dropped connections waited out); each status seen in `seen`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
            continue
        if seen is not None and (not seen or seen[-1] != batch.status):
            seen.append(batch.status)
        if batch.status in ("completed", "failed", "cancelled"):
            return batch
        time.sleep(0.05)
    raise AssertionError(f"batch {batch_id} did not end in {seconds} s")


def output_of(client, batch) -> dict[str, dict]:
    lines = {}
    for file_id in (batch.output_file_id, batch.error_file_id):
        if file_id is not None:
            for text in client.files.content(file_id).text.splitlines():
                line = json.loads(text)
                assert line["custom_id"] not in lines, f"{line['custom_id']} answered twice"
                lines[line["custom_id"]] = line
    return lines


COMPLETIONS = [line for line in LINES if line["url"] == "/v1/completions"] + [
    {"custom_id": "prompts", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": ["The dict", "A set"], "n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 8}}]
CHATS = [line for line in LINES if line["url"] == "/v1/chat/completions"] + [
    {"custom_id": "chat-seeded", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "a list"}], "seed": 11, "temperature": 0.8}}]
RESPONSES = [line for line in LINES if line["url"] == "/v1/responses"]


@pytest.mark.parametrize("endpoint, lines", [("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHATS),
                                             ("/v1/responses", RESPONSES)], ids=["completions", "chat", "responses"])
def test_each_output_line_is_the_same_request_sent_directly(apps, endpoint, lines):
    client = client_of(apps["real"])
    upload = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    seen = []
    batch = finished(client, batch.id, seen=seen)
    assert batch.status == "completed" and seen[-1] == "completed", (batch.errors, seen)
    failed = sum(1 for line in lines if line["custom_id"] == "bad-field")
    assert batch.request_counts.model_dump() == {"total": len(lines), "completed": len(lines) - failed,
                                                 "failed": failed}
    found = output_of(client, batch)
    assert set(found) == {line["custom_id"] for line in lines}
    with httpx.Client(timeout=120) as direct:
        for line in lines:
            got, answer = found[line["custom_id"]], direct.post(apps["real"] + line["url"], json=line["body"])
            assert got["error"] is None and got["response"]["status_code"] == answer.status_code, got
            same(got["response"]["body"], answer.json(), line["custom_id"])
    if failed:
        assert found["bad-field"]["response"]["body"]["error"]["param"] == "top_k"
        assert client.files.content(batch.error_file_id).text.count("\n") == 1


def test_files_and_batches_are_listed_and_refused_by_name_over_http(apps):
    client = client_of(apps["real"])
    upload = client.files.create(file=("one.jsonl", jsonl(COMPLETIONS[:1])), purpose="batch")
    assert upload.id in [f.id for f in client.files.list(purpose="batch").data]
    assert client.files.content(upload.id).content == jsonl(COMPLETIONS[:1])
    with pytest.raises(openai.BadRequestError) as e:
        client.files.create(file=("one.jsonl", b"{}"), purpose="assistants")
    assert e.value.body["param"] == "purpose"
    with pytest.raises(openai.NotFoundError) as e:
        client.batches.retrieve("batch_" + "0" * 32)
    assert e.value.body["param"] == "batch_id"
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    assert batch.id in [b.id for b in client.batches.list(limit=100).data]
    finished(client, batch.id)
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError) as e:
        client.files.retrieve(upload.id)
    assert e.value.body["param"] == "file_id"


def test_a_keyed_servers_batch_lines_carry_its_key(serve_apps):
    """The session's guarded app (an API key, one slot, a small queue): the lines reach its routes
    with its key (the runner holds none), and every route of the API asks for it."""
    client = openai.OpenAI(base_url=serve_apps.guarded + "/v1", api_key="sesame", max_retries=0, timeout=60)
    lines = [{"custom_id": f"k{k}", "url": "/v1/completions", "body": {"model": "fake", "prompt": f"k{k}",
                                                                       "max_tokens": 3}} for k in range(3)]
    upload = client.files.create(file=("keyed.jsonl", jsonl(lines)), purpose="batch")
    batch = finished(client, client.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                                   completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert output_of(client, batch)["k1"]["response"]["body"]["choices"][0]["text"] == fake_text("k1", max_new_tokens=3)
    for path in ("/v1/files", f"/v1/files/{upload.id}/content", "/v1/batches", f"/v1/batches/{batch.id}"):
        assert httpx.get(serve_apps.guarded + path, timeout=30).status_code == 401, path


FAKE_LINES = [{"custom_id": f"f{k}", "url": "/v1/completions",
               "body": {"model": "fake", "prompt": f"line {k}", "max_tokens": 30, "seed": k, "temperature": 1}}
              for k in range(48)]


def each_line_once_as_alone(client, batch) -> None:
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.model_dump() == {"total": len(FAKE_LINES), "completed": len(FAKE_LINES), "failed": 0}
    found = output_of(client, batch)
    assert set(found) == {line["custom_id"] for line in FAKE_LINES}
    for line in FAKE_LINES:
        k = int(line["custom_id"][1:])
        text = found[line["custom_id"]]["response"]["body"]["choices"][0]["text"]
        assert text == fake_text(f"line {k}", k, do_sample=True, max_new_tokens=30), line["custom_id"]


def started_batch(url: str, answered: int = 6):
    """The fake app's batch of FAKE_LINES, once `answered` lines are in."""
    client = client_of(url)
    upload = client.files.create(file=("fake.jsonl", jsonl(FAKE_LINES)), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(batch.id).request_counts.completed < answered:
        assert time.monotonic() < deadline, "the batch did not get going"
        time.sleep(0.05)
    return client, batch


def pid_of(deployment: str, app: str) -> int:
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=app).pid.remote().result(timeout_s=60)


def test_a_batch_outlives_its_ingress_replica_killed(apps):
    client, batch = started_batch(apps["fake"])
    pid = pid_of("Ingress", "batches-fake")
    os.kill(pid, signal.SIGKILL)
    mid = client_of(apps["fake"])
    batch = finished(mid, batch.id)
    each_line_once_as_alone(mid, batch)
    assert pid_of("Ingress", "batches-fake") != pid  # a new ingress replica took the lines after the kill


def test_a_batch_outlives_a_redeploy_of_the_ingress_and_decoder(apps):
    from ray import serve

    from deployments.app import build

    before = pid_of("Ingress", "batches-fake"), pid_of("Decoder", "batches-fake")
    client, batch = started_batch(apps["fake"])
    serve.run(build({**apps["fake_config"], "stream_interval_ms": 11.0}), name="batches-fake",
              route_prefix="/batches-fake")  # their config changed: both replaced (the old ones drain)
    each_line_once_as_alone(client, finished(client, batch.id))
    after = pid_of("Ingress", "batches-fake"), pid_of("Decoder", "batches-fake")
    assert after[0] != before[0] and after[1] != before[1]


def test_a_killed_batches_replica_is_resumed_by_the_next_from_its_folder(apps):
    client, batch = started_batch(apps["fake"])
    pid = pid_of("Records", "batches-fake")
    os.kill(pid, signal.SIGKILL)
    batch = finished(client, batch.id)
    each_line_once_as_alone(client, batch)
    assert pid_of("Records", "batches-fake") != pid


def test_records_in_the_server_replica_outlive_it_through_their_folders(serve_apps, tmp_path):
    """records 'server' (`raymuter serve`'s default with one Server replica, which gives both
    folders): no Records deployment; the Server replica Serve starts in place of a killed one
    reads the stored responses back and resumes the batch from the folders, every line answered once."""
    from ray import serve

    from deployments.app import build

    config = {**FAKE, "colocate": True, "records": "server", "batch_folder": str(tmp_path / "batches"),
              "response_folder": str(tmp_path / "responses")}
    serve.run(build(config), name="in-server", route_prefix="/in-server")
    try:
        assert set(serve.status().applications["in-server"].deployments) == {"Server"}
        url = serve_apps.url + "/in-server"
        stored = client_of(url).responses.create(model="fake", input="hello", max_output_tokens=5)
        client, batch = started_batch(url)
        pid = pid_of("Server", "in-server")
        os.kill(pid, signal.SIGKILL)
        batch = finished(client, batch.id)
        each_line_once_as_alone(client, batch)
        assert stored.output_text and client.responses.retrieve(stored.id).output_text == stored.output_text
        assert pid_of("Server", "in-server") != pid
    finally:
        serve.delete("in-server", _blocking=False)


def test_records_in_the_server_need_one_colocated_replica():
    from deployments.app import AppConfig

    assert AppConfig(colocate=True, records="server").records == "server"
    for bad in ({"records": "server"}, {"colocate": True, "records": "server", "autoscaling": {"decoder": {}}}):
        with pytest.raises(ValueError, match="records: 'server'"):
            AppConfig(**bad)
