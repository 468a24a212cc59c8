"""generation.logits.prompt_logprobs: each prompt token's log-probability given the tokens before it
(what completions' echo with logprobs returns), in pieces.

Invariant: equal to transformers' log_softmax of one forward pass over the whole prompt, at
the next token, in every cache mode's graph, for prompts shorter than, equal to and longer than
a piece; the top alternatives are transformers' best tokens, best first.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.logits.prompt_logprobs import PIECE, prompt_logprobs, prompt_passes


@pytest.mark.parametrize("name", ["llama-genai", "llama-optimum", "gpt2-grow", "llama-merged"])
def test_prompt_logprobs_equal_transformers(test_models, oracle, load_model, name):
    """Each prompt alone, and all of them in one batched pass (padded, with a row that asks
    for nothing between them)."""
    ctx = generation.context(load_model(test_models[name]))
    rng = np.random.default_rng(0)
    lengths = (2, 7, PIECE, PIECE + 1, 2 * PIECE - 1)
    prompts = [rng.integers(3, 900, length).tolist() for length in lengths]
    together = prompt_passes(ctx, prompts + [prompts[1]], [3, 3, 3, 3, 3, None])
    assert together[-1] is None
    for length, prompt, batched in zip(lengths, prompts, together):
        got = prompt_logprobs(ctx, prompt, top=3)
        np.testing.assert_allclose(batched.logprob, got.logprob, atol=1e-5)
        assert (batched.top_ids == got.top_ids).mean() > 0.99
        logits = oracle.logits(name.split("-")[0], prompt)
        shifted = logits - logits.max(1, keepdims=True)
        expected = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
        np.testing.assert_allclose(got.logprob, expected[np.arange(length - 1), prompt[1:]], atol=1e-4)
        best = np.argsort(-expected[:-1], axis=1, kind="stable")[:, :3]
        assert (got.top_ids == best).mean() > 0.99  # ties within float noise aside
        np.testing.assert_allclose(got.top, np.take_along_axis(expected[:-1], got.top_ids, 1), atol=1e-4)


def test_a_one_token_prompt_has_nothing_to_predict(test_models, load_model):
    ctx = generation.context(load_model(test_models["llama-genai"]))
    got = prompt_logprobs(ctx, [5], top=2)
    assert got.logprob.shape == (0,) and got.top_ids.shape == (0, 2)
