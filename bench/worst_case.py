"""What the worst request the limits allow costs the batch it shares: decode step time.

A batch of 8 rows of the ~125M model (bench/models.py, onnxruntime-genai build, in_place), each
with a long prompt (--prompt tokens) and room to generate, steps through the decode-state
verbs (`step`, or `assisted.verify` where a row asks for prompt lookup, as the batcher does).
"plain" is 8 greedy rows with nothing on; every other line is 7 of those plain rows and one
row with the named settings at the caps of generation/params/limits.py ("worst case": all of them at
once). Its prompt is the model's own greedy text, which (random weights) falls into a loop: the
n-gram and prompt-lookup matchers find a match at every position, and prompt lookup's
candidates are kept (their costliest input). A prompt-lookup row first runs alone for a few
steps, so it comes to the shared batch with a high acceptance rate; it is capped as the
batcher caps it (limits.MAX_STEP_SLOWDOWN), and once more uncapped (CostAware's plan for the
batch's tokens per second alone, as generate() runs it) to show what the cap prevents.

The "structured_outputs" lines hold slot 7 to the costliest constraints the default grammar
budget admits (generation.logits.constraints.GrammarBudget), each found here by bisection
against the server's own check (Grammars.check), up to the first limit it meets: the longest
x{N} and the widest (x{100}){B} (initial_lexer_fuel: their lexer derives a larger regex at
every token), the widest repeated rule (item+, item: one of K literals; step_max_items) and the
JSON schema of the most optional string properties (max_items_in_row, before max_grammar_size).
That row's first token comes from a prefill under its constraint, and it starts again at eos.

Every configuration keeps its own decode state and all of them step in turn, a few steps each,
round after round, in one process; the table gives each one's median step time and its ratio
to plain's (the machine is shared and noisy: read the ratios), and the tokens slot 7 got a
step. Goal: at most 1.5x.

    PYTHONPATH=. python bench/worst_case.py                    # ~6 min on 2 cores, ~4 GB
    PYTHONPATH=. python bench/worst_case.py --only "worst case" --rounds 4
    PYTHONPATH=. python bench/worst_case.py --only structured_outputs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from decode_systems import model_dirs  # noqa: E402
from generation.assisted import verify as assisted
from generation.params import limits  # noqa: E402
from generation.assisted.budget import CostAware  # noqa: E402
from generation.assisted.prompt_lookup import PromptLookup  # noqa: E402
from generation.params.checks import SettingError# noqa: E402
from generation.core.stop_strings import StopMatcher  # noqa: E402
from generation.logits.constraints import Grammars  # noqa: E402
from generation.text.tokenizer import model_tokenizer  # noqa: E402

SLOTS = 8


def costly(vocab: int, rng: np.random.Generator) -> dict[str, dict]:
    """Each costly setting at its cap (alone), by name."""
    ids = lambda count, length: rng.integers(3, vocab, (count, length)).tolist()  # noqa: E731
    stops = ["".join(rng.choice(list("abcdefghij"), limits.MAX_STOP_LENGTH)) for _ in range(limits.MAX_STOP_STRINGS)]
    return {
        "no_repeat_ngram_size 32": dict(no_repeat_ngram_size=limits.MAX_NGRAM_SIZE),
        "encoder_no_repeat_ngram_size 32": dict(encoder_no_repeat_ngram_size=limits.MAX_NGRAM_SIZE),
        "sequence_bias 256 x 32 tokens": dict(sequence_bias=[[s, 1.0] for s in ids(limits.MAX_SEQUENCES,
                                                                                 limits.MAX_SEQUENCE_LENGTH)]),
        "bad_words_ids 256 x 32 tokens": dict(bad_words_ids=ids(limits.MAX_SEQUENCES, limits.MAX_SEQUENCE_LENGTH)),
        "stop_strings 16 x 256 chars": dict(stop_strings=stops),
        "prompt lookup 32, ngram 32": dict(prompt_lookup_num_tokens=limits.MAX_LOOKUP_TOKENS,
                                           max_matching_ngram_size=limits.MAX_MATCHING_NGRAM_SIZE),
        "every warper (top_k 0)": dict(do_sample=True, temperature=0.7, top_k=0, top_p=0.9, typical_p=0.9, min_p=0.01,
                                       epsilon_cutoff=1e-5, eta_cutoff=1e-5, renormalize_logits=True),
        "penalties, eos ids, masks": dict(repetition_penalty=1.3, encoder_repetition_penalty=1.3,
                                          frequency_penalty=limits.MAX_ADDITIVE_PENALTY,
                                          presence_penalty=-limits.MAX_ADDITIVE_PENALTY,
                                          # (not with min_length: -inf eos scores decayed are nan, as in transformers)
                                          eos_token_id=list(range(3, 3 + limits.MAX_TOKEN_IDS)),
                                          exponential_decay_length_penalty=[0, 1.001], remove_invalid_values=True,
                                          suppress_tokens=list(range(3, vocab, 2)),
                                          forced_eos_token_id=list(range(3, 3 + limits.MAX_TOKEN_IDS))),
    }


def largest(fits, low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), fits(low) holding (fits falls once, as n grows)."""
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def constraints_at_limits(ctx) -> dict[str, dict]:
    """The costliest constraints the context's grammar budget admits, by name (module docstring)."""
    grammars = Grammars.of(ctx)

    def fits(value) -> bool:
        try:
            grammars.check(ctx.with_settings(structured_outputs=value).structured_outputs)
        except SettingError:
            return False
        return True

    def rule(k: int) -> dict:
        return {"grammar": "start: item+\nitem: " + " | ".join(f'"a{i}"' for i in range(k))}

    def schema(k: int) -> dict:
        return {"json": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(k)}}}

    n = largest(lambda n: fits({"regex": f"x{{{n}}}"}), 100, 1_000_000)
    b = largest(lambda b: fits({"regex": f"(x{{100}}){{{b}}}"}), 1, 10_000)
    k = largest(lambda k: fits(rule(k)), 2, 5000)
    p = largest(lambda p: fits(schema(p)), 1, 5000)
    eos = list(grammars.eos_ids)  # a row whose grammar is complete ends at eos, and starts again
    return {f"structured_outputs regex x{{{n}}}": dict(structured_outputs={"regex": f"x{{{n}}}"}, eos_token_id=eos),
            f"structured_outputs regex (x{{100}}){{{b}}}": dict(structured_outputs={"regex": f"(x{{100}}){{{b}}}"},
                                                               eos_token_id=eos),
            f"structured_outputs grammar item+ of {k} literals": dict(structured_outputs=rule(k), eos_token_id=eos),
            f"structured_outputs json, {p} optional string properties": dict(structured_outputs=schema(p),
                                                                              eos_token_id=eos)}


def looping(ctx, length: int, rng: np.random.Generator) -> list[int]:
    """`length` tokens of the model's own greedy text from a random start whose continuation
    settles into a short loop (the random model does so from most starts): the last 32 tokens
    repeat with a period of at most 4."""
    vocab = ctx.model.vocab_size
    for _ in range(8):
        bases = rng.integers(3, vocab, (SLOTS, 32)).tolist()
        short = generation.generate(_new_tokens(ctx, 160), bases, seeds=[0] * SLOTS)
        for base, text in zip(bases, short):
            if any(text[-32:] == text[-32 - p:-p] for p in range(1, 5)):
                return base + generation.generate(_new_tokens(ctx, length - 32), [base], seeds=[0])[0]
    raise SystemExit("no start settled into a loop")


def _new_tokens(ctx, count: int):
    return replace(ctx, settings=replace(ctx.settings, max_new_tokens=count))


def prefilled(ctx, prompt: list[int], room: int, seed: int):
    return generation.prefill(ctx, [prompt], [seed], settings=[ctx.settings], max_new=[room])


def seat(ctx, state, prefix, settings, tokenizer):
    """The row of `prefix` with `settings` into slot 7."""
    stops = [StopMatcher(tokenizer, settings.stop_strings, prefix.prompts[0])] if settings.stop_strings else [None]
    return generation.insert(ctx, replace(prefix, settings=[settings], stops=stops), state, [SLOTS - 1])


def build_state(ctx, plain_prefixes, last_prefix, settings, capacity: int, tokenizer, lookup=None):
    """A state of one row (slot 7) of `settings` (the prefix's prompt) and 7 plain rows. A row
    with prompt lookup first runs alone for a few steps: it keeps its candidates there, so its
    acceptance rate is high when the others join (a request that was alone, then shared)."""
    state = seat(ctx, generation.new_state(ctx, SLOTS, capacity), last_prefix, settings, tokenizer)
    for _ in range(4 if lookup is not None else 0):
        state, _ = assisted.verify(ctx, state, lookup)
    for slot, prefix in enumerate(plain_prefixes):
        state = generation.insert(ctx, prefix, state, [slot])
    return state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=1536)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8, help="steps of one configuration in a round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default=None, help="comma-separated configurations (besides plain)")
    args = parser.parse_args()
    model = generation.load(model_dirs("small")["genai"], threads=args.threads, provider="cpu")
    tokenizer = model_tokenizer(model)
    rng = np.random.default_rng(0)
    ctx = generation.context(model, do_sample=False, eos_token_id=[], repetition_penalty=1.0)
    alone = costly(model.vocab_size, rng)
    t0 = time.perf_counter()
    constrained = constraints_at_limits(ctx)
    print(f"constraints at the budget's limits found in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    configs = {"plain": {}, "worst case (all at once)": {k: v for c in alone.values() for k, v in c.items()}, **alone,
               "prompt lookup 32, ngram 32, uncapped (CostAware's plan alone)": alone["prompt lookup 32, ngram 32"],
               **constrained}
    if args.only:
        keep = {"plain", *args.only.split(",")}
        configs = {k: v for k, v in configs.items() if k in keep or any(k.startswith(x) for x in keep)}
    room = args.capacity - args.prompt - 1
    t0 = time.perf_counter()
    plain = [prefilled(ctx, rng.integers(3, model.vocab_size, args.prompt).tolist(), room, i) for i in range(SLOTS - 1)]
    # the model's own greedy text: a random-weight model falls into a loop, so every n-gram matches
    # many times and prompt lookup's candidates are kept (its costliest case for the others)
    last = prefilled(ctx, looping(ctx, args.prompt, rng), room, SLOTS - 1)
    print(f"prefill {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    states, steppers, times, made = {}, {}, {name: [] for name in configs}, {name: 0 for name in configs}
    settings_of = {name: ctx.with_settings(**settings) for name, settings in configs.items()}
    firsts = {}  # slot 7's prefill: under its constraint, where it has one (its first token the grammar's)
    for name, settings in configs.items():
        firsts[name] = last
        if settings.get("structured_outputs"):
            firsts[name] = generation.prefill(ctx, [last.prompts[0]], [SLOTS - 1], settings=[settings_of[name]],
                                              max_new=[room])
        lookup = None
        if settings.get("prompt_lookup_num_tokens"):  # as the batcher runs it: the step capped, unless told
            lookup = CostAware(PromptLookup(), max_slowdown=np.inf if "uncapped" in name else limits.MAX_STEP_SLOWDOWN)
        states[name] = build_state(ctx, plain, firsts[name], settings_of[name], args.capacity, tokenizer, lookup)
        steppers[name] = (lambda s: generation.step(ctx, s)) if lookup is None else (
            lambda s, g=lookup: assisted.verify(ctx, s, g))
    order = list(configs)
    for r in range(args.rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # each round starts elsewhere
            for _ in range(args.steps):
                if states[name].limit[SLOTS - 1] - states[name].lengths[SLOTS - 1] < 2 + limits.MAX_LOOKUP_TOKENS:
                    break  # a row that keeps 33 tokens a step is done early: its median has fewer steps
                before = int(states[name].lengths[SLOTS - 1])
                started = time.perf_counter()
                states[name], out = steppers[name](states[name])
                seconds = time.perf_counter() - started
                if r > 0:  # the first round warms each state up (and prompt lookup's cost model)
                    times[name].append(seconds)
                    made[name] += int(states[name].lengths[SLOTS - 1]) - before
                if not states[name].live[SLOTS - 1]:  # its eos came (the decay's purpose): it starts again
                    generation.release(ctx, states[name], SLOTS - 1)
                    states[name] = seat(ctx, states[name], firsts[name], settings_of[name], tokenizer)
                if states[name].live_rows.size < SLOTS:
                    raise SystemExit(f"{name}: a plain row ended; give more --capacity")
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr)
    base = statistics.median(times["plain"])
    print(f"## Decode step with one worst-case request ({model.vocab_size} ids, 12 layers, batch {SLOTS}, "
          f"prompts {args.prompt} tokens, rows up to {args.capacity}, {args.threads} threads)\n")
    print("| batch | step ms (median) | ratio to plain | tokens a step (slot 7) | steps timed |")
    print("|---|---|---|---|---|")
    for name in configs:
        ms = statistics.median(times[name]) * 1e3
        row = "8 plain rows" if name == "plain" else f"7 plain + {name}"
        rate = made[name] / len(times[name])
        print(f"| {row} | {ms:.1f} | {ms / base / 1e3:.2f}x | {rate:.1f} | {len(times[name])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
