"""A longer schema fuzz than the test suite's (tests/deployments/http/test_fuzz.py): schemathesis over the served
OpenAPI document, every phase (examples, coverage, fuzzing, stateful), positive and negative
data, every route; no 5xx, no answer slower than --max-response-time, answers as documented.

    python bench/fuzz.py                                   # starts `raymuter serve` (the default model) itself
    python bench/fuzz.py --url http://host:8000 --api-key "$KEY" --examples 2000
    python bench/fuzz.py --model path/to/folder --examples 300 --max-time 1800

What it finds is schemathesis' report: each failure with the curl line that reproduces it. The
exit status is schemathesis' (0: nothing found).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# --max-response-time is its own check in schemathesis 4 (not a name for --checks)
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance"


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
    args = parser.parse_args(argv)
    process, url = (None, args.url) if args.url else start_server(args.model, args.api_key)
    try:
        command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
                   "--checks", CHECKS, "--max-response-time", str(args.max_response_time),
                   "--max-examples", str(args.examples), "--max-time", str(args.max_time), "--seed", str(args.seed),
                   "--request-timeout", str(args.max_response_time + 5), "--continue-on-failure",
                   "--generation-database", "none"]
        if args.api_key:
            command += ["--header", f"Authorization: Bearer {args.api_key}"]
        print("$ " + " ".join(command), file=sys.stderr)
        return subprocess.call(command)
    finally:
        if process is not None:
            stop_server(process)


if __name__ == "__main__":
    sys.exit(main())
