"""The selection functions on hand-built scores, and against transformers' warpers.

Invariant: each warper equals its transformers 4.57 counterpart row by row, with a different
setting on every row of one batch, and never changes its input in place.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from generation.logits.rng import uniforms
from generation.logits.selection import (
    SamplingRows,
    final_scores,
    pick,
    sample,
    softmax,
    temperature,
    top_k,
    top_p,
)


def test_top_k_keeps_ties_at_the_kth_score():
    scores = np.array([[1.0, 3.0, 2.0, 3.0], [4.0, 1.0, 2.0, 3.0]], np.float32)
    out = top_k(scores, np.array([2, 3]))
    assert out.tolist() == [[-np.inf, 3.0, -np.inf, 3.0], [4.0, -np.inf, 2.0, 3.0]]


def test_top_k_zero_or_vocabulary_size_is_off():
    scores = np.array([[1.0, 3.0, 2.0], [0.5, 0.1, 0.2]], np.float32)
    assert top_k(scores, np.array([0, 3])).tolist() == scores.tolist()


def test_top_p_keeps_the_smallest_set_above_p():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    out = top_p(np.log(probs).astype(np.float32), np.array([0.7], np.float32))
    assert np.isfinite(out).tolist() == [[True, True, False, False]]
    # p so small that only the most likely token stays
    out = top_p(np.log(probs).astype(np.float32), np.array([0.01], np.float32))
    assert np.isfinite(out).tolist() == [[True, False, False, False]]


def test_sample_never_picks_a_removed_token_and_follows_u():
    scores = np.array([[-np.inf, 0.0, -np.inf, 0.0]] * 3, np.float32)  # two tokens, p = 0.5 each
    tokens = sample(scores, np.array([1e-12, 0.4999, 0.9999999]))
    assert tokens.tolist() == [1, 1, 3]


@pytest.mark.parametrize("seed", range(5))
def test_warpers_equal_transformers_row_by_row(seed):
    rng = np.random.default_rng(seed)
    scores = (rng.standard_normal((6, 200)) * 3).astype(np.float32)
    scores[0, :5] = scores[0, 5]  # ties
    t = np.array([0.5, 1.0, 1.3, 0.7, 2.0, 1.0], np.float32)
    k = np.array([0, 5, 50, 1, 199, 20])
    p = np.array([1.0, 0.9, 0.5, 0.99, 0.3, 0.05], np.float32)
    before = scores.copy()
    ours = top_p(top_k(temperature(scores, t), k), p)
    assert (scores == before).all()  # pure
    for row in range(6):
        theirs = torch.tensor(scores[row:row + 1])
        ids = torch.zeros((1, 1), dtype=torch.long)
        if t[row] != 1.0:
            theirs = TemperatureLogitsWarper(float(t[row]))(ids, theirs)
        if 0 < k[row] < 200:
            theirs = TopKLogitsWarper(int(k[row]))(ids, theirs)
        if p[row] < 1.0:
            theirs = TopPLogitsWarper(float(p[row]))(ids, theirs)
        expected = theirs[0].numpy()
        assert np.array_equal(np.isfinite(ours[row]), np.isfinite(expected)), row
        kept = np.isfinite(expected)
        np.testing.assert_allclose(ours[row][kept], expected[kept], rtol=1e-6)


def select(scores: np.ndarray, rows: SamplingRows, seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """The selection rule over the whole vocabulary, the reference `pick` is held to: the final
    scores (the warpers of sampling rows), then argmax for greedy rows and a seeded inverse-CDF
    draw for sampling rows."""
    final = final_scores(scores, rows)
    tokens = final.argmax(axis=1)
    sampling = np.flatnonzero(rows.do_sample)
    if sampling.size:
        tokens[sampling] = sample(final[sampling], uniforms(seeds[sampling], draws[sampling]))
    return tokens


def test_select_mixes_greedy_and_sampling_rows():
    scores = np.log(np.array([[0.1, 0.6, 0.3], [0.1, 0.6, 0.3], [0.45, 0.1, 0.45]], np.float32))
    rows = SamplingRows(do_sample=np.array([False, True, False]), temperature=np.ones(3, np.float32),
                        top_k=np.zeros(3, np.int64), top_p=np.ones(3, np.float32))
    draws = np.zeros(3, np.uint64)
    picks = np.array([pick(scores, rows, np.full(3, s, np.uint64), draws)[0][1] for s in range(3000)])
    first = pick(scores, rows, np.zeros(3, np.uint64), draws)[0]
    assert first[0] == 1 and first[2] == 0  # greedy rows: argmax, first of a tie as torch.argmax
    np.testing.assert_allclose(np.bincount(picks, minlength=3) / 3000, softmax(scores[1:2])[0], atol=0.03)


def test_pick_equals_the_whole_vocabulary_path():
    """`pick` runs top_k rows on their candidates only; tokens and log-probabilities must be
    those of the final scores over the whole vocabulary, row by row, in a mixed batch."""
    from generation.logits.selection import logprobs

    rng = np.random.default_rng(5)
    n, vocab = 12, 5000
    scores = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    scores[3, :4000] = -np.inf  # a row the processors mostly removed
    rows = SamplingRows(do_sample=np.array([True] * 10 + [False] * 2),
                        temperature=np.array([0.7, 1, 1.3, 0.5, 1, 1, 0.9, 1, 1, 2, 1, 1], np.float32),
                        top_k=np.array([50, 1, 7, 30, 0, 4000, 50, 5000, 200, 3, 50, 0]),
                        top_p=np.array([0.9, 1, 0.5, 1, 0.8, 1, 0.95, 0.9, 1, 1, 1, 1], np.float32),
                        min_p=np.array([0, 0, 0.1, 0, 0, 0.05, 0, 0, 0, 0, 0, 0], np.float32))
    for seed in range(20):
        seeds, draws = np.arange(n, dtype=np.uint64) + np.uint64(seed * 100), np.full(n, seed, np.uint64)
        final = final_scores(scores, rows)
        want = select(scores, rows, seeds, draws)
        tokens, lp = pick(scores, rows, seeds, draws, want_logprobs=True, top=3)
        assert tokens.tolist() == want.tolist()
        full = logprobs(final, want, top=3)
        np.testing.assert_allclose(lp.token, full.token, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(lp.top, full.top, rtol=1e-5, atol=1e-5)
        assert (lp.top_ids[:, 0] == full.top_ids[:, 0]).all()
