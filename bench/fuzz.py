"""A longer schema fuzz than the test suite's (tests/deployments/http/test_fuzz.py): schemathesis over the served
OpenAPI document, every phase (examples, coverage, fuzzing, stateful), positive and negative
data, every route (`model` held to the one served, so drawn generation requests run); no 5xx, no
answer slower than --max-response-time, answers as documented, and every JSON answer and
streamed event JSON that a strict parser reads (fuzz_hooks.py: no -Infinity, no NaN). Then sampled requests asking for log-probabilities (`logprob_phase`: drawn temperature,
top_k, top_p, min_p, top_logprobs, echo; whole and streamed) on every generation route and as a
batch's lines, held to the same: no 5xx, every body strict JSON.

    python bench/fuzz.py                                   # starts `raymuter serve` (the default model) itself
    python bench/fuzz.py --url http://host:8000 --api-key "$KEY" --examples 2000
    python bench/fuzz.py --model path/to/folder --examples 300 --max-time 1800 --logprob-requests 300

What it finds is schemathesis' report (each failure with the curl line that reproduces it), then the
log-probability phase's counts and its first failures. The exit status is schemathesis' (0: nothing
found), or 1 where only the log-probability phase found something.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
# --max-response-time is its own check in schemathesis 4 (not a name for --checks); strict_json_bodies is
# fuzz_hooks.py's
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance,strict_json_bodies"
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def start_server(model: str | None, api_key: str | None, extra: list[str] = (),
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`raymuter serve` on a free port (`extra`: more of its arguments; `env`: more variables);
    (process, base URL) once it serves."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "deployments.cli", "serve", "--port", str(port), *extra]
    command += ["--model", model] if model else []
    command += ["--api-key", api_key] if api_key else []
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(ROOT), **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 180
    while time.time() < deadline:
        line = process.stderr.readline()
        if not line and process.poll() is not None:
            break
        sys.stderr.write(line)
        found = re.search(r"serving '.+' at (http://\S+)/v1", line)
        if found:
            return process, found.group(1)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit("raymuter serve did not start")


def stop_server(process: subprocess.Popen) -> None:
    """Ctrl-C to the server start_server started; its process group killed after a minute."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def sampled_body(rng: random.Random, route: str, model: str) -> dict:
    """A sampled request asking for log-probabilities, its settings drawn: the sampling filters
    (top_k, top_p, min_p) leave alternatives at -inf, which once made answers that no JSON
    parser reads."""
    body = {"model": model, "temperature": rng.choice([0.3, 0.7, 1.0, 1.5]), "seed": rng.randrange(2**31)}
    for name, values in (("top_k", [1, 3, 40]), ("top_p", [0.1, 0.5, 0.9]), ("min_p", [0.05, 0.3])):
        if rng.random() < 0.5:
            body[name] = rng.choice(values)
    top, budget = rng.randrange(0, 6), rng.randrange(1, 13)
    if route == "/v1/chat/completions":
        body.update(messages=[{"role": "user", "content": rng.choice(["Hi", "Tell me a story", "2+2?"])}],
                    max_tokens=budget, logprobs=True, top_logprobs=top)
    elif route == "/v1/completions":
        body.update(prompt=rng.choice(["Once upon a time", "The list type", "def f(x):"]), max_tokens=budget,
                    logprobs=top, echo=rng.random() < 0.3)
    else:
        body.update(input=rng.choice(["Hi", "Tell me a story"]), max_output_tokens=budget, top_logprobs=top)
    return body


async def logprob_phase(url: str, api_key: str | None, count: int, batch_lines: int, seed: int,
                        timeout: float) -> dict:
    """`count` sampled log-probability requests spread over GENERATION_ROUTES, half streamed, and
    one batch of `batch_lines` such lines (chat): their answers' statuses, the server errors and
    the bodies (or batch output lines) a strict JSON parser refuses, with the first few failures."""
    import httpx

    from fuzz_hooks import body_errors

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng, found = random.Random(seed), {"requests": 0, "statuses": {}, "server_errors": 0, "not_json": 0,
                                       "batch_lines": 0, "failures": []}

    def record(what: str, status: int, errors: list[str]) -> None:
        found["statuses"][status] = found["statuses"].get(status, 0) + 1
        found["server_errors"] += status >= 500
        found["not_json"] += bool(errors)
        if (status >= 500 or errors) and len(found["failures"]) < 5:
            found["failures"].append(f"{what}: {status} {'; '.join(errors)[:300]}")

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        for k in range(count):
            route = GENERATION_ROUTES[k % len(GENERATION_ROUTES)]
            body = {**sampled_body(rng, route, model), "stream": k % 2 == 1}
            answer = await http.post(route, json=body)
            found["requests"] += 1
            record(f"POST {route} {json.dumps(body)}", answer.status_code,
                   body_errors(answer.content, answer.headers.get("content-type", "")))
        if batch_lines:
            await _batch_lines(http, rng, model, batch_lines, found, record)
    return found


async def _batch_lines(http, rng: random.Random, model: str, lines: int, found: dict, record) -> None:
    """A batch of sampled chat lines asking for log-probabilities, through /v1/files and /v1/batches;
    each output line's body read strictly."""
    from fuzz_hooks import strict_json

    text = "".join(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                               "body": sampled_body(rng, "/v1/chat/completions", model)}) + "\n"
                   for i in range(lines))
    uploaded = await http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("lines.jsonl", text)})
    record("POST /v1/files", uploaded.status_code, [])
    if uploaded.status_code != 200:
        return
    batch = await http.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                 "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    record("POST /v1/batches", batch.status_code, [])
    if batch.status_code != 200:
        return
    for _ in range(600):
        state = (await http.get(f"/v1/batches/{batch.json()['id']}")).json()
        if state["status"] in ("completed", "failed", "expired", "cancelled"):
            break
        await asyncio.sleep(0.5)
    for key in ("output_file_id", "error_file_id"):
        if state.get(key):
            content = await http.get(f"/v1/files/{state[key]}/content")
            for line in content.text.splitlines():
                found["batch_lines"] += 1
                try:
                    status = strict_json(line)["response"]["status_code"]
                    errors = []
                except (ValueError, KeyError, TypeError) as e:
                    status, errors = 0, [f"{e}: {line[:200]}"]
                record("a batch line", status or 200, errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL (default: start `raymuter serve` here)")
    parser.add_argument("--model", help="the model `raymuter serve` serves when --url is not given")
    parser.add_argument("--api-key", help="the server's API key")
    parser.add_argument("--examples", type=int, default=300, help="test cases per route and method")
    parser.add_argument("--max-time", type=int, default=1800, help="seconds for the whole run")
    parser.add_argument("--max-response-time", type=float, default=30, help="seconds an answer may take")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--logprob-requests", type=int, default=60,
                        help="sampled log-probability requests after the schema fuzz (0: none)")
    parser.add_argument("--batch-lines", type=int, default=12, help="their batch's lines (0: no batch)")
    parser.add_argument("--skip-schema", action="store_true", help="only the log-probability requests")
    args = parser.parse_args(argv)
    process, url = (None, args.url) if args.url else start_server(args.model, args.api_key)
    try:
        status = 0 if args.skip_schema else _schema_fuzz(url, args)
        if args.logprob_requests or args.batch_lines:
            sys.path.insert(0, str(BENCH))
            found = asyncio.run(logprob_phase(url, args.api_key, args.logprob_requests, args.batch_lines, args.seed,
                                              args.max_response_time + 5))
            print(json.dumps(found, indent=1))
            status = status or int(bool(found["server_errors"] or found["not_json"]))
        return status
    finally:
        if process is not None:
            stop_server(process)


def served_document(url: str, api_key: str | None) -> dict:
    """The server's OpenAPI document with `model` held to the model it serves, so that the drawn
    generation requests get past the model check and run (a drawn name is a 404)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    document = httpx.get(f"{url}/openapi.json", headers=headers, timeout=30).json()
    model = httpx.get(f"{url}/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                 "ResponseRequest"):
        document["components"]["schemas"][name]["properties"]["model"] = {"const": model}
    return document


def _schema_fuzz(url: str, args) -> int:
    """schemathesis over the served document, with fuzz_hooks.py's check; its exit status."""
    import tempfile

    schema = Path(tempfile.mkdtemp(prefix="raymuter-fuzz-")) / "openapi.json"
    schema.write_text(json.dumps(served_document(url, args.api_key)))
    command = [str(Path(sys.executable).with_name("schemathesis")), "run", str(schema), "--url", url,
               "--checks", CHECKS, "--max-response-time", str(args.max_response_time),
               "--max-examples", str(args.examples), "--max-time", str(args.max_time), "--seed", str(args.seed),
               "--request-timeout", str(args.max_response_time + 5), "--continue-on-failure",
               "--generation-database", "none"]
    if args.api_key:
        command += ["--header", f"Authorization: Bearer {args.api_key}"]
    print("$ " + " ".join(command), file=sys.stderr)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks",
           "PYTHONPATH": str(BENCH) + (os.pathsep + path if path else "")}
    return subprocess.call(command, env=env)


if __name__ == "__main__":
    sys.exit(main())
