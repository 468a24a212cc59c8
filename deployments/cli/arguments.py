"""The engine's arguments `raymuter serve` and `raymuter batch` share, and the layout they give."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser, batch: bool = False) -> None:
    """The model and how its decoder runs: what `raymuter serve` and `raymuter batch` share, a
    flag per EngineOptions field that has one (its name, a server's default or, where `batch`,
    `raymuter batch`'s, its help), the model and generation settings."""
    from generation.front import EngineOptions

    parser.add_argument("--model", help="model folder or hub id (default: the model that ships with Raymuter)")
    parser.add_argument("--name", help="the model id clients send (default: the folder's name)")
    EngineOptions.add_flags(parser, batch=batch)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a default generation setting for every request, e.g. --set max_new_tokens=64")
    parser.add_argument("--engine", choices=["onnx", "fake"], default="onnx", help=argparse_hidden())


def engine_config(args) -> dict:
    """The application's arguments (deployments.app.AppConfig) that add_engine_arguments' flags give."""
    import json
    from dataclasses import fields

    from generation.front import EngineOptions

    settings = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set takes NAME=JSON, not {item!r}")
        try:
            settings[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            settings[name.strip()] = value
    options = {f.name: getattr(args, f.name) for f in fields(EngineOptions) if f.metadata["flag"]}
    return dict(model=args.model, name=args.name, settings=settings, engine=args.engine, **options)


def port_number(text: str) -> int:
    """--port's type: an integer in 1-65535."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is an integer in 1-65535, not {text!r}")
    return port


def argparse_hidden():
    return argparse.SUPPRESS


def layout(args, routes_scaled: bool = False) -> dict:
    """AppConfig's colocate and engine_process from the command line's --split, --colocate and
    --engine-process (None or absent: not given; `raymuter batch` has none of them); with none
    given, a decoder-only text model's (the fastest on one node: bench/serve.py) unless the routes
    are autoscaled apart, and the two-deployment layout for anything else."""
    split, colocate, engine_process = (getattr(args, flag, None) for flag in ("split", "colocate", "engine_process"))
    if split and (colocate or engine_process):
        raise ValueError("--split puts the routes and the batching loop in separate places: it takes neither "
                         "--colocate nor --engine-process")
    if split or colocate is not None or engine_process is not None:
        return dict(colocate=bool(colocate), engine_process=bool(engine_process))
    fast = args.engine == "onnx" and not routes_scaled and _generative_text(args)
    return dict(colocate=fast, engine_process=fast)


def _generative_text(args) -> bool:
    """Whether the arguments' model (None: the default model) is a decoder-only text generator
    (not an encoder-decoder, vision or embedding model)."""
    if args.model is None:
        return True
    from generation.front import ModelFolder

    folder = ModelFolder.local(args.model, args.variant)
    return ModelFolder.kind(str(folder)) == "text" and not ModelFolder.embeds(folder)


def autoscaling_of(items: list[str]) -> dict:
    """--autoscale PART=MIN:MAX, repeated -> AppConfig.autoscaling."""
    from ..autoscaling import parse_autoscale

    out = {}
    for item in items:
        part, settings = parse_autoscale(item)
        out[part] = settings.model_dump()
    return out
