"""The engine's arguments `raymuter serve` and `raymuter batch` share, and the layout they give."""

from __future__ import annotations

import argparse


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


def _generative_text(model: str | None, variant: str | None) -> bool:
    """Whether `model` (None: the default model) is a decoder-only text generator (not an
    encoder-decoder, vision or embedding model)."""
    if model is None:
        return True
    from generation.front import ModelFolder

    folder = ModelFolder.local(model, variant)
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
