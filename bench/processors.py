"""What the logits processors cost per step, as a fraction of the model's step.

For each batch size, one decode state of the ~125M model (bench/models.py, onnxruntime-genai
build, in_place) runs its rows through `--steps` steps; each step is timed in two parts, side
by side: the model (the decoder run that gives the logits) and the selection (processors,
warpers, the seeded draw and the log-probabilities where asked) over those logits, with the
rows' real histories (prompt 32 + the steps so far). Prints the medians and the ratio; the
target is at most 5% for a typical chat configuration (repetition penalty, temperature, top-k,
top-p).

    PYTHONPATH=. python bench/processors.py                 # batch 1 and 32, ~2 min on 2 cores
    PYTHONPATH=. python bench/processors.py --model tiny --batch 1,8
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
from generation.core.rows import _select  # noqa: E402

CONFIGS = {
    "greedy (nothing to process)": dict(do_sample=False),
    "chat: repetition_penalty, temperature, top_k, top_p": dict(
        do_sample=True, repetition_penalty=1.1, temperature=0.7, top_k=50, top_p=0.9),
    "chat + no_repeat_ngram 3, min_p, logprobs": dict(
        do_sample=True, repetition_penalty=1.1, temperature=0.7, top_k=50, top_p=0.9, no_repeat_ngram_size=3,
        min_p=0.05, token_logprobs=True),
}
TARGET = "chat: repetition_penalty, temperature, top_k, top_p"


def measure(model, batch: int, settings: dict, steps: int, prompt: int):
    """Median seconds of the model part and the selection part of a step."""
    settings = dict(settings)
    logprobs = settings.pop("token_logprobs", False)
    ctx = generation.context(model, max_new_tokens=steps + 2, eos_token_id=[], token_logprobs=logprobs, **settings)
    state = generation.new_state(ctx, slots=batch, capacity=prompt + steps + 4)
    prompts = np.random.default_rng(0).integers(3, model.vocab_size, (batch, prompt)).tolist()
    state, _ = generation.admit(ctx, state, list(range(batch)), prompts, list(range(batch)))
    rows = state.live_rows
    model_times, select_times = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = state.cache.decode(state.lengths)[rows]
        t1 = time.perf_counter()
        position = state.lengths[rows] + 1
        tokens, _ = _select(ctx, logits, state.live_settings, state.processes, state.tokens, position,
                            state.prompt_length[rows], state.seeds[rows], state.draws[rows])
        t2 = time.perf_counter()
        state.draws[rows] += np.uint64(1)
        state.tokens[rows, position] = tokens
        state.lengths[rows] = position
        state.next_input[rows] = tokens
        model_times.append(t1 - t0)
        select_times.append(t2 - t1)
    return statistics.median(model_times), statistics.median(select_times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="small (the ~125M Llama) or tiny")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    model = generation.load(model_dirs(args.model)["genai"], threads=args.threads, provider="cpu")
    print(f"## Selection cost per step ({args.model} model, vocab {model.vocab_size}, {args.threads} threads, "
          f"prompt {args.prompt}, median of {args.steps} steps)\n")
    print("| configuration | " + " | ".join(f"B={b}: model ms | selection ms | ratio" for b in batches) + " |")
    print("|---|" + "---|---|---|" * len(batches))
    verdict = []
    for name, settings in CONFIGS.items():
        cells = []
        for batch in batches:
            model_s, select_s = measure(model, batch, settings, args.steps, args.prompt)
            ratio = select_s / model_s
            cells.append(f"{model_s * 1e3:.2f} | {select_s * 1e3:.3f} | {ratio:.1%}")
            if name == TARGET:
                verdict.append(f"B={batch} {ratio:.1%}")
                ok = ratio <= 0.05
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    print(f"\nTarget: the chat configuration's selection <= 5% of the model step: {', '.join(verdict)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
