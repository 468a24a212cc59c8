"""The batch file's lines (deployments/batch/requests.py) and a resumed run's output file
(requests.answered_ids): what can be sent, what is an error line, what a table's row becomes."""

from __future__ import annotations

import json

import pytest

from deployments.batch.requests import (answered_ids, custom_id_of, output_line, parsed_line, server_failed,
                                       table_line)


def test_a_line_becomes_its_request():
    line = {"custom_id": "x1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    request = parsed_line(json.dumps(line))
    assert (request.custom_id, request.url, request.body, request.error) == ("x1", line["url"], line["body"], None)
    assert custom_id_of(json.dumps(line)) == "x1" and custom_id_of("{") is None


@pytest.mark.parametrize("line, custom_id, words", [
    ("not json", None, "is not JSON"),
    ("[1, 2]", None, "not a JSON object"),
    (json.dumps({"url": "/v1/completions", "body": {}}), None, "custom_id"),
    (json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/models", "body": {}}), "a", "method"),
    (json.dumps({"custom_id": "a", "url": "/v1/fine_tuning/jobs", "body": {}}), "a", "url"),
    (json.dumps({"custom_id": "a", "url": "/v1/completions", "body": "x"}), "a", "body"),
    (json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"stream": True}}), "a", "body.stream"),
])
def test_a_line_that_cannot_be_sent_is_an_error_line(line, custom_id, words):
    request = parsed_line(line)
    assert request.custom_id == custom_id and words in request.error
    out = output_line(request.custom_id, error=request.error)
    assert out["response"] is None and out["error"]["message"] == request.error and out["id"].startswith("batch_req_")


def test_a_server_failure_is_told_from_the_request_s():
    assert server_failed(output_line("a", 500, {}))
    assert server_failed(output_line("a", 503, {}))
    assert server_failed(output_line("a", error="the server failed on this line (OSError)", code="server_error"))
    assert not server_failed(output_line("a", 200, {}))
    assert not server_failed(output_line("a", 400, {}))
    assert not server_failed(output_line("a", error="the line is not JSON"))


def test_a_table_row_is_a_completion_or_a_chat():
    prompt = json.loads(table_line({"text": "Once", "k": 7}, 3, "tiny", "text", None, None, {"max_tokens": 5}))
    assert prompt == {"custom_id": "row-3", "method": "POST", "url": "/v1/completions",
                      "body": {"max_tokens": 5, "model": "tiny", "prompt": "Once"}}
    chat = json.loads(table_line({"m": '[{"role": "user", "content": "hi"}]', "id": 9}, 0, "tiny", None, "m", "id", {}))
    assert chat["custom_id"] == "9" and chat["body"]["messages"] == [{"role": "user", "content": "hi"}]


def test_a_resumed_run_drops_a_line_cut_short(tmp_path):
    output = tmp_path / "out.jsonl"
    whole = [json.dumps(output_line(f"id{k}", 200, {"k": k})) for k in range(3)]
    output.write_text("\n".join(whole) + "\n" + whole[0][:25])  # killed while writing the fourth line
    assert answered_ids(output) == {"id0", "id1", "id2"}
    assert output.read_text() == "\n".join(whole) + "\n"  # appending goes on from a whole line
    assert answered_ids(tmp_path / "none.jsonl") == set()


def test_a_batch_runs_prompts_whole_unless_told_to_chunk_and_its_loop_apart():
    from deployments.cli import parser
    from deployments.cli.arguments import engine_config
    from deployments.cli.batch import batch_engine_config

    args = parser().parse_args(["batch", "in.jsonl", "out.jsonl"])
    assert batch_engine_config(args)["prefill_chunk_tokens"] == 0
    assert batch_engine_config(args)["engine_process"]  # the default model: the loop in a child process
    fake = parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--engine", "fake"])
    assert not batch_engine_config(fake)["engine_process"]
    assert engine_config(parser().parse_args(["serve"]))["prefill_chunk_tokens"] is None  # the server's default
    args = parser().parse_args(["batch", "in.jsonl", "out.jsonl", "--prefill-chunk-tokens", "64"])
    assert batch_engine_config(args)["prefill_chunk_tokens"] == 64
