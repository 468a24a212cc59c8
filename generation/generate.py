"""`generate`: a batch of prompts to their new tokens, built on the decode-state verbs.

The loop is continuous batching in miniature: prompts are admitted into free slots (one batched
prefill for all that fit), every live slot steps together, finished slots are released and
refilled. With more prompts than `ctx.batch_size` slots, later prompts start as earlier ones end.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from .assisted import candidates_for, merged, verify
from .beam import Hypothesis, beam_search
from .context import Context
from .rng import SEED_LIMIT
from .selection import LogProbs
from .settings import SettingError, shown
from .state import StepTokens, admit, advance, new_state, release, row_logprobs, row_tokens, step, with_logprobs


@dataclass
class Generated:
    """A row's new tokens (without the eos token) with their log-probabilities, and the
    `top_logprobs` best alternatives of each step ([(id, logprob), ...], best first)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


def check_prompts(ctx: Context, prompts) -> list[list[int]]:
    """The prompts as lists of ints, or SettingError ("prompt") naming the bad prompt and token."""
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if not isinstance(prompts, (list, tuple)):
        raise SettingError("prompt", f"prompts must be a list of token id lists, not {type(prompts).__name__}")
    vocab, context = ctx.model.vocab_size, ctx.model.max_context
    return [_prompt_ids(i, prompt, vocab, context) for i, prompt in enumerate(prompts)]


def _prompt_ids(i: int, prompt, vocab: int, context: int | None) -> list[int]:
    if not isinstance(prompt, (list, tuple, np.ndarray)):
        raise SettingError("prompt", f"prompts[{i}] must be a list of token ids, not {type(prompt).__name__}")
    if context and len(prompt) >= context:  # before looking at the tokens: a huge prompt costs nothing
        raise SettingError("prompt", f"prompts[{i}] has {len(prompt)} tokens; the model's context is {context} "
                                     "tokens, and at least one must be left for a new token")
    try:  # numpy checks the common case at once; anything odd (nested, ragged, huge ints) is read one by one
        ids = np.asarray(prompt)
        ok = ids.ndim == 1 and (not ids.size or ids.dtype.kind in "iu" and ids.min() >= 0 and ids.max() < vocab
                                and (isinstance(prompt, np.ndarray) or bool not in map(type, prompt)))
    except (ValueError, TypeError, OverflowError):
        ok = False
    if ok:
        return ids.tolist()
    for j, t in enumerate(prompt):
        if not isinstance(t, (int, np.integer)) or isinstance(t, (bool, np.bool_)) or not 0 <= t < vocab:
            raise SettingError("prompt", f"prompts[{i}][{j}] = {shown(t)} is not a token id of this model "
                                         f"(0 to {vocab - 1})")
    raise SettingError("prompt", f"prompts[{i}] must be a list of token ids, not {shown(prompt)}")


def check_seeds(seeds, count: int) -> list[int]:
    """One seed per prompt (random seeds when None), or SettingError ("seed") naming seeds."""
    if seeds is None:
        return [int.from_bytes(os.urandom(8), "little") for _ in range(count)]
    if isinstance(seeds, np.ndarray):
        seeds = seeds.tolist()
    if not isinstance(seeds, (list, tuple)) or len(seeds) != count:
        size = len(seeds) if isinstance(seeds, (list, tuple)) else type(seeds).__name__
        raise SettingError("seed", f"seeds must give one seed per prompt: got {size} for {count} prompts")
    for i, seed in enumerate(seeds):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, (bool, np.bool_)) or not 0 <= seed < SEED_LIMIT:
            raise SettingError("seed", f"seeds[{i}] = {shown(seed)} must be an integer from 0 to 2**64 - 1")
    return [int(s) for s in seeds]


def generate(ctx: Context, prompts, seeds=None,
             on_token: Callable[[StepTokens], None] | None = None, encoder=None) -> list[list[int]] | list[Generated]:
    """The new tokens of each prompt, without the eos token (with `token_logprobs` in the
    context: a `Generated` per prompt, the tokens with their log-probabilities).

    prompts: token id lists; an empty prompt is a padding row that yields nothing.
    seeds: one per prompt (a row's tokens depend only on its prompt, seed and settings).
    on_token: called after each step with a StepTokens over the prompts: the new token of each
    row (-1 where the row has none) and which rows are finished (all so far), with the
    log-probabilities when the context asks for them.
    encoder: for an encoder-decoder model, the EncoderOutputs of each prompt's source (the
    prompts are the decoder's; `generation.tasks` builds both); for a vision-language model,
    the vision.PromptImages of the prompts (`generation.tasks.image_text_to_text` builds them).
    """
    prompts = check_prompts(ctx, prompts)
    seeds = check_seeds(seeds, len(prompts))
    settings = ctx.settings
    if ctx.model.is_seq2seq and (encoder is None or len(encoder) != len(prompts)):
        raise ValueError("an encoder-decoder model needs encoder= outputs with one row per prompt "
                         "(generation.seq2seq.encode_text / encode_audio, or generation.tasks)")
    assistant = candidates_for(ctx)  # None unless assisted decoding is on
    if settings.num_beams > 1:
        return _best_beams(ctx, prompts, seeds, on_token, encoder)
    results: list = [Generated([], [], [] if ctx.top_logprobs else None) if ctx.token_logprobs else []
                     for _ in prompts]
    budget = [settings.new_tokens_for(len(p)) if p else 0 for p in prompts]
    waiting = deque(i for i, p in enumerate(prompts) if budget[i] > 0)
    finished = np.array([budget[i] == 0 for i in range(len(prompts))], bool)
    if not waiting:
        return results
    slots = min(ctx.batch_size or len(waiting), len(waiting))
    capacity = max(len(prompts[i]) + budget[i] for i in waiting)
    if ctx.model.max_context:
        capacity = min(capacity, ctx.model.max_context)
    state = _take_state(ctx, slots, capacity)
    row_of = np.full(slots, -1)

    def report(rows: np.ndarray, out: StepTokens) -> None:
        finished[rows] |= out.finished
        if on_token is not None:
            tokens = np.full(len(prompts), -1, np.int64)
            tokens[rows] = out.token
            lp = None if out.logprob is None else LogProbs(out.logprob, out.top_ids, out.top)
            on_token(with_logprobs(StepTokens(tokens, finished.copy(), bool(out.finished.any())), rows,
                                   len(prompts), lp))

    def keep(row: int, tokens: list[int], logprobs=None, top=None) -> None:
        results[row] = Generated(tokens, logprobs, top) if ctx.token_logprobs else tokens

    while waiting or state.live_rows.size:
        free = state.free_slots() if waiting else ()
        if len(free):
            admitted = [waiting.popleft() for _ in range(min(len(waiting), free.size))]
            state, first = admit(ctx, state, free[:len(admitted)], [prompts[i] for i in admitted],
                                 [seeds[i] for i in admitted], max_new=[budget[i] for i in admitted],
                                 encoder=None if encoder is None else encoder.take(admitted))
            _raise_failed(first)
            row_of[free[:len(admitted)]] = admitted
            for j, row in enumerate(admitted):
                if not ctx.token_logprobs:
                    results[row] = [int(first.token[j])] if first.token[j] >= 0 else []
                elif first.token[j] >= 0:
                    top = None if first.top is None else [list(zip(first.top_ids[j].tolist(), first.top[j].tolist()))]
                    keep(row, [int(first.token[j])], [float(first.logprob[j])], top)
            report(np.array(admitted), first)
        if state.live_rows.size:
            used = state.live_rows
            if assistant is not None:
                state, outs = verify(ctx, state, assistant)
                _raise_failed(out := merged(outs))
                for part in outs if on_token is not None else ():
                    report(row_of[used], StepTokens(part.token[used], part.finished[used]))
            elif on_token is None:  # tokens are read from the state when rows end
                state, out = advance(ctx, state, max_steps=state.capacity)
                _raise_failed(out)
            else:
                state, out = step(ctx, state)
                _raise_failed(out)
                report(row_of[used], StepTokens(out.token[used], out.finished[used]))
            if out.any_finished:
                for slot in np.flatnonzero(out.finished):
                    if ctx.token_logprobs:
                        keep(row_of[slot], row_tokens(state, slot), *row_logprobs(state, slot))
                    else:
                        results[row_of[slot]] = row_tokens(state, slot)
                    finished[row_of[slot]] = True
                    state = release(ctx, state, slot)
                    row_of[slot] = -1
    ctx.spare_states[:] = [state]  # every slot is free again
    return results


def _raise_failed(out: StepTokens) -> None:
    """A row whose own selection failed ends the call with its exception (the batcher, which
    serves requests apart, ends only that request)."""
    if out.failed:
        raise next(iter(out.failed.values()))


def _best_beams(ctx: Context, prompts, seeds, on_token, encoder=None) -> list:
    """generate() with num_beams > 1: each prompt's best hypothesis (`beam_search` gives them all)."""
    if on_token is not None:
        raise ValueError("on_token streams one token per step; beam search (num_beams > 1) settles its "
                         "tokens only at the end: call generate without on_token")
    out = []
    for hypotheses in beam_search(ctx, prompts, seeds, encoder=encoder):
        best = hypotheses[0] if hypotheses else Hypothesis([], 0.0, [])
        out.append(Generated(best.tokens, best.logprobs or []) if ctx.token_logprobs else best.tokens)
    return out


def _take_state(ctx: Context, slots: int, capacity: int):
    """The empty state a previous call left, when it has this shape; else a new one.
    `capacity` is already within the model's context."""
    try:
        state = ctx.spare_states.pop()
    except IndexError:  # none, or another thread took it
        return new_state(ctx, slots, capacity)
    if state.slots == slots and state.capacity == capacity:
        return state
    return new_state(ctx, slots, capacity)
