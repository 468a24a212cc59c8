"""One step of every live row (`step`), and runs of greedy steps without one boundary each
(`advance`): the model's run, each row's token (core/rows.py), the beam groups moved, the rows
that ended settled.
"""

from __future__ import annotations

import numpy as np

from ..search.beam import advance_groups
from .context import Context
from .rows import ends, select_rows
from .state import DecodeState, StepTokens, free_group, with_logprobs


def step(ctx: Context, state: DecodeState) -> tuple[DecodeState, StepTokens]:
    """One token for every live slot: run the decoder on each row's last token, choose the next.

    The returned StepTokens are over all slots; free and finished slots run as padding rows.
    """
    rows = state.live_rows
    if not rows.size and not state.groups:
        return state, StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
    if state.fast:
        return _greedy_steps(state, 1)
    used = np.flatnonzero(state.used)  # rows past the last used slot are free: the run may leave them out
    logits = state.cache.decode(state.lengths, int(used[-1]) + 1 if used.size else None)
    stopped, lost = _step_groups(ctx, state, logits) if state.groups else ({}, {})
    if not rows.size:
        state.refresh()
        return state, StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool), failed=lost,
                                 beams=stopped)
    scores = logits[rows]  # [n, V]
    position = state.lengths[rows] + 1  # the new token's index in the row
    history = state.tokens if rows.size == state.slots else state.tokens[rows]
    tokens, lp, failed = select_rows(ctx, scores, state.live_settings, state.processes, history, position,
                                     state.prompt_length[rows], state.seeds[rows], state.draws[rows])
    if not state.greedy:
        state.draws[rows] += np.uint64(1)
    state.tokens[rows, position] = tokens
    if lp is not None:
        state.logprob[rows, position] = lp.token
        if lp.top is not None:
            state.top_ids[rows, position], state.top[rows, position] = lp.top_ids, lp.top
    state.lengths[rows] = position
    if failed:  # a row whose own selection failed gains no token (as assisted verification's rows)
        state.lengths[rows[list(failed)]] -= 1
    state.next_input[rows] = tokens
    out = with_logprobs(_settle(state, rows, tokens, position, failed), rows, state.slots, lp)
    out.beams = stopped
    out.failed.update(lost)
    return state, out


def _step_groups(ctx: Context, state: DecodeState, logits: np.ndarray) -> tuple[dict, dict]:
    """The beam groups' step on their rows of this run's `logits` [B, V]. The groups that
    stopped, and those whose own part failed, leave the state (their slots are free): returns
    ({first slot: stopped group}, {first slot: exception})."""
    groups = list(state.groups.values())
    stopped, failed = advance_groups(ctx, state, groups, [logits[g.slots] for g in groups])
    for g in stopped + list(failed):
        free_group(ctx, state, g)
    return {int(g.slots[0]): g for g in stopped}, {int(g.slots[0]): e for g, e in failed.items()}


def advance(ctx: Context, state: DecodeState, max_steps: int) -> tuple[DecodeState, StepTokens]:
    """Up to `max_steps` steps, stopping after the first step in which a row finished; for
    callers that read the tokens from `state.tokens` rather than step by step. Returns the last
    step's StepTokens."""
    if state.fast and state.live_rows.size:
        return _greedy_steps(state, max_steps)
    return step(ctx, state)


def _greedy_steps(state: DecodeState, max_steps: int) -> tuple[DecodeState, StepTokens]:
    """The lean loop of greedy steps over a full batch: the argmax lands in the bound token
    input, nothing is gathered, the tokens go into the history once at the end, and the loop
    breaks at the first step in which a row can end."""
    rows, lengths, eos = state.live_rows, state.lengths, state.single_eos
    tokens, start = state.next_input, lengths + 1
    trace = []
    for logits in state.cache.decode_steps(lengths, min(max_steps, state.steps_to_limit)):
        logits.argmax(1, tokens)
        trace.append(chosen := tokens.tolist())
        if eos in chosen:
            break
    lengths += len(trace)
    state.tokens[rows[:, None], start[:, None] + np.arange(len(trace))] = np.array(trace).T
    state.refresh()  # the rows advanced: steps_to_limit is that much smaller
    if state.steps_to_limit > 0 and eos not in trace[-1]:
        return state, StepTokens(tokens.copy(), np.zeros(len(tokens), bool))
    return state, _settle(state, rows, tokens, lengths)


def _settle(state: DecodeState, rows: np.ndarray, tokens: np.ndarray, position: np.ndarray,
            failed: dict | None = None) -> StepTokens:
    """The step's output, and the rows it ended (an eos token, the row's limit, or a failure of
    its own: `failed`, by index into `rows`)."""
    out = StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
    failed = {} if failed is None else failed
    is_eos, finished = ends(tokens, state.eos[rows], position + 1, state.limit[rows],
                             [state.stops[r] for r in rows.tolist()] if state.any_stops else (), failed)
    out.token[rows] = np.where(is_eos, -1, tokens)
    out.finished[rows] = finished
    if failed:
        out.token[rows[list(failed)]] = -1
        out.failed = {int(rows[i]): e for i, e in failed.items()}
    if finished.any():
        state.live[rows[finished]] = False
        out.any_finished = True
    state.refresh()
    return out
