"""Beam search as transformers 4.57 `_beam_search`, as rows of a shared decode state.

A beam request (`BeamGroup`) holds num_beams = B slots of the scheduler's DecodeState; its
prompt is prefilled once, copied into the other slots, and only the first beam counts at first
(the others score -1e9). Its rows run in the same model run as every other row of the batch;
`advance_groups` then takes each group's logits through one step (`_step` below, written as
transformers' helpers), per request:

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
     request's slots are freed at once.

Scores are float32 as in transformers; the per-token log-probabilities are those of the step's
processed scores before the beam's score is added (compute_transition_scores with beam_indices).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..logits.row_settings import apply
from ..logits.rng import uniforms
from ..logits.selection import SamplingRows, log_softmax, top_k_candidates, warp
from ..params.settings import Settings

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


@dataclass(eq=False)
class BeamGroup:
    """One beam request in a DecodeState: its B slots (local row r is `slots[r]`), where its
    prompt ends and its rows stop, its random state, and the search's host side. `phys` [1, B]
    gives the local row of each beam, best first; its rows hold `cur` tokens."""

    slots: np.ndarray  # [B] int64
    settings: Settings
    prompt_length: int
    limit: int
    seed: np.ndarray  # [1] uint64
    beams: _Beams
    phys: np.ndarray  # [1, B]
    cur: int
    draws: np.ndarray = field(default_factory=lambda: np.zeros(1, np.uint64))

    @property
    def width(self) -> int:
        return len(self.slots)

    def hypotheses(self) -> list[Hypothesis]:
        """The best num_return_sequences finished hypotheses, best first."""
        count = min(self.settings.num_return_sequences, self.width)
        return [_hypothesis(self.beams.finished[0][b], float(self.beams.finished_scores[0, b]), self.settings)
                for b in range(count)]


def new_group(slots, settings: Settings, prompt_length: int, limit: int, seed: int) -> BeamGroup:
    """A search that starts from a prompt of `prompt_length` tokens in `slots` (all hold it)."""
    width = len(slots)
    running = np.where(np.arange(width) == 0, np.float32(0), LOST)[None].astype(np.float32)
    beams = _Beams(running=running, finished_scores=np.full((1, width), LOST, np.float32),
                   finished_flags=np.zeros((1, width), bool), finished=[[None] * width],
                   improvable=np.ones(1, bool), live=np.ones(1, bool))
    return BeamGroup(np.asarray(slots, np.int64), settings, prompt_length, limit, np.array([seed], np.uint64),
                     beams, np.arange(width)[None], prompt_length)


def beam_min_keep(settings: Settings) -> int:
    """The tokens a beam row's warpers keep at least: one that is not an eos token."""
    return max(2, 1 + len(settings.eos_token_id))


def advance_groups(ctx, state, groups: list[BeamGroup], logits: list[np.ndarray]
                   ) -> tuple[list[BeamGroup], dict]:
    """One step of each group from its rows' logits ([B, V] each, in local row order), in place
    on `state` (a DecodeState): its new tokens, its rows moved to their beams' sources (only
    the rows that move, only their valid part), its next inputs. Returns the groups that stopped
    and those whose own part failed ({group: exception}); the slots of both still hold their
    rows (the caller frees them). A group's failure (its processors, warpers or draw) leaves
    the other groups as if it had not been there."""
    try:
        parts = _scores(ctx, state, groups, logits)
    except Exception:  # noqa: BLE001 - someone's settings: each group on its own finds out whose
        parts = []
        for group, group_logits in zip(groups, logits):
            try:
                parts += _scores(ctx, state, [group], [group_logits])
            except Exception as e:  # noqa: BLE001 - this group's own failure
                parts.append(e)
    failed = {g: part for g, part in zip(groups, parts) if isinstance(part, Exception)}
    widths: dict[int, list] = {}
    for g, part in zip(groups, parts):
        if not isinstance(part, Exception):
            widths.setdefault(g.width, []).append((g, part))
    steps = {}
    for members in widths.values():  # the searches of one width step together, as one batch of prompts
        try:
            steps.update(_search_steps(state, members))
        except Exception:  # noqa: BLE001 - redone one by one: only the culprits fail
            for member in members:
                try:
                    steps.update(_search_steps(state, [member]))
                except Exception as e:  # noqa: BLE001 - this group's own failure
                    failed[member[0]] = e
    stopped = []
    for g, step in steps.items():
        try:
            if _move(ctx, state, g, *step):
                stopped.append(g)
        except Exception as e:  # noqa: BLE001 - this group's own failure
            failed[g] = e
    return stopped, failed


def _scores(ctx, state, groups: list[BeamGroup], logits: list[np.ndarray]) -> list[tuple]:
    """Each group's (processed scores [B, V], their log-softmax or None, eos [1, E], sampled):
    the processors over log_softmax(logits), then the sampling warpers, for all groups' rows
    at once (no state changes)."""
    rows = np.concatenate([g.slots for g in groups])
    key = (rows.tobytes(), state.settings.version)
    if state.beam_settings is None or state.beam_settings[0] != key:  # taken again only when rows moved
        state.beam_settings = (key, state.settings.take(rows))
    settings = state.beam_settings[1]
    cur = np.concatenate([np.full(g.width, g.cur, np.int64) for g in groups])
    prompt_length = np.concatenate([np.full(g.width, g.prompt_length, np.int64) for g in groups])
    scores = np.concatenate(logits).astype(np.float32, copy=False)
    processed = apply(log_softmax(scores), settings, state.tokens[rows], cur, ctx.processors, prompt_length,
                      inplace=True)
    sampling = SamplingRows.of(settings)
    if sampling.do_sample.any():
        processed = np.where(sampling.do_sample[:, None], warp(processed, sampling), processed)
    if sampling.renormalize.any():
        processed = np.where(sampling.renormalize[:, None], log_softmax(processed), processed)
    np.maximum(processed, FLOOR, out=processed)
    step_logprob = log_softmax(processed) if state.logprob is not None else None
    parts, at = [], 0
    for g in groups:
        local = slice(at, at + g.width)
        parts.append((processed[local], None if step_logprob is None else step_logprob[local],
                      settings.eos[at:at + 1], bool(settings.do_sample[at])))
        at += g.width
    return parts


def _search_steps(state, members: list[tuple[BeamGroup, tuple]]) -> dict:
    """`_step` for groups of one width at once, their host sides stacked as the prompts of one
    search (each group's rows are its own: phys offsets them), then split back. Returns each
    group's (source local row, token, log-probability) per next beam. No group changes when
    this raises."""
    groups = [g for g, _ in members]
    width, count = groups[0].width, len(groups)
    logprob = state.logprob
    beams = _Beams(running=np.concatenate([g.beams.running for g in groups]),
                   finished_scores=np.concatenate([g.beams.finished_scores for g in groups]),
                   finished_flags=np.concatenate([g.beams.finished_flags for g in groups]),
                   finished=[g.beams.finished[0] for g in groups],
                   improvable=np.concatenate([g.beams.improvable for g in groups]),
                   live=np.concatenate([g.beams.live for g in groups]))
    processed = np.concatenate([part[0] for _, part in members])
    step_logprob = None if members[0][1][1] is None else np.concatenate([part[1] for _, part in members])
    eos = np.full((count, max(part[2].shape[1] for _, part in members)), -1, np.int64)
    for p, (_, part) in enumerate(members):
        eos[p, :part[2].shape[1]] = part[2][0]
    phys = np.concatenate([g.phys + p * width for p, g in enumerate(groups)])

    def prefix(row: int):  # the new tokens (and their log-probabilities) of a row so far
        g = groups[row // width]
        slot = g.slots[row % width]
        tokens = state.tokens[slot, g.prompt_length:g.cur].tolist()
        return tokens, None if logprob is None else logprob[slot, g.prompt_length:g.cur].tolist()

    source, token, token_logprob = _step(beams, _StepInputs(
        processed=processed, phys=phys, beams=width, eos=eos, sampled=np.array([part[3] for _, part in members]),
        cur=np.array([g.cur for g in groups]), prompt_length=np.array([g.prompt_length for g in groups]),
        limit=np.array([g.limit for g in groups]),
        length_penalty=np.array([g.settings.length_penalty for g in groups], np.float64),
        early_stopping=[g.settings.early_stopping for g in groups], prefix=prefix, step_logprob=step_logprob,
        seeds=np.concatenate([g.seed for g in groups]), draws=np.concatenate([g.draws for g in groups])))
    out = {}
    for p, g in enumerate(groups):
        one = slice(p, p + 1)
        g.beams = _Beams(beams.running[one], beams.finished_scores[one], beams.finished_flags[one],
                         [beams.finished[p]], beams.improvable[one], beams.live[one])
        g.draws += np.uint64(width * processed.shape[1])
        rows = slice(p * width, (p + 1) * width)
        out[g] = (source[rows] - p * width, token[rows], None if token_logprob is None else token_logprob[rows])
    return out


def _move(ctx, state, g: BeamGroup, source: np.ndarray, new_tokens: np.ndarray, new_logprobs) -> bool:
    """A group's rows after its step: each next beam takes its source's row (only the rows that
    move), then its token. True when its search stopped."""
    slots, width = g.slots, g.width
    logprob = state.logprob
    if not g.beams.live[0]:
        return True
    g.phys, dst, src = _place(g.phys, source.reshape(1, width), g.beams.live)
    if dst:
        to, fro = slots[dst], slots[src]
        if ctx.model.is_seq2seq:  # a request's beams share its source: the cross cache stays
            state.cache.copy_rows(to.tolist(), fro.tolist(), g.cur, shared_cross=True)
        else:
            state.cache.copy_rows(to.tolist(), fro.tolist(), g.cur)
        state.tokens[to] = state.tokens[fro]
        if logprob is not None:
            logprob[to] = logprob[fro]
    where = slots[g.phys[0]]  # the slot of each beam, best first
    state.tokens[where, g.cur] = new_tokens
    if logprob is not None:
        logprob[where, g.cur] = new_logprobs
    state.next_input[where] = new_tokens
    state.lengths[where] = g.cur
    g.cur += 1
    return False


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


@dataclass
class _StepInputs:
    """What one step of `_step` reads, per prompt P of B beams: `processed` [rows, V] scores,
    `phys` [P, B] each beam's row of them, eos [P, E] (-1 padded), sampled [P], the rows' token
    count `cur`, prompt_length and limit [P], length_penalty [P] and early_stopping (P values) of
    each prompt's settings, its random state (seeds, draws [P]); prefix(row) -> (new tokens,
    their log-probabilities or None) of a row so far, and step_logprob [rows, V] or None."""

    processed: np.ndarray
    phys: np.ndarray
    beams: int
    eos: np.ndarray
    sampled: np.ndarray
    cur: np.ndarray
    prompt_length: np.ndarray
    limit: np.ndarray
    length_penalty: np.ndarray
    early_stopping: list
    prefix: object
    step_logprob: np.ndarray | None
    seeds: np.ndarray
    draws: np.ndarray


def _step(state: _Beams, step: _StepInputs):
    """One step of every live prompt, in place on `state`; returns the source row, the token and
    its log-probability of each next beam, [P * B] in beam order.
    Written after transformers' _get_top_k_continuations, _get_running_beams_for_next_iteration,
    _update_finished_beams and _check_early_stop_heuristic."""
    keep = int(np.max(np.maximum(2, 1 + (step.eos >= 0).sum(axis=1)))) * step.beams  # K candidates
    source_row, token, top_scores, ends = _candidates(state, step, keep)
    # the next running beams: the best B that do not end
    running_scores = top_scores + ends.astype(np.float32) * LOST
    next_pick = _topk_desc(running_scores, step.beams)
    next_running = np.take_along_axis(running_scores, next_pick, axis=1)
    _keep_finished(state, step, source_row, token, top_scores, ends)
    state.running = np.where(state.live[:, None], next_running, state.running)
    _check_early_stop(state, step, ends)
    next_source = np.take_along_axis(source_row, next_pick, axis=1).reshape(-1)
    next_token = np.take_along_axis(token, next_pick, axis=1).reshape(-1)
    next_logprob = None if step.step_logprob is None else step.step_logprob[next_source, next_token]
    return next_source, next_token, next_logprob


def _candidates(state: _Beams, step: _StepInputs, keep: int):
    """The best `keep` = K of each prompt's B * V continuations (or K drawn without replacement,
    for beam sampling): their source rows, tokens and scores [P, K], and whether each ends (an
    eos token, or the prompt's last new token)."""
    count, vocab, beams = len(step.cur), step.processed.shape[1], step.beams
    accumulated = (step.processed[step.phys.reshape(-1)].reshape(count, beams, vocab)
                   + state.running[:, :, None]).reshape(count, beams * vocab)
    pick = _best(accumulated, keep)
    if step.sampled.any():
        where = np.flatnonzero(step.sampled)
        pick[where] = _sample_without_replacement(accumulated[where], keep, step.seeds[where], step.draws[where])
    top_scores = np.take_along_axis(accumulated, pick, axis=1)  # [P, K]
    source_beam, token = pick // vocab, pick % vocab
    source_row = np.take_along_axis(step.phys, source_beam, axis=1)
    ends = (token[:, :, None] == step.eos[:, None, :]).any(axis=2) & (step.eos[:, None, :] >= 0).any(axis=2)
    ends |= (step.cur + 1 >= step.limit)[:, None]
    return source_row, token, top_scores, ends


def _keep_finished(state: _Beams, step: _StepInputs, source_row, token, top_scores, ends) -> None:
    """The candidates among the first B that end become hypotheses scored sum / new_length **
    length_penalty; each live prompt keeps its best B hypotheses (in place on `state`)."""
    beams = step.beams
    new_length = (step.cur + 1 - step.prompt_length).astype(np.float64)
    just_finished = ends & (np.arange(ends.shape[1]) < beams)[None, :]
    scored = top_scores / (new_length ** step.length_penalty).astype(np.float32)[:, None]
    # (transformers also bars new hypotheses once a prompt with early_stopping=True has B of them;
    # here such a prompt has stopped already)
    scored = scored + (~state.improvable)[:, None].astype(np.float32) * LOST
    scored = scored + (~just_finished).astype(np.float32) * LOST
    merged_scores = np.concatenate([state.finished_scores, scored], axis=1)
    merged_flags = np.concatenate([state.finished_flags, just_finished], axis=1)
    best = _topk_desc(merged_scores, beams)
    new_finished = [_kept_hypotheses(state, step, p, best[p], just_finished, source_row, token)
                    for p in range(len(step.cur))]
    live = state.live
    state.finished_scores = np.where(live[:, None], np.take_along_axis(merged_scores, best, axis=1), state.finished_scores)
    state.finished_flags = np.where(live[:, None], np.take_along_axis(merged_flags, best, axis=1), state.finished_flags)
    state.finished = new_finished


def _kept_hypotheses(state: _Beams, step: _StepInputs, p: int, best: np.ndarray, just_finished, source_row,
                     token) -> list:
    """Prompt p's hypotheses after the step: `best` indexes its B old ones, then its K candidates."""
    if not state.live[p]:
        return state.finished[p]
    kept = []
    for j in best.tolist():
        if j < step.beams:
            kept.append(state.finished[p][j])
        elif just_finished[p, j - step.beams]:
            c, row = j - step.beams, int(source_row[p, j - step.beams])
            new, lps = step.prefix(row)
            new = new + [int(token[p, c])]
            if step.step_logprob is not None:
                lps = lps + [float(step.step_logprob[row, token[p, c]])]
            kept.append((new, lps))
        else:
            kept.append(None)
    return kept


def _check_early_stop(state: _Beams, step: _StepInputs, ends) -> None:
    """Whether each prompt goes on: it stops when no running beam can beat its worst hypothesis
    (at the current length; with early_stopping "never" and a positive length_penalty, at the
    longest), when it has B hypotheses with early_stopping True, or when every candidate ended."""
    lp = step.length_penalty
    never = np.array([e == "never" for e in step.early_stopping]) & (lp > 0)
    hypothetical = np.where(never, step.limit - step.prompt_length, step.cur + 1 - step.prompt_length).astype(np.float64)
    best_possible = state.running[:, 0] / (hypothetical ** lp).astype(np.float32)
    worst = np.where(state.finished_flags, state.finished_scores.min(axis=1, keepdims=True), LOST)
    state.improvable &= (best_possible[:, None] > worst).any(axis=1)
    exists_open = ~(state.finished_flags.all(axis=1) & np.array([e is True for e in step.early_stopping]))
    state.live = state.live & state.improvable & exists_open & ~ends.all(axis=1)
