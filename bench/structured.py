"""Structured outputs: what the constraint costs beside the model step.

Three tables, on the ~125M bench model (onnxruntime-genai layout, in_place cache), all rows of a
batch constrained to one JSON schema (an object of a name, an age, a list of tags and a long
note, so the constraint is active for every measured step):

1. The mask beside the step, at batch 1, 8 and 32: milliseconds per decode step spent in the
   constraint (bringing each row's matcher to its tokens, computing its mask, applying it) over
   the whole step's time (model run, processors, selection). Goal: at most 10% at batch 8.
2. Compiling: llguidance's tokenizer for the model's 32000 ids (once per model), a schema the
   first time (cold) and again (cached by content).
3. Tokens/s of the batch of 8 constrained requests against the same requests unconstrained, in
   alternating rounds (the machine is noisy: read the ratio).

    PYTHONPATH=. python bench/structured.py                  # ~125M model, ~2 min on 2 cores
    PYTHONPATH=. python bench/structured.py --model tiny
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from decode_systems import model_dirs  # noqa: E402
from generation.engine.scheduler import Scheduler  # noqa: E402
from generation.logits import constraints, processors  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "note"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 130},
                         "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
                         "note": {"type": "string", "maxLength": 2000}}}


class Timed:
    """processors.constrain, timed."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0
        self.inner = processors.constrain

    def __call__(self, *args):
        started = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1


def run(ctx, batch: int, steps: int, structured) -> tuple[float, float, int]:
    """(seconds of `steps` decode steps of `batch` rows, seconds of the constraint in them, tokens)."""
    settings = {"structured_outputs": structured} if structured else {}
    scheduler = Scheduler(ctx, slots=batch, capacity=steps + 64)
    jobs = [scheduler.job([5 + i, 6, 7, 8, 9, 10, 11, 12], seed=i, settings=settings) for i in range(batch)]
    for job in jobs:
        scheduler.add(job)
    scheduler.step()  # admission and the first step: not measured
    timed = Timed()
    processors.constrain = timed
    try:
        started = time.perf_counter()
        for _ in range(steps):
            scheduler.step()
        elapsed = time.perf_counter() - started
    finally:
        processors.constrain = timed.inner
    return elapsed, timed.seconds, steps * batch  # every row lives through the steps (no eos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="small (~125M) or tiny")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    model = generation.load(model_dirs(args.model)["genai"], threads=args.threads)
    ctx = generation.context(model, max_new_tokens=args.steps + 8, eos_token_id=[], do_sample=True, temperature=0.8)
    structured = {"json": SCHEMA}

    grammars = constraints.Grammars.of(ctx)
    started = time.perf_counter()
    grammars.tokenizer
    tokenizer_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    grammars.matcher(("json", json.dumps(SCHEMA)))
    cold_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    grammars.matcher(("json", json.dumps(SCHEMA)))
    cached_ms = (time.perf_counter() - started) * 1e3

    print(f"## The mask beside the step ({args.model} model, {args.steps} steps, median of {args.rounds})\n")
    print("| batch | step ms | constraint ms / step | share of the step |")
    print("|---|---|---|---|")
    for batch in (1, 8, 32):
        results = [run(ctx, batch, args.steps, structured) for _ in range(args.rounds)]
        step = statistics.median(r[0] for r in results) / args.steps
        mask = statistics.median(r[1] for r in results) / args.steps
        print(f"| {batch} | {step * 1e3:.2f} | {mask * 1e3:.3f} | {mask / step:.1%} |", flush=True)

    print("\n## Compiling\n")
    print("| what | ms |")
    print("|---|---|")
    print(f"| llguidance tokenizer ({model.vocab_size} ids, once per model) | {tokenizer_ms:.1f} |")
    print(f"| the schema, cold | {cold_ms:.2f} |")
    print(f"| the schema, cached (a copy of its matcher) | {cached_ms:.3f} |")

    plain, shaped = [], []
    for _ in range(args.rounds):  # alternating, so both see the same machine
        seconds, _, tokens = run(ctx, 8, args.steps, None)
        plain.append(tokens / seconds)
        seconds, _, tokens = run(ctx, 8, args.steps, structured)
        shaped.append(tokens / seconds)
    print(f"\n## Tokens/s, batch 8 (median of {args.rounds} alternating rounds)\n")
    print("| requests | tokens/s | ratio |")
    print("|---|---|---|")
    print(f"| unconstrained | {statistics.median(plain):.1f} | 1.00 |")
    print(f"| JSON schema | {statistics.median(shaped):.1f} | {statistics.median(shaped) / statistics.median(plain):.2f} |")


if __name__ == "__main__":
    main()
