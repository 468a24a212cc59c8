"""Choosing the next token of each row from its logits: greedy or sampling.

Every setting is an array over the rows, so one call serves a batch whose rows have different
settings (the server mixes requests). The warpers are those of transformers 4.57
`_get_logits_processor` for sampling, in its order: temperature, top_k, top_p. They apply only
to rows that sample; greedy rows take the argmax of the processed scores, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .rng import uniforms


@dataclass
class SamplingRows:
    """Per-row selection settings, [B] each."""

    do_sample: np.ndarray  # bool
    temperature: np.ndarray  # float32, > 0
    top_k: np.ndarray  # int64, 0 = off
    top_p: np.ndarray  # float32, 1 = off

    def take(self, rows) -> "SamplingRows":
        return SamplingRows(self.do_sample[rows], self.temperature[rows], self.top_k[rows], self.top_p[rows])


def temperature(scores: np.ndarray, t: np.ndarray) -> np.ndarray:
    """scores [n, V] / t [n], as TemperatureLogitsWarper."""
    return scores / t[:, None].astype(scores.dtype)


def top_k(scores: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Keep the tokens at least as large as each row's k-th largest score (ties kept), as
    TopKLogitsWarper; k 0 or >= V leaves the row unchanged.

    >>> top_k(np.array([[1., 3., 2., 3.]]), np.array([2]))
    array([[-inf,   3., -inf,   3.]])
    """
    vocab = scores.shape[1]
    active = (k > 0) & (k < vocab)
    if not active.any():
        return scores
    kmax = int(k[active].max())
    largest = np.sort(np.partition(scores, vocab - kmax, axis=1)[:, vocab - kmax:], axis=1)  # ascending
    kth = largest[np.arange(len(scores)), kmax - np.clip(k, 1, kmax)]
    remove = active[:, None] & (scores < kth[:, None])
    return np.where(remove, -np.inf, scores).astype(scores.dtype, copy=False)


def softmax(scores: np.ndarray) -> np.ndarray:
    shifted = scores - scores.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    return e / e.sum(axis=1, keepdims=True)


def top_p(scores: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Keep the smallest set of most likely tokens whose probability exceeds p, as TopPLogitsWarper:
    sort ascending, remove tokens whose cumulative probability is <= 1 - p, always keep the top one."""
    active = p < 1.0
    if not active.any():
        return scores
    order = np.argsort(scores, axis=1, kind="stable")
    ordered = np.take_along_axis(scores, order, axis=1)
    cumulative = np.cumsum(softmax(ordered), axis=1)
    remove_sorted = cumulative <= (1.0 - p)[:, None].astype(cumulative.dtype)
    remove_sorted[:, -1] = False
    remove_sorted &= active[:, None]
    remove = np.empty_like(remove_sorted)
    np.put_along_axis(remove, order, remove_sorted, axis=1)
    return np.where(remove, -np.inf, scores).astype(scores.dtype, copy=False)


def warp(scores: np.ndarray, rows: SamplingRows) -> np.ndarray:
    """The sampling warpers in transformers' order, each skipped when no row uses it."""
    if (rows.temperature != 1.0).any():
        scores = temperature(scores, rows.temperature)
    scores = top_k(scores, rows.top_k)
    return top_p(scores, rows.top_p)


def sample(scores: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Inverse-CDF draw of one token per row from softmax(scores), with u [n] in (0, 1)."""
    cdf = np.cumsum(softmax(scores.astype(np.float64)), axis=1)
    target = u * cdf[:, -1]
    return np.minimum((cdf < target[:, None]).sum(axis=1), scores.shape[1] - 1)


def select(scores: np.ndarray, rows: SamplingRows, seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """Next token of each row: argmax for greedy rows, a seeded draw for sampling rows.

    scores [n, V] are the processed logits; seeds, draws [n] uint64 are the rows' random state.
    """
    tokens = scores.argmax(axis=1)
    sampling = np.flatnonzero(rows.do_sample)
    if sampling.size:
        warped = warp(scores[sampling], rows.take(sampling))
        tokens[sampling] = sample(warped, uniforms(seeds[sampling], draws[sampling]))
    return tokens
