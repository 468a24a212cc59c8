"""Beam search speed: raymuter against transformers on the same weights, and the share of the
step spent reordering the cache.

For each batch size, both systems make `--new` tokens for every prompt (eos ignored, so every
hypothesis runs to the limit) with num_beams 4, greedy beams, prompt `--prompt` random ids; the
systems alternate, best of the repeats. Tokens/s counts the best hypothesis' tokens of every
prompt (batch * new / seconds). Reorder share: raymuter's time in the cache's `copy_rows` over
the whole call. The targets: at least 3x transformers on the ~125M model, reorder at most 5%.

    PYTHONPATH=. python bench/beam.py                          # small model, batch 1 and 8: ~6 min
    PYTHONPATH=. python bench/beam.py --model tiny --batch 1,8 --repeats 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from decode_systems import model_dirs  # noqa: E402


def raymuter_run(model, prompts, beams, new, layout):
    ctx = generation.context(model, max_new_tokens=new, num_beams=beams, eos_token_id=[], do_sample=False)
    spent = [0.0]

    def run():
        from generation import cache as caches

        originals = {}
        for cls in caches.CACHES.values():  # time every reorder of this call
            originals[cls] = cls.copy_rows

            def timed(self, dst, src, length, _orig=cls.copy_rows):
                t0 = time.perf_counter()
                _orig(self, dst, src, length)
                spent[0] += time.perf_counter() - t0
            cls.copy_rows = timed
        try:
            spent[0] = 0.0
            out = generation.beam_search(ctx, prompts, [0] * len(prompts))
        finally:
            for cls, f in originals.items():
                cls.copy_rows = f
        return np.array([h[0].tokens for h in out]), spent[0]
    return run


def transformers_run(folder, prompts, beams, new, threads):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor(prompts)

    def run():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beams, do_sample=False,
                                 max_new_tokens=new, min_new_tokens=new, pad_token_id=0, early_stopping=False)
        return out[:, ids.shape[1]:].numpy(), 0.0
    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    dirs = model_dirs(args.model)
    layouts = {"in_place": generation.load(dirs["genai"], threads=args.threads, provider="cpu"),
               "append": generation.load(dirs["optimum"], threads=args.threads, provider="cpu")}
    rows = []
    for batch in [int(b) for b in args.batch.split(",")]:
        prompts = np.random.default_rng(0).integers(3, 1000, (batch, args.prompt)).tolist()
        systems = {f"raymuter {k}": raymuter_run(m, prompts, args.beams, args.new, k) for k, m in layouts.items()}
        systems["transformers"] = transformers_run(dirs["hf"], prompts, args.beams, args.new, args.threads)
        best, share, tokens = {}, {}, {}
        for rep in range(args.repeats + 1):  # the first round warms up
            for name, run in systems.items():
                t0 = time.perf_counter()
                out, reorder = run()
                elapsed = time.perf_counter() - t0
                tokens[name] = out
                if rep and (name not in best or elapsed < best[name]):
                    best[name], share[name] = elapsed, reorder / elapsed
            print(f"  batch {batch}: round {rep} done", file=sys.stderr, flush=True)
        base = best["transformers"]
        for name in systems:
            same = "yes" if np.array_equal(tokens[name], tokens["transformers"]) else "no"
            rows.append((batch, name, batch * args.new / best[name], base / best[name], share[name], same))
    print(f"\n## Beam search ({args.model} model, num_beams {args.beams}, prompt {args.prompt}, {args.new} new tokens, "
          f"{args.threads} threads, best of {args.repeats})\n")
    print("| batch | system | tokens/s | x transformers | reorder share | same tokens |\n|---|---|---|---|---|---|")
    for batch, name, tps, ratio, reorder, same in rows:
        print(f"| {batch} | {name} | {tps:.1f} | {ratio:.2f} | {reorder:.1%} | {same} |")
    print("\nTargets: >= 3x transformers on the ~125M model; reorder share <= 5%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
