"""`raymuter serve`: starts its own local Ray and the application, prints the URL, serves, and
stops cleanly on Ctrl-C (SIGINT), leaving no process behind."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def test_serve_prints_the_url_serves_and_stops_on_ctrl_c():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}  # not the session Ray's ports
    env = {**inherited, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    process = subprocess.Popen([sys.executable, "-m", "generation.cli", "serve", "--engine", "fake", "--port", str(port),
                                "--num-cpus", "4"], cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               text=True, start_new_session=True)
    try:
        url, deadline = None, time.time() + 90
        while url is None and time.time() < deadline:
            line = process.stderr.readline()
            if not line and process.poll() is not None:
                break
            found = re.search(r"serving '(.+)' at (http://\S+)/v1", line)
            if found:
                url = found.group(2)
        assert url == f"http://127.0.0.1:{port}", "no URL printed"
        out = httpx.post(url + "/v1/completions", json=dict(model="raymuter-default", prompt="abc", max_tokens=3),
                         timeout=30)
        assert out.json()["choices"][0]["text"] == "cba"  # the fake engine: the prompt reversed
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
        rest = process.stderr.read()
        assert "stopping" in rest and "Traceback" not in rest
        try:
            httpx.get(url + "/health", timeout=2)
            raise AssertionError("still serving after Ctrl-C")
        except httpx.HTTPError:
            pass
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
