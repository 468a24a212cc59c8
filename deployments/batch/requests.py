"""A batch file's lines as requests and their answers as lines, in OpenAI's batch format.

An input line is `{"custom_id", "method": "POST", "url", "body"}`; an output line
`{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`: the route's
answer whatever its status (a 400 names its field in the body, as the server's), and `error`
only for a line that could not be sent at all (not JSON, no custom_id, a route batch does not
take). A table's row (Parquet, JSONL) is a request too: its prompt or messages column with the
settings the command line gives. An output file that a killed run cut short resumes from its last
whole line (`answered_ids`): `raymuter batch` and the server's batches (services/batches.py) both.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses", "/v1/audio/transcriptions",
          "/v1/audio/translations")
AUDIO = ("/v1/audio/transcriptions", "/v1/audio/translations")


@dataclass
class BatchRequest:
    """One request of a batch; `error` where the line cannot be sent (then the rest is unset)."""

    custom_id: str | None
    url: str = ""
    body: dict = field(default_factory=dict)
    error: str | None = None
    param: str | None = None  # the line's field the error is about (None: the line is no JSON object)


def parsed_line(text: str) -> BatchRequest:
    """The request of an input line (a line that is none names itself by its start)."""
    start = json.dumps(text[:60])
    try:
        line = json.loads(text)
    except ValueError as e:
        return BatchRequest(None, error=f"the line {start}... is not JSON: {e}"[:300])
    if not isinstance(line, dict):
        return BatchRequest(None, error=f"the line {start} is not a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BatchRequest(None, error=f"custom_id: the line {start}... has none (a non-empty string)",
                            param="custom_id")
    method, url, body = line.get("method", "POST"), line.get("url"), line.get("body")
    if method != "POST":
        return BatchRequest(custom_id, error=f"method: a batch line's method is POST, not {json.dumps(method)[:40]}",
                            param="method")
    if url not in ROUTES:
        return BatchRequest(custom_id, error=f"url: {json.dumps(url)[:100]} is not a route batch takes "
                                             f"({', '.join(ROUTES)})", param="url")
    if not isinstance(body, dict):
        return BatchRequest(custom_id, error="body: a batch line's body is a JSON object", param="body")
    if body.get("stream"):
        return BatchRequest(custom_id, error="body.stream: a batch request is answered whole", param="body.stream")
    return BatchRequest(custom_id, url, body)


def table_line(row: dict, number: int, model: str, prompt_column: str | None, messages_column: str | None,
               id_column: str | None, body: dict) -> str:
    """A table row as a batch input line: a completion of its prompt column, or a chat of its
    messages column (a list of {role, content}, or its JSON text), with the settings in `body`."""
    custom_id = str(row[id_column]) if id_column else f"row-{number}"
    if messages_column:
        messages = row[messages_column]
        if isinstance(messages, str):
            messages = json.loads(messages)
        request = {"url": "/v1/chat/completions", "body": {**body, "model": model, "messages": _plain(messages)}}
    else:
        request = {"url": "/v1/completions", "body": {**body, "model": model, "prompt": _plain(row[prompt_column])}}
    return json.dumps({"custom_id": custom_id, "method": "POST", **request})


def _plain(value):
    """A table cell as JSON data (Arrow gives numpy arrays and their scalars)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def output_line(custom_id: str | None, status: int | None = None, body=None, request_id: str | None = None,
                error: str | None = None, code: str = "invalid_request") -> dict:
    """OpenAI's output line: the route's answer, or the error of a line that could not be sent
    (`code`: invalid_request, the line's fault; server_error, the server's)."""
    response = None if status is None else {"status_code": status, "request_id": request_id or "", "body": body}
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": custom_id, "response": response,
            "error": None if error is None else {"code": code, "message": error}}


def answered_ok(line: dict) -> bool:
    """Whether an output line is a 200 answer (OpenAI's output file; the rest go to its error file)."""
    return line["error"] is None and line["response"]["status_code"] == 200


def server_failed(line: dict) -> bool:
    """Whether an output line is the server's failure, not the request's: a 5xx answer, or a line
    the server failed to send (`"code": "server_error"`)."""
    if line["error"] is not None:
        return line["error"]["code"] == "server_error"
    return line["response"]["status_code"] >= 500


def custom_id_of(text: str) -> str | None:
    """The custom_id of an input line, or None (cheap: the resuming run's filter)."""
    try:
        line = json.loads(text)
    except ValueError:
        return None
    return line.get("custom_id") if isinstance(line, dict) else None


def answered_ids(output: Path) -> set[str]:
    """The custom_ids OUTPUT holds; a last line cut short (a run killed mid-write) is dropped
    from the file, so appending goes on from a whole line."""
    if not output.exists():
        return set()
    kept, ids = [], set()
    with output.open() as lines:
        for text in lines:
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if not text.endswith("\n"):
                continue
            kept.append(text)
            ids.add(line.get("custom_id"))
    whole = "".join(kept)
    if whole != output.read_text():
        partial = output.with_suffix(output.suffix + ".part")
        partial.write_text(whole)
        os.replace(partial, output)
    return ids
