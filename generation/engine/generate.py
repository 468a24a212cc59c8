"""`generate` and `beam_search`: a batch of prompts to their results, a Scheduler run to completion.

Prompts are admitted into free slots (one batched prefill for all that fit), every live slot
steps together, finished slots are released and refilled: with more prompts than the slots,
later prompts start as earlier ones end. This is the same loop the decoder deployment runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..assisted.verify import candidates_for
from ..core.context import Context
from ..core.state import StepTokens, new_state
from ..params.inputs import check_prompts, check_seeds
from ..params.checks import SettingError
from ..params.settings import Settings
from ..search.beam import Hypothesis, check_beam_settings
from .jobs import Job, spread
from .scheduler import Scheduler

__all__ = ["Generated", "beam_search", "check_prompts", "check_seeds", "generate"]


@dataclass
class Generated:
    """A row's new tokens (without the eos token) with their log-probabilities, and the
    `top_logprobs` best alternatives of each step ([(id, logprob), ...], best first)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None = None


def generate(ctx: Context, prompts, seeds=None,
             on_token: Callable[[StepTokens], None] | None = None, encoder=None,
             adapters=None) -> list[list[int]] | list[Generated]:
    """The new tokens of each prompt, without the eos token (with `token_logprobs` in the
    context: a `Generated` per prompt, the tokens with their log-probabilities). With
    num_beams > 1, each prompt's best hypothesis (`beam_search` gives them all).

    prompts: token id lists; an empty prompt is a padding row that yields nothing.
    seeds: one per prompt (a row's tokens depend only on its prompt, seed and settings).
    on_token: called after each step with a StepTokens over the prompts: the new token of each
    row (-1 where the row has none) and which rows are finished (all so far), with the
    log-probabilities when the context asks for them.
    encoder: for an encoder-decoder model, the EncoderOutputs of each prompt's source (the
    prompts are the decoder's; `generation.tasks` builds both); for a vision-language model,
    the vision.PromptImages of the prompts (`generation.tasks.image_text_to_text` builds them).
    adapters: one LoRA adapter name (or None) per prompt, for a model loaded with adapters
    (`generation.load(..., lora=LoraSpec(...))`).
    """
    prompts = check_prompts(ctx, prompts)
    seeds = check_seeds(seeds, len(prompts))
    settings = settings_with_adapters(ctx, adapters, len(prompts))
    if ctx.model.is_seq2seq and (encoder is None or len(encoder) != len(prompts)):
        raise ValueError("an encoder-decoder model needs encoder= outputs with one row per prompt "
                         "(generation.runtime.encoders.encode_text / encode_audio, or generation.tasks)")
    assistant = candidates_for(ctx)  # None unless assisted decoding is on
    if ctx.settings.num_beams > 1:
        if on_token is not None:
            raise ValueError("on_token streams one token per step; beam search (num_beams > 1) settles its "
                             "tokens only at the end: call generate without on_token")
        return [_best(ctx, h) for h in beam_search(ctx, prompts, seeds, settings, encoder=encoder)]
    jobs = _run(ctx, prompts, seeds, settings, encoder, assistant, on_token)
    if not ctx.token_logprobs:
        return [job.tokens if job else [] for job in jobs]
    empty = [] if ctx.top_logprobs else None
    return [Generated(job.tokens, job.logprobs, job.top) if job else Generated([], [], empty) for job in jobs]


def settings_with_adapters(ctx: Context, adapters, count: int) -> list[Settings]:
    """The context's settings for each of `count` prompts, with its adapter (SettingError naming
    `adapters` where the list does not fit)."""
    if adapters is None:
        return [ctx.settings] * count
    if not isinstance(adapters, (list, tuple)) or len(adapters) != count:
        raise SettingError("adapters", f"adapters must be a list of one adapter name (or None) per prompt, "
                                       f"{count} of them")
    return [ctx.settings if a is None else ctx.with_settings(adapter=a) for a in adapters]


def beam_search(ctx: Context, prompts: list[list[int]], seeds: list[int],
                settings: list[Settings] | None = None, encoder=None) -> list[list[Hypothesis]]:
    """The best `num_return_sequences` hypotheses of each prompt, best first (empty prompts: []),
    as transformers 4.57 `_beam_search` (generation.search.beam).

    prompts and seeds as `generate` checks them; settings: one per prompt (default: the
    context's), all with the same num_beams; encoder: an encoder-decoder model's EncoderOutputs,
    one row per prompt (a prompt's beams share its source, whose cross cache never moves), or
    a vision-language model's vision.PromptImages."""
    settings = settings or [ctx.settings] * len(prompts)
    check_beam_settings(settings)
    jobs = _run(ctx, prompts, seeds, settings, encoder)
    return [job.hypotheses if job else [] for job in jobs]


def _best(ctx: Context, hypotheses: list[Hypothesis]):
    best = hypotheses[0] if hypotheses else Hypothesis([], 0.0, [])
    return Generated(best.tokens, best.logprobs or []) if ctx.token_logprobs else best.tokens


def _run(ctx: Context, prompts, seeds, settings: list[Settings], encoder=None, assistant=None, on_token=None
         ) -> list[Job | None]:
    """Each prompt's ended Job (None for a prompt that gets no token), by a Scheduler of
    `ctx.batch_size` requests' slots. A job's error is raised (the batcher, which serves
    requests apart, ends only that request)."""
    jobs: list[Job | None] = [None] * len(prompts)
    for i, (prompt, s) in enumerate(zip(prompts, settings)):
        budget = s.new_tokens_for(len(prompt)) if prompt else 0
        if budget > 0:
            jobs[i] = Job(prompt, seeds[i], s, budget, None if encoder is None else encoder.take([i]), key=i)
    todo = [job for job in jobs if job is not None]
    if not todo:
        return jobs
    width = max(job.beams for job in todo)
    slots = min(ctx.batch_size or len(todo), len(todo)) * width
    capacity = max(len(job.prompt) + job.max_new for job in todo)
    if ctx.model.max_context:
        capacity = min(capacity, ctx.model.max_context)
    scheduler = Scheduler(ctx, slots, capacity, assistant=assistant, stream=on_token is not None,
                          state=_take_state(ctx, slots, capacity), isolate=False)
    for job in todo:
        scheduler.add(job)
    finished = np.array([job is None for job in jobs], bool)
    while scheduler.busy:
        updates, ended = scheduler.step()
        for job in ended:
            if job.error is not None:
                raise job.error
            finished[job.key] = True
        for update in updates if on_token is not None else ():
            rows = np.array([job.key for job in update.jobs], np.int64)
            finished[rows[update.out.finished]] = True
            on_token(spread(update, rows, len(prompts), finished))
    ctx.spare_states[:] = [scheduler.state]  # every slot is free again
    return jobs


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
