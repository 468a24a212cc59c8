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
random number of that token index, as a plain step would (rng.py). Sampling rows with a draft's
probabilities follow `speculative_accept` instead: the target's distribution, other tokens.
"""

from __future__ import annotations

import numpy as np

from ..core.context import Context, assisted_refusal
from ..core.rows import ends, select_rows
from ..core.state import DecodeState, StepTokens, with_logprobs
from ..core.step import step
from ..logits.processors import NEG_INF
from ..logits.row_settings import apply
from ..logits.rng import derived_seeds, uniforms
from ..logits.selection import LogProbs, SamplingRows, final_scores, softmax


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


def speculative_accept(candidates: np.ndarray, counts: np.ndarray, p: np.ndarray, q: np.ndarray,
                                          u_accept: np.ndarray, u_next: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The speculative sampling rule (transformers 4.57 `_speculative_sampling`; Leviathan et
    al. 2023), so the kept tokens have exactly the target's distribution whatever the draft's.

    candidates [n, K] drawn from the draft's q [n, K, V]; p [n, K + 1, V] the target's final
    probabilities at each position; u_accept [n, K], u_next [n, K + 1] uniforms in (0, 1) (the
    next token at position j draws u_next[:, j]).
    Candidate j is kept while u_accept[j] <= p_j(c_j) / q_j(c_j) (for all j before it too). At
    the first rejected j, the next token is drawn from max(p_j - q_j, 0) normalised; when all
    counts[b] are kept, from p at position counts[b]. Returns (accepted [n], next token [n]).

    >>> p = np.array([[[0.5, 0.5], [0.0, 1.0]]]); q = np.array([[[1.0, 0.0]]])
    >>> speculative_accept(np.array([[0]]), np.array([1]), p, q, np.array([[0.4]]), np.array([[0.5, 0.5]]))
    (array([1]), array([1]))
    >>> speculative_accept(np.array([[0]]), np.array([1]), p, q, np.array([[0.6]]), np.array([[0.3, 0.3]]))
    (array([0]), array([1]))

    Token 0 has p 0.5 and q 1: kept with probability 0.5. Kept (u 0.4), the next token comes
    from p at position 1 (always 1); rejected (u 0.6), from max(p - q, 0) = [0, 0.5]: token 1.
    """
    n, k = candidates.shape
    rows = np.arange(n)[:, None]
    cols = np.arange(k)
    safe = np.maximum(candidates, 0)
    ratio = p[rows, cols, safe] / np.maximum(q[rows, cols, safe], 1e-30)
    ok = (u_accept <= ratio) & (cols < counts[:, None])
    accepted = np.where(ok.all(axis=1), k, (~ok).argmax(axis=1)).clip(max=counts)
    at = np.arange(n)
    dist = p[at, accepted].astype(np.float64)
    rejected = accepted < counts
    if rejected.any():
        residual = np.maximum(dist[rejected] - q[at[rejected], accepted[rejected]], 0)
        total = residual.sum(axis=1, keepdims=True)
        dist[rejected] = np.where(total > 0, residual / np.where(total > 0, total, 1), dist[rejected])
    cdf = np.cumsum(dist, axis=1)
    u = u_next[at, accepted]
    nxt = np.minimum((cdf < (u * cdf[:, -1])[:, None]).sum(axis=1), p.shape[2] - 1)
    return accepted, nxt


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
    # the run is 1 + max(counts) wide for every row: it must fit past the longest row
    counts = np.clip(np.minimum(counts, room), 0, state.capacity - 1 - int(state.lengths.max()))
    if not counts.any():
        state, out = step(ctx, state)
        gen.accepted(rows, np.zeros(len(rows), np.int64), counts)
        return state, [out]
    width = 1 + int(counts.max())
    columns = np.arange(width)
    ids = ids[:, :width - 1]
    probs = None if probs is None else probs[:, :width - 1]
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
    target, lp, failed = _choose(ctx, state, rows, logits, counts)
    accepted = accept_greedy(ids, counts, target)
    sampled = np.flatnonzero(state.settings.do_sample[rows])
    sampled = sampled[~np.isin(sampled, list(failed))]
    if probs is not None and sampled.size:  # rows whose candidates were drawn from the draft's probs
        accepted[sampled] = _speculative_each(ctx, state, rows, sampled, logits, ids, counts, probs, target, failed)
    accepted[list(failed)] = 0
    outs, kept = _commit(state, rows, target, accepted + 1, lp, failed)
    if failed:
        outs = _report_failed(state, rows, outs, failed, ctx.settings.pad_token_id)
    state.cache.rewind(state.lengths)
    gen.accepted(rows, accepted, counts)
    state.refresh()
    return state, outs


def _report_failed(state: DecodeState, rows: np.ndarray, outs: list[StepTokens], failed: dict, pad: int):
    """The rows whose own selection failed (`failed`, by index into rows) end at this step with
    no token: reported in the step's first StepTokens."""
    if not outs:
        outs = [StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))]
    slots = rows[list(failed)]
    state.next_input[slots] = pad  # they run as padding rows until released
    outs[0].finished[slots] = True
    outs[0].any_finished = True
    outs[0].failed = {int(rows[i]): e for i, e in failed.items()}
    return outs


def _speculative_each(ctx, state, rows, sampled, logits, ids, counts, probs, target, failed: dict) -> np.ndarray:
    """`_speculative` over the batch, or row by row when that raises (a row that fails alone
    goes into `failed`)."""
    try:
        return _speculative(ctx, state, rows, sampled, logits, ids, counts, probs, target)
    except Exception:  # noqa: BLE001 - redone row by row: only the culprits fail
        accepted = np.zeros(len(sampled), np.int64)
        for n, i in enumerate(sampled.tolist()):
            try:
                accepted[n] = _speculative(ctx, state, rows, sampled[n:n + 1], logits, ids, counts, probs, target)[0]
            except Exception as e:  # noqa: BLE001 - this row's own failure
                failed[i] = e
        return accepted


def _speculative(ctx, state, rows, sampled, logits, ids, counts, probs, target) -> np.ndarray:
    """`speculative_accept` for the sampling rows `sampled` (indices into rows); writes their
    kept candidates and next token into `target` and returns how many they kept. The target's
    probabilities are its final scores (processors, then warpers) at every position; the
    acceptance draws come from a stream of the row's seed apart from its token draws."""
    width = logits.shape[1]
    r = np.repeat(sampled, width)
    j = np.tile(np.arange(width), len(sampled))
    b = rows[r]
    settings = state.live_settings.take(r)
    length = np.minimum(state.lengths[b] + 1 + j, state.capacity)
    scores = logits[r, j]
    if state.processes or ctx.processors:
        scores = apply(scores, settings, state.tokens[b], length, ctx.processors, state.prompt_length[b], inplace=True)
    p = softmax(final_scores(scores, SamplingRows.of(settings)).astype(np.float64)).reshape(len(sampled), width, -1)
    k = ids.shape[1]
    draws = state.draws[rows[sampled]][:, None] + np.arange(k + 1).astype(np.uint64)
    seeds = np.repeat(state.seeds[rows[sampled]], k + 1).reshape(len(sampled), k + 1)
    u_accept = uniforms(derived_seeds(seeds.reshape(-1), 1), draws.reshape(-1)).reshape(len(sampled), k + 1)[:, :k]
    u_next = uniforms(seeds.reshape(-1), draws.reshape(-1)).reshape(len(sampled), k + 1)
    accepted, nxt = speculative_accept(ids[sampled], counts[sampled], p[:, :k + 1], probs[sampled], u_accept, u_next)
    target[sampled, :k] = np.where(np.arange(k) < accepted[:, None], ids[sampled], target[sampled, :k])
    target[sampled, accepted] = nxt
    return accepted


def _allowed(ctx: Context, state: DecodeState, rows: np.ndarray):
    """The processors' verdict on candidate tokens (see the module docstring): a token is
    forbidden where the processors turn a score of 1 into -inf (or float32's lowest), as
    transformers' prompt lookup tests it."""
    def verdict(history, length, sub, tokens):
        settings = state.live_settings.take(sub)
        scores = apply(np.ones((len(sub), state.settings.vocab), np.float32), settings, history, length,
                       ctx.processors, state.prompt_length[rows[sub]])
        got = scores[np.arange(len(sub)), tokens]
        return (got != NEG_INF) & (got != np.finfo(np.float32).min)

    def allowed(history, length, sub, tokens):
        try:
            return verdict(history, length, sub, tokens)
        except Exception:  # noqa: BLE001 - row by row; a row whose processors fail gets no candidates (its plain
            ok = np.zeros(len(sub), bool)  # selection then reports the failure)
            for i in range(len(sub)):
                try:
                    ok[i] = verdict(history[i:i + 1], length[i:i + 1], sub[i:i + 1], tokens[i:i + 1])[0]
                except Exception:  # noqa: BLE001, S110
                    pass
            return ok
    return allowed


def _choose(ctx: Context, state: DecodeState, rows: np.ndarray, logits: np.ndarray, counts: np.ndarray):
    """The target's token at every verified position (j <= counts[b]) of each row: the
    processors with the row's history up to there, then greedy or the draw of that token
    index. Returns tokens [n, S] (-1 elsewhere), their log-probabilities (or None) and the rows
    whose selection failed at some position ({index into rows: exception})."""
    n, width = logits.shape[:2]
    if state.greedy and not (state.processes or ctx.processors or ctx.token_logprobs):
        return logits.argmax(axis=2), None, {}  # positions past a row's count are never read
    r, j = np.nonzero(np.arange(width) <= counts[:, None])
    settings = state.live_settings.take(r)
    history = state.tokens[rows[r]] if state.processes or ctx.processors else None
    tokens, lp, failed_at = select_rows(ctx, logits[r, j], settings, state.processes, history,
                                        state.lengths[rows[r]] + 1 + j, state.prompt_length[rows[r]],
                                        state.seeds[rows[r]], state.draws[rows[r]] + j.astype(np.uint64))
    failed = {}
    for pair, e in failed_at.items():
        failed.setdefault(int(r[pair]), e)
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
    return target, lp, failed


def _commit(state: DecodeState, rows: np.ndarray, target: np.ndarray, kept: np.ndarray, lp, failed: dict):
    """Rows gain target[b, :kept[b]], cut after an eos token, a stop string or the row's limit;
    the rows in `failed` gain nothing and end (a row whose stop matcher raises ends at that token,
    reported in its StepTokens' `failed`).
    Returns one StepTokens per position and the kept counts."""
    lengths = state.lengths[rows].copy()
    kept = kept.copy()
    outs = []
    going = np.ones(len(rows), bool)
    kept[list(failed)] = 0
    going[list(failed)] = False
    stops = [state.stops[r] for r in rows.tolist()] if state.any_stops else None
    for j in range(int(kept.max())):
        now = np.flatnonzero(going & (kept > j))
        if not now.size:
            break
        tokens = target[now, j]
        broke: dict = {}
        is_eos, finished = ends(tokens, state.eos[rows[now]], lengths[now] + 2 + j, state.limit[rows[now]],
                                 [stops[i] for i in now] if stops else (), broke)
        out = StepTokens(np.full(state.slots, -1, np.int64), np.zeros(state.slots, bool))
        out.token[rows[now]] = np.where(is_eos, -1, tokens)
        if broke:  # a row whose stop matcher raised ends here, without this token
            out.token[rows[now[list(broke)]]] = -1
            out.failed = {int(rows[now[i]]): e for i, e in broke.items()}
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
    prompt lookup (prompt_lookup_num_tokens) verifying the candidates worth their cost
    (budget.py), else None."""
    s = ctx.settings
    if ctx.draft is not None:
        refusal = assisted_refusal(ctx.model, "draft", s.num_beams)
        if refusal is not None:
            raise ValueError(refusal)
        from .draft import Draft

        return Draft(ctx.draft, s.num_assistant_tokens, s.num_assistant_tokens_schedule,
                     speculative=not ctx.token_logprobs)
    if s.prompt_lookup_num_tokens is None:
        return None
    refusal = assisted_refusal(ctx.model, "prompt_lookup_num_tokens", s.num_beams)
    if refusal is not None:
        raise ValueError(refusal)
    from .budget import CostAware
    from .prompt_lookup import PromptLookup

    return CostAware(PromptLookup())  # each row's own prompt_lookup_num_tokens, where they pay


def merged(outs: list[StepTokens]) -> StepTokens:
    """The StepTokens of a whole assisted step: each row's last token and whether it finished."""
    last = outs[-1]
    token = last.token.copy()
    for out in outs[-2::-1]:
        token = np.where(token < 0, out.token, token)
    finished = np.logical_or.reduce([o.finished for o in outs])
    return StepTokens(token, finished, bool(finished.any()), failed={k: v for o in outs for k, v in o.failed.items()})
