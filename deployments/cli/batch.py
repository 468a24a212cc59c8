"""`raymuter batch`: a file of requests answered by engine actors on Ray Data (deployments/batch/run.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .arguments import add_engine_arguments, engine_config, layout
from .environment import local_ray_environment, signals_deferred, stop_on_signals


def add_batch_arguments(parser) -> None:
    """`raymuter batch`'s arguments (deployments/batch/run.py runs it)."""
    parser.add_argument("input", help="OpenAI batch JSONL (custom_id, method, url, body per line), or a table "
                                      "(.parquet, .csv, or .jsonl with --prompt-column / --messages-column)")
    parser.add_argument("output", help="OpenAI batch output JSONL; lines already there are not run again")
    add_engine_arguments(parser, batch=True)
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
    from .. import instance
    from ..batch.run import table_format

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
    from .. import instance
    from ..batch.run import ray_cpus, run_batch

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
    """`serve`'s engine options (with `raymuter batch`'s defaults: prompts whole unless
    --prefill-chunk-tokens says otherwise, a batch having no interactive rows whose pace chunks
    would keep), and a decoder-only text model's batching loop in a child process of the engine
    actor, as `serve`'s default layout has it (the lines' routes then do not share the loop's
    GIL): bench/batch.py."""
    return {**engine_config(args), **layout(args), "colocate": False}  # colocate places a server's routes: none here


def _table_options(args) -> dict | None:
    if not (args.prompt_column or args.messages_column):
        return None
    body = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                              ("seed", args.seed)) if v is not None}
    return {"prompt_column": args.prompt_column, "messages_column": args.messages_column,
            "id_column": args.id_column, "body": body}
