"""Greedy decoding equals transformers 4.57 `generate` on the same weights, exactly.

Invariant: every row of a batch of prompts of lengths 0 to 37 gets the tokens transformers
gives that prompt alone, in every cache mode each graph supports (the exports as exported and
as rewritten at load), with the prompt in one step
or in power-of-two pieces, with all rows in one batch or admitted a few at a time.
"""

from __future__ import annotations

import pytest

import generation

MAX_NEW = 40
LENGTHS = range(38)  # 0 (a padding row) to 37

# fixture folder, oracle model, the modes its graph supports (native first)
GRAPHS = [
    ("llama-optimum", "llama", ("append", "grow")),
    ("qwen2-optimum", "qwen2", ("append", "grow")),
    ("gpt2-optimum", "gpt2", ("append", "grow")),
    ("gpt2-grow", "gpt2", ("grow",)),
    ("llama-merged", "llama", ("append", "grow")),
    ("llama-genai", "llama", ("in_place", "grow")),
    ("qwen2-genai", "qwen2", ("in_place", "grow")),
    # the exports' fused rewrites (generation.runtime.fusion), as generation.load gives them by default
    ("llama-optimum+fused", "llama", ("in_place", "grow")),
    ("qwen2-optimum+fused", "qwen2", ("in_place", "grow")),
    ("llama-merged+fused", "llama", ("in_place", "grow")),
]


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=0)


@pytest.fixture(scope="module")
def expected(oracle, prompts):
    return {name: [oracle.greedy(name, p, MAX_NEW) if p else [] for p in prompts]
            for name in ("llama", "qwen2", "gpt2")}


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {folder: load_model(test_models[folder.removesuffix("+fused")], fuse=folder.endswith("+fused"))
            for folder, _, _ in GRAPHS}


def test_the_oracle_is_not_trivial(expected):
    """Guard against a fixture whose greedy output is degenerate (all eos, one repeated token)."""
    for name, rows in expected.items():
        lengths = [len(r) for r in rows[1:]]
        assert max(lengths) == MAX_NEW, name
        distinct = {tuple(r) for r in rows[1:]}
        assert len(distinct) > 30, name
        assert all(len(set(r)) > 3 for r in rows[1:] if len(r) == MAX_NEW), name


@pytest.mark.parametrize("folder,name,modes", GRAPHS, ids=[g[0] for g in GRAPHS])
def test_graph_modes(models, folder, name, modes):
    assert models[folder].graph.modes == modes


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("folder,name,mode", [(f, n, m) for f, n, modes in GRAPHS for m in modes],
                         ids=[f"{f}-{m}" for f, _, modes in GRAPHS for m in modes])
def test_batch_equals_transformers_alone(models, prompts, expected, folder, name, mode, steps):
    ctx = generation.context(models[folder], max_new_tokens=MAX_NEW, cache_mode=mode, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    assert rows[0] == []
    mismatched = [i for i, (got, want) in enumerate(zip(rows, expected[name])) if got != want]
    assert not mismatched, f"rows of lengths {mismatched} differ from transformers"


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("folder,name,mode", [("llama-genai", "llama", "in_place"), ("llama-optimum", "llama", "append"),
                                              ("gpt2-grow", "gpt2", "grow")])
def test_rows_admitted_as_slots_free_up(models, prompts, expected, folder, name, mode, steps):
    """38 prompts through 5 slots: later prompts enter slots that finished rows left."""
    ctx = generation.compile(generation.context(models[folder], max_new_tokens=MAX_NEW, cache_mode=mode,
                                                prompt_steps=steps), batch_size=5)
    order = list(reversed(range(len(prompts))))  # long prompts first, short ones join running rows
    rows = generation.generate(ctx, [prompts[i] for i in order], seeds=order)
    assert rows == [expected[name][i] for i in order]


def test_modes_agree_with_each_other(models, prompts):
    """Same weights, three layouts, all modes: one answer (beyond matching transformers row by row,
    this catches a mode that is right alone but wrong in a batch)."""
    answers = {}
    for folder in ("llama-optimum", "llama-merged", "llama-genai"):
        for mode in models[folder].graph.modes:
            ctx = generation.compile(generation.context(models[folder], max_new_tokens=12, cache_mode=mode), 7)
            answers[folder, mode] = generation.generate(ctx, prompts[1:], seeds=[0] * 37)
    first = next(iter(answers.values()))
    assert all(rows == first for rows in answers.values()), sorted(answers)


def test_prompt_near_the_context_stops_at_the_context(models, oracle, prompts_of):
    """A row never outgrows max_position_embeddings (256): a 250-token prompt gets 6 tokens."""
    prompt = prompts_of([250], seed=3)[0]
    ctx = generation.context(models["llama-genai"], max_new_tokens=MAX_NEW)
    rows = generation.generate(ctx, [prompt], seeds=[0])
    assert rows[0] == oracle.greedy("llama", prompt, 6)
    assert len(rows[0]) == 6
