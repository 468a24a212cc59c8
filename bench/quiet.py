"""What `raymuter serve`'s quiet settings cost and save: Ray's defaults beside Raymuter's.

    PYTHONPATH=. .venv/bin/python bench/quiet.py [--model FOLDER] [--rounds 2]

`deployments.cli.environment.QUIET` sets three of Ray's and Serve's knobs for a local server (a
replica's metrics export 1 s instead of 0.1 s, no idle worker started ahead of need). Each round
starts `raymuter serve` once with them and once with Ray's own values given in the environment
(which QUIET never overrides), alternating, and measures, for each (a knob QUIET leaves alone is
tried by giving it in this script's environment: RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1 reaches the
QUIET side only):

- start-up: the command's start until /v1/models answers;
- idle CPU: the whole process tree's CPU over --idle-seconds, 5 s after a warm-up request;
- failure detection: the engine process killed (SIGKILL), then a 4-token request every 0.1 s:
  seconds until one answers 200 (meanwhile 503); then the Server replica itself killed, the same;
- autoscaling reaction (a second server, `--autoscale decoder=1:2,upscale_delay_s=1,metrics_interval_s=0.5,look_back_period_s=2`): a burst of
  64 streams of 400 tokens (twice the slots), sent again as each ends,
  seconds from its start until a second Server replica runs.

The log monitor is stopped and the records live in the Server in both (they cost no reaction
time: docs/serving.md "A quiet server"). Prints a table of medians, and the CPU model.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import peers  # noqa: E402 - bench/peers.py's process trees

START_TIMEOUT = 600.0  # seconds a server gets to start
RAY_DEFAULTS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100",
                "RAY_enable_worker_prestart": "1", "RAY_prestart_worker_first_driver": "1"}


def _post(url: str, body: dict, timeout: float = 30.0) -> int:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            response.read()
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def start(setting: str, model: str | None, logs: Path, extra: list[str]) -> tuple[peers.Managed, str, str, float]:
    from deployments.instance import free_port

    port = free_port()
    command = [str(Path(sys.executable).with_name("raymuter")), "serve", "--port", str(port), *extra]
    if model:
        command[2:2] = ["--model", model]
    env = peers.clean_env(RAY_DEFAULTS if setting == "ray" else {})
    server = peers.Managed(setting, command, env, logs / f"{setting}-{port}.log")
    url = f"http://127.0.0.1:{port}"
    return (server, url, *peers.wait_ready(server, url, f"raymuter serve ({setting})", START_TIMEOUT))


def _named(server: peers.Managed, text: str) -> list[int]:
    found = []
    for pid in server.pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(pid)
        except OSError:
            pass
    return found


def back_after_kill(server: peers.Managed, url: str, name: str, pid: int) -> float:
    """Seconds from SIGKILL of `pid` until a 4-token request answers 200 again."""
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    time.sleep(0.05)
    while time.monotonic() - killed < 120:
        if _post(url, {"model": name, "prompt": "The list type", "max_tokens": 4}, timeout=10) == 200:
            return time.monotonic() - killed
        time.sleep(0.1)
    return float("nan")


def one_server(setting: str, args, logs: Path) -> dict:
    server, url, name, startup = start(setting, args.model, logs, [])
    try:
        _post(url, {"model": name, "prompt": "Hello there", "max_tokens": 32})
        time.sleep(5)
        idle = server.idle_cores(args.idle_seconds)
        engine = back_after_kill(server, url, name, _named(server, "spawn_main")[0])
        replica = back_after_kill(server, url, name, _named(server, "ServeReplica:raymuter:Server")[0])
    finally:
        server.stop()
    return {"startup": startup, "idle": idle, "engine_back": engine, "replica_back": replica}


def burst(setting: str, args, logs: Path) -> float:
    """Seconds from a burst's start until a second Server replica runs."""
    server, url, name, _ = start(setting, args.model, logs, ["--autoscale", "decoder=1:2,upscale_delay_s=1,metrics_interval_s=0.5,look_back_period_s=2"])
    try:
        body = {"model": name, "prompt": "The list type", "max_tokens": 400, "ignore_eos": True}
        done = threading.Event()

        def client():  # one of the burst's streams, again and again until the second replica runs
            while not done.is_set():
                _post(url, body, 300.0)  # 0 once the server stops

        threads = [threading.Thread(target=client, daemon=True) for _ in range(64)]
        began = time.monotonic()
        for thread in threads:
            thread.start()
        while time.monotonic() - began < 120:
            if len(_named(server, "ServeReplica:raymuter:Server")) >= 2:
                return time.monotonic() - began
            time.sleep(0.1)
        return float("nan")
    finally:
        done.set()
        server.stop()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model folder (default: the default model)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    args = ap.parse_args(argv)
    logs = Path(tempfile.mkdtemp(prefix="raymuter-quiet-"))
    results: dict[str, list[dict]] = {"ray": [], "quiet": []}
    for r in range(args.rounds):
        for setting in (("ray", "quiet") if r % 2 == 0 else ("quiet", "ray")):
            got = one_server(setting, args, logs)
            got["burst"] = burst(setting, args, logs)
            print(f"[quiet] round {r} {setting}: " + ", ".join(f"{k} {v:.3f}" for k, v in got.items()),
                  file=sys.stderr, flush=True)
            results[setting].append(got)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{model}, {os.cpu_count()} CPUs, {args.model or 'the default model'}, {args.rounds} rounds, medians\n")
    print("| measure | Ray's defaults | Raymuter's (QUIET) | ratio |")
    print("|---|---|---|---|")
    for key, label in (("startup", "start-up s"), ("idle", f"idle CPU, cores over {args.idle_seconds:.0f} s"),
                       ("engine_back", "engine process killed: s until a 200"),
                       ("replica_back", "Server replica killed: s until a 200"),
                       ("burst", "burst: s until a 2nd replica runs")):
        a = statistics.median(x[key] for x in results["ray"])
        b = statistics.median(x[key] for x in results["quiet"])
        print(f"| {label} | {a:.3f} | {b:.3f} | {b / a:.2f} |")
    print(f"\nlogs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
