"""Chunked prefill (Scheduler(prefill_chunk_tokens=...), core/chunks.py).

Invariants: with a prompt budget per step smaller than the prompts (several chunks each), jobs
that arrive while others decode, mixed with running rows, greedy and seeded sampling, get exactly
what each gets alone (tokens; log-probabilities and their top alternatives up to the float
rounding a prompt run in pieces differs by), in the in_place, append and grow modes; under a KV
budget (preemption, a resumed row recomputed in chunks), with the prefix store, stop strings, a
constraint and prompt lookup as well; no step runs more prompt tokens than the budget, and the
running rows get a token at every step while a long prompt runs its chunks (where without a
budget one step runs it all); a job cancelled mid-prefill ends with nothing, runs no more chunks and frees its slot;
rows that do not run in chunks (beam searches, prompt log-probabilities) are seated whole; a
waiting job of a lower priority value runs before a prompt part-way through, and a prompt
part-way through before a later arrival of its priority; the budget is checked when the
scheduler is made; the server's loop (ContinuousBatcher) chunks by default (generate does not) and
streams such prompts as alone.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.engine.scheduler import Scheduler
from generation.engine.batching import ContinuousBatcher
from generation.params.checks import SettingError

MODES = [("llama-genai", "in_place"), ("llama-optimum", "append"), ("gpt2-grow", "grow")]
CAPACITY = 128
LOGPROB_TOLERANCE = 1e-5  # a prompt run in chunks differs from one run whole by float rounding


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {folder: load_model(test_models[folder]) for folder, _ in MODES}


class PromptTokens:
    """The prompt tokens each `session.run` of the model ran (rows x width of its input_ids): the
    prompts' runs (whole, or a chunk), apart from the decode steps, which run by IOBinding."""

    def __init__(self, monkeypatch, model):
        self.runs: list[int] = []
        session = model.session
        tokens = self

        class Counted:
            def run(self, names, feeds, *rest):
                ids = feeds.get("input_ids")
                if ids is not None:
                    tokens.runs.append(int(ids.size))
                return session.run(names, feeds, *rest)

            def __getattr__(self, name):
                return getattr(session, name)

        monkeypatch.setattr(model, "session", Counted())

    def take(self) -> int:
        """The prompt tokens run since the last take."""
        count, self.runs = sum(self.runs), []
        return count


def alone(ctx, prompt, seed, settings):
    """The job in a scheduler of its own, its prompt run whole."""
    scheduler = Scheduler(ctx, 1, CAPACITY)
    job = scheduler.job(prompt, seed, dict(settings))
    scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    return job


def assert_same(job, want):
    assert job.error is None, job.error
    assert (job.reason, job.tokens) == (want.reason, want.tokens)
    if want.logprobs is not None:
        np.testing.assert_allclose(job.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)
    if want.top is not None:
        assert [[i for i, _ in t] for t in job.top] == [[i for i, _ in t] for t in want.top]
        np.testing.assert_allclose([[lp for _, lp in t] for t in job.top], [[lp for _, lp in t] for t in want.top],
                                   rtol=0, atol=LOGPROB_TOLERANCE)


def plan(prompts_of, lengths, seed):
    """Prompts of `lengths`, each with its own budget of new tokens; every other one samples."""
    prompts = prompts_of(lengths, seed=seed)
    budgets = np.random.default_rng(seed + 1).integers(8, 30, len(lengths))
    settings = [dict(max_new_tokens=int(n), eos_token_id=[]) for n in budgets]
    settings = [dict(s, do_sample=True, temperature=0.8, top_k=40) if i % 2 else s for i, s in enumerate(settings)]
    return prompts, settings


def run_joining(scheduler, jobs, every: int = 2):
    """The first two jobs at once, then one more every `every` steps (they join a running batch);
    steps to the end, and returns the steps taken."""
    waiting, steps = list(jobs), 0
    for job in waiting[:2]:
        scheduler.add(job)
    waiting = waiting[2:]
    while scheduler.busy or waiting:
        if waiting and steps % every == 0:
            scheduler.add(waiting.pop(0))
        scheduler.step()
        steps += 1
    return steps


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
@pytest.mark.parametrize("budget", [5, 16])
def test_prompts_run_in_chunks_give_each_job_what_it_gets_alone(models, prompts_of, folder, mode, budget):
    ctx = generation.context(models[folder], cache_mode=mode, token_logprobs=True, top_logprobs=2)
    prompts, settings = plan(prompts_of, [37, 4, 61, 12, 23, 50], seed=3)
    seeds = list(range(20, 26))
    expected = [alone(ctx, p, s, st) for p, s, st in zip(prompts, seeds, settings)]

    scheduler = Scheduler(ctx, 4, CAPACITY, prefill_chunk_tokens=budget)
    jobs = [scheduler.job(p, s, dict(st)) for p, s, st in zip(prompts, seeds, settings)]
    parts, seen = [], set()
    scheduler_step = scheduler.step

    def step(*args, **kwargs):  # which jobs were part-way through, and whether rows ran beside them
        out = scheduler_step(*args, **kwargs)
        seen.update(id(job) for job in scheduler.filling.values())
        parts.append(bool(scheduler.filling and scheduler.holder))
        return out

    scheduler.step = step
    run_joining(scheduler, jobs)
    assert id(jobs[5]) in seen and sum(parts) > 3  # the long prompts that came to running rows ran in chunks
    assert id(jobs[0]) not in seen  # it came to an idle loop: IDLE_PREFILL_FACTOR times the budget, whole
    for job, want in zip(jobs, expected):
        assert_same(job, want)
    assert not scheduler.filling and not scheduler.state.used.any()


def test_a_long_prompt_does_not_stall_the_running_rows(models, prompts_of, monkeypatch):
    """Two rows decode; a prompt of 60 tokens arrives. With a budget of 8, every step runs at most
    8 prompt tokens and gives both running rows a token, and the new row's first token comes at
    the 8th step (60 = 7 x 8 + 4); without a budget, one step runs all 60."""
    model = models["llama-optimum"]
    ctx = generation.context(model, cache_mode="append", max_new_tokens=40, eos_token_id=[])
    running, long = prompts_of([6, 9], seed=4), prompts_of([60], seed=5)[0]
    for chunk, most in ((8, 8), (0, 60)):
        counted = PromptTokens(monkeypatch, model)
        scheduler = Scheduler(ctx, 4, CAPACITY, prefill_chunk_tokens=chunk)
        rows = [scheduler.job(p) for p in running]
        for job in rows:
            scheduler.add(job)
        while len(scheduler.holder) < 2:
            scheduler.step()
        counted.take()
        job = scheduler.job(long, settings=dict(max_new_tokens=5))
        scheduler.add(job)
        per_step, first_at = [], None
        for step in range(1, 10):
            updates, _ = scheduler.step()
            per_step.append(counted.take())
            got = [j for u in updates for j, *_ in u.tokens()]
            assert all(got.count(row) == 1 for row in rows)  # each running row: its token at this step
            if first_at is None and job in got:
                first_at = step
        assert max(per_step) == most
        assert sum(per_step) == 60
        assert first_at == (8 if chunk else 1)
        monkeypatch.undo()
        while scheduler.busy:
            scheduler.step()
        assert job.tokens == alone(ctx, long, 0, dict(max_new_tokens=5)).tokens


def test_a_burst_at_an_idle_loop_runs_batched_and_a_longer_prompt_still_in_chunks(models, prompts_of, monkeypatch):
    """No row steps: a boundary runs IDLE_PREFILL_FACTOR times the budget (no pace to keep), so 4
    prompts of 9 tokens with a budget of 8 run in one batched prefill (one step seats them all); a
    prompt longer than that runs the idle boundary's budget first, and its rest at the next
    boundary under the plain budget (a prompt part-way through: the loop is not idle)."""
    from generation.engine.admission import IDLE_PREFILL_FACTOR

    model = models["llama-optimum"]
    ctx = generation.context(model, cache_mode="append", max_new_tokens=3, eos_token_id=[])
    counted = PromptTokens(monkeypatch, model)
    scheduler = Scheduler(ctx, 4, CAPACITY, prefill_chunk_tokens=8)
    burst = [scheduler.job(p) for p in prompts_of([9, 9, 9, 9], seed=7)]
    for job in burst:
        scheduler.add(job)
    scheduler.step()
    assert len(scheduler.holder) == 4 and counted.runs == [36]  # one run of the 4 prompts
    while scheduler.busy:
        scheduler.step()
    counted.take()
    long = prompts_of([8 * IDLE_PREFILL_FACTOR + 5], seed=8)[0]
    job = scheduler.job(long)
    scheduler.add(job)
    scheduler.step()
    assert counted.runs == [8 * IDLE_PREFILL_FACTOR]  # the idle boundary's larger budget, then...
    scheduler.step()
    assert counted.runs[1:] == [5]  # ... the rest at the next (a prompt part-way: the plain budget)
    monkeypatch.undo()
    while scheduler.busy:
        scheduler.step()
    assert job.tokens == alone(ctx, long, 0, {}).tokens


def test_a_job_cancelled_mid_prefill_ends_and_frees_its_slot(models, prompts_of, monkeypatch):
    model = models["llama-optimum"]  # its prompts run by session.run, whole or in chunks: counted
    ctx = generation.context(model, cache_mode="append", token_logprobs=True)
    prompts, settings = plan(prompts_of, [70, 5, 9], seed=6)
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    counted = PromptTokens(monkeypatch, model)
    scheduler = Scheduler(ctx, 2, CAPACITY, prefill_chunk_tokens=10)
    jobs = [scheduler.job(p, i, dict(s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    scheduler.add(jobs[1])
    scheduler.step()
    scheduler.add(jobs[0])
    scheduler.step()
    scheduler.step()
    assert list(scheduler.filling.values()) == [jobs[0]] and jobs[0].partial.done == 20
    counted.take()
    scheduler.cancel(jobs[0])
    scheduler.add(jobs[2])  # it takes the cancelled job's slot at the same boundary
    _, ended = scheduler.step()
    assert jobs[0] in ended and jobs[0].reason == "cancelled" and jobs[0].tokens == []
    assert not scheduler.filling and jobs[0].partial is None
    assert counted.take() == 9  # the new job's whole prompt: the cancelled one ran no more chunks
    assert set(scheduler.holder.values()) == {jobs[1], jobs[2]}
    while scheduler.busy:
        scheduler.step()
    for i in (1, 2):
        assert_same(jobs[i], expected[i])


def test_chunks_under_a_kv_budget_with_preemption_and_the_prefix_store(models, prompts_of):
    """A KV budget that preempts rows (a row resuming whose tokens outgrow the prompt budget runs
    them in chunks too) and a prefix store the prompts share: every job as alone; the store is
    used by prompts run in chunks; the buffers stay within the budget after every step."""
    ctx = generation.context(models["llama-genai"], token_logprobs=True)
    shared = prompts_of([40], seed=7)[0]
    tails, settings = plan(prompts_of, [9, 3, 30, 1, 17, 25, 6, 12], seed=8)
    prompts = [shared + tail if i % 3 else tail for i, tail in enumerate(tails)]
    settings = [dict(s, max_new_tokens=int(n)) for s, n in zip(settings, [40, 60, 30, 50, 70, 20, 45, 55])]
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    budget = Scheduler(ctx, 4, CAPACITY).state.cache.footprint(4, 64)
    scheduler = Scheduler(ctx, 4, CAPACITY, kv_cache_bytes=budget, prefix_cache_bytes=1 << 30, prefill_chunk_tokens=8)
    scheduler.idle_prefill_factor = 1  # the plain budget at every boundary: resumed rows meet it
    jobs = [scheduler.job(p, i, dict(s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    resumed_in_chunks = []
    fill = scheduler._fill

    def recorded(chunks, updates):
        resumed_in_chunks.extend(job for _, job, _ in chunks if job.paused is not None)
        return fill(chunks, updates)

    scheduler._fill = recorded
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
        assert scheduler.state.cache.nbytes <= budget
    assert scheduler.preemptions > 0 and resumed_in_chunks
    assert scheduler.state.prefix.hits > 0 and any(job.cached_tokens for job in jobs)
    for job, want in zip(jobs, expected):
        assert_same(job, want)


def test_stop_strings_a_constraint_and_prompt_lookup_run_in_chunks(models, prompts_of):
    from generation.assisted.prompt_lookup import PromptLookup
    from generation.text.tokenizer import model_tokenizer

    ctx = generation.context(models["llama-genai"])
    prompts = prompts_of([33, 45, 28], seed=9) + [[40, 41, 42, 43] * 9]  # the last repeats: candidates found
    plain = alone(ctx, prompts[0], 0, dict(max_new_tokens=40, eos_token_id=[]))
    stop = model_tokenizer(ctx.model).decode(plain.tokens[20:23])
    settings = [dict(max_new_tokens=40, eos_token_id=[], stop_strings=[stop]),
                dict(max_new_tokens=30, structured_outputs={"regex": "[a-z ]{10,300}"}),
                dict(max_new_tokens=30, repetition_penalty=1.3, no_repeat_ngram_size=2, do_sample=True),
                dict(max_new_tokens=30, prompt_lookup_num_tokens=3)]
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    assert expected[0].reason == "stop" and len(expected[0].tokens) <= 23
    scheduler = Scheduler(ctx, 4, CAPACITY, lookup=PromptLookup(), prefill_chunk_tokens=6)
    jobs = [scheduler.job(p, i, dict(s)) for i, (p, s) in enumerate(zip(prompts, settings))]
    run_joining(scheduler, jobs, every=3)
    for job, want in zip(jobs, expected):
        assert_same(job, want)


def test_the_servers_loop_chunks_by_default_and_the_engine_does_not(models):
    """generate's Scheduler runs every prompt whole; the server's loop has a budget."""
    from generation.engine.batching import DEFAULT_PREFILL_CHUNK_TOKENS

    ctx = generation.context(models["llama-genai"])
    assert Scheduler(ctx, 2, CAPACITY).prefill_chunk_tokens == 0
    batcher = ContinuousBatcher(ctx, slots=2, capacity=CAPACITY)
    try:
        assert batcher.scheduler.prefill_chunk_tokens == DEFAULT_PREFILL_CHUNK_TOKENS > 0
    finally:
        batcher.close()


def test_rows_that_do_not_run_in_chunks_are_seated_whole(models, prompts_of):
    """A beam search and a job asking for its prompt's log-probabilities, longer than the budget,
    each seated whole at a boundary whose budget is untouched; a plain job beside them in chunks."""
    ctx = generation.context(models["llama-genai"], token_logprobs=True)
    prompts = prompts_of([30, 26, 41], seed=10)
    beam = dict(num_beams=2, max_new_tokens=10)
    scheduler = Scheduler(ctx, 4, CAPACITY, prefill_chunk_tokens=8)
    scheduler.idle_prefill_factor = 1  # the plain budget from the first boundary on
    jobs = [scheduler.job(prompts[0], 0, beam), scheduler.job(prompts[1], 1, dict(max_new_tokens=12),
                                                               prompt_logprobs=1),
            scheduler.job(prompts[2], 2, dict(max_new_tokens=12))]
    for job in jobs:
        scheduler.add(job)
    scheduler.step()  # the beam search whole: the boundary's budget is spent
    assert list(scheduler.groups.values()) == [jobs[0]] and list(scheduler.waiting) == jobs[1:]
    scheduler.step()  # the prompt log-probabilities whole, at a boundary of their own
    assert list(scheduler.holder.values()) == [jobs[1]] and list(scheduler.waiting) == jobs[2:]
    scheduler.step()  # the plain prompt in chunks
    assert list(scheduler.filling.values()) == [jobs[2]] and jobs[2].partial.done == 8
    while scheduler.busy:
        scheduler.step()
    alone_beam = generation.beam_search(generation.context(ctx.model, **beam), [prompts[0]], [0])[0]
    assert [h.tokens for h in jobs[0].hypotheses] == [h.tokens for h in alone_beam]
    free = Scheduler(ctx, 1, CAPACITY)
    want = free.job(prompts[1], 1, dict(max_new_tokens=12), prompt_logprobs=1)
    free.add(want)
    while free.busy:
        free.step()
    assert jobs[1].tokens == want.tokens
    assert jobs[1].prompt_logprobs is not None
    assert_same(jobs[2], alone(ctx, prompts[2], 2, dict(max_new_tokens=12)))


def test_the_budget_goes_by_the_queue_order_prompts_part_way_through_included(models, prompts_of):
    """A waiting job of a lower priority value runs before a prompt part-way through; among equal
    priorities, the prompt part-way through (it arrived first) runs before a later arrival."""
    ctx = generation.context(models["llama-genai"])
    prompts = prompts_of([60, 5, 30], seed=11)
    scheduler = Scheduler(ctx, 4, CAPACITY, prefill_chunk_tokens=8)
    scheduler.idle_prefill_factor = 1  # the plain budget from the first boundary on
    batch = scheduler.job(prompts[0], 0, dict(max_new_tokens=6), priority=1)
    scheduler.add(batch)
    scheduler.step()
    assert batch.partial.done == 8
    later = scheduler.job(prompts[2], 2, dict(max_new_tokens=6), priority=1)
    interactive = scheduler.job(prompts[1], 1, dict(max_new_tokens=6))
    scheduler.add(later)
    scheduler.add(interactive)
    scheduler.step()  # 5 tokens to the interactive prompt (whole), the 3 left to the batch prompt part-way
    assert list(scheduler.holder.values()) == [interactive] and batch.partial.done == 11
    assert list(scheduler.waiting) == [later]
    while scheduler.busy:
        scheduler.step()
    for job, prompt, seed in ((batch, prompts[0], 0), (interactive, prompts[1], 1), (later, prompts[2], 2)):
        assert_same(job, alone(ctx, prompt, seed, dict(max_new_tokens=6)))


def test_the_budget_is_checked_when_the_scheduler_is_made(models):
    ctx = generation.context(models["llama-genai"])
    for bad in (-1, 1.5, "8"):
        with pytest.raises(SettingError, match="prefill_chunk_tokens") as e:
            Scheduler(ctx, 2, CAPACITY, prefill_chunk_tokens=bad)
        assert e.value.setting == "prefill_chunk_tokens"


def test_a_batcher_streams_prompts_run_in_chunks_as_alone(models, prompts_of):
    """The server's loop: requests that join while others stream, a budget smaller than their
    prompts, one cancelled mid-prefill; each streamed request as alone."""
    ctx = generation.context(models["llama-genai"])
    prompts, settings = plan(prompts_of, [50, 8, 44, 70], seed=12)
    expected = [alone(ctx, p, i, s) for i, (p, s) in enumerate(zip(prompts, settings))]
    batcher = ContinuousBatcher(ctx, slots=3, capacity=CAPACITY, prefill_chunk_tokens=4)
    try:
        assert batcher.scheduler.prefill_chunk_tokens == 4
        requests = [batcher.submit(p, seed=i, settings=s) for i, (p, s) in enumerate(zip(prompts, settings))]
        requests[3].cancel()
        results = [r.result(timeout=120) for r in requests]
    finally:
        batcher.close()
    for request, result, want in zip(requests[:3], results, expected):
        assert (result.finish_reason, result.tokens) == (want.reason, want.tokens)
        assert list(request.emitted) == want.tokens
    assert results[3].finish_reason == "cancelled" and results[3].tokens == []
