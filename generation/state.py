"""The decode state and its verbs: prefill, insert, step, release.

As JetStream's engine (`prefill`, `insert(prefix, decode_state, slot)`,
`generate(params, decode_state) -> (decode_state, tokens)`), a step is a function of an explicit
state and returns the next state with the step's tokens. The state has a fixed number of slots;
each slot holds one row: its tokens so far, its cache, its selection settings and its random
state (seed and draw count). Buffers are reused in place from step to step.

    prefix = prefill(ctx, prompts, seeds)        # cache and first token of fresh rows
    state = insert(ctx, prefix, state, slots)    # into free slots of a running batch
    state, out = step(ctx, state)                # one token for every live slot
    state = release(ctx, state, slot)            # free a finished or cancelled slot
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cache import CACHES
from .context import Context
from .prompts import PromptCache, run_prompts
from .selection import SamplingRows, select
from .settings import Settings


@dataclass
class StepTokens:
    """What one step gave: per row, the new token (-1 where the row has none) and whether the
    row finished at this step."""

    token: np.ndarray  # [B] int64
    finished: np.ndarray  # [B] bool


@dataclass
class Prefix:
    """Prefilled rows, ready to insert: prompts, caches, first tokens, settings, random state.
    A row whose first token ended it (eos, or a one-token budget) is `finished` and needs no slot."""

    prompts: list[list[int]]
    cache: PromptCache
    first: StepTokens
    settings: list[Settings]
    seeds: np.ndarray  # uint64
    max_new: np.ndarray  # int64


@dataclass
class DecodeState:
    """The rows of a running batch, one per slot. `tokens[b, :count[b]]` is slot b's prompt and
    new tokens; the last one is not yet in the cache (it is the next step's input)."""

    cache: object
    capacity: int  # tokens a row may hold, prompt included
    tokens: np.ndarray  # [B, capacity] int64
    count: np.ndarray  # [B] tokens so far
    prompt_length: np.ndarray  # [B]
    new_tokens: np.ndarray  # [B] new tokens so far
    max_new: np.ndarray  # [B]
    live: np.ndarray  # [B] bool: the slot holds an unfinished row
    used: np.ndarray  # [B] bool: the slot holds a row (finished rows stay until released)
    seeds: np.ndarray  # [B] uint64
    draws: np.ndarray  # [B] uint64: random numbers drawn so far
    sampling: SamplingRows
    eos: np.ndarray  # [B, E] int64, -1 padded: each row's stop tokens

    @property
    def slots(self) -> int:
        return len(self.count)

    def free_slots(self) -> np.ndarray:
        return np.flatnonzero(~self.used)


def _sampling_rows(settings: list[Settings]) -> SamplingRows:
    return SamplingRows(
        do_sample=np.array([s.do_sample for s in settings], bool),
        temperature=np.array([s.temperature for s in settings], np.float32),
        top_k=np.array([s.top_k for s in settings], np.int64),
        top_p=np.array([s.top_p for s in settings], np.float32))


def _eos_table(settings: list[Settings], width: int) -> np.ndarray:
    table = np.full((len(settings), width), -1, np.int64)
    for i, s in enumerate(settings):
        table[i, :len(s.eos_token_id)] = s.eos_token_id
    return table


def new_state(ctx: Context, slots: int | None = None, capacity: int | None = None) -> DecodeState:
    """An empty state of `slots` rows (default: the compiled batch size), each holding up to
    `capacity` tokens (default: the model's context)."""
    slots = slots or ctx.batch_size
    if not slots:
        raise ValueError("slots: give the number of slots, or compile(ctx, batch_size) first")
    capacity = capacity or ctx.model.max_context
    if not capacity:
        raise ValueError("capacity: the model's config gives no context length; pass capacity")
    cache = CACHES[ctx.cache_mode](ctx.model.session, ctx.model.graph, slots, capacity, ctx.max_position)
    eos_width = max(1, len(ctx.settings.eos_token_id))
    return DecodeState(
        cache=cache, capacity=capacity,
        tokens=np.zeros((slots, capacity), np.int64), count=np.zeros(slots, np.int64),
        prompt_length=np.zeros(slots, np.int64), new_tokens=np.zeros(slots, np.int64),
        max_new=np.zeros(slots, np.int64), live=np.zeros(slots, bool), used=np.zeros(slots, bool),
        seeds=np.zeros(slots, np.uint64), draws=np.zeros(slots, np.uint64),
        sampling=_sampling_rows([ctx.settings] * slots), eos=_eos_table([ctx.settings] * slots, eos_width))


def _stops(tokens: np.ndarray, eos: np.ndarray, new_tokens: np.ndarray, max_new: np.ndarray,
           count: np.ndarray, capacity: int | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Which rows end with this token, and the token each row emits (-1 for an eos token).
    new_tokens and count include the token."""
    is_eos = (tokens[:, None] == eos).any(axis=1)
    finished = is_eos | (new_tokens >= max_new) | (count >= capacity)
    return finished, np.where(is_eos, -1, tokens)


def prefill(ctx: Context, prompts: list[list[int]], seeds, settings: list[Settings] | None = None,
            max_new: list[int] | None = None) -> Prefix:
    """Run non-empty `prompts` and choose each row's first token.

    seeds: one per prompt. settings: one per prompt (default: the context's). max_new: the new
    tokens each row may get (default: each row's settings by the max_new_tokens rule), at most
    the model's context minus the prompt.
    """
    settings = settings or [ctx.settings] * len(prompts)
    lengths = np.array([len(p) for p in prompts], np.int64)
    if max_new is None:
        max_new = [s.new_tokens_for(len(p)) for s, p in zip(settings, prompts)]
    max_new = np.minimum(np.array(max_new, np.int64), ctx.max_position - lengths)
    seeds = np.array(seeds, np.uint64)
    model = ctx.model
    cache = run_prompts(model.session, model.graph, ctx.cache_mode, ctx.prompt_steps, prompts,
                        ctx.settings.pad_token_id, ctx.max_position)
    sampling = _sampling_rows(settings)
    tokens = select(cache.last_logits, sampling, seeds, np.zeros(len(prompts), np.uint64))
    eos = _eos_table(settings, max(1, max(len(s.eos_token_id) for s in settings)))
    finished, emitted = _stops(tokens, eos, np.ones_like(lengths), max_new, lengths + 1, ctx.max_position)
    return Prefix(list(prompts), cache, StepTokens(emitted, finished), list(settings), seeds, max_new)


def insert(ctx: Context, prefix: Prefix, state: DecodeState, slots) -> DecodeState:
    """Put the unfinished rows of `prefix` into free `slots` (one per prefix row; finished rows'
    slots are left free)."""
    slots = list(slots)
    if len(slots) != len(prefix.prompts):
        raise ValueError(f"slots has {len(slots)} entries for {len(prefix.prompts)} prefilled rows")
    for j, slot in enumerate(slots):
        if prefix.first.finished[j]:
            continue
        if not 0 <= slot < state.slots or state.used[slot]:
            raise ValueError(f"slots[{j}] = {slot} is not a free slot of this state")
        prompt, length = prefix.prompts[j], len(prefix.prompts[j])
        if length + 1 > state.capacity:
            raise ValueError(f"prompt {j} has {length} tokens; the state's rows hold {state.capacity}")
        state.cache.insert(slot, prefix.cache.rows[j], length)
        state.tokens[slot, :length] = prompt
        state.tokens[slot, length] = prefix.first.token[j]
        state.count[slot], state.prompt_length[slot] = length + 1, length
        state.new_tokens[slot], state.max_new[slot] = 1, prefix.max_new[j]
        state.live[slot] = state.used[slot] = True
        state.seeds[slot], state.draws[slot] = prefix.seeds[j], 1
        s = prefix.settings[j]
        state.sampling.do_sample[slot], state.sampling.temperature[slot] = s.do_sample, s.temperature
        state.sampling.top_k[slot], state.sampling.top_p[slot] = s.top_k, s.top_p
        if len(s.eos_token_id) > state.eos.shape[1]:
            state.eos = np.pad(state.eos, ((0, 0), (0, len(s.eos_token_id) - state.eos.shape[1])), constant_values=-1)
        state.eos[slot] = -1
        state.eos[slot, :len(s.eos_token_id)] = s.eos_token_id
    return state


def step(ctx: Context, state: DecodeState) -> tuple[DecodeState, StepTokens]:
    """One token for every live slot: run the decoder on each row's last token, choose the next."""
    live = np.flatnonzero(state.live)
    out = StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
    if not live.size:
        return state, out
    # input: [B]; lengths: [B] valid cache rows (the last token is not in the cache yet)
    last = state.tokens[np.arange(state.slots), np.maximum(state.count - 1, 0)]
    lengths = np.where(state.live, state.count - 1, 0)
    inputs = np.where(state.live, last, ctx.settings.pad_token_id)
    logits = state.cache.decode(inputs, lengths)
    scores = logits[live].astype(np.float32, copy=False)
    tokens = select(scores, state.sampling.take(live), state.seeds[live], state.draws[live])
    state.draws[live] += np.uint64(1)
    state.tokens[live, state.count[live]] = tokens
    state.count[live] += 1
    state.new_tokens[live] += 1
    finished, emitted = _stops(tokens, state.eos[live], state.new_tokens[live], state.max_new[live],
                               state.count[live], state.capacity)
    state.live[live[finished]] = False
    out.token[live], out.finished[live] = emitted, finished
    return state, out


def release(ctx: Context, state: DecodeState, slot: int) -> DecodeState:
    """Free `slot` (a finished row, or a live one whose client went away)."""
    if not 0 <= slot < state.slots:
        raise ValueError(f"slot {slot} is outside this state's {state.slots} slots")
    state.cache.release(slot)
    state.live[slot] = state.used[slot] = False
    state.count[slot] = 0
    return state


def warm_up(ctx: Context) -> None:
    """One short generation over `ctx.batch_size` rows, so onnxruntime sets up its kernels and
    memory for this batch size before the first request."""
    rows = ctx.batch_size
    state = new_state(ctx, rows, capacity=4)
    prefix = prefill(ctx, [[0, 0]] * rows, [0] * rows, max_new=[2] * rows)
    state = insert(ctx, prefix, state, range(rows))
    step(ctx, state)
