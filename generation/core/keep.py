"""A finished row's answer into the prefix store, so that a conversation's next turn, whose
prompt starts with this turn's prompt and answer, runs only its new message (vLLM's prefix cache
keeps decoded blocks too).

The rows the decode steps wrote are not quite a prompt run's: a step's attention sums over the
buffer's width, a prompt run's over the prompt's own, so a layer's output differs by float
rounding (1e-7 of the keys and values on SmolLM2-135M fp32, layer 1 on). With float activations
that stays rounding (1e-6 at the last layer; the next turn's tokens are a cold server's), and
the rows are kept as decoded (`keep_decoded`: read back from the cache, `cache.read_row`). Where
activations are quantized per token (`DecoderGraph.quantized_activations`: the int8 precision,
int8 and q4 exports) a rounding apart becomes a quantization step apart here and there, and it
grows through the layers (2-8% of the last layer's keys and values, 0.04 in the next turn's
first log-probability; its greedy tokens part from a cold server's). There the tokens run again
as a prompt runs, from the longest prefix cached (`recompute_answer`, a piece at a time while the
engine is idle: engine/answers.py): bit for bit the rows a cold prompt computes, as cached
prompt blocks are.

Plain rows of decoder-only text models (a vision row's prefix is named by its images too; a beam
search's rows are its group's); the cache mode must give the row back (`read_row`: not a sliding
window's).
"""

from __future__ import annotations

import numpy as np

from ..cache.prefix import PrefixStore
from .context import Context
from .insert import prompt_cache_of, rest_after_prefix
from .state import DecodeState


def answer_tokens(ctx: Context, state: DecodeState, slot: int) -> np.ndarray | None:
    """The tokens in `slot`'s cache (its prompt and the new tokens but the last, never fed) when
    decoding filled a block past the prompt's and the state keeps prefixes; else None."""
    store = state.prefix
    if not isinstance(store, PrefixStore) or not store.max_bytes or ctx.model.graph.has_inputs_embeds:
        return None
    rows = getattr(state.cache, "lora", None)
    if rows is not None and rows.places[slot] and ctx.model.graph.quantized_activations:
        return None  # its recompute would run without its adapter

    length = int(state.lengths[slot])
    if length // store.block <= int(state.prompt_length[slot]) // store.block:
        return None
    return state.tokens[slot, :length].copy()


def keep_decoded(state: DecodeState, slot: int, tokens: np.ndarray) -> None:
    """`slot`'s cache rows of `tokens`, as the decode steps wrote them, into the prefix store (a
    row with a LoRA adapter under its adapter's key: LoraBank.prefix_key)."""
    rows = state.cache.read_row(slot, len(tokens))
    if rows is None:
        return
    lora = getattr(state.cache, "lora", None)
    place = int(lora.places[slot]) if lora is not None else 0
    state.prefix.store(lora.bank.prefix_key(tokens, place) if place else tokens, rows)


def recompute_answer(ctx: Context, store: PrefixStore, tokens: np.ndarray, most: int) -> bool:
    """Run up to `most` tokens of `tokens` past the longest prefix `store` holds, as a prompt's
    rest runs after a cached prefix, and keep the rows; whether every full block of `tokens` is
    held now."""
    full = len(tokens) // store.block * store.block
    have, past = store.held(tokens)
    if have >= full:
        return True
    end = min(full, have + max(most // store.block, 1) * store.block)
    part = tokens[:end].tolist()
    rows = rest_after_prefix(ctx, part, have, past)[1] if have else prompt_cache_of(ctx, [part]).rows[0]
    store.store(part, rows)
    return end >= full
