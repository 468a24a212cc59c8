"""deployments/haproxy.py: the wrapper Ray Serve runs as its HAProxy binary, on the configuration
Ray Serve itself writes (no Ray started: its HAProxyApi renders the file).

Invariant: the wrapper binds the stats page and the Prometheus frontend to the serving host,
makes the admin socket mode 600 and its folder 700, and the real HAProxy accepts the result
(`haproxy -c`); it runs the real binary with Ray's arguments unchanged; a configuration it does
not know stops it with a message, before any HAProxy runs.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from deployments import haproxy

STATS, METRICS = 18404, 19101


def ray_config(folder: Path, host: str) -> Path:
    """The HAProxy configuration Ray Serve 2.60 writes for Serve on `host`, no application yet."""
    from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(http_options=HTTPOptions(host=host, port=8123), socket_path=str(folder / "admin.sock"),
                        metrics_socket_path=str(folder / "metrics.sock"), server_state_file=str(folder / "server-state"),
                        stats_port=STATS, metrics_port=METRICS)
    HAProxyApi(cfg=cfg, config_file_path=str(folder / "haproxy.cfg"))._generate_config_file_internal()
    return folder / "haproxy.cfg"


def wrapped(args, host: str, binary: str, fallback: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, **haproxy.environment(host, binary, fallback)}
    return subprocess.run([env["RAY_SERVE_HAPROXY_BINARY_PATH"], *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("host, bound", [("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "*")])
def test_stats_and_metrics_listen_on_the_serving_host_and_the_sockets_are_private(tmp_path, host, bound):
    config = ray_config(tmp_path / "node", host)
    assert "mode 666" in config.read_text()  # guard: what Ray writes
    # an application's backend, as Ray writes one per app (none without apps)
    config.write_text(config.read_text() + "backend demo\n    log global\n    http-reuse always\n")
    done = wrapped(["-c", "-f", config], host, haproxy.real_binary())
    assert done.returncode == 0, done.stdout + done.stderr  # the real HAProxy takes the rewritten file
    text = config.read_text()
    assert re.search(rf"^listen stats\n\s*bind {re.escape(bound)}:{STATS}$", text, re.M)
    assert re.search(rf"^frontend prometheus\n\s*bind {re.escape(bound)}:{METRICS}$", text, re.M)
    assert re.search(r"^\s*stats socket \S+ mode 600 level admin", text, re.M) and "mode 666" not in text
    # each request its own server connection: a client's close reaches the replica (a leaving client cancels)
    assert "http-reuse always" not in text and re.search(r"^\s*http-reuse never$", text, re.M)
    assert len(re.findall(r"^\s*timeout client-fin 1s$", text, re.M)) == 1
    assert stat.S_IMODE(config.parent.stat().st_mode) == 0o700
    again = wrapped(["-c", "-f", config], host, haproxy.real_binary())  # a reload rewrites a rewritten file
    assert again.returncode == 0 and config.read_text() == text


# An application's backend as Ray writes it: its ingress replica, and Serve's fallback proxy as a backup.
BACKEND = """backend http-raymuter
    log global
    http-reuse always
    option httpchk GET /-/healthz
    server SERVE_REPLICA_raymuter-Server-abc 127.0.0.1:30000 check
    # Fallback to head node's Serve proxy when no ingress replicas are available
    server SERVE_PROXY_ACTOR-fallback-0123abcd 127.0.0.1:8500 check backup
"""


@pytest.mark.parametrize("fallback", [False, True])
def test_no_replica_answers_503_in_openai_s_shape_and_a_leaving_client_reaches_the_replica(tmp_path, fallback):
    """HAProxy's own answers (502, 503: no replica could take the request; 504) are the wrapper's
    error files, OpenAI's error body, 503 with Retry-After; the request is not spliced (HAProxy
    then misses clients that leave); Serve's fallback route (a proxy that holds requests silently
    until a replica is back) stays only where asked (routes that scale to zero)."""
    config = ray_config(tmp_path / "node", "127.0.0.1")
    assert re.search(r"^\s*option splice-request$", config.read_text(), re.M)  # guard: what Ray writes
    assert len(re.findall(r"^\s*errorfile 50[234] ", config.read_text(), re.M)) == 3
    config.write_text(config.read_text() + BACKEND)
    done = wrapped(["-c", "-f", config], "127.0.0.1", haproxy.real_binary(), fallback)
    assert done.returncode == 0, done.stdout + done.stderr
    text = config.read_text()
    assert "splice-request" not in text and re.search(r"^\s*option splice-response$", text, re.M)
    files = dict(re.findall(r"^\s*errorfile (50[234]) (\S+)$", text, re.M))
    assert set(files) == {"502", "503", "504"} and files["502"] == files["503"] != files["504"]
    unavailable = Path(files["503"]).read_bytes().decode()
    head, body = unavailable.split("\r\n\r\n")
    assert head.startswith("HTTP/1.1 503 ") and "\r\nRetry-After: 1" in head
    assert f"\r\nContent-Length: {len(body.encode())}" in head
    assert json.loads(body)["error"]["type"] == "server_overloaded"
    assert Path(files["504"]).read_text().startswith("HTTP/1.1 504 ")
    assert ("SERVE_PROXY_ACTOR-fallback" in text) == fallback
    assert "server SERVE_REPLICA_raymuter-Server-abc 127.0.0.1:30000 check" in text


def test_the_real_binary_gets_ray_s_arguments(tmp_path):
    config = ray_config(tmp_path / "node", "127.0.0.1")
    fake = tmp_path / "haproxy"
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    args = ["-db", "-f", str(config), "-dR", "-sf", "123", "456"]
    done = wrapped(args, "127.0.0.1", str(fake))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == args  # CONFIG stays in the command line, where Ray looks for it


def test_a_configuration_it_does_not_know_stops_it(tmp_path):
    config = tmp_path / "haproxy.cfg"
    config.write_text("global\n    stats socket /tmp/x.sock mode 666 level admin\nfrontend f\n    bind :80\n")
    before = config.read_text()
    ran = tmp_path / "ran"
    fake = tmp_path / "haproxy"
    fake.write_text(f"#!/bin/sh\ntouch {ran}\n")
    fake.chmod(0o755)
    done = wrapped(["-db", "-f", config], "127.0.0.1", str(fake))
    assert done.returncode == 1
    assert "a Ray Serve template deployments/haproxy.py does not know" in done.stderr
    assert config.read_text() == before and not ran.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["haproxy", "haproxy.cfg"]  # no temporary file left


def test_the_host_must_be_an_address():
    assert haproxy.bind_host("::") == "*" and haproxy.bind_host("::1") == "::1"
    with pytest.raises(ValueError, match="--host must be an IP address or a host name, not 'a b'"):
        haproxy.bind_host("a b")
