"""Beam search against transformers 4.57 `generate(num_beams=...)`.

Invariants: for every num_beams 2-5, length_penalty, early_stopping and num_return_sequences,
in every cache mode, on a batch of prompts of different lengths, with processors on or off,
the returned hypotheses are transformers' sequences in its order, with its `sequences_scores`;
each token's log-probability is `compute_transition_scores(..., beam_indices,
normalize_logits=True)`; num_beams=1 is greedy; beam sampling is seeded and independent of
the other prompts.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import generation

PROMPTS = [[5, 6, 7, 8, 9, 10], [20, 21], [30, 31, 32, 30, 31, 32, 30, 31, 3], [40]]
MODES = [("llama-optimum", "llama", "append"), ("llama-genai", "llama", "in_place"), ("gpt2-grow", "gpt2", "grow"),
         # the Optimum exports' fused rewrites (generation.runtime.fusion), generation.load's default for them
         ("llama-optimum+fused", "llama", "in_place"), ("qwen2-optimum+fused", "qwen2", "in_place")]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return lambda folder: load_model(test_models[folder.removesuffix("+fused")], fuse=folder.endswith("+fused"))


def transformers_beams(oracle, name, prompt, max_new, **settings):
    """[(tokens without the final eos, score, per-token log-probabilities)] of transformers."""
    import torch

    model = oracle.model(name)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=model.config.pad_token_id, output_scores=True,
                             return_dict_in_generate=True, **settings)
        transition = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices,
                                                     normalize_logits=True)
    eos, hypotheses = model.generation_config.eos_token_id, []
    for r in range(len(out.sequences)):
        steps = int((out.beam_indices[r] >= 0).sum())
        tokens = out.sequences[r, len(prompt):len(prompt) + steps].tolist()
        logprobs = transition[r, :steps].tolist()
        if tokens and tokens[-1] == eos:
            tokens, logprobs = tokens[:-1], logprobs[:-1]
        hypotheses.append((tokens, float(out.sequences_scores[r]), logprobs))
    return hypotheses


def assert_same(ours, theirs, context):
    assert len(ours) == len(theirs), context
    for r, (h, (tokens, score, logprobs)) in enumerate(zip(ours, theirs)):
        assert h.tokens == tokens, (context, r)
        assert np.isclose(h.score, score, rtol=1e-5, atol=1e-4), (context, r, h.score, score)
        if h.logprobs is not None:
            np.testing.assert_allclose(h.logprobs, logprobs, atol=1e-4, err_msg=str((context, r)))


GRID = list(itertools.product([2, 3, 4, 5], [-1.0, 0.0, 1.0, 2.0], [False, True, "never"]))


@pytest.mark.parametrize("beams, length_penalty, early_stopping", GRID)
def test_beam_search_equals_transformers(models, oracle, beams, length_penalty, early_stopping):
    returned = 1 + (beams + int(length_penalty)) % beams  # 1 .. num_beams across the grid
    max_new = 4 if beams % 2 else 24  # short runs end by length, long ones by eos and early stopping
    settings = dict(num_beams=beams, length_penalty=length_penalty, early_stopping=early_stopping,
                    num_return_sequences=returned)
    if beams % 2 == 0:  # make eos (id 2) likely, so hypotheses finish early and the stopping rules matter
        settings["sequence_bias"] = {(2,): 2.0 + length_penalty}
    ctx = generation.context(models("llama-optimum"), max_new_tokens=max_new, token_logprobs=True, **settings)
    got = generation.beam_search(ctx, PROMPTS, [0] * len(PROMPTS))
    for prompt, hypotheses in zip(PROMPTS, got):
        assert_same(hypotheses, transformers_beams(oracle, "llama", prompt, max_new, **settings), (prompt, settings))


@pytest.mark.parametrize("folder, name, mode", MODES, ids=[m[2] + "-fused" * m[0].endswith("+fused") for m in MODES])
@pytest.mark.parametrize("settings", [
    dict(num_beams=3, no_repeat_ngram_size=2, repetition_penalty=1.3, min_new_tokens=5),
    dict(num_beams=4, early_stopping=True, length_penalty=0.5, num_return_sequences=4, bad_words_ids=[[7, 8]]),
    dict(num_beams=2, early_stopping="never", length_penalty=2.0, suppress_tokens=[730]),
], ids=["penalties", "early", "never"])
def test_every_cache_mode_with_processors(models, oracle, folder, name, mode, settings):
    ctx = generation.context(models(folder), cache_mode=mode, max_new_tokens=16, token_logprobs=True, **settings)
    got = generation.beam_search(ctx, PROMPTS, [0] * len(PROMPTS))
    for prompt, hypotheses in zip(PROMPTS, got):
        assert_same(hypotheses, transformers_beams(oracle, name, prompt, 16, **settings), (prompt, mode))


def test_generate_gives_the_best_hypothesis_and_one_beam_is_greedy(models, oracle):
    model = models("llama-genai")
    beams = generation.context(model, max_new_tokens=12, num_beams=3, repetition_penalty=1.2)
    best = [h[0].tokens for h in generation.beam_search(beams, PROMPTS, [0] * 4)]
    assert generation.generate(beams, PROMPTS) == best
    one = generation.context(model, max_new_tokens=12, num_beams=1)
    assert generation.generate(one, PROMPTS) == [oracle.greedy("llama", p, 12) for p in PROMPTS]
    with pytest.raises(ValueError, match="beam search .* settles its tokens only at the end"):
        generation.generate(beams, PROMPTS, on_token=lambda event: None)


def test_empty_prompt_and_settings_errors(models):
    model = models("llama-optimum")
    ctx = generation.context(model, max_new_tokens=5, num_beams=2)
    got = generation.beam_search(ctx, [[], [5, 6]], [0, 0])
    assert got[0] == [] and len(got[1]) == 1
    with pytest.raises(ValueError, match=r"num_return_sequences must be an integer from 1 to num_beams \(2\)"):
        generation.context(model, num_beams=2, num_return_sequences=3)
    with pytest.raises(ValueError, match="early_stopping must be true, false or \"never\", not 'sometimes'"):
        generation.context(model, num_beams=2, early_stopping="sometimes")
    with pytest.raises(ValueError, match="num_beams must be an integer >= 1, not 0"):
        generation.context(model, num_beams=0)
    with pytest.raises(ValueError, match="decode-state verbs"):
        generation.prefill(ctx, [[5, 6]], [0])


def test_beam_sampling_is_seeded_and_independent_of_other_prompts(models):
    ctx = generation.context(models("llama-optimum"), max_new_tokens=10, num_beams=3, do_sample=True,
                             temperature=0.9, top_k=20, num_return_sequences=2)
    first = generation.beam_search(ctx, PROMPTS, [1, 2, 3, 4])
    again = generation.beam_search(ctx, PROMPTS, [1, 2, 3, 4])
    assert [[h.tokens for h in hs] for hs in first] == [[h.tokens for h in hs] for hs in again]
    alone = generation.beam_search(ctx, [PROMPTS[2]], [3])[0]
    assert [h.tokens for h in alone] == [h.tokens for h in first[2]]
    other = generation.beam_search(ctx, PROMPTS, [10, 20, 30, 40])
    assert [[h.tokens for h in hs] for hs in other] != [[h.tokens for h in hs] for hs in first]
    greedy = generation.beam_search(generation.context(models("llama-optimum"), max_new_tokens=10, num_beams=3),
                                    PROMPTS, [0] * 4)
    assert [h[0].tokens for h in greedy] != [h[0].tokens for h in first]


def test_compiled_batch_smaller_than_the_prompts(models):
    """compile sizes the decoder for batch_size * num_beams rows; more prompts run batch after batch."""
    ctx = generation.context(models("llama-genai"), max_new_tokens=8, num_beams=3)
    compiled = generation.compile(ctx, batch_size=2)
    want = generation.beam_search(ctx, PROMPTS, [0] * 4)
    got = generation.beam_search(compiled, PROMPTS, [0] * 4)
    assert [[(h.tokens, h.score) for h in hs] for hs in got] == [[(h.tokens, h.score) for h in hs] for hs in want]
