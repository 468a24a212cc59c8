"""`raymuter serve`: a local Ray, the application on it, the URL printed, Ctrl-C to stop."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from .arguments import add_engine_arguments, autoscaling_of, engine_config, layout, port_number
from .environment import START_TIMEOUT, local_environment, stop_on_signals
from .startup import StartFailed, check_port, first_line, start


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
                             "below every interactive request (default: --slots, 32 where --slots is 0)")
    parser.add_argument("--stream-interval-ms", type=float, default=10.0, metavar="MS",
                        help="a stream's chunks at most this often (the first at once; the tokens made meanwhile "
                             "travel together; 0: a chunk per token; default: 10)")
    parser.add_argument("--stream-chunks-per-second", type=float, default=200.0, metavar="N",
                        help="about this many chunks a second from all streams together while many rows run, each "
                             "stream's at most every 100 ms (default: 200; docs/performance.md, Stream pacing)")
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


def app_config(args) -> dict:
    """The application's arguments (deployments.app.AppConfig) from the command line's."""
    from generation.front import cores

    autoscaling = autoscaling_of(args.autoscale)
    where = layout(args, routes_scaled="ingress" in autoscaling)
    # one Server replica holds the records itself: one Ray worker process fewer (docs/serving.md "A quiet server")
    records = "server" if where["colocate"] and "decoder" not in autoscaling else "deployment"
    return dict(**engine_config(args), autoscaling=autoscaling, records=records,
                api_key=args.api_key if args.api_key is not None else os.environ.get("RAYMUTER_API_KEY"),
                response_store_bytes=args.response_store_bytes, response_ttl_seconds=args.response_ttl,
                response_folder=args.response_folder and os.path.abspath(args.response_folder),
                batch_folder=args.batch_folder and os.path.abspath(args.batch_folder),
                file_size_limit=args.file_size_limit, batch_concurrency=args.batch_concurrency,
                stream_interval_ms=args.stream_interval_ms, stream_chunks_per_second=args.stream_chunks_per_second,
                engine_cores=None if args.engine_cores is None else list(cores.parse(args.engine_cores,
                                                                                     "--engine-cores")),
                reserve_cores=args.reserve_cores, **where)


def place_cores(config: dict):
    """Where the engine process computes on this machine (generation.runtime.cores.Placement),
    written into `config` as the cores it names; None where the layout has no engine process.
    ValueError names the flag."""
    if not config["engine_process"]:
        if config.get("engine_cores") is not None or config.get("reserve_cores") is not None:
            raise ValueError("--engine-cores and --reserve-cores place the batching loop's child process "
                             "(--engine-process); this layout runs the loop in the replica")
        return None
    from generation.front import cores

    try:
        place = cores.placement(config.get("reserve_cores"), config.get("engine_cores"))
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


def check_models(args) -> None:
    """--model and --draft as `raymuter generate` checks a model (generation.front.ModelFolder.local,
    the same message): a folder must exist and hold config.json and the decoder file (a folder
    that is no model fails here, not in a replica after Ray started); a hub id is fetched, into
    the cache the replicas then read. No model is loaded here."""
    if args.engine != "onnx":
        return
    from generation.front import ModelFolder

    if args.model is not None:
        ModelFolder.local(args.model, args.variant)
    if args.draft is not None:
        ModelFolder.local(args.draft)


def check_batch_folder(folder: str | None) -> None:
    """--batch-folder made as the Records replica makes it (0700), before Ray starts: one that
    cannot be is one line naming the flag, not a replica that fails to start."""
    if folder is None:
        return
    from ..services.files import private_folder

    try:
        private_folder(Path(folder))
    except OSError as e:
        raise ValueError(f"--batch-folder: cannot keep files in {folder} ({e.strerror or e})") from None


def serve_command(args) -> int:
    # First thing: a server launched with SIGINT ignored (nohup, `&` in a script) kept ignoring a
    # Ctrl-C that came before Ray started, and went on to serve.
    stop_on_signals()
    from .. import instance

    folder = None
    try:
        check_models(args)  # a hub id is fetched here, before app_config reads its kind
        config = app_config(args)
        check_port(args.host, args.port)
        check_batch_folder(config["batch_folder"])
        if args.start_timeout <= 0:
            raise ValueError(f"--start-timeout: seconds above 0, not {args.start_timeout}")
        folder = instance.run_folder()
        if config["batch_folder"] is None:  # in the run folder, so that the uploads go with it at stop
            config["batch_folder"] = str(folder / "batches")
        if config["records"] == "server" and config["response_folder"] is None:
            # the records live in the Server's replica: one Serve replaces reads them back, as a
            # restarted Records replica would (gone at stop with the run folder)
            config["response_folder"] = str(folder / "responses")
        return _serve(args, config, folder)
    except KeyboardInterrupt:  # stopped before Ray started (_serve stops it once it has)
        print("[raymuter] stopping ...", file=sys.stderr)
        return 0
    finally:
        if folder is not None:
            instance.remove(folder)  # Ray's session and HAProxy's files: nothing of this instance stays in /tmp


def _serve(args, config: dict, folder: Path) -> int:
    local_only = local_environment(args, folder, fallback=routes_scale_to_zero(config))
    if args.model is None and args.engine == "onnx":
        from generation.default_model import default_model_path

        print(f"[raymuter] no --model: serving the default model ({default_model_path()})", file=sys.stderr)
    print(f"[raymuter] layout: {layout_words(config)}", file=sys.stderr)
    if args.engine == "onnx":
        from generation.default_model import default_model_path
        from generation.front import EngineOptions, ModelFolder

        options = EngineOptions.split(vars(args))[0]
        print(f"[raymuter] precision on this machine: {ModelFolder.precision(args.model or default_model_path(), options)}",
              file=sys.stderr)
    from ..app import AppConfig

    place = place_cores(config)
    AppConfig(**config)  # bad arguments fail here, before Ray starts
    if place is not None:
        print(f"[raymuter] cores: {place.words(config['threads'])}", file=sys.stderr)
        if not place.shared:  # Ray's processes, HAProxy and the replicas start from here: they inherit it
            from generation.front import cores

            cores.pin(place.service)
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
        from .. import instance

        logs = instance.keep_logs(folder / "ray")
        what = str(e) if isinstance(e, StartFailed) else f"{type(e).__name__}: {first_line(e)}"
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


def routes_scale_to_zero(config: dict) -> bool:
    """Whether the deployment holding the HTTP routes may have no replica (autoscaling's
    min_replicas 0): HAProxy then keeps Serve's fallback route, whose proxy holds a request while
    a replica starts; otherwise it answers 503 with Retry-After at once (deployments/haproxy.py)."""
    part = "decoder" if config.get("colocate") else "ingress"
    return (config.get("autoscaling") or {}).get(part, {}).get("min_replicas", 1) == 0
