"""How the engine behind a front runs: the options of `EngineFront.from_model`, apart from the
generation settings (generation_config.json's fields) every request starts from.

    options, settings = EngineOptions.split({"slots": 4, "threads": 1, "max_new_tokens": 64})
    front = EngineFront.from_model("folder", options, **settings)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .request import own_fields


@dataclass(frozen=True)
class EngineOptions:
    """`slots`: rows the batch steps together; `capacity`: tokens per slot (default: the model's
    context, at most 4096); `max_waiting`: the queue (beyond it, Overloaded); `max_logprobs`: the
    most alternatives a request may ask per token (-1: none, the lean greedy loop); `threads`,
    `provider`, `variant`, `fuse`: generation.load's; `spin`: onnxruntime's idle threads spin
    between runs (False frees the cores for the server); `cache_mode`: generation.context's;
    `draft`: a small model with the same tokenizer whose proposals every step verifies;
    `prefix_cache_bytes`: prompt prefixes kept for reuse (0: none); `kv_cache_bytes`: the KV
    cache's budget, rows admitted while what they hold fits it (None: a quarter of the machine's
    memory; 0: none, each slot may hold the whole capacity); `prefill_chunk_tokens`: the prompt
    tokens a step may run, a long prompt in chunks between the running rows' steps (None:
    batching.DEFAULT_PREFILL_CHUNK_TOKENS; 0: every prompt whole); `engine_process`: the batching
    loop in a child process (decoder-only text models); `engine_cores`, `reserve_cores`: where that
    child computes (generation.runtime.cores: the cores named, or all but the first `reserve_cores`,
    its onnxruntime threads one a core unless `threads` says; this process keeps the others; None:
    the machine size's default); `grammar_budget`: what a request's
    constraint may cost (generation.logits.constraints.GrammarBudget, or a dict of its fields);
    `reasoning_parser`: how a chat's reasoning is told from its answer (front/reasoning.py: "auto"
    from the chat template, "none", or a parser by name)."""

    slots: int = 8
    capacity: int | None = None
    max_waiting: int = 256
    max_logprobs: int = 20
    threads: int | None = None
    provider: str | None = None
    variant: str | None = None
    cache_mode: str | None = None
    draft: str | Path | None = None
    prefix_cache_bytes: int = 0
    kv_cache_bytes: int | None = None
    prefill_chunk_tokens: int | None = None
    fuse: bool = True
    spin: bool = True
    engine_process: bool = False
    engine_cores: tuple[int, ...] | None = None
    reserve_cores: int | None = None
    grammar_budget: object = None
    reasoning_parser: str = "auto"

    @classmethod
    def split(cls, values: dict) -> tuple["EngineOptions", dict]:
        """(the options among `values`, the rest: generation settings)."""
        options = own_fields(cls, values)
        return cls(**options), {k: v for k, v in values.items() if k not in options}

    def batcher_arguments(self) -> dict:
        """ContinuousBatcher.from_model's arguments (all but what the front itself uses)."""
        out = asdict(self)
        for name in ("engine_process", "engine_cores", "reserve_cores", "reasoning_parser"):
            del out[name]
        return out
