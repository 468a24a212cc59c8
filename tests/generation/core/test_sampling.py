"""Sampling: seeded, batch-independent, and distributed as the processed logits say.

Invariants: the same seed gives the same tokens; a row's tokens depend only on its prompt, seed
and settings (not on the other rows, the batch size or its slot); the first sampled token over
many seeds fits softmax of the logits after transformers' own temperature, top-k and top-p
warpers (chi-square).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import generation
from generation.logits.rng import uniforms

SETTINGS = dict(do_sample=True, temperature=0.7, top_k=30, top_p=0.9)


@pytest.fixture(scope="module", params=[("llama-genai", "in_place"), ("llama-optimum", "append"), ("gpt2-grow", "grow")],
                ids=lambda p: p[1])
def ctx(request, test_models, load_model):
    folder, mode = request.param
    model = load_model(test_models[folder])
    return generation.context(model, max_new_tokens=30, cache_mode=mode, **SETTINGS)


def test_same_seed_same_tokens(ctx, prompts_of):
    prompts = prompts_of([5, 11, 2], seed=2)
    first = generation.generate(ctx, prompts, seeds=[7, 8, 9])
    assert generation.generate(ctx, prompts, seeds=[7, 8, 9]) == first
    other = generation.generate(ctx, prompts, seeds=[70, 80, 90])
    assert other != first  # the seed matters
    assert len({tuple(r) for r in first}) == 3


def test_row_depends_only_on_its_prompt_seed_and_settings(ctx, prompts_of):
    prompt, seed = prompts_of([9], seed=2)[0], 1234
    alone = generation.generate(ctx, [prompt], seeds=[seed])[0]
    others = prompts_of([3, 14, 1, 22, 6], seed=5)
    for position in (0, 2, 5):
        batch = others[:position] + [prompt] + others[position:]
        seeds = list(range(len(batch)))
        seeds[position] = seed
        assert generation.generate(ctx, batch, seeds=seeds)[position] == alone
    compiled = generation.compile(ctx, batch_size=2)  # fewer slots: the row waits for a free one
    assert generation.generate(compiled, others + [prompt], seeds=[0] * 5 + [seed])[5] == alone
    greedy_neighbours = generation.context(ctx.model, cache_mode=ctx.cache_mode, max_new_tokens=30)
    state = generation.new_state(ctx, slots=3, capacity=64)  # a greedy row beside it changes nothing
    prefix_greedy = generation.prefill(greedy_neighbours, others[:1], [0])
    prefix = generation.prefill(ctx, [prompt], [seed])
    state = generation.insert(ctx, prefix_greedy, state, [0])
    state = generation.insert(ctx, prefix, state, [2])
    tokens = [int(prefix.first.token[0])]
    while state.live[2]:
        state, out = generation.step(ctx, state)
        tokens.append(int(out.token[2]))
    assert [t for t in tokens if t >= 0] == alone


def processed_distribution(oracle, prompt):
    """softmax of the last logits after transformers' sampling warpers, in its order."""
    import torch
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)

    scores = torch.tensor(oracle.logits("llama", prompt)[-1:])
    ids = torch.tensor([prompt])
    for warper in (TemperatureLogitsWarper(SETTINGS["temperature"]), TopKLogitsWarper(SETTINGS["top_k"]),
                   TopPLogitsWarper(SETTINGS["top_p"])):
        scores = warper(ids, scores)
    return torch.softmax(scores, dim=-1)[0].double().numpy()


def test_first_token_fits_the_processed_distribution(test_models, oracle, load_model, prompts_of):
    model = load_model(test_models["llama-genai"])
    ctx = generation.context(model, max_new_tokens=1, **SETTINGS)
    prompt = prompts_of([6], seed=11)[0]
    expected = processed_distribution(oracle, prompt)
    support = np.flatnonzero(expected > 0)
    assert 3 < len(support) <= SETTINGS["top_k"]  # the warpers cut the vocabulary, but not to one token
    draws = 4000
    prefix = generation.prefill(ctx, [prompt] * draws, list(range(draws)))
    tokens = prefix.first.token
    assert set(tokens.tolist()) <= set(support.tolist())  # nothing outside top-k / top-p
    counts = np.bincount(tokens, minlength=len(expected))[support]
    # the expected frequencies from a float32 softmax sum ~1e-8 off 1: scipy's chisquare checks
    # that both sides sum alike, so normalize them in float64
    frequencies = expected[support].astype(np.float64)
    p = stats.chisquare(counts, frequencies / frequencies.sum() * counts.sum()).pvalue
    assert p > 1e-3, f"chi-square p = {p}"


def test_uniforms_depend_only_on_seed_and_draw():
    seeds = np.array([0, 1, 2**63, 2**64 - 1], np.uint64)
    draws = np.array([0, 5, 5, 1], np.uint64)
    u = uniforms(seeds, draws)
    assert ((u > 0) & (u < 1)).all()
    assert uniforms(seeds[::-1], draws[::-1]).tolist() == u[::-1].tolist()
    assert uniforms(seeds[1:2], draws[1:2])[0] == u[1]
    big = uniforms(np.arange(20000, dtype=np.uint64), np.zeros(20000, np.uint64))
    assert stats.kstest(big, "uniform").pvalue > 1e-3
