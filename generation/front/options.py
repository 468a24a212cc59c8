"""How the engine behind a front runs: the options of `EngineFront.from_model`, apart from the
generation settings (generation_config.json's fields) every request starts from.

Each option is written out here once, with its default, its range and a sentence of help: a
server's configuration (deployments.config.AppConfig), its command-line flags (`raymuter serve`,
`raymuter batch`) and the Helm chart's values schema are made from these fields
(`dataclasses.fields(EngineOptions)`, each field's metadata), and an option out of range is
refused by name when the options are made.

    options, settings = EngineOptions.split({"slots": 4, "threads": 1, "max_new_tokens": 64})
    front = EngineFront.from_model("folder", options, **settings)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from generation.engine.batching import DEFAULT_PREFILL_CHUNK_TOKENS
from generation.engine.admission import IDLE_PREFILL_FACTOR
from generation.runtime.precision import CHOICES as PRECISIONS

from .reasoning import CHOICES as REASONING_PARSERS
from .request import own_fields


def option(default, help: str, low=None, high=None, choices=None, served=None, flag: bool = True,
           off: str | None = None, serve: bool = True, batch: tuple | None = None, pairs: bool = False):
    """A field of EngineOptions: its default, a sentence of help, its integer range or its
    choices; `served`: a server's default where it differs from a library caller's (a server
    runs many rows, and keeps prefixes); `batch`: (`raymuter batch`'s default, why) where it
    differs from a server's; `flag`: whether the CLI makes it a flag (`off`: a true default's
    --no- flag's help); `serve`: whether a server's configuration takes it; `pairs`: a dict of
    names to strings, the flag's NAME=VALUE words (vLLM's --lora-modules)."""
    return field(default=default, metadata={"help": help, "low": low, "high": high, "choices": choices,
                                            "served": default if served is None else served, "flag": flag,
                                            "off": off, "serve": serve, "batch": batch, "pairs": pairs})


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs: each field's `help` (its metadata) says what it is; an option out of
    its range is a ValueError naming it."""

    slots: int = option(8, "rows the decoder steps together at most; as many run as the KV budget "
                           "(kv_cache_bytes) holds; 0: as many as the budget seats (256 where a row costs what it "
                           "holds, else the rows it holds at the capacity, at least 32)", 0, 1024, served=0)
    capacity: int | None = option(None, "tokens a slot holds, prompt and new tokens (default: the model's context, "
                                        "at most 4096)", 2, 2**31)
    max_waiting: int = option(256, "interactive requests queued before a new one is refused (a server's 503)", 0, 2**31)
    max_logprobs: int = option(20, "the most alternatives per token a request may ask; -1: no log-probabilities "
                                   "(the lean greedy loop)", -1, 20)
    threads: int | None = option(None, "onnxruntime intra-op threads of the decoder (default: one a core, within a "
                                       "container's CPU quota)", 1, 4096)
    provider: str | None = option(None, "cpu or cuda (default: CUDA where usable, else CPU)", choices=("cpu", "cuda"))
    variant: str | None = option(None, "dtype variant of a transformers.js export: fp16, q4, ... (default: fp32)")
    precision: str = option("auto", "the decoder's precision: auto (int8 where the CPU has int8 dot products and the "
                                    "weights are large, else as exported; the log says which and why), fp32, fp16 "
                                    "(the fused graph's), int8 (int8 weights, per-token int8 activations; built once, "
                                    "cached)", choices=PRECISIONS)
    cache_mode: str | None = option(None, "force a KV cache mode the graph supports (default: the graph's own)",
                                    choices=("in_place", "append", "grow"), flag=False, serve=False)
    draft: str | Path | None = option(None, "a draft model (folder or hub id, the model's tokenizer) whose proposals "
                                            "every step verifies: speculative decoding (settings num_assistant_tokens)")
    prefix_cache_bytes: int = option(0, "bytes of prefixes kept (prompts, and the answers decoded after them), so a "
                                        "prompt that starts as one seen before (a conversation's next turn) runs "
                                        "only its rest; 0: off", 0, 2**40, served=256 * 2**20)
    kv_cache_bytes: int | None = option(None, "the KV cache's budget: requests are seated while what their rows hold "
                                              "fits it, up to slots (default: a quarter of the machine's memory, or of a "
                                              "container's limit; 0: "
                                              "none)", 0, 2**46)
    prefill_chunk_tokens: int | None = option(None, "prompt tokens the decoder runs per step: a long prompt (or a "
                                                    "burst) runs in chunks between the running rows' steps, which "
                                                    f"keep their pace (default: {DEFAULT_PREFILL_CHUNK_TOKENS}, {IDLE_PREFILL_FACTOR}x "
                                                    "that while no row runs; 0: every prompt whole at once)", 0, 2**31,
                                              batch=(0, "every prompt whole at once, no interactive rows to keep "
                                                        "pace for"))
    fuse: bool = option(True, "run an Optimum / transformers.js Llama-family decoder as its fused rewrite "
                              "(generation.runtime.fusion; built once, cached under $RAYMUTER_CACHE)",
                        off="run an Optimum / transformers.js decoder as exported, not as its fused rewrite "
                            "(generation.runtime.fusion; built once, cached under $RAYMUTER_CACHE)")
    spin: bool = option(True, "the decoder's idle onnxruntime threads spin between the model's runs (false: they "
                              "sleep, freeing the cores for a server's HTTP stack on a small machine)",
                        off="the decoder's idle onnxruntime threads sleep between the model's runs instead of "
                            "spinning (frees the cores for the HTTP stack: a small CPU machine; see docs/serving.md)")
    engine_process: bool = option(False, "the batching loop in a child process (decoder-only text models): a "
                                         "server's event loop and the engine's Python then share no GIL", flag=False)
    engine_cores: tuple[int, ...] | None = option(None, "the cores the engine process computes on (the rest stay "
                                                        "the server's); needs engine_process", flag=False)
    reserve_cores: int | None = option(None, "the engine process computes on all but the first this many cores "
                                             "(default: 1 from 4 cores, 0 below); needs engine_process", 0, 4096,
                                       flag=False)
    grammar_budget: object = option(None, "what one request's constraint (structured outputs, a tool's parameters) "
                                          "may cost: generation.logits.constraints.GrammarBudget, or a dict of its "
                                          "fields (seconds, max_grammar_size, initial_lexer_fuel, step_lexer_fuel, "
                                          "step_max_items, max_items_in_row, max_lexer_states; default: 1 s, 4096 "
                                          "symbols, 50000 fuel, llguidance's for the rest)",
                                    served={})
    lora_modules: dict | None = option(None, "LoRA adapters by name (PEFT folders or hub ids), each request's "
                                             "`model` naming one or the base model", served={}, pairs=True)
    max_loras: int = option(0, "LoRA adapters resident at once (the least recently used idle one leaves for a new "
                               "one); 0: as many as lora_modules names, at least 4, where it names any, else no "
                               "adapter path at all", 0, 1024)
    max_lora_rank: int = option(16, "the largest rank of a LoRA adapter (each resident one holds this rank for "
                                    "each module it changes)", 1, 1024)
    reasoning_parser: str = option("auto", "how a chat's reasoning is told from its answer: auto (from the chat "
                                           "template), none, or a parser by name (think: <think>...</think>; "
                                           "mistral: [THINK]...[/THINK])", choices=REASONING_PARSERS)

    def __post_init__(self):
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None or isinstance(value, bool):
                continue
            if meta["choices"] is not None and value not in meta["choices"]:
                raise ValueError(f"{f.name}: one of {', '.join(meta['choices'])}, not {value!r}")
            if meta["low"] is not None and not (isinstance(value, int) and meta["low"] <= value <= meta["high"]):
                raise ValueError(f"{f.name}: an integer from {meta['low']} to {meta['high']}, not {value!r}")
        modules = self.lora_modules or {}
        if not (isinstance(modules, dict) and all(isinstance(k, str) and k and isinstance(v, str) and v
                                                  for k, v in modules.items())):
            raise ValueError(f"lora_modules: an object of adapter names to folders or hub ids, not {modules!r}")
        if self.max_loras and len(modules) > self.max_loras:
            raise ValueError(f"max_loras: {self.max_loras} places for the {len(modules)} adapters lora_modules names")
        if not self.engine_process and (self.engine_cores is not None or self.reserve_cores is not None):
            raise ValueError("engine_cores and reserve_cores place the batching loop's child process: they need "
                             "engine_process")
        if self.engine_cores is not None and self.reserve_cores is not None:
            raise ValueError("engine_cores and reserve_cores: give one (the replica keeps the cores engine_cores "
                             "does not name)")

    @classmethod
    def split(cls, values: dict) -> tuple["EngineOptions", dict]:
        """(the options among `values`, the rest: generation settings)."""
        options = own_fields(cls, values)
        return cls(**options), {k: v for k, v in values.items() if k not in options}

    @classmethod
    def add_flags(cls, parser, names=None, served: bool = True, batch: bool = False) -> None:
        """A flag on `parser` for each option of `names` (default: each whose `flag` says so), as its
        field gives it: --kv-cache-bytes, its range's type or its choices, its help, its default (a
        server's where `served`, `raymuter batch`'s where `batch`, else a library caller's; a true
        default makes a --no- flag). A dict option (grammar_budget) takes FIELD=VALUE[,FIELD=VALUE],
        repeated."""
        for option in fields(cls):
            meta = option.metadata
            if not (option.name in names if names is not None else meta["flag"]):
                continue
            default, help = meta["served"] if served else option.default, meta["help"]
            flag = "--" + option.name.replace("_", "-")
            if default is True:
                parser.add_argument("--no-" + flag[2:], dest=option.name, action="store_false", help=meta["off"])
            elif meta["pairs"]:
                parser.add_argument(flag, action=_Pairs, nargs="+", default=dict(default or {}),
                                    metavar="NAME=PATH", help=f"{help}; e.g. {flag} sql=./sql-lora chat=org/chat-lora")
            elif isinstance(meta["served"], dict):  # grammar_budget: its fields, parsed and checked here
                parser.add_argument(flag, action=_FieldValues, default=dict(default or {}), metavar="FIELD=VALUE[,FIELD=VALUE]",
                                    help=f"{help}; e.g. {flag} seconds=2,max_grammar_size=8192")
            else:
                if batch and meta["batch"] is not None:
                    default, why = meta["batch"]
                    help = f"{help.split(' (default:')[0]} (default: {default}: {why})"
                elif default is not None:
                    help = f"{help} (default: {default})"
                parser.add_argument(flag, type=int if meta["low"] is not None else str, default=default,
                                    choices=meta["choices"], help=help)

    def lora(self):
        """The LoRA adapters `generation.load` builds for (runtime.lora.registry.LoraSpec), or None
        for no adapter path."""
        modules = dict(self.lora_modules or {})
        if not modules and not self.max_loras:
            return None
        from generation.runtime.lora.registry import LoraSpec

        return LoraSpec(self.max_loras or max(len(modules), 4), self.max_lora_rank, tuple(modules.items()))

    def with_adapters(self, modules: dict | None) -> "EngineOptions":
        """These options with `modules` (name -> folder) the adapters known at start, the places as
        many as now; None: no adapter path (a draft model's)."""
        from dataclasses import replace

        if modules is None:
            return replace(self, lora_modules=None, max_loras=0)
        spec = self.lora()
        return replace(self, lora_modules=dict(modules), max_loras=spec.max_loras if spec else max(len(modules), 4))

    def context_arguments(self) -> dict:
        """The context's arguments (generation.context's) these options give: log-probabilities, the
        KV cache mode, the constraint budget."""
        return dict(cache_mode=self.cache_mode, token_logprobs=self.max_logprobs >= 0,
                    top_logprobs=max(0, self.max_logprobs), grammar_budget=self.grammar_budget)

    def loop_arguments(self) -> dict:
        """The batching loop's arguments (ContinuousBatcher's: its slots, queue and budgets)."""
        return {name: getattr(self, name) for name in LOOP_OPTIONS}


class _Pairs(argparse.Action):
    """NAME=VALUE words, repeated -> one dict of strings (a later name wins)."""

    def __call__(self, parser, namespace, words, option_string=None):
        values = dict(getattr(namespace, self.dest) or {})
        for word in words:
            name, sep, value = word.partition("=")
            if not sep or not name.strip() or not value.strip():
                raise argparse.ArgumentError(self, f"takes NAME=PATH words, not {word!r}")
            values[name.strip()] = value.strip()
        setattr(namespace, self.dest, values)


class _FieldValues(argparse.Action):
    """FIELD=VALUE[,FIELD=VALUE], repeated -> one dict of numbers (a later value wins), checked
    as the option's type takes it (GrammarBudget.of: a field that is not one, a value out of range)
    before anything starts."""

    def __call__(self, parser, namespace, text, option_string=None):
        from generation.logits.constraints import GrammarBudget

        values = dict(getattr(namespace, self.dest) or {})
        for pair in text.split(","):
            name, sep, value = pair.partition("=")
            try:
                values[name.strip()] = float(value) if name.strip() == "seconds" else int(value)
            except ValueError:
                raise argparse.ArgumentError(self, f"takes FIELD=VALUE (VALUE a number), not {pair!r}") from None
        try:
            GrammarBudget.of(values)
        except ValueError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, values)


LOOP_OPTIONS = ("slots", "capacity", "max_waiting", "prefix_cache_bytes", "kv_cache_bytes", "prefill_chunk_tokens")
