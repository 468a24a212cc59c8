"""`raymuter serve` as a user and an operator run it: a subprocess that starts its own local Ray
and the application, prints the URL and serves.

Invariants: a bad model or a port in use is one line and exit code 2 before Ray starts; SIGINT
and SIGTERM stop it however it was launched (here with SIGINT ignored, as nohup and `&` in a
script launch it), with exit code 0 and nothing left listening; served on 127.0.0.1, nothing of it
listens on another interface, and HAProxy's admin socket is private to the user. Each serve start
costs 10-15 s on 2 cores: the two below check everything that needs a running server.
"""

from __future__ import annotations

import ipaddress
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[2]


def environment() -> dict[str, str]:
    """This checkout first on the import path; not the session Ray's HAProxy ports or wrapper."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_SERVE_", "RAYMUTER_HAPROXY_"))}
    return {**inherited, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def free_port() -> int:
    from ports import quiet_port

    return quiet_port()


def raymuter(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *map(str, args)], cwd=cwd, env=env or environment(),
                          capture_output=True, text=True, timeout=120)


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def serving(*args):
    """`raymuter serve --engine fake --num-cpus 4 ARGS`, launched with SIGINT ignored; yields the
    process and its URL once it prints it. Whatever of its process tree is left at the end is killed."""
    process = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--engine", "fake", "--num-cpus", "4",
                                *map(str, args)], cwd=ROOT, env=environment(), stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True, start_new_session=True, preexec_fn=ignore_sigint)
    seen = set()
    try:
        url, deadline, lines = None, time.time() + 120, []
        while url is None and time.time() < deadline:
            line = process.stderr.readline()
            lines.append(line)
            if not line and process.poll() is not None:
                break
            found = re.search(r"serving '(.+)' at (http://\S+)/v1", line)
            if found:
                url = found.group(2)
        assert url is not None, "no URL printed:\n" + "".join(lines)
        seen.update(process_tree(process.pid))
        yield process, url
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for p in seen:  # Ray's processes that left the group
            try:
                p.kill()
            except psutil.Error:
                pass


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def listening(processes) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of `processes`."""
    found = []
    for p in processes:
        try:
            name = p.name()
            found += [(c.laddr.ip, c.laddr.port, name) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # ended meanwhile
            pass
    return found


def settled_sockets(process, port: int, timeout: float = 15) -> tuple[list[psutil.Process], list[tuple[str, int, str]]]:
    """The process tree and its listening sockets once HAProxy's API port is among them. Serve
    reloads HAProxy when its targets change (a new process takes the port, the old one leaves), so
    one read can fall between the two and see neither."""
    deadline = time.time() + timeout
    while True:
        tree = process_tree(process.pid)
        sockets = listening(tree)
        if any(p == port for _, p, _ in sockets) or time.time() > deadline:
            return tree, sockets
        time.sleep(0.2)


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def assert_stops(process, signum, url) -> None:
    """`signum` ends the server: exit code 0, "stopping" and no traceback; within a few seconds no
    process of its tree listens and the URL does not answer."""
    tree = process_tree(process.pid)
    process.send_signal(signum)
    assert process.wait(timeout=60) == 0
    rest = process.stderr.read()
    assert "stopping" in rest and "Traceback" not in rest, rest
    deadline = time.time() + 10
    while listening(tree) and time.time() < deadline:
        time.sleep(0.2)
    assert listening(tree) == []
    try:
        httpx.get(url + "/health", timeout=2)
        raise AssertionError(f"still serving after {signal.Signals(signum).name}")
    except httpx.HTTPError:
        pass


def test_on_loopback_nothing_listens_beyond_it_and_sigint_stops_it_though_ignored():
    port, key = free_port(), "test-key"
    with serving("--host", "127.0.0.1", "--port", port, "--api-key", key) as (process, url):
        assert url == f"http://127.0.0.1:{port}"
        out = httpx.post(url + "/v1/completions", json=dict(model="raymuter-default", prompt="abc", max_tokens=3),
                         headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert out.status_code == 200, out.text
        assert out.json()["choices"][0]["text"] == "cba"  # ingress -> decoder over gRPC, on loopback too
        tree, sockets = settled_sockets(process, port)
        assert {(ip, p) for ip, p, _ in sockets if p == port} == {("127.0.0.1", port)}, sockets  # HAProxy's API port
        names = {name for _, _, name in sockets}
        assert {"gcs_server", "raylet", "haproxy"} <= names, names  # guard: Ray's own servers were read
        assert [s for s in sockets if not is_loopback(s[0])] == []

        haproxy = [p for p in tree if p.name() == "haproxy"]
        assert haproxy, "no HAProxy in the process tree"
        command = haproxy[0].cmdline()
        config = Path(command[command.index("-f") + 1]).read_text()
        admin = Path(re.search(r"^\s*stats socket (\S+)", config, re.M).group(1))
        assert stat.S_IMODE(admin.stat().st_mode) == 0o600
        assert stat.S_IMODE(admin.parent.stat().st_mode) == 0o700  # Ray's metrics socket beside it is 666
        stats_port = int(re.search(r"^listen stats\n\s*bind 127\.0\.0\.1:(\d+)$", config, re.M).group(1))
        assert httpx.get(f"http://127.0.0.1:{stats_port}/stats", timeout=10).status_code == 200
        assert_stops(process, signal.SIGINT, url)


def test_sigterm_stops_it():
    port = free_port()
    with serving("--port", port) as (process, url):
        out = httpx.post(url + "/v1/completions", json=dict(model="raymuter-default", prompt="abc", max_tokens=3),
                         timeout=30)
        assert out.json()["choices"][0]["text"] == "cba"  # the fake engine: the prompt reversed
        assert_stops(process, signal.SIGTERM, url)


def test_a_missing_model_is_generate_s_error_before_ray_starts(tmp_path):
    missing = tmp_path / "no-such-model"
    started = time.perf_counter()
    served = raymuter("serve", "--model", missing, "--port", free_port())
    assert time.perf_counter() - started < 10
    generated = raymuter("generate", "--model", missing, "hello")
    assert served.returncode == generated.returncode == 2
    assert served.stderr == generated.stderr == f"raymuter: error: model folder '{missing}' does not exist\n"


def test_a_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        done = raymuter("serve", "--engine", "fake", "--port", port)
    assert time.perf_counter() - started < 10  # before Ray starts
    assert done.returncode == 2
    assert done.stderr == f"raymuter: error: port {port} on 127.0.0.1 is in use (--port to choose another)\n"
    bad = raymuter("serve", "--port", 70000)
    assert bad.returncode == 2 and "--port: a port is an integer in 1-65535, not '70000'" in bad.stderr


def test_help_shows_the_defaults_and_no_secret():
    serve = raymuter("serve", "--help", env={**environment(), "RAYMUTER_API_KEY": "sk-secret"})
    assert serve.returncode == 0
    text = " ".join(serve.stdout.split())  # argparse wraps lines
    for shown in ("port of the HTTP API (default: 8000)", "(default: 127.0.0.1)", "(default: 8)", "(default: 256)",
                  "(default: haproxy)", "(default: $RAYMUTER_API_KEY, else none)"):
        assert shown in text
    assert "sk-secret" not in text and "(default: None)" not in text and "--engine " not in text  # hidden (--engine-process is not)
    assert "--engine-process" in text
    generate = raymuter("generate", "--help")
    text = " ".join(generate.stdout.split())
    assert "prompt i gets seed + i (default: 0)" in text and "(default: whole)" in text
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: [])" not in text


def test_version_is_the_distribution_s_or_the_checkout_s(monkeypatch):
    import tomllib
    from importlib import metadata

    from generation import cli

    done = raymuter("--version")
    assert done.returncode == 0 and done.stdout == f"raymuter {metadata.version('raymuter')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    checkout = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.version() == f"{checkout} (not installed)"


def test_the_url_is_printed_only_once_every_connection_for_a_while_is_routed():
    """A stand-in proxy that routes /health on some connections only (as a displaced HAProxy process
    with the config from before the application does, right after a reload): wait_routed returns
    only after a second of consecutive answers, not at the first one."""
    import http.server
    import threading

    from deployments.cli import wait_routed

    answers = iter([200, 404, 200, 200, 404] + [200] * 1000)
    served = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = next(answers)
            served.append((time.monotonic(), status))
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_routed(f"http://127.0.0.1:{server.server_address[1]}", timeout=20, settle=1.0)
    finally:
        server.shutdown()
    last_refusal = max(t for t, status in served if status != 200)
    assert [status for _, status in served[:5]] == [200, 404, 200, 200, 404]
    assert served[-1][0] - last_refusal >= 1.0
