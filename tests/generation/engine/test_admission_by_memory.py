"""Admission by memory (Scheduler(kv_cache_bytes=...), engine/budget.py, core/preempt.py).

Invariants: under a KV budget smaller than slots x capacity, the scheduler seats more rows than
the budget holds rows of the whole capacity, the cache's buffers never take more than the budget
between steps, rows that outgrow it are preempted and resumed by recompute, and every job gets
exactly what it gets alone (greedy, and seeded sampling in a mixed batch; tokens and
log-probabilities as an unbudgeted run gives them); beam searches are never preempted and get
what they get alone; a budget that holds no row of the capacity is refused, naming the field.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import generation
from generation.engine.scheduler import Scheduler
from generation.params.checks import SettingError

MODES = [("llama-genai", "in_place")]  # the append mode keeps every slot's rows: it admits by slots
SLOTS, CAPACITY = 8, 128
# FIXTURES.md: ONNX and torch differ by ~1e-5; a prompt run and steps by about as much (an AMD EPYC
# without AVX-512 gave 1.17e-5 at a log-probability of -2.86 after a preemption, 49 float32 ulps)
LOGPROB_TOLERANCE = 2e-5


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f]) for f in {f for f, _ in MODES} | {"gpt2-grow", "llama-optimum"}}


def run(scheduler: Scheduler, jobs, budget=None):
    """Add the jobs, step to the end; the most rows seated at once, and the most bytes the
    cache's buffers held after any step (checked against `budget`)."""
    for job in jobs:
        scheduler.add(job)
    most_rows, most_bytes = 0, 0
    while scheduler.busy:
        scheduler.step()
        most_rows = max(most_rows, scheduler.occupied)
        most_bytes = max(most_bytes, scheduler.state.cache.nbytes)
        if budget is not None:
            assert scheduler.state.cache.nbytes <= budget
    return most_rows, most_bytes


def jobs_of(scheduler, prompts, seeds, settings):
    return [scheduler.job(p, s, dict(st)) for p, s, st in zip(prompts, seeds, settings)]


def plan(prompts_of, count, seed):
    prompts = prompts_of(list(np.random.default_rng(seed).integers(3, 24, count)), seed=seed)
    budgets = np.random.default_rng(seed + 1).integers(30, 90, count)
    settings = [dict(max_new_tokens=int(n), eos_token_id=[]) for n in budgets]
    return prompts, settings


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampling"])
def test_rows_past_the_budget_are_preempted_and_resume_exactly(models, prompts_of, folder, mode, sampling):
    ctx = generation.context(models[folder], cache_mode=mode, token_logprobs=True, top_logprobs=2)
    prompts, settings = plan(prompts_of, 12, seed=7)
    if sampling:  # a mixed batch: every other row samples
        settings = [dict(s, do_sample=True, temperature=0.8, top_k=40) if i % 2 else s for i, s in enumerate(settings)]
    seeds = list(range(100, 112))
    free = Scheduler(ctx, SLOTS, CAPACITY)
    expected = jobs_of(free, prompts, seeds, settings)
    run(free, expected)

    probe = Scheduler(ctx, SLOTS, CAPACITY).state.cache
    budget = probe.footprint(SLOTS, 64)  # half of what 8 rows of the whole capacity take
    assert budget < probe.footprint(SLOTS, CAPACITY) * 0.6
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=budget)
    jobs = jobs_of(scheduler, prompts, seeds, settings)
    most_rows, _ = run(scheduler, jobs, budget)

    assert most_rows == SLOTS  # short rows fill every slot, where the whole capacity would fit 4
    assert scheduler.preemptions > 0 and any(job.preemptions for job in jobs)
    for job, want, prompt, seed, s in zip(jobs, expected, prompts, seeds, settings):
        assert (job.reason, job.tokens) == (want.reason, want.tokens)
        # a recomputed cache is the prompt run's, not the steps': equal up to float rounding
        np.testing.assert_allclose(job.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)
        assert [[i for i, _ in top] for top in job.top] == [[i for i, _ in top] for top in want.top]
        np.testing.assert_allclose([[lp for _, lp in top] for top in job.top],
                                   [[lp for _, lp in top] for top in want.top], rtol=0, atol=LOGPROB_TOLERANCE)
        if not sampling or not s.get("do_sample"):
            assert job.tokens == generation.generate(generation.context(ctx.model, cache_mode=mode, **s), [prompt],
                                                     seeds=[seed])[0]


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_beam_searches_reserve_their_limit_and_are_not_preempted(models, prompts_of, folder, mode):
    ctx = generation.context(models[folder], cache_mode=mode)
    prompts, settings = plan(prompts_of, 6, seed=9)
    beam = dict(num_beams=3, max_new_tokens=40, length_penalty=0.5)
    settings[1] = beam
    probe = Scheduler(ctx, SLOTS, CAPACITY).state.cache
    budget = probe.footprint(SLOTS, 64)
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=budget)
    jobs = jobs_of(scheduler, prompts, [0] * 6, settings)
    run(scheduler, jobs, budget)
    assert scheduler.preemptions > 0 and jobs[1].preemptions == 0
    beam_ctx = generation.context(ctx.model, cache_mode=mode, **beam)
    alone = generation.beam_search(beam_ctx, [prompts[1]], [0])[0]
    assert [(h.tokens, h.score) for h in jobs[1].hypotheses] == [(h.tokens, h.score) for h in alone]
    for i in (0, 2, 3, 4, 5):
        assert jobs[i].tokens == generation.generate(generation.context(ctx.model, cache_mode=mode, **settings[i]),
                                                     [prompts[i]], seeds=[0])[0]


def test_a_budget_is_checked_when_the_scheduler_is_made(models):
    ctx = generation.context(models["llama-genai"])
    least = Scheduler(ctx, SLOTS, CAPACITY).state.cache.footprint(1, CAPACITY)
    with pytest.raises(SettingError, match="kv_cache_bytes") as e:
        Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=least - 1)
    assert e.value.setting == "kv_cache_bytes" and str(least) in str(e.value)
    with pytest.raises(SettingError, match="kv_cache_bytes"):
        Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=-1)
    assert Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=least).budget == least
    assert Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=0).budget is None


def test_a_beam_search_that_never_fits_ends_with_an_error(models, prompts_of):
    ctx = generation.context(models["llama-genai"])
    least = Scheduler(ctx, SLOTS, CAPACITY).state.cache.footprint(1, CAPACITY)
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=least)
    beam, plain = scheduler.job(prompts_of([10], seed=1)[0], 0, dict(num_beams=4, max_new_tokens=100)), \
        scheduler.job(prompts_of([10], seed=2)[0], 0, dict(max_new_tokens=5))
    run(scheduler, [beam, plain])
    assert beam.reason == "error" and beam.admitting and beam.error.setting == "kv_cache_bytes"
    assert plain.reason == "length" and len(plain.tokens) == 5


@pytest.mark.parametrize("folder, mode", [("gpt2-grow", "grow"), ("llama-optimum", "append")])
def test_modes_whose_buffers_keep_every_slot_admit_by_slots(models, prompts_of, folder, mode):
    """grow mode (its arrays grow row by row) and append mode (every slot keeps its rows): the
    budget does not apply; they run as before."""
    ctx = generation.context(models[folder], cache_mode=mode, max_new_tokens=8)
    scheduler = Scheduler(ctx, 4, CAPACITY, kv_cache_bytes=1)
    assert scheduler.budget is None
    prompts = prompts_of([4, 9, 6], seed=3)
    jobs = [scheduler.job(p) for p in prompts]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    assert [j.tokens for j in jobs] == [generation.generate(ctx, [p])[0] for p in prompts]


def test_a_resumed_row_keeps_its_stop_strings_constraint_and_penalties(models, prompts_of):
    """What moves with a row besides its tokens: its stop-string matcher (a string its row makes
    late, after it was preempted), its constraint's matcher, its processors' history."""
    from generation.text.tokenizer import model_tokenizer

    ctx = generation.context(models["llama-genai"], token_logprobs=True)
    prompts, settings = plan(prompts_of, 10, seed=11)
    settings[2] = dict(settings[2], structured_outputs={"regex": "[a-z ]{60,300}"})
    settings[9] = dict(settings[9], no_repeat_ngram_size=2, do_sample=True, temperature=0.7, repetition_penalty=1.3)
    free = Scheduler(ctx, SLOTS, CAPACITY)
    plain = free.job(prompts[3], 3, settings[3])
    run(free, [plain])
    stop = model_tokenizer(ctx.model).decode(plain.tokens[70:73])
    settings[3] = dict(settings[3], stop_strings=[stop])
    expected = jobs_of(free, prompts, range(10), settings)
    run(free, expected)
    assert expected[3].reason == "stop" and 60 < len(expected[3].tokens) <= 73
    budget = free.state.cache.footprint(SLOTS, 64)
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=budget)
    jobs = jobs_of(scheduler, prompts, range(10), settings)
    run(scheduler, jobs, budget)
    assert all(jobs[i].preemptions for i in (2, 3, 9)), [j.preemptions for j in jobs]
    assert [(j.reason, j.tokens) for j in jobs] == [(j.reason, j.tokens) for j in expected]


def test_the_prefix_store_shares_the_budget_and_gives_way_to_rows(models, prompts_of):
    """Prompts that share a 32-token prefix, under a budget the prefix store shares: after every
    step the rows' buffers and the stored prefixes together stay within it, the store is used
    (hits), and every job gets what an unbudgeted run without a store gives it."""
    ctx = generation.context(models["llama-genai"])
    shared = prompts_of([32], seed=12)[0]
    tails, settings = plan(prompts_of, 10, seed=13)
    prompts = [shared + tail for tail in tails]
    settings = [dict(s, max_new_tokens=min(s["max_new_tokens"], CAPACITY - len(p) - 1)) for s, p in zip(settings, prompts)]
    free = Scheduler(ctx, SLOTS, CAPACITY)
    expected = jobs_of(free, prompts, range(10), settings)
    run(free, expected)
    budget = free.state.cache.footprint(SLOTS, 128) // 2
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, kv_cache_bytes=budget, prefix_cache_bytes=1 << 30)
    store = scheduler.state.prefix
    jobs = jobs_of(scheduler, prompts, range(10), settings)
    for job in jobs:
        scheduler.add(job)
    most = 0
    while scheduler.busy:
        scheduler.step()
        assert scheduler.state.cache.nbytes + store.bytes <= budget
        most = max(most, store.bytes)
    assert most > 0 and store.hits > 0 and scheduler.preemptions > 0
    assert [(j.reason, j.tokens) for j in jobs] == [(j.reason, j.tokens) for j in expected]


def test_a_scheduler_that_does_not_stream_steps_within_the_budget(models, prompts_of):
    """stream=False runs greedy steps in a tight loop (`advance`): under a budget, as many as the
    buffers hold as laid out, so the budget holds there too."""
    ctx = generation.context(models["llama-genai"])
    prompts, settings = plan(prompts_of, 10, seed=14)
    free = Scheduler(ctx, SLOTS, CAPACITY, stream=False)
    expected = jobs_of(free, prompts, range(10), settings)
    run(free, expected)
    budget = free.state.cache.footprint(SLOTS, 64)
    scheduler = Scheduler(ctx, SLOTS, CAPACITY, stream=False, kv_cache_bytes=budget)
    jobs = jobs_of(scheduler, prompts, range(10), settings)
    run(scheduler, jobs, budget)
    assert scheduler.preemptions > 0
    assert [(j.reason, j.tokens) for j in jobs] == [(j.reason, j.tokens) for j in expected]


def test_slots_0_seats_what_the_budget_holds(models, prompts_of):
    """`slots=0` (a server's default): where admission goes by memory, 256 slots and the budget
    decides, so 64 requests sent at once all run at once (and each gets what a loop of fixed slots
    gives it); where each row may grow to the capacity, the rows the budget holds so, at least 32;
    no budget, 32."""
    from generation.cache.base import token_bytes
    from generation.engine.batching import ContinuousBatcher
    from generation.engine.budget import AUTO_SLOTS, FIXED_SLOTS, resolved_slots

    ctx = generation.context(models["llama-genai"], max_new_tokens=24, eos_token_id=[])
    row = token_bytes(ctx.model.graph) * CAPACITY
    assert resolved_slots(ctx, 0, CAPACITY, 64 * row) == AUTO_SLOTS and resolved_slots(ctx, 5, CAPACITY, None) == 5
    assert resolved_slots(ctx, 0, CAPACITY, 0) == FIXED_SLOTS  # no budget: rows grow to the capacity
    append = generation.context(models["llama-optimum"])
    assert append.cache_mode == "append"
    assert resolved_slots(append, 0, CAPACITY, 40 * row) == 40 and resolved_slots(append, 0, CAPACITY, 8 * row) == 32
    prompts = prompts_of([int(n) for n in np.random.default_rng(3).integers(4, 40, 64)], seed=21)
    batcher = ContinuousBatcher(ctx, slots=0, capacity=CAPACITY, kv_cache_bytes=64 * row)
    most = 0
    try:
        assert batcher.slots == AUTO_SLOTS
        requests = [batcher.submit(p, seed=i, priority=0, logprobs=False) for i, p in enumerate(prompts)]
        while not all(r.done for r in requests):
            most = max(most, batcher.running)
            time.sleep(0.001)
        got = [r.result(timeout=120).tokens for r in requests]
    finally:
        batcher.close()
    assert most == 64  # every request seated at once
    assert got == generation.generate(ctx, prompts, seeds=list(range(64)))
