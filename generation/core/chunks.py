"""Chunked prefill: a prompt run a chunk at a time between the batch's decode steps (vLLM's
chunked prefill), so a long prompt does not hold the running rows up for its whole run.

    partial = begin(ctx, prompt, store)                  # its start from the prefix store, if seen
    partial = extend(ctx, partial, 64)                    # its next 64 tokens: one chunk
    state, first = seat(ctx, state, [slot], [partial], seeds, settings, max_new)  # once partial.left == 0

A chunk runs as a later piece of a prompt does (cache/prefill.py `run_rows` from an offset, the
way the prefix store continues a cached start): its cache grows beside the decode state, and the
logits of the last chunk choose the first token, so the row's tokens and log-probabilities are
those of its prompt run whole (equal up to the float rounding by which a prompt run in pieces
already differs from one run whole; greedy and seeded tokens equal on the test models). Then
its rows go into the slot as any prefilled prompt's do (state.insert).

Kept apart, not in the slot's buffer rows: the batch's steps never see a half-run prompt (a
step runs every used slot, and a padding row writes its keys at its length), every cache mode
takes a finished one the same way (`insert`), and a cancelled or preempted one leaves nothing
behind. What it costs: each chunk's run copies the rows before it once (the graph's present is
past + chunk), and the seat copies them into the slot; beside the chunk's own compute that is
small (SmolLM2-135M, a chunk of 256 after 0 / 512 / 1024 tokens: 1.02 / 0.64 / 0.48x the time of
the same chunk run into an in_place slot's buffer rows, 2 shared cores).

A chunk runs apart from the step's decode, not joined to it in one run: the graphs take one
[rows, tokens] rectangle, so a joined run pads every decoding row to the chunk's width (and
GroupQueryAttention refuses several tokens of more than one row over a past); on SmolLM2-135M's
append graph, 8 decoding rows and a chunk of 32 took 2.8x the two runs apart, 32 rows and 128
tokens 16x.

Decoder-only text rows (a plain row, or a preempted one resuming: core/preempt.py `resume` takes
its rows); the scheduler admits beam searches, prompt log-probabilities, encoder-decoders and
vision-language prompts whole.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..cache.prefill import PromptCache, run_rows
from ..cache.prefix import PrefixStore
from ..params.settings import Settings
from ..runtime.feeds import prompt_widths
from .context import Context
from .insert import first_tokens_of, insert, lora_feeds
from .state import DecodeState, StepTokens


@dataclass(frozen=True)
class Partial:
    """A prompt part-way through its prefill: `past` holds the cache of `tokens[:done]` (per
    cache input [1, heads, done, head_dim]; None before the first chunk), `last` the logits [V]
    after token done - 1. `cached`: its first tokens that came from the prefix store. `place`: its
    LoRA adapter's place in the model's bank (0: none), which its slot holds meanwhile."""

    tokens: list[int]
    done: int = 0
    past: dict | None = None
    last: np.ndarray | None = None
    cached: int = 0
    place: int = 0

    def key(self, ctx: Context, tokens) -> list[int]:
        """`tokens` as the prefix store names them for this row (by its adapter too)."""
        return ctx.model.lora.bank.prefix_key(tokens, self.place) if self.place else tokens

    @property
    def left(self) -> int:
        """Tokens still to run."""
        return len(self.tokens) - self.done

    def rows(self) -> dict[str, np.ndarray]:
        """Its cache as a prefilled row's ([heads, done, head_dim] per cache input: `insert`'s)."""
        return {name: array[0] for name, array in self.past.items()}


def begin(ctx: Context, tokens: list[int], store: PrefixStore | None = None, place: int = 0) -> Partial:
    """A prompt about to run in chunks, from the longest start of it that `store` holds (as
    `state._cached_prompts` looks it up; nothing when `store` is None); `place`: its LoRA
    adapter's place (0: none)."""
    fresh = Partial(list(tokens), place=place)
    if store is None:
        return fresh
    length, rows = store.lookup(fresh.key(ctx, tokens))
    if not length:
        return fresh
    past = {name: np.ascontiguousarray(array[None]) for name, array in rows.items()}
    return Partial(list(tokens), length, past, cached=length, place=place)


def extend(ctx: Context, partial: Partial, count: int) -> Partial:
    """`partial` with its next `count` tokens run (in `ctx.prompt_steps` pieces), from its past."""
    if not 0 < count <= partial.left:
        raise ValueError(f"count: {count} tokens; the prompt has {partial.left} left to run")
    model, end = ctx.model, partial.done + count
    lora = lora_feeds(model, [partial.place]) if partial.place else None
    last, presents = run_rows(model.session, model.graph, [partial.tokens[:end]],
                              prompt_widths(count, ctx.prompt_steps), ctx.settings.pad_token_id, ctx.max_position,
                              partial.past, partial.done, lora=lora)
    past = {name: array if array.shape[2] == end else np.ascontiguousarray(array[:, :, :end])
            for name, array in presents.items()}
    return replace(partial, done=end, past=past, last=last[0])


def seat(ctx: Context, state: DecodeState, slots, partials: list[Partial], seeds, settings: list[Settings],
         max_new: list[int]) -> tuple[DecodeState, StepTokens]:
    """Rows whose prompts ran to their end (`partials`, none left) into free `slots`: their first
    tokens chosen from their last logits and their rows inserted, as `state.admit` seats a
    prompt; their full blocks into the state's prefix store. Returns the state and the first
    tokens (as `admit` gives them)."""
    if any(p.left for p in partials):
        raise ValueError("seat: a prompt has tokens left to run")
    prompts = [p.tokens for p in partials]
    last = np.stack([p.last for p in partials]).astype(np.float32, copy=False)
    prefix = first_tokens_of(ctx, prompts, seeds, settings, max_new, last, prompts)
    rows = [p.rows() for p in partials]
    prefix.cache = PromptCache(rows, np.array([len(p) for p in prompts]), last)
    state = insert(ctx, prefix, state, slots)
    state.cached[list(slots)] = [p.cached for p in partials]
    if isinstance(state.prefix, PrefixStore):
        for partial, row in zip(partials, rows):
            state.prefix.store(partial.key(ctx, partial.tokens), row)
    return state, prefix.first
