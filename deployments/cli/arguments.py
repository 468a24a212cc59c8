"""The engine's arguments `raymuter serve` and `raymuter batch` share, and the layout they give."""

from __future__ import annotations

import argparse


def add_engine_arguments(parser, whole_prompts: bool = False) -> None:
    """The model and how its decoder runs: what `raymuter serve` and `raymuter batch` share, a
    flag per EngineOptions field that has one (its name, a server's default, its help), and the
    model, generation settings and the constraint budget (`whole_prompts`: --prefill-chunk-tokens
    defaults to 0, batch_engine_config's)."""
    from dataclasses import fields

    from generation.front import EngineOptions

    parser.add_argument("--model", help="model folder or hub id (default: the model that ships with Raymuter)")
    parser.add_argument("--name", help="the model id clients send (default: the folder's name)")
    helps = None
    if whole_prompts:  # batch_engine_config's default
        chunks = next(f for f in fields(EngineOptions) if f.name == "prefill_chunk_tokens")
        helps = {chunks.name: chunks.metadata["help"].split(" (default:")[0] + " (default: 0: every prompt whole at "
                                                                              "once, no interactive rows to keep pace for)"}
    EngineOptions.add_flags(parser, helps=helps)
    parser.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                        help="a default generation setting for every request, e.g. --set max_new_tokens=64")
    parser.add_argument("--grammar-budget", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                        help="what one request's constraint (structured outputs, a tool's parameters) may cost, e.g. "
                             "--grammar-budget seconds=2,max_grammar_size=8192 (FIELD: seconds, max_grammar_size, "
                             "initial_lexer_fuel, step_lexer_fuel, step_max_items, max_items_in_row, max_lexer_states; "
                             "default: 1 s, 4096 symbols, 50000 fuel, llguidance's for the rest)")
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
    return dict(model=args.model, name=args.name, settings=settings, engine=args.engine,
                grammar_budget=grammar_budget_of(args.grammar_budget), **options)


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
    from ..autoscaling import parse_autoscale

    out = {}
    for item in items:
        part, settings = parse_autoscale(item)
        out[part] = settings.model_dump()
    return out
