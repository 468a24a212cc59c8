"""Beam search as transformers 4.57 `_beam_search`, over a batch of prompts in every cache mode.

The beams of prompt p are rows p, P + p, 2P + p, ... of the batch (P prompts, B = num_beams
rows each: the first beams are rows 0..P-1, so the prompts prefill as one batch); all start from
that prefill, copied, and only the first beam counts at first (the others score -1e9). Each step, per prompt (`_step` below, written as transformers' helpers):

  1. scores = processors(log_softmax(logits)) per row (the sampling warpers too, when
     sampling, keeping 1 + the eos count tokens), plus the row's running score;
  2. the best K = max(2, 1 + eos count) * B of the B * V candidates (or K sampled without
     replacement, for beam sampling);
  3. a candidate ends at an eos token or at the prompt's last new token; among the first B,
     those become finished hypotheses scored sum / new_length ** length_penalty (the length
     counts the eos token), and the prompt keeps its best B hypotheses;
  4. the best B candidates that do not end are the next beams: each row takes the cache and the
     tokens of its source row (only rows that move are copied, only their valid part);
  5. a prompt stops when no running beam can beat its worst hypothesis (early_stopping False:
     at the current length; "never": at the longest length for a positive length_penalty), when
     it has B hypotheses (early_stopping True), or when every candidate ended. A stopped
     prompt's rows run as padding until every prompt stops.

Scores are float32 as in transformers; the per-token log-probabilities are those of the step's
processed scores before the beam's score is added (compute_transition_scores with beam_indices).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .cache import new_cache
from .context import Context
from .processors import RowSettings, apply
from .prompts import run_prompts
from .seq2seq import run_first_steps
from .rng import uniforms
from .selection import SamplingRows, log_softmax, top_k_candidates, warp
from .settings import Settings
from .state import _encoder_ids, prompt_inputs

LOST = np.float32(-1e9)  # transformers' score of a beam or hypothesis that must not be chosen
FLOOR = np.finfo(np.float32).min  # a removed token's score, in place of -inf


@dataclass
class Hypothesis:
    """One finished beam: its new tokens (without a final eos), its score (transformers'
    `sequences_scores`), and each token's log-probability (with token_logprobs)."""

    tokens: list[int]
    score: float
    logprobs: list[float] | None = None


def _topk_desc(values: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of each row, largest first (ties: lower index first)."""
    if k >= values.shape[1]:
        return np.argsort(-values, axis=1, kind="stable")[:, :k]
    part = np.argpartition(-values, k - 1, axis=1)[:, :k]
    order = np.lexsort((part, -np.take_along_axis(values, part, axis=1)), axis=1)
    return np.take_along_axis(part, order, axis=1)


def _best(values: np.ndarray, k: int) -> np.ndarray:
    """`_topk_desc` over B * V candidates, through their top-k candidates (O(V) compares, no
    partition of the whole row)."""
    ids, top = top_k_candidates(values, np.full(len(values), k))
    return np.take_along_axis(ids, _topk_desc(top, k), axis=1)


def _sample_without_replacement(scores: np.ndarray, k: int, seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """k draws without replacement from softmax(scores) per row, in draw order (Gumbel top-k:
    the same law as drawing one by one), from each row's seeded counter."""
    n, width = scores.shape
    u = uniforms(np.repeat(seeds, width), np.repeat(draws, width) + np.tile(np.arange(width, dtype=np.uint64), n))
    keys = scores.astype(np.float64) - np.log(-np.log(u.reshape(n, width)))
    return _topk_desc(np.where(np.isfinite(scores), keys, -np.inf), k)


@dataclass
class _Beams:
    """The host side of the search, per prompt: [P, B] running scores, the finished hypotheses
    ([P, B] scores and flags, and their tokens/log-probabilities), and whether each prompt goes on."""

    running: np.ndarray
    finished_scores: np.ndarray
    finished_flags: np.ndarray
    finished: list[list]  # [P][B] (tokens, logprobs) or None
    improvable: np.ndarray  # [P] transformers' is_early_stop_heuristic_unsatisfied
    live: np.ndarray  # [P]


def check_beam_settings(settings: list[Settings]) -> int:
    beams = {s.num_beams for s in settings}
    if len(beams) > 1:
        raise ValueError(f"the prompts of one beam search must share num_beams, got {sorted(beams)}")
    return beams.pop()


def beam_search(ctx: Context, prompts: list[list[int]], seeds: list[int],
                settings: list[Settings] | None = None, encoder=None) -> list[list[Hypothesis]]:
    """The best `num_return_sequences` hypotheses of each prompt, best first (empty prompts: []).

    prompts and seeds as `generate` checks them; settings: one per prompt (default: the
    context's), all with the same num_beams; encoder: an encoder-decoder model's EncoderOutputs,
    one row per prompt (a prompt's beams share its source, whose cross cache never moves), or
    a vision-language model's vision.PromptImages."""
    settings = settings or [ctx.settings] * len(prompts)
    beams = check_beam_settings(settings)
    results: list[list[Hypothesis]] = [[] for _ in prompts]
    order = [i for i, p in enumerate(prompts) if p and settings[i].new_tokens_for(len(p)) > 0]
    if not order:
        return results
    size = ctx.batch_size or len(order)
    for start in range(0, len(order), size):  # more prompts than the compiled batch: one batch after another
        chunk = order[start:start + size]
        part = None if encoder is None else encoder.take(chunk)
        for i, hypotheses in zip(chunk, _search(ctx, [prompts[i] for i in chunk], [seeds[i] for i in chunk],
                                                [settings[i] for i in chunk], beams, part)):
            results[i] = hypotheses
    return results


def _search(ctx: Context, run: list[list[int]], seeds: list[int], run_settings: list[Settings],
            beams: int, encoder=None) -> list[list[Hypothesis]]:
    """beam_search over non-empty prompts that each may get a token."""
    model, vocab = ctx.model, ctx.model.vocab_size
    count, rows = len(run), len(run) * beams
    length = np.array([len(p) for p in run], np.int64)
    limit = np.minimum(length + np.array([s.new_tokens_for(len(p)) for s, p in zip(run_settings, run)]),
                       ctx.max_position)
    capacity = int(limit.max())
    cache = new_cache(model, ctx.cache_mode, rows, capacity, ctx.max_position)
    first = np.arange(count)  # beam 0 of each prompt
    owner = np.tile(np.arange(count), beams)  # the prompt of each row
    encoder_ids = _encoder_ids(ctx, run, encoder)
    if hasattr(cache, "prefill"):
        last = cache.prefill(first.tolist(), run, ctx.prompt_steps, ctx.settings.pad_token_id)
    elif model.is_seq2seq:
        last, prompt_rows = run_first_steps(model, run, encoder)
        for p, slot in enumerate(first.tolist()):
            cache.insert(slot, prompt_rows[p], len(run[p]))
    else:
        prompt_cache = run_prompts(model.session, model.graph, ctx.cache_mode, ctx.prompt_steps, run,
                                   ctx.settings.pad_token_id, ctx.max_position, *prompt_inputs(model, run, encoder))
        last = prompt_cache.last_logits
        for p, slot in enumerate(first.tolist()):
            cache.insert(slot, prompt_cache.rows[p], len(run[p]))
    for b in range(1, beams):
        cache.copy_rows((first + b * count).tolist(), first.tolist(), int(length.max()))

    row_settings = RowSettings(rows, vocab)
    tokens = np.zeros((rows, capacity), np.int64)
    for p, (prompt, s) in enumerate(zip(run, run_settings)):
        for b in range(beams):
            row_settings.set_row(b * count + p, s, len(prompt), int(limit[p]), encoder_ids=encoder_ids[p])
            tokens[b * count + p, :len(prompt)] = prompt
    row_settings.min_keep[:] = np.maximum(2, 1 + (row_settings.eos >= 0).sum(axis=1))  # beams keep a non-eos token
    sampling = SamplingRows.of(row_settings)
    keep_logprobs = ctx.token_logprobs
    logprob = np.zeros((rows, capacity), np.float32) if keep_logprobs else None
    seeds_p = np.array(seeds, np.uint64)
    draws = np.zeros(count, np.uint64)
    state = _Beams(running=np.where(np.arange(beams) == 0, np.float32(0), LOST)[None].repeat(count, 0).astype(np.float32),
                   finished_scores=np.full((count, beams), LOST, np.float32),
                   finished_flags=np.zeros((count, beams), bool),
                   finished=[[None] * beams for _ in range(count)],
                   improvable=np.ones(count, bool), live=np.ones(count, bool))
    logits = np.tile(last, (beams, 1))
    phys = np.arange(beams)[None, :] * count + first[:, None]  # [P, B] the row of each prompt's j-th best beam
    cur = length.copy()  # tokens in each prompt's rows
    lengths = length[owner]  # valid cache rows of each row
    while state.live.any():
        processed = apply(log_softmax(logits.astype(np.float32, copy=False)), row_settings, tokens, cur[owner],
                          ctx.processors, length[owner], inplace=True)
        if sampling.do_sample.any():
            processed = np.where(sampling.do_sample[:, None], warp(processed, sampling), processed)
        if sampling.renormalize.any():
            processed = np.where(sampling.renormalize[:, None], log_softmax(processed), processed)
        np.maximum(processed, FLOOR, out=processed)
        step_logprob = log_softmax(processed) if keep_logprobs else None
        was_live = state.live.copy()
        source, new_tokens, new_logprobs = _step(state, processed, phys, run_settings, row_settings, cur, length,
                                                 limit, beams, tokens, logprob, step_logprob, seeds_p, draws)
        draws += np.uint64(beams * vocab)
        for slot in np.flatnonzero((was_live & ~state.live)[owner]).tolist():
            cache.release(slot)  # a stopped prompt's rows run as padding from now on
        if not state.live.any():
            break
        phys, dst, src = _place(phys, source.reshape(count, beams), state.live)
        if dst:
            if model.is_seq2seq:  # a prompt's beams share its source: the cross cache stays
                cache.copy_rows(dst, src, int(cur.max()), shared_cross=True)
            else:
                cache.copy_rows(dst, src, int(cur.max()))
            tokens[dst] = tokens[src]
            if logprob is not None:
                logprob[dst] = logprob[src]
        live = np.repeat(state.live, beams)
        where, at = phys.reshape(-1)[live], np.repeat(cur, beams)[live]
        tokens[where, at] = new_tokens[live]
        if logprob is not None:
            logprob[where, at] = new_logprobs[live]
        cache.token_input[:] = ctx.settings.pad_token_id
        cache.token_input[where] = new_tokens[live]
        lengths = np.zeros(rows, np.int64)
        lengths[where] = at
        cur = cur + state.live
        logits = cache.decode(lengths)

    return [[_hypothesis(state.finished[p][b], float(state.finished_scores[p, b]), run_settings[p])
             for b in range(min(run_settings[p].num_return_sequences, beams))] for p in range(count)]


def _place(phys: np.ndarray, source: np.ndarray, live: np.ndarray):
    """The rows of the next beams ([P, B]) and the (dst, src) rows to copy. A beam stays in its
    source's row when it is that source's first child; the other children take the rows of
    beams that ended, so a step copies one row per extra child instead of reordering them all
    (the beams' order, which the search reads, lives in `phys`, not in the rows)."""
    placed, dst, src = phys.copy(), [], []
    for p in np.flatnonzero(live).tolist():
        claimed, extra = set(), []
        for j, row in enumerate(source[p].tolist()):
            if row in claimed:
                extra.append(j)
            else:
                claimed.add(row)
                placed[p, j] = row
        free = [row for row in phys[p].tolist() if row not in claimed]
        for j in extra:
            placed[p, j] = free.pop()
            dst.append(int(placed[p, j]))
            src.append(int(source[p, j]))
    return placed, dst, src


def _hypothesis(entry, score: float, settings: Settings) -> Hypothesis:
    new, logprobs = entry
    if new and new[-1] in settings.eos_token_id:
        new, logprobs = new[:-1], None if logprobs is None else logprobs[:-1]
    return Hypothesis(new, score, logprobs)


def _step(state: _Beams, processed: np.ndarray, phys: np.ndarray, settings: list[Settings], rows: RowSettings,
          cur: np.ndarray, prompt_length: np.ndarray, limit: np.ndarray, beams: int, tokens: np.ndarray, logprob,
          step_logprob, seeds: np.ndarray, draws: np.ndarray):
    """One step of every live prompt, in place on `state`; returns the source row, the token and
    its log-probability of each next beam, [P * B] in beam order. `phys` [P, B]: each beam's row.
    Written after transformers' _get_top_k_continuations, _get_running_beams_for_next_iteration,
    _update_finished_beams and _check_early_stop_heuristic."""
    count, vocab = len(cur), processed.shape[1]
    eos = rows.eos[phys[:, 0]]  # per prompt (its rows share settings)
    eos_count = (eos >= 0).sum(axis=1)
    keep = int(np.max(np.maximum(2, 1 + eos_count))) * beams
    accumulated = (processed[phys.reshape(-1)].reshape(count, beams, vocab)
                   + state.running[:, :, None]).reshape(count, beams * vocab)
    sampled = rows.do_sample[phys[:, 0]]
    pick = _best(accumulated, keep)
    if sampled.any():
        where = np.flatnonzero(sampled)
        pick[where] = _sample_without_replacement(accumulated[where], keep, seeds[where], draws[where])
    top_scores = np.take_along_axis(accumulated, pick, axis=1)  # [P, K]
    source_beam, token = pick // vocab, pick % vocab
    source_row = np.take_along_axis(phys, source_beam, axis=1)
    ends = (token[:, :, None] == eos[:, None, :]).any(axis=2) & (eos[:, None, :] >= 0).any(axis=2)
    ends |= (cur + 1 >= limit)[:, None]

    # the next running beams: the best B that do not end
    running_scores = top_scores + ends.astype(np.float32) * LOST
    next_pick = _topk_desc(running_scores, beams)
    next_running = np.take_along_axis(running_scores, next_pick, axis=1)

    # finished hypotheses: candidates among the first B that end
    new_length = (cur + 1 - prompt_length).astype(np.float64)
    lp = np.array([s.length_penalty for s in settings], np.float64)
    early = [s.early_stopping for s in settings]
    just_finished = ends & (np.arange(keep) < beams)[None, :]
    scored = top_scores / (new_length ** lp).astype(np.float32)[:, None]
    # (transformers also bars new hypotheses once a prompt with early_stopping=True has B of them;
    # here such a prompt has stopped already)
    scored = scored + (~state.improvable)[:, None].astype(np.float32) * LOST
    scored = scored + (~just_finished).astype(np.float32) * LOST
    merged_scores = np.concatenate([state.finished_scores, scored], axis=1)
    merged_flags = np.concatenate([state.finished_flags, just_finished], axis=1)
    best = _topk_desc(merged_scores, beams)
    new_finished = []
    for p in range(count):
        kept = []
        for j in best[p].tolist():
            if not state.live[p]:
                kept = state.finished[p]
                break
            if j < beams:
                kept.append(state.finished[p][j])
            elif just_finished[p, j - beams]:
                c, row = j - beams, int(source_row[p, j - beams])
                new = tokens[row, prompt_length[p]:cur[p]].tolist() + [int(token[p, c])]
                lps = None
                if step_logprob is not None:
                    lps = logprob[row, prompt_length[p]:cur[p]].tolist() + [float(step_logprob[row, token[p, c]])]
                kept.append((new, lps))
            else:
                kept.append(None)
        new_finished.append(kept)
    live = state.live
    state.finished_scores = np.where(live[:, None], np.take_along_axis(merged_scores, best, axis=1), state.finished_scores)
    state.finished_flags = np.where(live[:, None], np.take_along_axis(merged_flags, best, axis=1), state.finished_flags)
    state.finished = new_finished
    state.running = np.where(live[:, None], next_running, state.running)

    # can a prompt still improve?
    length_now = cur + 1
    never = np.array([e == "never" for e in early]) & (lp > 0)
    hypothetical = np.where(never, limit - prompt_length, length_now - prompt_length).astype(np.float64)
    best_possible = state.running[:, 0] / (hypothetical ** lp).astype(np.float32)
    worst = np.where(state.finished_flags, state.finished_scores.min(axis=1, keepdims=True), LOST)
    state.improvable &= (best_possible[:, None] > worst).any(axis=1)
    exists_open = ~(state.finished_flags.all(axis=1) & np.array([e is True for e in early]))
    state.live = live & state.improvable & exists_open & ~ends.all(axis=1)

    next_source = np.take_along_axis(source_row, next_pick, axis=1).reshape(-1)
    next_token = np.take_along_axis(token, next_pick, axis=1).reshape(-1)
    next_logprob = None if step_logprob is None else step_logprob[next_source, next_token]
    return next_source, next_token, next_logprob
