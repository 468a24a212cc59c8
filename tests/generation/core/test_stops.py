"""When rows stop: eos tokens, max_new_tokens / max_length, and what on_token reports on the way.

Invariant: a row's new tokens are the tokens it would produce with no stop at all, cut before
its first eos id and after its token budget, exactly as transformers `generate` cuts them; the
on_token stream tells the same story step by step.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import generation
from generation import Settings

MAX_NEW = 30


def cut(row, eos_ids):
    """`row` before its first eos id (the engine's and transformers' stop rule)."""
    for i, token in enumerate(row):
        if token in eos_ids:
            return row[:i]
    return row


@pytest.fixture(scope="module")
def qwen2(test_models, load_model):
    return load_model(test_models["qwen2-optimum"])


@pytest.fixture(scope="module")
def llama(test_models, load_model):
    return load_model(test_models["llama-optimum"])


@pytest.fixture(scope="module")
def free_running(qwen2, prompts_of):
    """400 random prompts and their first MAX_NEW greedy tokens with no eos id at all."""
    prompts = prompts_of(np.random.default_rng(0).integers(1, 8, 400), seed=0)
    ctx = generation.compile(generation.context(qwen2, max_new_tokens=MAX_NEW, eos_token_id=[]), 16)
    rows = generation.generate(ctx, prompts)
    assert all(len(r) == MAX_NEW for r in rows)
    return prompts, rows


@pytest.fixture(scope="module")
def eos_prompts(free_running):
    """Prompts whose free-running greedy output holds the model's eos id 2 (17 of the 400 on the
    fixture build), and as many prompts whose output does not."""
    prompts, rows = free_running
    hits = [i for i, r in enumerate(rows) if 2 in r]
    misses = [i for i, r in enumerate(rows) if 2 not in r][:len(hits)]
    assert len(hits) >= 4, "the fixture model should emit eos now and then"
    return hits, misses


# --- eos ----------------------------------------------------------------------------------------

def test_eos_stops_a_row_and_is_not_in_its_output(qwen2, free_running, eos_prompts):
    prompts, raw = free_running
    hits, misses = eos_prompts
    ctx = generation.compile(generation.context(qwen2, max_new_tokens=MAX_NEW), 8)
    assert ctx.settings.eos_token_id == (2,)
    order = [i for pair in zip(hits, misses) for i in pair]  # eos rows beside full rows
    rows = generation.generate(ctx, [prompts[i] for i in order])
    for i, row in zip(order, rows):
        assert 2 not in row
        expected = raw[i][:raw[i].index(2)] if i in hits else raw[i]
        assert row == expected
    assert any(len(row) < MAX_NEW for row in rows)


def test_eos_rows_match_transformers(qwen2, oracle, free_running, eos_prompts):
    prompts, _ = free_running
    hits, misses = eos_prompts
    chosen = hits[:5] + misses[:2]
    ctx = generation.context(qwen2, max_new_tokens=MAX_NEW)
    rows = generation.generate(ctx, [prompts[i] for i in chosen])
    assert rows == [oracle.greedy("qwen2", prompts[i], MAX_NEW) for i in chosen]


def test_eos_token_id_setting_stops_at_that_token(llama, oracle, prompts_of):
    prompt = prompts_of([6], seed=11)[0]
    plain = generation.generate(generation.context(llama, max_new_tokens=16), [prompt])[0]
    assert len(plain) == 16
    stop_at = next(i for i in range(4, 16) if plain[i] not in plain[:i])
    x = plain[stop_at]
    rows = generation.generate(generation.context(llama, max_new_tokens=16, eos_token_id=x), [prompt])
    assert rows == [plain[:stop_at]]
    assert rows[0] == oracle.greedy("llama", prompt, 16, eos_token_id=x)


def test_first_token_eos_gives_an_empty_row(llama, prompts_of):
    prompts = prompts_of([4, 6], seed=12)
    plain = generation.generate(generation.context(llama, max_new_tokens=8), prompts)
    first = plain[0][0]
    ctx = generation.context(llama, max_new_tokens=8, eos_token_id=[2, first])
    assert generation.generate(ctx, prompts) == [[], cut(plain[1], {2, first})]


# --- on_token -----------------------------------------------------------------------------------

@pytest.mark.parametrize("batch_size", [None, 2])
def test_on_token_tells_the_same_story_as_the_rows(qwen2, free_running, eos_prompts, batch_size):
    """Rows: an eos row, an empty prompt, a full-length row, a row whose first token is an eos id,
    and a second eos row; with 2 slots the later rows wait for a free slot."""
    prompts, raw = free_running
    hits, misses = eos_prompts
    first_eos = raw[misses[1]][0]  # the first token of this row becomes an eos id
    eos_ids = {2, first_eos}
    batch = [prompts[hits[0]], [], prompts[misses[0]], prompts[misses[1]], prompts[hits[1]]]
    expected = [cut(raw[hits[0]], eos_ids), [], cut(raw[misses[0]], eos_ids), [],
                cut(raw[hits[1]], eos_ids)]
    assert any(0 < len(r) < MAX_NEW for r in expected)  # some row does stop at an eos id

    ctx = generation.context(qwen2, max_new_tokens=MAX_NEW, eos_token_id=sorted(eos_ids))
    if batch_size:
        ctx = generation.compile(ctx, batch_size)
    events = []
    rows = generation.generate(ctx, batch, seeds=list(range(len(batch))),
                               on_token=lambda e: events.append((e.token.copy(), e.finished.copy())))
    assert rows == expected

    tokens = np.array([t for t, _ in events])  # [steps, rows]
    finished = np.array([f for _, f in events])
    assert tokens.dtype == np.int64 and tokens.shape[1] == len(batch)
    assert (tokens[:, 1] == -1).all() and finished[:, 1].all()  # the empty prompt
    assert finished[-1].all()
    assert (finished[1:] >= finished[:-1]).all()  # once finished, always finished
    for b, row in enumerate(rows):
        assert tokens[:, b][tokens[:, b] >= 0].tolist() == row
        done = int(np.argmax(finished[:, b]))  # the event at which row b finishes
        assert (tokens[done + 1:, b] == -1).all()
    if batch_size == 2:  # the last row waits: nothing for it until a slot is free
        assert (tokens[0, 4] == -1) and not finished[0, 4]


def test_on_token_is_not_called_when_nothing_is_generated(llama):
    events = []
    ctx = generation.context(llama, max_new_tokens=0)
    rows = generation.generate(ctx, [[5, 6, 7], [], [8]], on_token=events.append)
    assert rows == [[], [], []]
    assert events == []


# --- token budgets --------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, length, expected", [
    (dict(max_new_tokens=5), 100, 5),
    (dict(max_new_tokens=5, max_length=50), 10, 5),  # max_new_tokens wins
    (dict(max_new_tokens=0, max_length=50), 10, 0),
    (dict(), 10, 256),  # max_length unset
    (dict(max_length=20), 10, 256),  # transformers' default max_length counts as unset
    (dict(max_length=20), 30, 256),
    (dict(max_length=15), 3, 12),
    (dict(max_length=15), 15, 0),
    (dict(max_length=15), 40, 0),  # never negative
    (dict(max_length=21), 1, 20),
])
def test_new_tokens_for(settings, length, expected):
    assert Settings(**settings).new_tokens_for(length) == expected


def transformers_max_length(oracle, name, prompt, max_length):
    """transformers `generate(max_length=...)` without max_new_tokens: its new tokens, no eos."""
    import torch

    model = oracle.model(name)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_length=max_length, pad_token_id=0)
    return cut(out[0, len(prompt):].tolist(), {2})


def test_max_length_from_generation_config(test_models, tmp_path, oracle, prompts_of):
    folder = tmp_path / "llama-optimum"
    shutil.copytree(test_models["llama-optimum"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    assert "max_new_tokens" not in config
    config["max_length"] = 15
    (folder / "generation_config.json").write_text(json.dumps(config))

    ctx = generation.context(generation.load(folder, threads=1))
    assert (ctx.settings.max_length, ctx.settings.max_new_tokens) == (15, None)
    prompts = prompts_of(range(3, 11), seed=14)
    rows = generation.generate(ctx, prompts)
    assert [len(r) for r in rows] == [15 - len(p) for p in prompts]  # no eos on these prompts
    assert rows == [transformers_max_length(oracle, "llama", p, 15) for p in prompts]


def test_max_new_tokens_zero_gives_empty_rows(llama):
    ctx = generation.context(llama, max_new_tokens=0)
    assert generation.generate(ctx, [[5, 6, 7], [8]]) == [[], []]


def test_empty_prompts_give_empty_rows(llama):
    ctx = generation.context(llama, max_new_tokens=5)
    plain = generation.generate(ctx, [[5, 6, 7]])[0]
    assert len(plain) == 5
    assert generation.generate(ctx, [[], [5, 6, 7], []]) == [[], plain, []]
    assert generation.generate(ctx, [[], []]) == [[], []]
    assert generation.generate(ctx, []) == []
