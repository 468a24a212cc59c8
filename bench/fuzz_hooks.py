"""bench/fuzz.py's own check for schemathesis (loaded as SCHEMATHESIS_HOOKS=fuzz_hooks): every JSON
answer, and every event of a server-sent stream, reads with a strict JSON parser. Python's
json.dumps writes -Infinity and NaN, which no other parser reads (RFC 8259 has no such numbers);
a log-probability of -inf once went out so."""

from __future__ import annotations

import json

import schemathesis


def strict_json(text: str):
    """`text` read as JSON, refusing -Infinity, Infinity and NaN."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def body_errors(body: bytes, content_type: str) -> list[str]:
    """What in an answer's body a strict JSON parser does not read: the body of a JSON answer, each
    `data:` line of an event stream ([DONE] aside); other bodies (text, files' bytes) are not JSON."""
    if "text/event-stream" not in content_type and "json" not in content_type:
        return []
    try:
        text = body.decode()
    except UnicodeDecodeError as e:
        return [f"not UTF-8: {e}"]
    if "text/event-stream" in content_type:
        pieces = [line[len("data: "):] for line in text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        pieces = [text]
    errors = []
    for piece in pieces:
        try:
            strict_json(piece)
        except ValueError as e:
            errors.append(f"{e}: {piece[:200]}")
    return errors


@schemathesis.check
def strict_json_bodies(ctx, response, case):
    """JSON answers and streamed events are JSON a strict parser reads (no -Infinity, no NaN)."""
    errors = body_errors(response.content, (response.headers.get("content-type") or [""])[0])  # lowercased, lists
    if errors:
        raise AssertionError("not strict JSON: " + "; ".join(errors[:3]))
    return True
