"""Start-up: the application deployed on a local Ray, what it waits for said every few seconds, and a
failure in one line."""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
import time
from pathlib import Path

from .environment import START_TIMEOUT, signals_deferred


def check_port(host: str, port: int) -> None:
    """Raise ValueError naming host:port when a server cannot listen there (SO_REUSEADDR, as
    HAProxy and uvicorn bind: a connection closing on the port does not count)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                              flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} is not an address of this machine ({e.strerror})") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is in use (--port to choose another)") from None
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror} (--host and --port choose "
                             "where)") from None


class StartFailed(Exception):
    """Start-up did not finish: the message says what failed (one line)."""


def first_line(error: BaseException) -> str:
    """The line of an exception's text that says what happened (Ray's put a traceback first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("File ", "Traceback", "^", "ray::"))]
    line = said[-1] if said else lines[-1] if lines else type(error).__name__
    # an exception named with its module (a replica's: generation.runtime.errors.ModelError) by its name alone
    return re.sub(r"^(?:\w+\.)+(\w*(?:Error|Exception): )", r"\1", line)[:300]


PROGRESS_SECONDS = 10.0  # a line on what start-up waits for, this often


def wait_routed(url: str, timeout: float = 60.0, settle: float = 1.0) -> bool:
    """Whether the proxy routes `url`/health to the application on every fresh connection for
    `settle` seconds within `timeout`: Serve reports an application ready before its proxy has
    the route, and right after HAProxy reloads a displaced process can still accept a connection
    with the config it started with (no routes: "Path not found"), so one answer is not enough
    (CI saw both)."""
    import urllib.error
    import urllib.request

    deadline, answering_since = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                routed = response.status == 200
        except (urllib.error.URLError, OSError):
            routed = False
        now = time.monotonic()
        if not routed:
            answering_since = None
        elif answering_since is None:
            answering_since = now
        elif now - answering_since >= settle:
            return True
        time.sleep(0.1)
    return False


def wait_running(name: str, deadline: float, started: float, status=None) -> None:
    """Return once Serve says application `name` runs; a line of progress every PROGRESS_SECONDS
    (what is not ready yet); StartFailed when it failed to deploy or `deadline` (monotonic) came."""
    if status is None:
        from ray.serve import status
    said = time.monotonic()
    while True:
        now = time.monotonic()
        overview = status()
        app = overview.applications.get(name)
        state = getattr(getattr(app, "status", None), "value", str(getattr(app, "status", "NOT_STARTED")))
        if state == "RUNNING":
            return
        if state == "DEPLOY_FAILED":
            raise StartFailed(f"the application failed to deploy: {_deploy_error(app)}")
        waiting = _waiting_for(overview, app)
        if now > deadline:
            raise StartFailed(f"not running after {now - started:.0f} s (--start-timeout): waiting for {waiting}")
        if now - said >= PROGRESS_SECONDS:
            print(f"[raymuter] still starting ({now - started:.0f} s): waiting for {waiting}", file=sys.stderr)
            said = now
        time.sleep(0.25)


def _deploy_error(app) -> str:
    """Why an application failed to deploy, in one line: its failed deployments' own error (a
    replica's exception, as `Server: ModelError: config.json is missing from ...`), where Serve's
    status has it, else the application's message."""
    said = []
    for name, deployment in (getattr(app, "deployments", None) or {}).items():
        if getattr(deployment.status, "value", str(deployment.status)) in ("DEPLOY_FAILED", "UNHEALTHY") \
                and deployment.message:
            said.append(f"{name}: {first_line(Exception(deployment.message))}")
    return "; ".join(said) or first_line(Exception(app.message))


def _waiting_for(overview, app) -> str:
    """What of the application and the proxies is not ready yet, in words."""
    parts = []
    for name, deployment in (getattr(app, "deployments", None) or {}).items():
        states = {getattr(k, "value", str(k)): v for k, v in (deployment.replica_states or {}).items()}
        if states.get("RUNNING", 0) == 0 or getattr(deployment.status, "value", "") != "HEALTHY":
            counts = ", ".join(f"{n} {s.lower()}" for s, n in sorted(states.items())) or "no replica yet"
            parts.append(f"{name} ({counts})")
    proxies = [getattr(s, "value", str(s)).lower() for s in (overview.proxies or {}).values()]
    if any(p != "healthy" for p in proxies):
        parts.append(f"the HTTP proxy ({', '.join(proxies)})")
    return "; ".join(parts) or "the application to be created"


def start(args, config: dict, local_only: bool, folder: Path | None = None) -> None:
    """A local Ray (its session in `folder`), Serve on --host:--port and the application on it,
    with progress while it starts; prints the URL. StartFailed after --start-timeout."""
    import ray
    from ray import serve

    from .. import instance, loopback
    from ..app import build
    from ..config import served_name

    started = time.monotonic()
    deadline = started + getattr(args, "start_timeout", START_TIMEOUT)
    print("[raymuter] starting Ray ...", file=sys.stderr)
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    if local_only:
        runtime_env["worker_process_setup_hook"] = loopback.SETUP_HOOK
    options = {} if folder is None else {"_temp_dir": str(folder / "ray")}
    if args.dashboard:
        options["dashboard_port"] = 8265 if _free(args.host, 8265) else instance.free_port()
    with signals_deferred(), instance.dashboard_agent_on_a_free_port():
        ray.init(include_dashboard=args.dashboard, num_cpus=args.num_cpus, log_to_driver=False,
                 runtime_env=runtime_env, **options)
    quiet_node()
    if args.dashboard:
        print(f"[raymuter] Ray's dashboard: http://127.0.0.1:{options['dashboard_port']}", file=sys.stderr)
    print(f"[raymuter] Ray started ({time.monotonic() - started:.1f} s); starting the application "
          "(each replica loads the model) ...", file=sys.stderr)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
    except Exception as e:
        try:  # taken since the first check: say so, with what Serve said (its own proxy may hold the port)
            check_port(args.host, args.port)
        except ValueError as taken:
            raise ValueError(f"{taken}; Serve did not start: {type(e).__name__}: {str(e)[:500]}") from None
        raise
    serve._run(build(config), _blocking=False, name="raymuter", route_prefix="/")
    wait_running("raymuter", deadline, started)
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    if not wait_routed(url, timeout=max(deadline - time.monotonic(), 5.0)):
        raise StartFailed(f"the application runs but {url}/health does not answer through the proxy "
                          f"after {time.monotonic() - started:.0f} s (--start-timeout)")
    name = served_name(args.model, args.name)
    keyed = config.get("api_key") is not None
    print(f"[raymuter] serving '{name}' at {url}/v1 (ready in {time.monotonic() - started:.1f} s); Ctrl-C stops\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
          + ("-H \"Authorization: Bearer $RAYMUTER_API_KEY\" " if keyed else "")
          + f"-d '{{\"model\": \"{name}\", \"prompt\": \"The list type\", \"max_tokens\": 40}}'"
          + ("" if not keyed or os.environ.get("RAYMUTER_API_KEY") else
             "\n  (RAYMUTER_API_KEY: the --api-key this server was given)"),
          file=sys.stderr)


def quiet_node() -> None:
    """Stop the local node's log monitor: it tails every worker's log file to stream them to
    drivers, and this driver takes none (log_to_driver=False); the files are still written. It
    took ~0.7% of a core with no request (docs/serving.md "A quiet server")."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        if node is not None and node.head:
            node.kill_log_monitor(check_alive=False)
    except Exception as e:  # noqa: BLE001 - a Ray without it: nothing to stop
        print(f"[raymuter] Ray's log monitor kept ({type(e).__name__}: {e})", file=sys.stderr)


def _free(host: str, port: int) -> bool:
    try:
        check_port(host, port)
    except ValueError:
        return False
    return True
