"""Preemption: a live row leaves its slot to free memory, and resumes later by recomputing its
cache, going on exactly as if it had not left (vLLM's preemption by recompute).

    paused = pause(ctx, state, slot)                         # the slot is free; the row is kept
    state = resume(ctx, state, [slot], [paused], [settings])  # its cache recomputed, into a free slot

A row is its tokens (prompt and new ones, the last not yet in the cache: the next step's input)
and what moves as it decodes: its random state (seed and draws: sampling draws from a counter-
based generator, so the draws so far give the same next ones), its stop-string matcher, its
constraint's matcher, its log-probabilities. Its cache is a function of its tokens: `resume` runs
them as a prompt (the way prompts run: `ctx.prompt_steps`) and chooses nothing, so the row's
next token comes from a step over the same cache as the uninterrupted row's (equal up to the
float rounding that a prompt run in one piece or in pieces already differs by; greedy and
seeded tokens are the same on the test models, as cached and uncached prompts are).

Plain decoder-only text rows only: a beam search's rows move as a group (search/beam.py), and
an encoder-decoder's or a vision row's cache needs its encoder outputs or images again.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..params.settings import Settings
from .context import Context
from .insert import adapter_places, prompt_cache_of, set_places, undone_on_error
from .state import DecodeState, free_slot


@dataclass
class Paused:
    """A row out of its slot: `tokens[:length]` are in its cache when it runs, `tokens[length]`
    is its next input; the rest as the state held it (`DecodeState` fields of its slot)."""

    tokens: np.ndarray  # [length + 1] int64: prompt, then new tokens
    length: int
    prompt_length: int
    limit: int
    seed: np.uint64
    draws: np.uint64
    encoder_ids: np.ndarray
    stops: object  # its StopMatcher, or None
    constraint: object  # its constraints.RowConstraint, or None
    cached: int  # prompt tokens that came from the prefix store when it was first admitted
    logprob: np.ndarray | None = None  # [length + 1]
    top_ids: np.ndarray | None = None
    top: np.ndarray | None = None


def pause(ctx: Context, state: DecodeState, slot: int) -> Paused:
    """Take the live plain row out of `slot` (the slot is free after) and return it."""
    if not state.live[slot] or any(slot in g.slots for g in state.groups.values()):
        raise ValueError(f"slot {slot} holds no live plain row to pause")
    if ctx.model.is_seq2seq or ctx.model.graph.has_inputs_embeds:
        raise ValueError("pause: an encoder-decoder's or a vision-language model's rows are not paused "
                         "(their cache needs the encoder outputs or images again)")
    length = int(state.lengths[slot])
    paused = Paused(
        tokens=state.tokens[slot, :length + 1].copy(), length=length, prompt_length=int(state.prompt_length[slot]),
        limit=int(state.limit[slot]), seed=state.seeds[slot], draws=state.draws[slot],
        encoder_ids=state.settings.encoder_ids[slot], stops=state.stops[slot],
        constraint=state.settings.constraints[slot], cached=int(state.cached[slot]))
    if state.logprob is not None:
        paused.logprob = state.logprob[slot, :length + 1].copy()
        if state.top is not None:
            paused.top_ids, paused.top = state.top_ids[slot, :length + 1].copy(), state.top[slot, :length + 1].copy()
    free_slot(ctx, state, slot)
    state.refresh()
    return paused


def resume(ctx: Context, state: DecodeState, slots, rows: list[Paused], settings: list[Settings],
           caches: list[dict] | None = None) -> DecodeState:
    """Put paused `rows` into free `slots`, their caches recomputed from their tokens (one
    prompt run, apart from the prefix store: their new tokens are nobody's prompt); `settings`:
    each row's, as it was admitted with. `caches`: their caches recomputed already ([heads,
    length, head_dim] per cache input: a resume run in chunks, core/chunks.py), inserted."""
    slots = [int(s) for s in slots]
    for j, slot in enumerate(slots):
        if not 0 <= slot < state.slots or state.used[slot] or slot in slots[:j]:
            raise ValueError(f"slots[{j}] = {slot} is not a free slot of this state")
    places = adapter_places(ctx, state, settings)
    set_places(state, slots, places)
    with undone_on_error(ctx, state, slots):
        if caches is None:
            state.cache.prefill(slots, [row.tokens[:row.length].tolist() for row in rows], ctx.prompt_steps,
                                ctx.settings.pad_token_id, lambda prompts: prompt_cache_of(ctx, prompts, None, places))
        else:
            for slot, row, cache in zip(slots, rows, caches):
                state.cache.insert(slot, cache, row.length)
        for slot, row, s in zip(slots, rows, settings):
            _place(state, slot, row, s)
    state.refresh()
    return state


def _place(state: DecodeState, slot: int, row: Paused, settings: Settings) -> None:
    """Slot `slot` takes the paused row (its cache is in place)."""
    end = row.length + 1
    state.tokens[slot, :end] = row.tokens
    state.next_input[slot] = row.tokens[row.length]
    state.lengths[slot], state.prompt_length[slot], state.limit[slot] = row.length, row.prompt_length, row.limit
    state.live[slot] = state.used[slot] = True
    state.seeds[slot], state.draws[slot] = row.seed, row.draws
    state.settings.set_row(slot, settings, row.prompt_length, row.limit, encoder_ids=row.encoder_ids)
    state.settings.constraints[slot] = row.constraint  # its matcher, where it was (set_row made a fresh one)
    state.stops[slot] = row.stops
    state.cached[slot] = row.cached
    if state.logprob is not None:
        state.logprob[slot] = np.nan
        state.logprob[slot, :end] = row.logprob
        if state.top is not None:
            state.top_ids[slot, :end], state.top[slot, :end] = row.top_ids, row.top
