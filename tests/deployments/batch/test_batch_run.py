"""`raymuter batch` on Ray Data: each output line is what the server answers the same request
(the tiny real model, greedy and seeded; the session's app at /real has the same arguments), a
bad line is an error line and never fails the job, and a table's column runs as requests. (A run
resumes where a killed one stopped: test_batch_cli.py, on a Ray of its own.)"""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import ServeApps

LINES = [
    {"custom_id": "greedy", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "The list", "temperature": 0}},
    {"custom_id": "seeded", "url": "/v1/completions",
     "body": {"model": "tiny", "prompt": "A tuple", "seed": 5, "temperature": 0.9, "top_k": 20, "max_tokens": 12}},
    {"custom_id": "chat", "url": "/v1/chat/completions",
     "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "logprobs": True,
              "top_logprobs": 2}},
    {"custom_id": "bad-field", "url": "/v1/completions", "body": {"model": "tiny", "prompt": "x", "top_k": -9}},
    {"custom_id": "embed", "url": "/v1/embeddings", "body": {"model": "tiny", "input": "x"}},
    {"custom_id": "response", "url": "/v1/responses", "body": {"model": "tiny", "input": "hello", "temperature": 0}},
]
# what differs between two runs of one request: ids, times, and what the prefix cache held (the
# server's has seen the chat template's first block before; the batch's engine starts empty)
VOLATILE = ("id", "created", "created_at", "completed_at", "system_fingerprint", "prompt_tokens_details",
            "input_tokens_details")


def same(a, b, where="") -> None:
    """Two answers equal but for VOLATILE fields; log-probabilities to float noise (a prompt
    computed from a cached prefix and one computed whole differ in their last bits)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - set(VOLATILE)
        assert keys == set(b) - set(VOLATILE), where
        for k in keys:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}.{i}")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-4), where
    else:
        assert a == b, where


def write_lines(path, lines):
    path.write_text("".join(json.dumps({"method": "POST", **line}) + "\n" for line in lines) + "not json\n")


def test_each_line_is_what_the_server_answers(serve_apps, tmp_path):
    from deployments.batch.run import run_batch

    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(source, LINES)
    # the batching loop in a child process of the actor, as `raymuter batch` runs a text model
    # (the table's test below keeps it in the actor)
    config = {**ServeApps.REAL, "model": str(serve_apps.real_model), "engine_process": True}
    counts = run_batch(str(source), str(output), config, replicas=1, cpus=1, progress=False)
    assert counts["done"] == len(LINES) + 1 and counts["skipped"] == 0
    # not 200: bad-field's 400, embed's 400 (a text model gives no embeddings), the line not JSON
    assert counts["errors"] == 3 and counts["server_errors"] == 0
    found = {}
    for text in output.read_text().splitlines():
        line = json.loads(text)
        found[line["custom_id"]] = line
    broken = found.pop(None)
    assert broken["response"] is None and "not JSON" in broken["error"]["message"]
    for line in LINES:
        got = found[line["custom_id"]]
        direct = httpx.post(serve_apps.real + line["url"], json=line["body"], timeout=60)
        assert got["error"] is None and got["response"]["status_code"] == direct.status_code, got
        same(got["response"]["body"], direct.json(), line["custom_id"])
    assert found["bad-field"]["response"]["body"]["error"]["param"] == "top_k"


def test_a_table_column_runs_as_completions(serve_apps, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from deployments.batch.run import run_batch

    source, output = tmp_path / "prompts.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.table({"text": ["The list", "A dict", "Why"]}), source)
    config = {**ServeApps.REAL, "model": str(serve_apps.real_model)}
    run_batch(str(source), str(output), config, cpus=1, progress=False,
              table={"prompt_column": "text", "messages_column": None, "id_column": None,
                     "body": {"max_tokens": 6, "temperature": 0}})
    lines = {json.loads(t)["custom_id"]: json.loads(t) for t in output.read_text().splitlines()}
    assert set(lines) == {"row-0", "row-1", "row-2"}
    direct = httpx.post(serve_apps.real + "/v1/completions", timeout=60,
                        json={"model": "tiny", "prompt": "A dict", "max_tokens": 6, "temperature": 0}).json()
    assert lines["row-1"]["response"]["body"]["choices"] == direct["choices"]
