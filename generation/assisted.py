"""Assisted decoding: a candidate generator proposes each row's next tokens, the target model
checks them all in one run, and each row keeps what the target would have chosen itself.

A candidate generator (prompt_lookup.PromptLookup, draft.Draft) speaks this contract:

    ids, counts, probs = gen.propose(state, rows, room, allowed)
        ids [n, K] (-1 past a row's count), counts [n] <= room [n]: the candidates of the live
        `rows` of `state` (a DecodeState); probs [n, K, V] the generator's probabilities of its
        candidates, or None (then sampling rows keep a candidate only where the target's own
        seeded draw equals it). `allowed(history, length, sub, tokens) -> [m] bool`, or None when
        no processor is on, says whether the processors let `tokens` follow `history[:, :length]`
        for rows `rows[sub]`: no candidate they forbid is proposed.
    gen.accepted(rows, accepted, counts)
        after the state moved on: how many candidates each row kept (to adapt).
    gen.admit(ctx, state, slots) / gen.release(slot)        (optional)
        rows entered or left the state (a draft keeps a cache of its own per slot).

`verify` is the step: the target runs every live row's last token and its candidates at once
(`cache.verify`), the processors apply at every position with the row's history as it would
have been there, and `accept_greedy` keeps the longest prefix of candidates equal to the
target's choices, plus the target's own next token. Rows keep different counts in one step;
the cache forgets the rest (`cache.rewind`). The output is the plain decoder's, token for token,
for greedy rows and for sampling rows with prompt lookup: position j of a step draws the row's
random number of that token index, as a plain step would (rng.py).
"""

from __future__ import annotations

import numpy as np

from .context import Context
from .processors import NEG_INF, apply
from .selection import LogProbs
from .state import DecodeState, StepTokens, _ends, _select, step, with_logprobs


def accept_greedy(candidates: np.ndarray, counts: np.ndarray, target: np.ndarray) -> np.ndarray:
    """How many leading candidates each row keeps: those equal to the target's choices.

    candidates [n, K], counts [n] (a row's candidates are its first counts[b]); target [n, S>K]
    the target's token at each verified position (position j follows candidate j - 1).
    The row then gains target[b, :accepted[b] + 1] (the kept candidates and the target's next).

    >>> accept_greedy(np.array([[4, 5, 6], [4, 5, 6], [7, -1, -1]]), np.array([3, 3, 1]),
    ...               np.array([[4, 5, 6, 9], [4, 8, 6, 9], [1, 2, 3, 4]])).tolist()
    [3, 1, 0]
    """
    k = candidates.shape[1]
    same = (candidates == target[:, :k]) & (np.arange(k) < counts[:, None])
    return np.where(same.all(axis=1), k, (~same).argmax(axis=1)).clip(max=counts)


def verify(ctx: Context, state: DecodeState, gen) -> tuple[DecodeState, list[StepTokens]]:
    """One assisted step for every live slot: up to 1 + K tokens per row. Returns the state and
    one StepTokens per position of the step (the j-th new token of each row; -1 where a row got
    fewer), as `step` would have given them one by one. With no candidate for any row this is
    a plain `step`."""
    rows = state.live_rows
    if not rows.size:
        return step(ctx, state)[0], []
    lengths = state.lengths[rows]
    room = np.maximum(state.limit[rows] - lengths - 2, 0)  # the target adds one token past them
    allowed = _allowed(ctx, state, rows) if state.processes or ctx.processors else None
    ids, counts, probs = gen.propose(state, rows, room, allowed)
    if probs is not None:
        raise NotImplementedError("candidate probabilities (speculative sampling) are not verified yet")
    # the run is 1 + max(counts) wide for every row: it must fit past the longest row
    counts = np.clip(np.minimum(counts, room), 0, state.capacity - 1 - int(state.lengths.max()))
    if not counts.any():
        state, out = step(ctx, state)
        gen.accepted(rows, np.zeros(len(rows), np.int64), counts)
        return state, [out]
    width = 1 + int(counts.max())
    columns = np.arange(width)
    ids = ids[:, :width - 1]
    feed = np.full((state.slots, width), ctx.settings.pad_token_id, np.int64)
    feed[rows, 0] = state.next_input[rows]
    real = columns[1:] <= counts[:, None]
    feed[rows, 1:] = np.where(real, ids, ctx.settings.pad_token_id)
    widths = np.ones(state.slots, np.int64)
    widths[rows] = 1 + counts
    where = (lengths + 1)[:, None] + columns[:-1]  # the candidates' token indices
    r, c = np.nonzero(real)
    state.tokens[rows[r], where[r, c]] = ids[r, c]  # the history the processors read
    logits = state.cache.verify(state.lengths, feed, rows, widths)  # [n, S, V]
    target, lp = _choose(ctx, state, rows, logits, counts)
    accepted = accept_greedy(ids, counts, target)
    outs, kept = _commit(state, rows, target, accepted + 1, lp)
    state.cache.rewind(state.lengths)
    gen.accepted(rows, accepted, counts)
    state.refresh()
    return state, outs


def _allowed(ctx: Context, state: DecodeState, rows: np.ndarray):
    """The processors' verdict on candidate tokens (see the module docstring): a token is
    forbidden where the processors turn a score of 1 into -inf (or float32's lowest), as
    transformers' prompt lookup tests it."""
    def allowed(history, length, sub, tokens):
        settings = state.live_settings.take(sub)
        scores = apply(np.ones((len(sub), state.settings.vocab), np.float32), settings, history, length,
                       ctx.processors, state.prompt_length[rows[sub]])
        got = scores[np.arange(len(sub)), tokens]
        return (got != NEG_INF) & (got != np.finfo(np.float32).min)
    return allowed


def _choose(ctx: Context, state: DecodeState, rows: np.ndarray, logits: np.ndarray, counts: np.ndarray):
    """The target's token at every verified position (j <= counts[b]) of each row: the
    processors with the row's history up to there, then greedy or the draw of that token
    index. Returns tokens [n, S] (-1 elsewhere) and their log-probabilities (or None)."""
    n, width = logits.shape[:2]
    if state.greedy and not (state.processes or ctx.processors or ctx.token_logprobs):
        return logits.argmax(axis=2), None  # positions past a row's count are never read
    r, j = np.nonzero(np.arange(width) <= counts[:, None])
    settings = state.live_settings.take(r)
    history = state.tokens[rows[r]] if state.processes or ctx.processors else None
    tokens, lp = _select(ctx, logits[r, j], settings, state.processes, history, state.lengths[rows[r]] + 1 + j,
                         state.prompt_length[rows[r]], state.seeds[rows[r]],
                         state.draws[rows[r]] + j.astype(np.uint64))
    target = np.full((n, width), -1, np.int64)
    target[r, j] = tokens
    if lp is not None:
        token = np.full((n, width), np.nan, np.float32)
        token[r, j] = lp.token
        top_ids = top = None
        if lp.top is not None:
            top_ids = np.full((n, width, lp.top.shape[1]), -1, np.int64)
            top = np.full((n, width, lp.top.shape[1]), np.nan, np.float32)
            top_ids[r, j], top[r, j] = lp.top_ids, lp.top
        lp = LogProbs(token, top_ids, top)
    return target, lp


def _commit(state: DecodeState, rows: np.ndarray, target: np.ndarray, kept: np.ndarray, lp):
    """Rows gain target[b, :kept[b]], cut after an eos token, a stop string or the row's limit.
    Returns one StepTokens per position and the kept counts."""
    lengths = state.lengths[rows].copy()
    kept = kept.copy()
    outs = []
    going = np.ones(len(rows), bool)
    stops = [state.stops[r] for r in rows.tolist()] if state.any_stops else None
    for j in range(int(kept.max())):
        now = np.flatnonzero(going & (kept > j))
        if not now.size:
            break
        tokens = target[now, j]
        is_eos, finished = _ends(tokens, state.eos[rows[now]], lengths[now] + 2 + j, state.limit[rows[now]],
                                 [stops[i] for i in now] if stops else ())
        out = StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
        out.token[rows[now]] = np.where(is_eos, -1, tokens)
        out.finished[rows[now]] = finished
        out.any_finished = bool(finished.any())
        if lp is not None:
            step_lp = LogProbs(lp.token[now, j], None if lp.top is None else lp.top_ids[now, j],
                               None if lp.top is None else lp.top[now, j])
            out = with_logprobs(out, rows[now], state.slots, step_lp)
        ended = now[finished]
        kept[ended] = j + 1
        going[ended] = False
        outs.append(out)
    new = np.arange(target.shape[1]) < kept[:, None]
    r, j = np.nonzero(new)
    position = lengths[r] + 1 + j
    state.tokens[rows[r], position] = target[r, j]
    if lp is not None and state.logprob is not None:
        state.logprob[rows[r], position] = lp.token[r, j]
        if state.top is not None and lp.top is not None:
            state.top_ids[rows[r], position], state.top[rows[r], position] = lp.top_ids[r, j], lp.top[r, j]
    state.lengths[rows] = lengths + kept
    state.next_input[rows] = target[np.arange(len(rows)), kept - 1]
    if not state.greedy:
        state.draws[rows] += kept.astype(np.uint64)
    state.live[rows[~going]] = False
    return outs, kept


def candidates_for(ctx: Context):
    """The candidate generator the context asks for: a draft model (context(draft=...)), else
    prompt lookup (prompt_lookup_num_tokens), else None."""
    s = ctx.settings
    if ctx.draft is not None:
        if s.num_beams > 1:
            raise ValueError(f"draft: assisted decoding needs num_beams=1, not {s.num_beams}")
        from .draft import Draft

        return Draft(ctx.draft, s.num_assistant_tokens, s.num_assistant_tokens_schedule)
    if s.prompt_lookup_num_tokens is None:
        return None
    if s.num_beams > 1:
        raise ValueError(f"prompt_lookup_num_tokens={s.prompt_lookup_num_tokens} needs num_beams=1, not {s.num_beams}")
    if ctx.model.is_seq2seq:
        raise ValueError("prompt_lookup_num_tokens: assisted decoding runs decoder-only models; "
                         "this is an encoder-decoder model")
    from .prompt_lookup import PromptLookup

    return PromptLookup(s.prompt_lookup_num_tokens, s.max_matching_ngram_size or 2)


def merged(outs: list[StepTokens]) -> StepTokens:
    """The StepTokens of a whole assisted step: each row's last token and whether it finished."""
    last = outs[-1]
    token = last.token.copy()
    for out in outs[-2::-1]:
        token = np.where(token < 0, out.token, token)
    finished = np.logical_or.reduce([o.finished for o in outs])
    return StepTokens(token, finished, bool(finished.any()))
