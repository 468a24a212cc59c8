"""Assisted decoding's speed: tokens/s and target-model steps per token, with and without
prompt lookup, on an input-grounded and an ungrounded workload, at batch 1 and 8.

Model: the ~125M random-weight Llama of bench/models.py (built once into
$RAYMUTER_BENCH_MODELS, default ~/.cache/raymuter/bench-models), in_place (genai graph) and
append (Optimum export) cache modes, 2 intra-op threads.

* grounded: each prompt is 32 random ids P followed by the first `--copied` tokens of the
  model's own greedy output G for P; the model then continues with the rest of G, which
  (a random-weight model falls into loops) repeats spans of the prompt.
* ungrounded: 32 random ids, sampled at temperature 1 with top_k 0 (a random model's
  distribution is nearly flat over 32000 ids, so nothing repeats).

The ceiling column is the most any candidate generator could give on this machine: a verify
run of width w (every row's last token and w - 1 candidates) timed against a plain step, at
the best w, as if every candidate were kept. Where a plain step already keeps the hardware busy
(a batch on a CPU) a wide run costs nearly its width, and the ceiling falls toward 1.

"lookup" is prompt lookup as generate() runs it, verifying the candidates worth their cost
(generation/assisted/budget.py); "every candidate" verifies all of them (transformers' way).

Every row makes `--new` tokens (eos ignored); the assisted tokens are checked equal to the plain
ones (sampling: the same seeds give the same tokens). Times are the best of `--repeats`, systems
interleaved. A target step is one `cache.decode` or `cache.verify` (the in_place cache runs a
batch's verify row by row: one step, `batch` runs).

    PYTHONPATH=. python bench/assisted.py                      # both modes, B=1 and 8: ~4 min
    PYTHONPATH=. python bench/assisted.py --modes append --batch 1
    PYTHONPATH=. python bench/assisted.py --draft             # with the other export as a draft

The ungrounded workload samples, so a draft's speculative sampling gives other (equally
distributed) tokens there: only the grounded draft tokens are checked.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
import generation  # noqa: E402
from generation.assisted.budget import CostAware  # noqa: E402

LAYOUT = {"in_place": "genai", "append": "optimum"}


class Counting:
    """Wraps a candidate generator, counting the assisted steps (target runs)."""

    def __init__(self, inner):
        self.inner, self.steps = inner, 0

    def propose(self, state, rows, room, allowed=None):
        self.steps += 1
        return self.inner.propose(state, rows, room, allowed)

    def accepted(self, rows, accepted, counts):
        self.inner.accepted(rows, accepted, counts)


def run(ctx, prompts, seeds, counting: list, every: bool = False):
    """generate() with its candidate generator counted; `every`: without the cost rule (every
    candidate verified)."""
    module = importlib.import_module("generation.engine.generate")
    original = module.candidates_for

    def wrapped(c):
        inner = original(c)
        if inner is None:
            return None
        if every and isinstance(inner, CostAware):
            inner = inner.inner
        counting.append(Counting(inner))
        return counting[-1]
    module.candidates_for = wrapped
    try:
        t0 = time.perf_counter()
        out = generation.generate(ctx, prompts, seeds=seeds)
        return out, time.perf_counter() - t0
    finally:
        module.candidates_for = original


def ceiling(model, mode: str, batch: int, k: int, repeats: int) -> tuple[float, int]:
    """The most a verify step can give over plain steps on this machine: every row keeps all
    of w - 1 candidates, so w tokens a row for what a verify run of width w costs, over the
    cost of a plain step (which gives one). Returns the best w / cost(w) and its w."""
    ctx = generation.context(model, cache_mode=mode, max_new_tokens=8, do_sample=False)
    state = generation.new_state(ctx, slots=batch, capacity=256)
    cache, lengths, rows = state.cache, np.full(batch, 128, np.int64), np.arange(batch)

    def best_of(run):
        times = []
        for _ in range(repeats * 3):
            t0 = time.perf_counter()
            run()
            times.append(time.perf_counter() - t0)
        return min(times)

    cache.rewind(lengths)  # every row holds 128 tokens (the in_place mask)
    plain = best_of(lambda: (cache.decode(lengths), cache.rewind(lengths)))
    gains = {}
    for width in range(2, k + 2):
        ids = np.ones((batch, width), np.int64)
        widths = np.full(batch, width)
        gains[width] = width * plain / best_of(lambda: (cache.verify(lengths, ids, rows, widths), cache.rewind(lengths)))
    width = max(gains, key=gains.get)
    return gains[width], width


def workloads(model, batch, args):
    rng = np.random.default_rng(0)
    bases = rng.integers(3, model.vocab_size, (batch, 32)).tolist()
    plain = generation.context(model, max_new_tokens=args.copied + args.new, do_sample=False, eos_token_id=[])
    continued = generation.generate(plain, bases, seeds=[0] * batch)
    grounded = [b + g[:args.copied] for b, g in zip(bases, continued)]
    return {"grounded": (grounded, dict(do_sample=False)),
            "ungrounded": (bases, dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="in_place,append")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--copied", type=int, default=64)
    parser.add_argument("--k", type=int, default=10, help="prompt_lookup_num_tokens (transformers' default 10)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--draft", action="store_true",
                        help="also a draft: the model's other export (the same weights: every candidate is kept, "
                             "so this shows the steps saved and what a draft as costly as the model gives)")
    parser.add_argument("--draft-tokens", type=int, default=5)
    args = parser.parse_args()
    root = Path(os.environ.get("RAYMUTER_BENCH_MODELS", Path.home() / ".cache/raymuter/bench-models")) / "small"
    head = ("| mode | workload | B | plain tok/s | lookup tok/s | ratio | steps/token plain | lookup "
            "| every candidate: ratio | steps/token | ceiling |")
    print(head + (" draft tok/s | ratio | steps/token draft |" if args.draft else ""))
    print("|---" * (11 + 3 * args.draft) + "|")
    for mode in args.modes.split(","):
        model = generation.load(root / LAYOUT[mode], threads=args.threads)
        other = {"in_place": "append", "append": "in_place"}[mode]
        if args.draft:  # both without spin-waiting threads: they run in turns (generation.load)
            draft = generation.load(root / LAYOUT[other], threads=args.threads, spin_wait=False)
            drafted = generation.load(root / LAYOUT[mode], threads=args.threads, spin_wait=False)
        else:
            draft = drafted = None
        for batch in [int(b) for b in args.batch.split(",")]:
            most, width = ceiling(model, mode, batch, args.k, args.repeats)
            for name, (prompts, settings) in workloads(model, batch, args).items():
                seeds = list(range(batch))
                common = dict(max_new_tokens=args.new, eos_token_id=[], cache_mode=mode, repetition_penalty=1.0,
                              **settings)
                lookup = generation.context(model, prompt_lookup_num_tokens=args.k, **common)
                systems = {"plain": generation.context(model, **common), "lookup": lookup, "every": lookup}
                if draft is not None:
                    systems["draft"] = generation.context(drafted, draft=draft, num_assistant_tokens=args.draft_tokens,
                                                          **common)
                best, outs, counts = {}, {}, {}
                for _ in range(args.repeats):
                    for key, ctx in systems.items():
                        counting = []
                        out, seconds = run(ctx, prompts, seeds, counting, every=key == "every")
                        best[key] = min(best.get(key, seconds), seconds)
                        outs[key] = out
                        counts[key] = counting[-1].steps if counting else args.new - 1
                if outs["lookup"] != outs["plain"] or outs["every"] != outs["plain"] or (draft is not None and name == "grounded"
                                                       and outs["draft"] != outs["plain"]):
                    raise SystemExit(f"{mode} {name} B={batch}: assisted decoding changed the tokens")
                tokens = sum(len(o) for o in outs["plain"])
                tps = {k: tokens / v for k, v in best.items()}
                per_token = {k: (c + 1) / (tokens / batch) for k, c in counts.items()}  # + the prompt's run
                print(f"| {mode} | {name} | {batch} | {tps['plain']:.0f} | {tps['lookup']:.0f} | "
                      f"{tps['lookup'] / tps['plain']:.2f}x | {per_token['plain']:.2f} | {per_token['lookup']:.2f} | "
                      f"{tps['every'] / tps['plain']:.2f}x | {per_token['every']:.2f} | {most:.2f}x (w {width}) |"
                      + (f" {tps['draft']:.0f} | {tps['draft'] / tps['plain']:.2f}x | {per_token['draft']:.2f} |"
                         if draft is not None else ""), flush=True)


if __name__ == "__main__":
    main()
