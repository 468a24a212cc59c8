"""LoRA adapters per row on the real model: what a batch mixing adapters costs beside the base
alone (optional, not run in CI or tests).

The model is SmolLM2-135M's onnxruntime-genai fp32 build as `bench/real_models.py` builds it (the
in_place cache); the adapters are PEFT's, saved by `peft` from random weights on every projection
(q, k, v, o, gate, up, down), ranks 8 and 16 (built once under the bench cache). Rows:

  base          the model loaded without LoRA (no adapter path in its graph)
  mixed 4       the model loaded with --max-loras 4 --max-lora-rank 16, its rows spread over 4
                adapters (ranks 8, 16, 8, 16) in turn
  one adapter   the same, every row on the rank-16 adapter
  no adapter    the same, no row naming one (what the path costs when unused)

32-token prompts, 64 new tokens, eos ignored, greedy, in process; per batch size each row is run
once untimed, then --repeats times in alternating order, the median kept; tok/s = B x 64 / s.
`load` is what writing a rank-16 adapter into a place takes (read from disk and into the
bank's buffers): a run-time load does it between two steps, so it is the running rows' stall.
`read and check` is what a decoder replica adds to its first request of an adapter another
replica was told to load (it reads it from the path the request brings), before that load.

`--check N` first runs N prompts (English text through the chat template) per adapter, and the
base, as one mixed batch and compares each row's greedy tokens with transformers + PEFT on the
prompt alone (the real model's 30 layers, tokenizer and template: what the tiny fixtures miss).

    PYTHONPATH=. .venv/bin/python bench/lora.py                  # ~6 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/lora.py --batch 1,32 --repeats 5 --check 4
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH), str(BENCH.parent / "tests")]

RANKS = {"r8a": 8, "r16a": 16, "r8b": 8, "r16b": 16}
PROMPT, NEW = 32, 64


def adapters(hf: Path, root: Path) -> dict[str, Path]:
    """The four adapters of the real model, built once under `root` (PEFT, every projection)."""
    from model_builders.lora import build_adapters

    specs = {name: dict(r=rank, lora_alpha=rank, target_modules="all-linear") for name, rank in RANKS.items()}
    missing = {n: s for n, s in specs.items() if not (root / n / "adapter_model.safetensors").exists()}
    if missing:
        build_adapters(hf, root, missing)
    return {name: root / name for name in RANKS}


def timed(ctx, prompts, names) -> float:
    import generation

    start = time.perf_counter()
    rows = generation.generate(ctx, prompts, adapters=names)
    seconds = time.perf_counter() - start
    assert all(len(r) == NEW for r in rows)
    return len(prompts) * NEW / seconds


def check(model, hf: Path, found: dict, count: int) -> None:
    """Each adapter's (and the base's) rows of one mixed batch against transformers + PEFT alone."""
    import torch
    from transformers import AutoTokenizer

    import generation
    from model_builders.lora import peft_model

    tokenizer = AutoTokenizer.from_pretrained(hf)
    texts = ["Write a haiku about the sea.", "What is the capital of France?", "List three prime numbers.",
             "Explain what a compiler does.", "Say hello in Spanish.", "Why is the sky blue?"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
               for t in texts[:count]]
    names = [None] + list(found)
    rows = [(p, a) for a in names for p in prompts]
    ctx = generation.context(model, max_new_tokens=32, do_sample=False)
    ours = generation.generate(ctx, [p for p, _ in rows], adapters=[a for _, a in rows])
    oracle = peft_model(hf, found)
    equal = 0
    for (prompt, adapter), got in zip(rows, ours):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            if adapter is None:
                with oracle.disable_adapter():
                    want = oracle.generate(ids, max_new_tokens=32, do_sample=False)
            else:
                oracle.set_adapter(adapter)
                want = oracle.generate(ids, max_new_tokens=32, do_sample=False)
        want = [t for t in want[0, len(prompt):].tolist() if t not in (tokenizer.eos_token_id,)]
        equal += got == want[:len(got)] and len(got) == len(want)
        if got != want[:len(got)]:
            print(f"  differs: adapter {adapter}: {tokenizer.decode(got)!r} vs {tokenizer.decode(want)!r}")
    print(f"greedy rows equal to transformers + PEFT: {equal} of {len(rows)} (adapters {', '.join(found)} and the base)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", type=int, default=0, help="prompts per adapter compared with PEFT first")
    args = parser.parse_args(argv)

    import generation
    from generation.runtime.fusion import cache_root
    from generation.runtime.lora.registry import LoraSpec

    import machine
    from real_models import build_real

    dirs = build_real(cache_root() / "bench-models")
    found = adapters(dirs["hf"], cache_root() / "bench-models" / "lora")
    spec = LoraSpec(max_loras=4, max_lora_rank=16, modules=tuple((n, str(p)) for n, p in found.items()))
    base = generation.load(dirs["genai"])
    lora = generation.load(dirs["genai"], lora=spec)
    print(f"# {machine.cpu()}; SmolLM2-135M genai fp32, in_place; LoRA bank {lora.lora.bank.nbytes / 1e6:.1f} MB")
    if args.check:
        check(lora, dirs["hf"], found, args.check)
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = rng.integers(100, 40000, (batch, PROMPT)).tolist()
        names = list(RANKS)
        rows = {"base": (base, None), "mixed 4": (lora, [names[i % 4] for i in range(batch)]),
                "one adapter": (lora, ["r16a"] * batch), "no adapter": (lora, None)}
        contexts = {}
        for name, (model, _) in rows.items():
            ctx = generation.context(model, max_new_tokens=NEW, do_sample=False, eos_token_id=None, min_new_tokens=NEW)
            contexts[name] = generation.compile(ctx, batch_size=batch)
        rates = {name: [] for name in rows}
        for name in rows:
            timed(contexts[name], prompts, rows[name][1])
        for k in range(args.repeats):
            for name in (list(rows) if k % 2 == 0 else list(rows)[::-1]):
                rates[name].append(timed(contexts[name], prompts, rows[name][1]))
        base_rate = statistics.median(rates["base"])
        print(f"\n| B={batch} | tok/s (median of {args.repeats}) | vs base |\n|---|---|---|")
        for name in rows:
            rate = statistics.median(rates[name])
            print(f"| {name} | {rate:.1f} | {rate / base_rate:.2f}x |")
    loads = []
    for _ in range(5):
        start = time.perf_counter()
        lora.lora.bank.load(generation.runtime.lora.adapter.read_adapter("r16a", found["r16a"]), 4)
        loads.append((time.perf_counter() - start) * 1000)
    print(f"\nload of a rank-16 adapter into a place: {statistics.median(loads):.1f} ms (median of 5)")
    reads = []
    for k in range(5):  # a decoder replica's first request of an adapter loaded through another replica
        start = time.perf_counter()
        lora.lora.add(f"lazy{k}", found["r16a"])
        reads.append((time.perf_counter() - start) * 1000)
    print(f"read and check of a rank-16 adapter (a replica's first request of one it did not load; on the "
          f"replica's thread, before the place): {statistics.median(reads):.1f} ms (median of 5)")


if __name__ == "__main__":
    main()
