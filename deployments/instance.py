"""What one `raymuter serve` owns on its host, so that two on one host never answer each other's
clients: ports chosen free for it (or given by the operator) and never shared through
SO_REUSEPORT, and a run folder for its files, removed when it stops. `raymuter batch`'s local Ray
takes the same (deployments/cli/batch.py batch_command).

Ray Serve 2.60 binds fixed ports unless told otherwise: its fallback proxy (the Python proxy
HAProxy lists as every backend's `backup` server, 127.0.0.1:8500 and gRPC 9500) with
SO_REUSEPORT, so a second instance binds the same port and the kernel splits the first one's
requests between the two applications; HAProxy's stats page (8404) and Prometheus frontend
(9101); Ray's autoscaler and dashboard metrics (44217, 44227) and the dashboard agent's HTTP
server (52365); HAProxy's files under /tmp/haproxy-serve/<node id>/, left there after a stop.
Ray's other servers (GCS, raylet, agents, replicas) take ports the kernel gives them.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import tempfile
import time
from pathlib import Path

# Ports the instance chooses come from here: above Ray's worker ports (10002-19999), below the
# replicas' (30000-31000, 40000-41000) and the kernel's ephemeral range (32768 on), where
# Ray's own servers land, and at random, so that two instances starting at once do not pick the
# same one (a sequential search from a default did: the second HAProxy then failed to bind).
QUIET_PORTS = (20000, 29999)

# The ports an instance picks, by the environment variable Ray reads, with Ray's default.
PORT_VARIABLES = {
    "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500,
    "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": 9500,
    "RAY_SERVE_HAPROXY_STATS_PORT": 8404,
    "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
    "AUTOSCALER_METRIC_PORT": 44217,
    "DASHBOARD_METRIC_PORT": 44227,
}
# Serve's Python proxies (the fallback proxy; `--proxy ray`'s) bind with SO_REUSEPORT unless
# this is 0; HAProxy does not (Ray runs it with -dR while it is 0).
NO_SHARED_PORTS = {"SERVE_SOCKET_REUSE_PORT_ENABLED": "0"}
# HAProxy's files, each under a folder of the node's id in the run folder (Ray's _per_node).
HAPROXY_FILES = {
    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg",
    "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
    "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "log.sock",
}
# HAProxy refuses a Unix socket path over 97 bytes: RUN_FOLDER/<56-character node id>/admin.sock.
SOCKET_PATH_BYTES = 97


def free_port(taken: set[int] = frozenset(), rng: random.Random | None = None) -> int:
    """A port of QUIET_PORTS nothing listens on (on any interface), not in `taken`."""
    rng = rng or random.Random()
    for _ in range(1000):
        port = rng.randint(*QUIET_PORTS)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {QUIET_PORTS[0]}-{QUIET_PORTS[1]}")


def port_environment(environ=os.environ) -> dict[str, str]:
    """PORT_VARIABLES, each a free port unless the operator set it, and Serve's proxies without
    SO_REUSEPORT (unless the operator set that too)."""
    chosen = {name: environ[name] for name in PORT_VARIABLES if environ.get(name)}
    taken = {int(value) for value in chosen.values() if value.isdigit()}
    for name in PORT_VARIABLES:
        if name not in chosen:
            port = free_port(taken)
            taken.add(port)
            chosen[name] = str(port)
    return {**{k: v for k, v in NO_SHARED_PORTS.items() if k not in environ}, **chosen}


def haproxy_environment(folder: Path) -> dict[str, str]:
    """HAProxy's files in `folder` (Ray adds a folder of the node's id to each)."""
    return {"RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder),
            **{name: str(folder / file) for name, file in HAPROXY_FILES.items()}}


def run_folder() -> Path:
    """A new folder of this instance's own (mode 700) for HAProxy's files and Ray's session, in
    the temporary folder, or in /tmp where that is too long for the Unix sockets in it (HAProxy's
    admin socket under a 56-character node id: SOCKET_PATH_BYTES)."""
    base = tempfile.gettempdir()
    longest = max(len(name) for name in HAPROXY_FILES.values() if name.endswith(".sock"))
    if len(base) + len("/raymuter-12345678/") + 57 + longest > SOCKET_PATH_BYTES:
        base = "/tmp"
    return Path(tempfile.mkdtemp(prefix="raymuter-", dir=base))


@contextlib.contextmanager
def dashboard_agent_on_a_free_port():
    """`ray.init` with the dashboard agent's HTTP server on a port the kernel gives it: ray.init
    passes no such argument, and Ray's default (52365) is one port for every Ray on the host."""
    from ray._private import parameter

    original = parameter.RayParams

    def ray_params(*args, **kwargs):
        kwargs.setdefault("dashboard_agent_listen_port", 0)
        return original(*args, **kwargs)

    parameter.RayParams = ray_params
    try:
        yield
    finally:
        parameter.RayParams = original


def keep_logs(ray_folder: Path) -> Path | None:
    """Ray's logs of a failed start, copied out of the run folder (removed at exit) into
    $XDG_CACHE_HOME/raymuter/logs/serve-<time>-<pid>/; None where there are none."""
    sessions = sorted(ray_folder.glob("session_2*"))
    if not sessions or not (sessions[-1] / "logs").is_dir():
        return None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raymuter" / "logs"
    target = cache / f"serve-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    try:
        shutil.copytree(sessions[-1] / "logs", target, ignore=shutil.ignore_patterns("*.sock"),
                        ignore_dangling_symlinks=True)
    except (OSError, shutil.Error):
        pass
    return target if target.is_dir() else None


def remove(folder: Path) -> None:
    """The run folder and everything in it (Ray's session, HAProxy's files)."""
    shutil.rmtree(folder, ignore_errors=True)
