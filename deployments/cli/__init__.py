"""The `raymuter` command: `raymuter generate` (the engine's, generation/cli.py), `raymuter serve`
(a local Ray, the application on it, the URL printed, Ctrl-C to stop) and `raymuter batch`. It
lives here, in the serving layer, because it composes both; the engine never imports deployments.

The model and the port are checked before Ray starts; SIGINT and SIGTERM stop it however it was
launched; with a loopback --host, nothing of it listens beyond loopback (deployments/loopback.py,
deployments/haproxy.py). On a cluster, use cluster/serve.yaml with `serve run` / `serve deploy`.

    __init__.py     `parser` and `main` (the console script; `python -m deployments.cli`)
    serve.py        `raymuter serve`: its arguments, the application's config, the run
    batch.py        `raymuter batch`: its arguments and the run on Ray Data
    arguments.py    the engine's arguments both share, and the layout they give
    environment.py  Ray's and Serve's environment for a local instance, signals
    startup.py      start-up: the application deployed, progress and failures in one line
"""

from __future__ import annotations

import argparse
import logging
import sys

from .batch import add_batch_arguments, batch_command
from .serve import add_arguments, serve_command


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
