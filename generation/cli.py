"""`raymuter generate`: generate text from a model folder or hub id, streamed as it comes.

The `raymuter` command itself (this subcommand beside `raymuter serve`) is deployments/cli/'s
`main`: the serving layer composes the engine's command, the engine never imports the serving
layer."""

from __future__ import annotations

import argparse
import sys
import time


class HelpFormatter(argparse.HelpFormatter):
    """argparse.ArgumentDefaultsHelpFormatter without its noise: no default for a flag (--greedy),
    an unset option ("None") or an empty list, and none added where the help says it already."""

    def _get_help_string(self, action) -> str:
        text, default = action.help or "", action.default
        if (not action.option_strings or action.nargs == 0 or "default" in text or default is None
                or default == [] or default is argparse.SUPPRESS):
            return text
        return text + " (default: %(default)s)"


def version() -> str:
    """The installed distribution's version; in a checkout that is not installed, pyproject.toml's."""
    from importlib import metadata

    try:
        return metadata.version("raymuter")
    except metadata.PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
                return tomllib.load(f)["project"]["version"] + " (not installed)"
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown (not installed)"


# The engine options `raymuter generate` takes (generation.front's EngineOptions: their flags, help and
# checks); the batching loop's are a server's.
ENGINE_FLAGS = ("threads", "provider", "variant", "precision", "cache_mode", "fuse")


def add_generate_command(commands) -> None:
    """The `generate` subcommand, on `commands` (an argparse parser's add_subparsers())."""
    from generation.front import EngineOptions

    gen = commands.add_parser("generate", help="generate text after one or more prompts, streamed as it comes",
                              formatter_class=HelpFormatter)
    gen.add_argument("prompts", nargs="+", help="prompt text; several prompts run as one batch")
    gen.add_argument("--model", help="model folder (Hugging Face layout) or hub id (default: the model that ships "
                     "with Raymuter, a small Llama trained on the Python documentation)")
    EngineOptions.add_flags(gen, ENGINE_FLAGS, served=False)  # as `raymuter serve` has them, a library's defaults
    gen.add_argument("--max-new-tokens", type=int, help="new tokens per prompt (default: generation_config.json's)")
    sampling = gen.add_mutually_exclusive_group()
    sampling.add_argument("--do-sample", dest="do_sample", action="store_true", default=None,
                          help="sample (default: generation_config.json's do_sample)")
    sampling.add_argument("--greedy", dest="do_sample", action="store_false", help="greedy decoding")
    gen.add_argument("--temperature", type=float, help="sampling temperature (default: generation_config.json's)")
    gen.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default: generation_config.json's)")
    gen.add_argument("--top-p", type=float, help="sample among the likeliest tokens whose probabilities add up to p "
                     "(default: generation_config.json's)")
    gen.add_argument("--repetition-penalty", type=float, help="divide the scores of tokens already in the text "
                     "(default: generation_config.json's)")
    gen.add_argument("--presence-penalty", type=float, help="OpenAI's: subtract this from the score of every token "
                     "already generated, from -2 to 2 (default: generation_config.json's, else 0)")
    gen.add_argument("--frequency-penalty", type=float, help="OpenAI's: subtract this times its count from the score "
                     "of every token already generated, from -2 to 2 (default: generation_config.json's, else 0)")
    gen.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeat for several); the text "
                     "ends before it")
    shape = gen.add_mutually_exclusive_group()  # structured_outputs: one constraint
    shape.add_argument("--json-schema", metavar="FILE", help="the output is JSON following the schema in FILE")
    shape.add_argument("--json", action="store_true", help="the output is a JSON object")
    shape.add_argument("--regex", metavar="PATTERN", help="the output matches the regular expression")
    shape.add_argument("--choice", action="append", metavar="TEXT", help="the output is one of these (repeat)")
    shape.add_argument("--grammar", metavar="FILE", help="the output follows the Lark (or GBNF) grammar in FILE")
    gen.add_argument("--set", action="append", default=[], metavar="NAME=JSON",
                     help="any generation_config.json setting, e.g. --set no_repeat_ngram_size=3 "
                     "--set 'bad_words_ids=[[5]]' (repeat for several)")
    gen.add_argument("--seed", type=int, default=0, help="seed of the first prompt; prompt i gets seed + i")
    gen.add_argument("--prompt-steps", choices=["whole", "pieces"], default="whole",
                     help="run the prompt in one step, or in power-of-two pieces")


def _overrides(args) -> dict:
    import json

    names = {"max_new_tokens": args.max_new_tokens, "do_sample": args.do_sample, "temperature": args.temperature,
             "top_k": args.top_k, "top_p": args.top_p, "repetition_penalty": args.repetition_penalty,
             "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
             "stop_strings": args.stop}
    overrides = {k: v for k, v in names.items() if v is not None}
    structured = _structured(args)
    if structured is not None:
        overrides["structured_outputs"] = structured
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--set takes NAME=JSON, not {item!r}")
        try:
            overrides[name.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[name.strip()] = value  # a bare string
    return overrides


def _structured(args) -> dict | None:
    """The structured_outputs setting of --json-schema, --json, --regex, --choice or --grammar."""
    import json
    from pathlib import Path

    def read(flag: str, name: str) -> str:
        try:
            return Path(name).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {name}: {e.strerror}") from None

    if args.json_schema:
        text = read("--json-schema", args.json_schema)
        try:
            return {"json": json.loads(text)}
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema: {args.json_schema} is not JSON: {e}") from None
    if args.json:
        return {"json_object": True}
    if args.regex:
        return {"regex": args.regex}
    if args.choice:
        return {"choice": args.choice}
    if args.grammar:
        return {"grammar": read("--grammar", args.grammar)}
    return None


def generate_command(args) -> int:
    import numpy as np

    import generation
    from generation.core.stop_strings import cut_at_stop
    from generation.front import EngineOptions
    from generation.front.loading import load_model
    from generation.text.tokenizer import Detokenizer, load_tokenizer

    started = time.perf_counter()
    if args.model is None:
        from generation.default_model import default_model_path

        args.model = default_model_path(args.variant)
        print(f"[raymuter] no --model given: using the default model in {args.model} (a small Llama trained on "
              "the Python documentation; its card is README.md beside it)", file=sys.stderr)
    options = EngineOptions.split(vars(args))[0]
    model = load_model(args.model, options)
    tokenizer = load_tokenizer(model.tokenizer_path, model.folder)
    ctx = generation.context(model, cache_mode=options.cache_mode, prompt_steps=args.prompt_steps, **_overrides(args))
    ctx = generation.compile(ctx, batch_size=len(args.prompts))
    print(f"[raymuter] {model.folder} ({model.decoder_path.name}, cache {ctx.cache_mode}, {model.provider}, "
          f"{model.threads} threads) loaded in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    print(f"[raymuter] precision {model.precision or 'as exported'} ({options.precision} asked): "
          f"{model.precision_reason}", file=sys.stderr)
    prompts = [tokenizer.encode(text).ids for text in args.prompts]
    seeds = [args.seed + i for i in range(len(prompts))]
    stops = ctx.settings.stop_strings
    stream = Detokenizer(tokenizer) if len(prompts) == 1 and not stops else None  # stop strings: cut, then print

    def on_token(event) -> None:
        token = int(event.token[0])
        if token >= 0:
            sys.stdout.write(stream.add(token))
            sys.stdout.flush()

    started = time.perf_counter()
    rows = generation.generate(ctx, prompts, seeds=seeds, on_token=on_token if stream else None)
    elapsed = time.perf_counter() - started
    if stream:
        print(stream.flush())
    else:
        for text, row in zip(args.prompts, rows):
            out = cut_at_stop(tokenizer.decode(row, skip_special_tokens=True), stops)
            print(out if len(prompts) == 1 else f"--- {text}\n{out}")
    count = int(np.sum([len(r) for r in rows]))
    print(f"[raymuter] {count} tokens in {elapsed:.2f} s ({count / max(elapsed, 1e-9):.1f} tokens/s)", file=sys.stderr)
    return 0
