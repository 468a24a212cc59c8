"""`compile`: a context sized for its batches, its session warmed up. Apart from context.py
because warming runs the decode state (state.py), which itself builds on Context: here both are
imported, and neither imports this module."""

from __future__ import annotations

from dataclasses import replace

from .context import Context
from .insert import insert, prefill
from .state import new_state
from .step import step


def compile(ctx: Context, batch_size: int) -> Context:  # noqa: A001 - the public verb of the seed
    """Size `ctx` for batches of `batch_size` rows (the decode state's slots) and warm the session
    up with one run of that many rows, so the first request does not pay onnxruntime's set-up."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, not {batch_size!r}")
    compiled = replace(ctx, batch_size=batch_size, spare_states=[])
    warm_up(compiled)
    return compiled


def warm_up(ctx: Context) -> None:
    """One short generation over the rows a batch runs (`ctx.batch_size`, times num_beams), so
    onnxruntime sets up its kernels and memory for them before the first request."""
    if ctx.model.is_seq2seq:
        return  # its first step needs an encoder's outputs; the first request sets it up
    rows = ctx.batch_size * ctx.settings.num_beams
    settings = [replace(ctx.settings, num_beams=1, num_return_sequences=1, stop_strings=None)] * rows
    state = new_state(ctx, rows, capacity=4)
    prefix = prefill(ctx, [[0, 0]] * rows, [0] * rows, settings=settings, max_new=[2] * rows)
    state = insert(ctx, prefix, state, range(rows))
    step(ctx, state)
