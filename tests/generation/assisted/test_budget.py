"""The cost rule of assisted decoding (generation/assisted/budget.py).

Invariants: a plan only drops candidates, and picks the option of most tokens per second
under the cost model (checked against brute force over every option); the fitted run costs
recover a and b from timed steps; a slot's acceptance rate follows what its rows keep and starts
again for a new row; with the rule on, the tokens are the plain ones whatever it decides, it
verifies where candidates pay and never where a verify run costs more than it can give.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import generation
from generation.assisted import budget
from generation.assisted.budget import (CostAware, RunCosts, expected_gain, plan_rows, plan_shared, run_shape)
from generation.assisted.prompt_lookup import PromptLookup

from test_assisted import GREEDY, grounded, take_tokens


def rate_of(tokens, seconds):
    return tokens / seconds


def shared_cost(counts, slots, a, b):
    return a + b * slots * (1 + counts.max(initial=0))


def rows_cost(counts, slots, a, b):
    alone = counts > 0
    rest = int((~alone).sum())
    if not alone.any():
        return a + b * slots
    decode = 0.0 if rest == 0 else (a + b) if rest == 1 else a + b * slots
    return decode + a * alone.sum() + b * (1 + counts[alone]).sum()


@pytest.mark.parametrize("seed", range(12))
def test_plans_are_the_fastest_option_by_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 5))
    slots = n + int(rng.integers(0, 3))
    counts = rng.integers(0, 5, n)
    rates = rng.uniform(0.05, 0.99, n)
    a, b = 1.0, float(rng.choice([0.002, 0.02, 0.1, 0.3]))
    gain = expected_gain(rates, int(counts.max(initial=0)))
    for plan, cost in ((plan_shared, shared_cost), (plan_rows, rows_cost)):
        got = plan(gain, counts, slots, a, b)
        assert ((0 <= got) & (got <= counts)).all()
        value = rate_of(n + gain[np.arange(n), got].sum(), cost(got, slots, a, b))
        options = itertools.product(*[range(c + 1) for c in counts.tolist()])
        best = max(rate_of(n + gain[np.arange(n), list(o)].sum(), cost(np.array(o), slots, a, b)) for o in options)
        if plan is plan_shared:  # one cap for every row: the best among the caps
            best = max(rate_of(n + gain[np.arange(n), np.minimum(counts, c)].sum(),
                               cost(np.minimum(counts, c), slots, a, b)) for c in range(int(counts.max(initial=0)) + 1))
        assert value == pytest.approx(best, rel=1e-9), (plan.__name__, counts, rates, b)


def test_plans_refuse_where_the_hardware_is_busy_and_take_all_where_it_is_idle():
    gain = expected_gain(np.full(8, 0.9), 10)
    counts = np.full(8, 10)
    # a CPU at batch 8 (b / a = 0.09, as measured on the bench model): a column of 8 positions
    # costs 0.42 plain steps, worth it for rows keeping 9 in 10 up to a point, not to 10
    cpu = plan_shared(gain, counts, 8, 1.0, 0.09)
    assert 0 < cpu.max() < 10
    # an idle device (b / a = 0.001): every candidate
    assert plan_shared(gain, counts, 8, 1.0, 0.001).tolist() == [10] * 8
    # row by row at batch 8: each row's run costs what the plain step of all eight does
    assert plan_rows(gain, counts, 8, 1.0, 0.09).tolist() == [0] * 8
    # one row of spurious candidates (never kept) beside rows without: nothing
    lone = np.array([10, 0, 0, 0, 0, 0, 0, 0])
    assert plan_shared(expected_gain(np.full(8, 0.05), 10), lone, 8, 1.0, 0.09).tolist() == [0] * 8


def test_run_shape_per_cache():
    widths = np.array([1, 3, 1, 5])
    assert run_shape(np.ones(4, np.int64), 6, True) == (1.0, 6.0)  # a plain step runs every slot
    assert run_shape(widths, 6, False) == (1.0, 30.0)  # every slot as wide as the widest
    assert run_shape(widths, 6, True) == (3.0, 14.0)  # two runs alone, the others' decode of 6 slots
    assert run_shape(np.array([1, 3]), 6, True) == (2.0, 4.0)  # a lone row of width 1 runs alone


def test_run_costs_recover_a_and_b():
    a, b, slots = 0.012, 0.0011, 8
    costs = RunCosts(slots)
    assert costs.ab()[1] == pytest.approx(budget.PRIOR_COST_RATIO * costs.ab()[0], rel=0.2)
    rng = np.random.default_rng(0)
    for _ in range(200):
        costs.observe(1, slots, (a + b * slots) * rng.uniform(0.98, 1.02))
        widths = np.where(rng.random(slots) < 0.5, rng.integers(2, 11, slots), 1)
        for row_by_row in (False, True):
            runs, positions = run_shape(widths, slots, row_by_row)
            costs.observe(runs, positions, (a * runs + b * positions) * rng.uniform(0.98, 1.02))
    got_a, got_b = costs.ab()
    assert got_a == pytest.approx(a, rel=0.1) and got_b == pytest.approx(b, rel=0.1)
    # a verify step timed first, on a machine whose b / a is the prior's: a and b as they are
    first = RunCosts(slots)
    a = 0.01
    first.observe(3, 20, a * 3 + budget.PRIOR_COST_RATIO * a * 20)
    assert first.ab() == pytest.approx((a, budget.PRIOR_COST_RATIO * a))


class Scripted:
    """Candidates from a known continuation: the first `good` of each proposal right, the rest wrong."""

    def __init__(self, plain, k, good):
        self.plain, self.k, self.good = plain, k, good

    def propose(self, state, rows, room, allowed=None):
        ids = np.zeros((len(rows), self.k), np.int64)
        for i, b in enumerate(rows.tolist()):
            made = int(state.lengths[b] + 1 - state.prompt_length[b])  # tokens the row has made
            rest = self.plain[b][made:made + self.k]
            rest = rest + [3] * (self.k - len(rest))
            ids[i] = [t if j < self.good else t + 1 for j, t in enumerate(rest)]
        return ids, np.minimum(room, self.k), None

    def cut(self, state, rows, ids, counts, allowed):
        return counts

    def accepted(self, rows, accepted, counts):
        pass


class Never:
    """No candidates: every verify is a plain step."""

    def propose(self, state, rows, room, allowed=None):
        return np.zeros((len(rows), 1), np.int64), np.zeros(len(rows), np.int64), None

    def accepted(self, rows, accepted, counts):
        pass


def run_steps(ctx, gen, prompts, slots, steps=40):
    from generation.assisted.verify import verify

    state = generation.new_state(ctx, slots=slots, capacity=96)
    state, first = generation.admit(ctx, state, list(range(len(prompts))), prompts, [0] * len(prompts))
    got = [[t] for t in first.token.tolist()]
    runs = 0
    for _ in range(steps):
        if not state.live.any():
            break
        state, outs = verify(ctx, state, gen)
        runs += 1
        take_tokens(got, outs)
    return got, runs, state


@pytest.fixture(scope="module")
def default(load_model):
    from generation.default_model import FOLDER

    return load_model(FOLDER / "genai")


def test_rates_follow_what_rows_keep_and_start_again_for_a_new_row(load_model, monkeypatch):
    from generation.default_model import FOLDER

    monkeypatch.setattr(RunCosts, "ab", lambda self: (1.0, 0.0001))  # verifying is nearly free: always try
    ctx = generation.context(load_model(FOLDER), max_new_tokens=20, cache_mode="append", **GREEDY)
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    plain = generation.generate(ctx, prompts, seeds=[0, 0])
    for good, low, high in ((4, 0.9, 1.0), (0, 0.0, 0.3)):
        gen = CostAware(Scripted(plain, 4, good))
        got, _, state = run_steps(ctx, gen, prompts, slots=2, steps=3)
        assert [g[:len(p)] for g, p in zip(got, plain)] == [p[:len(g)] for g, p in zip(got, plain)]
        rates = gen.rates(np.arange(2))
        assert ((low <= rates) & (rates <= high)).all(), (good, rates)
    # slot 0 gets a new row: its rate is the prior again on its first step
    state = generation.release(ctx, state, 0)
    state, _ = generation.admit(ctx, state, [0], [[12, 13]], [0])
    seen = []
    monkeypatch.setattr(gen.inner, "propose", lambda st, rows, room, allowed=None: (
        seen.append(gen.rates(rows).tolist()) or (np.zeros((len(rows), 1), np.int64), np.zeros(len(rows), np.int64), None)))
    from generation.assisted.verify import verify

    verify(ctx, state, gen)
    assert seen[0][0] == pytest.approx(budget.PRIOR_RATE) and seen[0][1] < 0.3


@pytest.mark.parametrize("mode", ["in_place", "append"])
def test_the_rule_gives_the_plain_tokens_and_verifies_only_where_it_pays(load_model, default, mode, monkeypatch):
    from generation.default_model import FOLDER

    model = default if mode == "in_place" else load_model(FOLDER)
    ctx = generation.context(model, max_new_tokens=30, cache_mode=mode, **GREEDY)
    prompts = grounded(model)
    plain = generation.generate(ctx, prompts, seeds=[0] * 4)
    steps = {}
    for name, ab in (("cheap", (1.0, 0.001)), ("dear", (1.0, 100.0)), ("measured", None)):
        if ab is not None:
            monkeypatch.setattr(RunCosts, "ab", lambda self, ab=ab: ab)
        else:
            monkeypatch.undo()
        for batch in (1, 4):
            got = []
            total = 0
            for rows in ([prompts[:batch]] if batch == 4 else [[p] for p in prompts]):
                out, runs, _ = run_steps(ctx, CostAware(PromptLookup(4)), rows, slots=len(rows), steps=60)
                got += [o[:len(p)] for o, p in zip(out, plain[len(got):])]
                total += runs
            assert got == plain, (name, batch)
            steps[name, batch] = total
    every = sum(run_steps(ctx, PromptLookup(4), [p], slots=1, steps=60)[1] for p in prompts)
    assert steps["cheap", 1] == every < steps["dear", 1]  # cheap runs: every candidate verified, some kept
    # dear runs: never a verify, as many steps as without candidates
    assert steps["dear", 1] == sum(run_steps(ctx, Never(), [p], slots=1, steps=60)[1] for p in prompts)
    if mode == "append":  # (in_place runs a decode of all slots: a last row alone verifies for less)
        assert steps["dear", 4] == run_steps(ctx, Never(), prompts, slots=4, steps=60)[1]


def test_the_processors_judge_the_candidates_the_rule_keeps(default, monkeypatch):
    """CostAware asks the processors about the planned candidates only: none it proposes is
    forbidden, and the tokens are the plain ones."""
    monkeypatch.setattr(RunCosts, "ab", lambda self: (1.0, 1e-4))
    prompts = grounded(default)
    flat = [t for row in prompts for t in row]
    banned = max(set(flat), key=flat.count)
    settings = dict(repetition_penalty=1.05, no_repeat_ngram_size=8, bad_words_ids=[[banned]], min_new_tokens=5,
                    max_new_tokens=30, do_sample=False)
    ctx = generation.context(default, prompt_lookup_num_tokens=4, **settings)
    plain = generation.generate(generation.context(default, **settings), prompts, seeds=[0] * 4)
    proposed, raw = [], []

    def kept(ids, counts):
        return ids[np.arange(ids.shape[1]) < counts[:, None]].tolist()

    class Candidates(PromptLookup):
        def propose(self, state, rows, room, allowed=None):
            ids, counts, probs = super().propose(state, rows, room, allowed)
            raw.append(kept(ids, counts))
            return ids, counts, probs

    class Recording(CostAware):
        def propose(self, state, rows, room, allowed=None):
            ids, counts, probs = super().propose(state, rows, room, allowed)
            proposed.append(kept(ids, counts))
            return ids, counts, probs

    got, _, _ = run_steps(ctx, Recording(Candidates(4)), prompts, slots=4, steps=60)
    assert [g[:len(p)] for g, p in zip(got, plain)] == plain
    assert any(banned in row for row in raw), "the banned token was never a candidate: the test proves nothing"
    assert all(banned not in row for row in proposed) and sum(map(len, proposed)) > 0
