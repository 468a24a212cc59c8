"""Choosing the next token of each row from its processed scores: the sampling warpers,
greedy or seeded sampling, and the chosen tokens' log-probabilities.

Every setting is an array over the rows, so one call serves a batch whose rows have different
settings (the server mixes requests). The warpers are those of transformers 4.57
`_get_logits_processor`, in its order: temperature, top_k, top_p, min_p, typical_p,
epsilon_cutoff, eta_cutoff, each keeping at least `min_keep` tokens (1, or 1 + the eos tokens
with beams); they apply only to rows that sample, and `renormalize_logits` comes after them.
Greedy rows take the argmax of the processed scores, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rng import uniforms

NEG_INF = np.float32(-np.inf)


@dataclass
class SamplingRows:
    """Per-row warper settings, [n] each; the off values are those of transformers."""

    do_sample: np.ndarray  # bool
    temperature: np.ndarray  # float32, > 0; 1 = off
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32, 1 = off
    min_p: np.ndarray | None = None  # float32, 0 = off
    typical_p: np.ndarray | None = None  # float32, 1 = off
    epsilon: np.ndarray | None = None  # float32, 0 = off
    eta: np.ndarray | None = None  # float32, 0 = off
    min_keep: np.ndarray | None = None  # int64, >= 1
    renormalize: np.ndarray | None = None  # bool
    untempered: np.ndarray | None = None  # bool: log-probabilities of the scores x temperature
    no_logprobs: np.ndarray | None = None  # bool: rows whose log-probabilities nobody reads

    def __post_init__(self):
        n = len(self.do_sample)
        for name, value, dtype in (("min_p", 0, np.float32), ("typical_p", 1, np.float32), ("epsilon", 0, np.float32),
                                   ("eta", 0, np.float32), ("min_keep", 1, np.int64), ("renormalize", False, bool),
                                   ("untempered", False, bool), ("no_logprobs", False, bool)):
            if getattr(self, name) is None:
                setattr(self, name, np.full(n, value, dtype))

    def take(self, rows) -> "SamplingRows":
        return SamplingRows(*(getattr(self, f)[rows] for f in self.__dataclass_fields__))

    @classmethod
    def of(cls, settings) -> "SamplingRows":
        """From a RowSettings (processors.py), whose fields have the same names."""
        return cls(settings.do_sample, settings.temperature, settings.top_k, settings.top_p, settings.min_p,
                   settings.typical_p, settings.epsilon, settings.eta, settings.min_keep, settings.renormalize,
                   settings.untempered, settings.no_logprobs)


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def log_softmax(scores: np.ndarray) -> np.ndarray:
    """log_softmax over the last axis; a row of all -inf stays -inf (no nan)."""
    top = scores.max(axis=1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0).astype(scores.dtype)
    shifted = scores - top
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def _sort_keep(sorted_remove: np.ndarray, keep: np.ndarray, at_end: bool) -> np.ndarray:
    """Clear the removal of the `keep[i]` first (or last) sorted entries of each row."""
    vocab = sorted_remove.shape[1]
    column = np.arange(vocab)
    kept = column >= vocab - keep[:, None] if at_end else column < keep[:, None]
    return sorted_remove & ~kept


def _unsort(sorted_values: np.ndarray, order: np.ndarray) -> np.ndarray:
    out = np.empty_like(sorted_values)
    np.put_along_axis(out, order, sorted_values, axis=1)
    return out


def _kth_largest(scores: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Each row's k[i]-th largest score (1 <= k[i] <= V)."""
    vocab, kmax = scores.shape[1], int(k.max())
    if kmax == 1:  # the largest: one pass, where a partition moves the whole row (nan, as there, wins)
        return scores.max(axis=1)
    largest = np.sort(np.partition(scores, vocab - kmax, axis=1)[:, vocab - kmax:], axis=1)  # ascending
    return largest[np.arange(len(scores)), kmax - k]


def temperature(scores: np.ndarray, t: np.ndarray) -> np.ndarray:
    """scores [n, V] / t [n], as TemperatureLogitsWarper (float32's lowest, from
    remove_invalid_values, may go to -inf, as in torch)."""
    with np.errstate(over="ignore"):
        return scores / t[:, None].astype(scores.dtype)


def top_k(scores: np.ndarray, k: np.ndarray, min_keep: np.ndarray | None = None) -> np.ndarray:
    """Keep the tokens at least as large as each row's k-th largest score (ties kept), as
    TopKLogitsWarper (k raised to min_keep); k 0 or >= V leaves the row unchanged.

    >>> top_k(np.array([[1., 3., 2., 3.]]), np.array([2]))
    array([[-inf,   3., -inf,   3.]])
    """
    vocab = scores.shape[1]
    if min_keep is not None:
        k = np.where(k > 0, np.maximum(k, min_keep), 0)
    active = (k > 0) & (k < vocab)
    if not active.any():
        return scores
    kth = _kth_largest(scores, np.clip(k, 1, vocab))
    remove = active[:, None] & (scores < kth[:, None])
    return np.where(remove, -np.inf, scores).astype(scores.dtype, copy=False)


def top_p(scores: np.ndarray, p: np.ndarray, min_keep: np.ndarray | None = None) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability exceeds p, as TopPLogitsWarper:
    sort ascending, remove tokens whose cumulative probability is <= 1 - p, keep the top min_keep.

    The removed tokens are the m smallest (cumulative probabilities only grow), ties going
    lower ids first as transformers' sort does; m needs only the sorted values, which a plain
    sort gives as a stable argsort would, at a tenth of its cost (no permutation to undo)."""
    active = p < 1.0
    if not active.any():
        return scores
    keep = np.ones(len(scores), np.int64) if min_keep is None else min_keep
    ordered = np.sort(scores, axis=1)
    cumulative = np.cumsum(softmax(ordered), axis=1)
    removed = (cumulative <= (1.0 - p)[:, None].astype(cumulative.dtype)).sum(axis=1)
    removed = np.where(active, np.clip(np.minimum(removed, scores.shape[1] - keep), 0, None), 0)
    return np.where(_smallest(scores, ordered, removed), -np.inf, scores).astype(scores.dtype, copy=False)


def _smallest(values: np.ndarray, ordered: np.ndarray, count: np.ndarray) -> np.ndarray:
    """[n, V] mask of each row's `count[i]` smallest values in stable ascending order (among
    equal values the lower ids first); `ordered` is `values` sorted ascending along rows."""
    mask = np.zeros(values.shape, bool)
    for i in np.flatnonzero(count > 0).tolist():
        edge = ordered[i, count[i] - 1]  # the largest value taken
        np.less(values[i], edge, out=mask[i])
        need = int(count[i] - np.count_nonzero(mask[i]))  # how many of the values equal to it are taken
        if need > 0:
            mask[i, np.flatnonzero(values[i] == edge)[:need]] = True
    return mask


def min_p(scores: np.ndarray, p: np.ndarray, min_keep: np.ndarray) -> np.ndarray:
    """MinPLogitsWarper: remove tokens less likely than p times the most likely one, keeping the
    min_keep best; p 0 is off."""
    active = p > 0
    if not active.any():
        return scores
    probs = softmax(scores)
    remove = probs < (p[:, None] * probs.max(axis=1, keepdims=True))
    if (min_keep > 1).any():
        order = np.argsort(-scores, axis=1, kind="stable")
        remove = _unsort(_sort_keep(np.take_along_axis(remove, order, axis=1), min_keep, at_end=False), order)
    else:  # the best token is never below p times itself
        remove[np.arange(len(scores)), scores.argmax(axis=1)] = False
    return np.where(remove & active[:, None], -np.inf, scores).astype(scores.dtype, copy=False)


def typical_p(scores: np.ndarray, mass: np.ndarray, min_keep: np.ndarray) -> np.ndarray:
    """TypicalLogitsWarper: keep the tokens whose surprise is closest to the entropy, up to
    `mass` of probability; mass 1 is off.

    The cumulative probability needs the scores in the stable order of the surprise gap
    (`_stable_argsort`); the cut is made on the values, so nothing is unsorted."""
    active = mass < 1.0
    if not active.any():
        return scores
    normalized = log_softmax(scores)
    p = np.exp(normalized)
    with np.errstate(invalid="ignore"):
        entropy = -np.nansum(normalized * p, axis=1, keepdims=True)
    shifted = np.abs(-normalized - entropy)
    order = _stable_argsort(shifted)
    sorted_shifted = np.take_along_axis(shifted, order, axis=1)
    sorted_scores = np.take_along_axis(scores, order, axis=1)
    cumulative = np.cumsum(softmax(sorted_scores), axis=1)
    last = np.minimum((cumulative < mass[:, None]).sum(axis=1), scores.shape[1] - 1)
    remove = shifted > sorted_shifted[np.arange(len(scores)), last][:, None]
    remove &= ~_smallest(shifted, sorted_shifted, np.minimum(min_keep, scores.shape[1]))
    return np.where(remove & active[:, None], -np.inf, scores).astype(scores.dtype, copy=False)


def _stable_argsort(values: np.ndarray) -> np.ndarray:
    """argsort(values, axis=1, kind="stable") of float32 rows, at a third of its cost: each value
    as an order-keeping 32-bit key above its 32-bit id, one sort of the uint64 (a SIMD sort in
    numpy), the ids back. -0.0 sorts as 0.0 and every nan last, ids ascending, as numpy's."""
    if values.dtype != np.float32 or values.shape[1] >= 1 << 32:
        return np.argsort(values, axis=1, kind="stable")
    bits = (values + np.float32(0)).view(np.uint32).astype(np.uint64)  # + 0: -0.0 becomes 0.0
    key = np.where(bits >> np.uint64(31), ~bits & np.uint64(0xFFFFFFFF), bits | np.uint64(1 << 31))
    key[np.isnan(values)] = 0xFFFFFFFF
    key = np.sort((key << np.uint64(32)) | np.arange(values.shape[1], dtype=np.uint64), axis=1)
    return (key & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _cutoff(scores: np.ndarray, threshold: np.ndarray, active: np.ndarray, min_keep: np.ndarray) -> np.ndarray:
    """Remove tokens whose probability is below threshold [n, 1], unless among the min_keep best."""
    remove = softmax(scores) < threshold
    remove &= scores < _kth_largest(scores, np.minimum(min_keep, scores.shape[1]))[:, None]
    return np.where(remove & active[:, None], -np.inf, scores).astype(scores.dtype, copy=False)


def epsilon_cutoff(scores: np.ndarray, epsilon: np.ndarray, min_keep: np.ndarray) -> np.ndarray:
    """EpsilonLogitsWarper: remove tokens of probability below epsilon; 0 is off."""
    active = (epsilon > 0) & (epsilon < 1)
    if not active.any():
        return scores
    return _cutoff(scores, epsilon[:, None].astype(np.float32), active, min_keep)


def eta_cutoff(scores: np.ndarray, eta: np.ndarray, min_keep: np.ndarray) -> np.ndarray:
    """EtaLogitsWarper: remove tokens of probability below min(eta, sqrt(eta) * exp(-entropy));
    0 is off."""
    active = (eta > 0) & (eta < 1)
    if not active.any():
        return scores
    logp = log_softmax(scores)
    finite = np.maximum(logp, np.finfo(np.float32).min)  # as torch's Categorical: 0 * -inf is 0
    entropy = -(finite * np.exp(logp)).sum(axis=1)
    eta = eta.astype(np.float32)
    threshold = np.minimum(eta, np.sqrt(eta) * np.exp(-entropy).astype(np.float32))
    return _cutoff(scores, threshold[:, None], active, min_keep)


def warp(scores: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """The sampling warpers in transformers' order, each skipped when no row uses it."""
    if (rows.temperature != 1.0).any():
        scores = temperature(scores, rows.temperature)
    scores = top_k(scores, rows.top_k, rows.min_keep)
    scores = top_p(scores, rows.top_p, rows.min_keep)
    scores = min_p(scores, rows.min_p, rows.min_keep)
    scores = typical_p(scores, rows.typical_p, rows.min_keep)
    scores = epsilon_cutoff(scores, rows.epsilon, rows.min_keep)
    return eta_cutoff(scores, rows.eta, rows.min_keep)


def sample(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of one token per row from softmax(scores), with u [n] in (0, 1)."""
    cdf = np.cumsum(softmax(scores.astype(np.float64)), axis=1)
    target = u * cdf[:, -1]
    return np.minimum((cdf < target[:, None]).sum(axis=1), scores.shape[1] - 1)


def final_scores(scores: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """The scores a row's token is chosen from (transformers' `outputs.scores`): the warpers on
    sampling rows, then renormalize_logits."""
    sampling = np.flatnonzero(rows.do_sample)
    if sampling.size:
        scores = scores.copy()
        scores[sampling] = warp(scores[sampling], rows.take(sampling))
    if rows.renormalize.any():
        scores = np.where(rows.renormalize[:, None], log_softmax(scores), scores)
    return scores


def _pack(flat: np.ndarray, n: int, m: int, ids: np.ndarray | None, values: np.ndarray):
    """The entries `flat` (ascending flat indices into [n, m]) of each row, in order, as [n, width]
    arrays: ids (the column, or `ids` at it; -1 padded) and values (-inf padded)."""
    rows = flat // m
    counts = np.bincount(rows, minlength=n)
    width = max(1, int(counts.max()))
    into = np.arange(flat.size) + np.repeat(np.arange(n) * width - (np.cumsum(counts) - counts), counts)
    out_ids = np.full(n * width, -1, np.int64)
    out_values = np.full(n * width, NEG_INF, values.dtype)
    out_ids[into] = flat - rows * m if ids is None else ids.reshape(-1)[flat]
    out_values[into] = values.reshape(-1)[flat]
    return out_ids.reshape(n, width), out_values.reshape(n, width)


def top_k_candidates(scores: np.ndarray, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's tokens at least as large as its k-th largest score (ties kept), in token-id
    order: ids [n, m] (-1 padded) and their scores (-inf padded), m about max(k).

    A row's sampling over these equals its sampling over the whole vocabulary after top_k, since
    every other token has probability 0, and the id order keeps the inverse-CDF draw the same;
    but it costs O(V) compares instead of a sort or partition of the vocabulary. A threshold from
    every 32nd score lets a few hundred tokens through, which are then cut to the top k exactly;
    a row where fewer than k pass takes an exact partition, or, with k or fewer tokens above -inf
    (a grammar's mask), those. Tokens at -inf (probability 0) are never candidates.

    >>> ids, values = top_k_candidates(np.array([[0., 5., 1., 4.]], np.float32), np.array([2]))
    >>> ids.tolist(), values.tolist()
    ([[1, 3]], [[5.0, 4.0]])
    """
    n, vocab = scores.shape
    stride = 32 if vocab >= 32 * 64 else 1
    sample = scores[:, ::stride]
    # the j-th largest of the sample: about j * stride tokens pass; fewer than k only when j of the
    # row's k best fall in the sample (Poisson, mean k / stride): rare with 6 to spare
    j = np.minimum(-(-k // stride) + 6, sample.shape[1])
    jmax = int(j.max())
    head = np.sort(np.partition(sample, sample.shape[1] - jmax, axis=1)[:, sample.shape[1] - jmax:], axis=1)
    finite = scores > NEG_INF  # a token at -inf has probability 0: never a candidate
    passed = (scores >= head[np.arange(n), jmax - j][:, None]) & finite
    flat = np.flatnonzero(passed)
    short = np.flatnonzero(np.bincount(flat // vocab, minlength=n) < k)
    if short.size:  # exact: at least everything >= the k-th largest (all a row has, when it has k or fewer)
        few = finite[short].sum(axis=1) <= k[short]
        passed[short[few]] = finite[short[few]]
        rest = short[~few]
        if rest.size:
            passed[rest] = (scores[rest] >= _kth_largest(scores[rest], k[rest])[:, None]) & finite[rest]
        flat = np.flatnonzero(passed)
    ids, values = _pack(flat, n, vocab, None, scores)
    width = values.shape[1]
    kth = np.sort(values, axis=1)[np.arange(n), width - np.minimum(k, width)]  # sorts of a few hundred
    return _pack(np.flatnonzero((values >= kth[:, None]) & (ids >= 0)), n, width, ids, values)  # pads left out


def pick(scores: np.ndarray, rows: SamplingRows, seeds: np.ndarray, draws: np.ndarray,
         want_logprobs: bool = False, top: int = 0) -> tuple[np.ndarray, "LogProbs | None"]:
    """The next token of each row from its processed scores (argmax for greedy rows, a seeded draw
    from the final scores for sampling rows: seeds, draws [n] uint64, the rows' random state), and
    the log-probabilities of the final scores at the chosen tokens when asked, without building
    the final scores over the whole vocabulary: sampling rows
    with top_k run their warpers on their top_k candidates only (`top_k_candidates`).
    renormalize_logits changes neither the tokens nor the log-probabilities, so it is skipped."""
    n, vocab = scores.shape
    tokens = np.empty(n, np.int64)
    out = LogProbs(np.full(n, np.nan, np.float32)) if want_logprobs else None
    if out is not None and top:
        out.top_ids, out.top = np.full((n, top), -1, np.int64), np.full((n, top), NEG_INF, np.float32)

    def finish(where, ids, final, chosen, rated=None):
        """Rows `where` chose column `chosen` of `final` (their ids: `ids`, or None for 0..V-1);
        their log-probabilities are those of `rated` (default: `final`)."""
        tokens[where] = chosen if ids is None else np.take_along_axis(ids, chosen[:, None], axis=1)[:, 0]
        if out is not None:
            lp = logprobs(final if rated is None else rated, chosen, top, wanted(rows.no_logprobs[where]))
            out.token[where] = lp.token
            if top:
                width = lp.top.shape[1]
                out.top_ids[where, :width] = lp.top_ids if ids is None else np.take_along_axis(ids, lp.top_ids, axis=1)
                out.top[where, :width] = lp.top

    sampling = rows.do_sample
    compact = sampling & (rows.top_k > 0) & (rows.top_k < vocab)
    for where, kind in ((np.flatnonzero(~sampling), "greedy"), (np.flatnonzero(sampling & ~compact), "full"),
                        (np.flatnonzero(compact), "compact")):
        if not where.size:
            continue
        block = scores if where.size == n else scores[where]
        if kind == "greedy":
            finish(where, None, block, block.argmax(axis=1))
            continue
        settings = rows.take(where)
        ids = None
        if kind == "compact":
            k = np.maximum(settings.top_k, settings.min_keep)
            ids, block = top_k_candidates(block, np.minimum(k, vocab))
        final = warp(block, settings)
        chosen = sample(final, uniforms(seeds[where], draws[where]))
        rated = None
        if out is not None and settings.untempered.any():
            rated = final * np.where(settings.untempered, settings.temperature, np.float32(1))[:, None]
        finish(where, ids, final, chosen, rated)
    return tokens, out


@dataclass
class LogProbs:
    """The log-probabilities of one step's chosen tokens, [n], and optionally the `k` best
    alternatives of each row, [n, k] ids and log-probabilities, best first."""

    token: np.ndarray
    top_ids: np.ndarray | None = None
    top: np.ndarray | None = None


def wanted(no_logprobs: np.ndarray) -> np.ndarray | None:
    """`logprobs`' rows: those not flagged (None: every row)."""
    return None if not no_logprobs.any() else ~no_logprobs


def logprobs(scores: np.ndarray, tokens: np.ndarray, top: int = 0, rows: np.ndarray | None = None) -> LogProbs:
    """log_softmax(scores) at `tokens` (compute_transition_scores with normalize_logits=True
    when `scores` are the final scores), and the `top` best tokens of each row (ties by id).
    `rows` (bool [n]): only those (the others nan, their top ids -1: nobody reads them).

    Each step of a server that offers log-probabilities runs this over the whole batch, so it
    reads the vocabulary twice (max, then exp and sum) and writes no [n, V] log-probabilities:
    the values are log_softmax's, each `(score - max) - log(sum)` as it computes them; the best
    come from top_k_candidates (O(V) compares), not a partition of the vocabulary.

    >>> logprobs(np.log(np.array([[0.5, 0.25, 0.25]])), np.array([1]), top=1).top_ids.tolist()
    [[0]]
    """
    if rows is not None:
        n, width = len(scores), min(top, scores.shape[1])
        out = LogProbs(np.full(n, np.nan, np.float32))
        if top:
            out.top_ids, out.top = np.full((n, width), -1, np.int64), np.full((n, width), np.nan, np.float32)
        if rows.any():
            some = logprobs(scores[rows], tokens[rows], top)
            out.token[rows] = some.token
            if top:
                out.top_ids[rows], out.top[rows] = some.top_ids, some.top
        return out
    scores = scores.astype(np.float32, copy=False)
    n, vocab = scores.shape
    peak = scores.max(axis=1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0).astype(scores.dtype)
    with np.errstate(divide="ignore"):
        log_sum = np.log(np.exp(scores - peak).sum(axis=1, keepdims=True))
    rows = np.arange(n)
    out = LogProbs((scores[rows, tokens] - peak[:, 0]) - log_sum[:, 0])
    if top:
        top = min(top, vocab)
        ids = None
        if vocab >= 2048:  # where the sampled threshold pays; every row needs `top` finite candidates
            ids, values = top_k_candidates(scores, np.full(n, top))
            if values.shape[1] < top or np.isfinite(values).sum(axis=1).min() < top:
                ids = None
        if ids is None:
            ids = np.argpartition(-scores, top - 1, axis=1)[:, :top]
            values = np.take_along_axis(scores, ids, axis=1)
        order = _best_first(ids, values, top)
        ids, values = np.take_along_axis(ids, order, axis=1), np.take_along_axis(values, order, axis=1)
        out.top_ids, out.top = ids, (values - peak) - log_sum
    return out


def _best_first(ids: np.ndarray, values: np.ndarray, top: int) -> np.ndarray:
    """Per row, the columns of the `top` largest values, best first, equal values by id."""
    by_id = np.argsort(ids, axis=1, kind="stable")
    by_value = np.argsort(-np.take_along_axis(values, by_id, axis=1), axis=1, kind="stable")
    return np.take_along_axis(by_id, by_value, axis=1)[:, :top]
