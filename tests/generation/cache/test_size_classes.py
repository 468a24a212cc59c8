"""The in_place and append caches' size classes (cache/base.size_class).

Invariant: a row's tokens do not depend on the classes its buffers are laid out at. Rows that
cross length classes while others run (16 -> 32 -> 64 -> 128), rows that join mid-batch in
higher slots (the in_place buffer's rows grow by classes too), and buffers fit down to what the
rows need after rows leave, give every row what a state laid out at the full capacity from the
start gives it (greedy and seeded sampling), and, greedy, what transformers gives it.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.cache.base import size_class

MODES = [("llama-genai", "in_place"), ("llama-optimum", "append")]
CAPACITY = 128

# (step it arrives before, slot, prompt length, max_new): rows that start in the smallest
# classes, join higher slots mid-batch and grow through every length class to 128
PLAN = [(0, 0, 3, 60), (0, 1, 14, 100), (5, 3, 30, 40), (20, 6, 9, 90)]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f]) for f, _ in MODES}


def classes(cache) -> tuple[int, int]:
    """(rows, length) the buffers are laid out for (append keeps every slot's rows)."""
    return getattr(cache, "held", cache.slots), getattr(cache, "length", None) or cache.room


def drive(ctx, plan, prompts, seeds, full=False, fit=False):
    """Admit plan row i (its step, its slot, prompts[i], seeds[i], its max_new) and step until
    every row ends. full: the buffers laid out at the whole capacity first; fit: after each
    release, the buffers fit to the rows left. Returns each row's tokens and the classes seen."""
    state = generation.new_state(ctx, slots=8, capacity=CAPACITY)
    if full:
        state.cache.fit(8, CAPACITY)
    tokens, where, seen = [[] for _ in plan], {}, set()
    for step_no in range(400):
        for i, (at, slot, _, max_new) in enumerate(plan):
            if at == step_no:
                state, first = generation.admit(ctx, state, [slot], [prompts[i]], [seeds[i]], max_new=[max_new])
                tokens[i] += [int(first.token[0])] if first.token[0] >= 0 else []
                if not first.finished[0]:
                    where[slot] = i
        if not where and step_no > max(p[0] for p in plan):
            break
        state, out = generation.step(ctx, state)
        seen.add(classes(state.cache))
        for slot, i in list(where.items()):
            if out.token[slot] >= 0:
                tokens[i].append(int(out.token[slot]))
            if out.finished[slot]:
                state = generation.release(ctx, state, slot)
                del where[slot]
                if fit and where:
                    state.cache.fit(max(where) + 1, int(state.lengths.max()) + 1)
                    seen.add(classes(state.cache))
    return tokens, seen


def test_size_class():
    assert [size_class(n, 1000) for n in (0, 1, 16, 17, 100, 600)] == [16, 16, 16, 32, 128, 1000]
    assert [size_class(n, 12, 1) for n in (1, 2, 3, 5, 9, 12)] == [1, 2, 4, 8, 12, 12]


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_rows_crossing_classes_get_what_a_full_layout_and_transformers_give(models, oracle, prompts_of, folder, mode):
    ctx = generation.context(models[folder], cache_mode=mode, do_sample=False)
    prompts = prompts_of([length for _, _, length, _ in PLAN], seed=3)
    seeds = [0] * len(PLAN)
    grown, seen = drive(ctx, PLAN, prompts, seeds)
    full, full_seen = drive(ctx, PLAN, prompts, seeds, full=True)
    assert grown == full
    for (_, _, _, max_new), prompt, tokens in zip(PLAN, prompts, grown):
        assert tokens == oracle.greedy("llama", prompt, max_new)
    lengths = sorted({length for _, length in seen})
    assert lengths[0] <= 32 and lengths[-1] == CAPACITY and len(lengths) >= 3, seen
    if mode == "in_place":  # rows 0, 1 then slot 3 (4 rows), then slot 6 (8 rows)
        assert {rows for rows, _ in seen} >= {2, 4, 8}, seen
    assert full_seen == {(8, CAPACITY)}


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_seeded_sampling_does_not_depend_on_the_classes(models, prompts_of, folder, mode):
    ctx = generation.context(models[folder], cache_mode=mode, do_sample=True, temperature=0.9, top_k=50)
    prompts = prompts_of([length for _, _, length, _ in PLAN], seed=4)
    seeds = [11, 12, 13, 14]
    assert drive(ctx, PLAN, prompts, seeds)[0] == drive(ctx, PLAN, prompts, seeds, full=True)[0]


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_fit_shrinks_the_buffers_when_rows_leave_and_the_rest_go_on(models, prompts_of, folder, mode):
    """A long row in slot 5 ends; the buffers fit down to the short row left in slot 0, which
    then grows again through the classes."""
    ctx = generation.context(models[folder], cache_mode=mode, do_sample=False, eos_token_id=[])
    plan = [(0, 0, 2, 110), (0, 5, 40, 30)]
    prompts = prompts_of([2, 40], seed=5)
    fitted, seen = drive(ctx, plan, prompts, [0, 0], fit=True)
    assert fitted == drive(ctx, plan, prompts, [0, 0], full=True)[0]
    alone = 1 if mode == "in_place" else 8  # the row in slot 0 (append keeps every slot's rows)
    assert {(8, 128), (alone, 64), (alone, 128)} <= seen, seen  # 70 tokens; fit to 34; 112 tokens
    assert len(fitted[0]) == 110


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_footprint_is_what_the_buffers_take(models, folder, mode):
    ctx = generation.context(models[folder], cache_mode=mode)
    cache = generation.new_state(ctx, slots=8, capacity=CAPACITY).cache
    for rows, length in [(1, 10), (3, 40), (8, 128), (2, 17)]:
        cache.fit(rows, length)
        assert cache.nbytes == cache.footprint(rows, length)
        assert cache.footprint(rows, length) == cache.footprint(rows, size_class(length, CAPACITY))
    assert cache.footprint(8, 128) >= 8 * 128 * cache.token_bytes
    assert np.isclose(cache.footprint(8, 100) / cache.footprint(8, 64), 2, rtol=0.1)
