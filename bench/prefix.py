"""Prefix caching: time to first token of requests that share a long system prompt, with and
without the engine's prefix store, side by side in one run.

32 requests, each a 1000-token system prompt (the same for all) and a 20-token question of its
own, arrive one after another at the engine's Scheduler (as a decoder replica's batcher feeds
it); each is admitted as soon as it arrives and runs --new tokens. A request's time to first
token is from its arrival to the step that gave its first token. Two rounds alternate: without
the store, and with it (`Scheduler(prefix_cache_bytes=...)`; the first request fills it). The
table gives p50 / p95 time to first token, the tokens/s of the whole round, and the prefill's
cost per prompt token computed against per cached token copied.

    PYTHONPATH=. python bench/prefix.py                     # ~125M model, ~3 min on 2 cores
    PYTHONPATH=. python bench/prefix.py --model tiny --system 200
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from decode_systems import model_dirs  # noqa: E402
from generation.engine.scheduler import Scheduler  # noqa: E402


def round_of(ctx, prompts, new: int, slots: int, prefix_bytes: int) -> tuple[list[float], float, int]:
    """(each request's time to first token, the round's seconds, its tokens)."""
    scheduler = Scheduler(ctx, slots, max(len(p) for p in prompts) + new + 8, prefix_cache_bytes=prefix_bytes)
    pending = list(prompts)
    arrived, first, jobs = {}, {}, []
    started = time.perf_counter()
    while pending or scheduler.busy:
        if pending and len(scheduler.jobs()) < slots:  # the next request arrives once a slot is free
            job = scheduler.job(pending.pop(0), seed=len(jobs), settings={"max_new_tokens": new})
            scheduler.add(job)
            arrived[id(job)] = time.perf_counter()
            jobs.append(job)
        updates, _ = scheduler.step()
        now = time.perf_counter()
        for update in updates:
            for job, *_ in update.tokens():
                first.setdefault(id(job), now)
        for job in jobs:
            if job.tokens and id(job) not in first:
                first[id(job)] = now
    elapsed = time.perf_counter() - started
    return [first[id(j)] - arrived[id(j)] for j in jobs], elapsed, sum(len(j.tokens) for j in jobs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="small (~125M) or tiny")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--system", type=int, default=1000, help="tokens of the shared system prompt")
    parser.add_argument("--question", type=int, default=20)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    dirs = model_dirs(args.model)
    model = generation.load(dirs["genai"], threads=args.threads)
    ctx = generation.context(model, max_new_tokens=args.new, eos_token_id=[])
    rng = np.random.default_rng(0)
    vocab = model.vocab_size
    system = rng.integers(10, vocab - 10, args.system).tolist()
    prompts = [system + rng.integers(10, vocab - 10, args.question).tolist() for _ in range(args.requests)]
    results = {"no cache": [], "prefix cache": []}
    for _ in range(args.rounds):
        results["no cache"].append(round_of(ctx, prompts, args.new, args.slots, 0))
        results["prefix cache"].append(round_of(ctx, prompts, args.new, args.slots, 1 << 30))
    print(f"## Prefix caching: {args.requests} requests, a {args.system}-token system prompt + {args.question} "
          f"tokens each, {args.new} new tokens, {args.slots} slots ({args.model} model, in_place)\n")
    print("| | p50 TTFT ms | p95 TTFT ms | tokens/s | p50 ratio |")
    print("|---|---|---|---|---|")
    base = None
    for name, rounds in results.items():
        ttft = sorted(t for r in rounds for t in r[0])
        p50, p95 = statistics.median(ttft), ttft[int(0.95 * (len(ttft) - 1))]
        rate = sum(r[2] for r in rounds) / sum(r[1] for r in rounds)
        base = base or p50
        print(f"| {name} | {p50 * 1e3:.1f} | {p95 * 1e3:.1f} | {rate:.1f} | {p50 / base:.2f} |")


if __name__ == "__main__":
    main()
