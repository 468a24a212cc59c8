"""Priorities in the scheduler (Job.priority, Scheduler.add / _yield_to): batch rows below
interactive ones.

Invariants: waiting jobs are seated by (priority, arrival); a job that waits for a slot (or for
the KV budget) takes it from the running plain row of a higher priority value that is last in
the order of preemption, at the very next step boundary; equal priorities never preempt each
other; a preempted row resumes exactly (its tokens and log-probabilities those of its run
alone); beam searches are not preempted.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.engine.scheduler import Scheduler
from generation.engine.batching import ContinuousBatcher
from generation.params.checks import SettingError

MODES = [("llama-genai", "in_place"), ("llama-optimum", "append"), ("gpt2-grow", "grow")]
CAPACITY = 96
LOGPROB_TOLERANCE = 1e-5  # a recomputed cache is a prompt run's, not the steps'


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {folder: load_model(test_models[folder]) for folder, _ in MODES}


def settings_of(count: int, seed: int) -> list[dict]:
    budgets = np.random.default_rng(seed).integers(12, 30, count)
    return [dict(max_new_tokens=int(n), eos_token_id=[]) for n in budgets]


def alone(ctx, prompts, seeds, settings):
    """Each job's result in a scheduler of its own."""
    results = []
    for prompt, seed, s in zip(prompts, seeds, settings):
        scheduler = Scheduler(ctx, 1, CAPACITY)
        job = scheduler.job(prompt, seed, dict(s))
        scheduler.add(job)
        while scheduler.busy:
            scheduler.step()
        results.append(job)
    return results


@pytest.mark.parametrize("folder, mode", MODES, ids=[m for _, m in MODES])
def test_interactive_jobs_take_batch_slots_at_the_next_step_and_every_job_is_exact(models, prompts_of, folder,
                                                                                    mode):
    ctx = generation.context(models[folder], cache_mode=mode, token_logprobs=True)
    prompts = prompts_of([5, 9, 3, 12, 7, 4], seed=3)
    settings = settings_of(6, seed=4)
    settings[1] = dict(settings[1], do_sample=True, temperature=0.9, top_k=20)  # a sampled batch row resumes too
    seeds = list(range(50, 56))
    expected = alone(ctx, prompts, seeds, settings)

    scheduler = Scheduler(ctx, 2, CAPACITY)
    batch = [scheduler.job(p, s, dict(st), priority=1) for p, s, st in zip(prompts[:4], seeds[:4], settings[:4])]
    for job in batch:
        scheduler.add(job)
    for _ in range(3):
        scheduler.step()
    assert sorted(job.order for job in scheduler.holder.values()) == [batch[0].order, batch[1].order]

    interactive = [scheduler.job(p, s, dict(st)) for p, s, st in zip(prompts[4:], seeds[4:], settings[4:])]
    for job in interactive:
        scheduler.add(job)
    scheduler.step()  # the next boundary seats both: the batch rows gave their slots up
    assert {id(job) for job in scheduler.holder.values()} == {id(job) for job in interactive}
    assert batch[0].preemptions == batch[1].preemptions == 1
    assert [id(job) for job in scheduler.waiting] == [id(job) for job in batch]  # they wait in arrival order

    ended_at = {}
    while scheduler.busy:
        _, ended = scheduler.step()
        for job in ended:
            ended_at[id(job)] = scheduler.steps
    assert max(ended_at[id(job)] for job in interactive) < min(ended_at[id(job)] for job in batch)
    for job, want in zip(batch + interactive, expected):
        assert (job.reason, job.tokens) == (want.reason, want.tokens)
        np.testing.assert_allclose(job.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)


def test_waiting_jobs_are_seated_by_priority_then_arrival(models, prompts_of):
    ctx = generation.context(models["llama-genai"], cache_mode="in_place")
    scheduler = Scheduler(ctx, 1, CAPACITY)
    prompts = prompts_of([4, 4, 4, 4], seed=1)
    jobs = [scheduler.job(p, 0, dict(max_new_tokens=3, eos_token_id=[]), priority=priority)
            for p, priority in zip(prompts, [0, 2, 1, 0])]
    admitted = []
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
        for job in scheduler.holder.values():
            if id(job) not in {id(j) for j in admitted}:
                admitted.append(job)
    assert [jobs.index(job) for job in admitted] == [0, 3, 2, 1]
    assert all(job.preemptions == 0 for job in jobs)  # a running job of a lower value is never preempted


def test_equal_priorities_wait_and_beams_are_not_preempted(models, prompts_of):
    ctx = generation.context(models["llama-genai"], cache_mode="in_place")
    scheduler = Scheduler(ctx, 2, CAPACITY)
    prompts = prompts_of([5, 6, 7], seed=2)
    beams = scheduler.job(prompts[0], 0, dict(num_beams=2, max_new_tokens=8, eos_token_id=[]), priority=1)
    same = scheduler.job(prompts[1], 0, dict(max_new_tokens=8, eos_token_id=[]), priority=1)
    scheduler.add(beams)
    scheduler.step()
    scheduler.add(same)
    scheduler.add(urgent := scheduler.job(prompts[2], 0, dict(max_new_tokens=4, eos_token_id=[])))
    scheduler.step()
    assert scheduler.groups and not scheduler.holder  # the beams kept both slots
    while scheduler.busy:
        scheduler.step()
    assert beams.preemptions == same.preemptions == 0 and urgent.done and same.done


def test_a_priority_is_checked_and_reaches_the_job_through_the_batcher(models, prompts_of):
    ctx = generation.context(models["llama-genai"], cache_mode="in_place")
    scheduler = Scheduler(ctx, 1, CAPACITY)
    with pytest.raises(SettingError, match="priority"):
        scheduler.job(prompts_of([3], seed=0)[0], 0, {}, priority=-1)
    batcher = ContinuousBatcher(ctx, slots=1, capacity=CAPACITY)
    told, interrupt_for = [], batcher.scheduler.interrupt_for
    batcher.scheduler.interrupt_for = lambda priority: told.append(priority) or interrupt_for(priority)
    try:
        request = batcher.submit(prompts_of([3], seed=0)[0], settings=dict(max_new_tokens=2), priority=3)
        assert request.job.priority == 3 and told == [3]  # a step under way would hear of it
        assert len(request.result(timeout=60).tokens) == 2
    finally:
        batcher.close()


def test_an_interactive_arrival_ends_a_step_of_batch_rows_early_and_every_row_stays_exact(models, prompts_of,
                                                                                          monkeypatch):
    """Scheduler.interrupt_for, as the server's submit calls it from another thread while a step
    runs: the step's model run (in_place) ends early, the next boundary seats the job in a batch
    row's slot, and every row's tokens and log-probabilities are those of its run alone."""
    import generation.engine.scheduler as scheduling

    ctx = generation.context(models["llama-genai"], cache_mode="in_place", token_logprobs=True)
    prompts = prompts_of([5, 9, 3, 7], seed=8)
    settings = settings_of(4, seed=9)
    settings[2] = dict(settings[2], do_sample=True, temperature=0.8, top_k=30)
    seeds = [70, 71, 72, 73]
    expected = alone(ctx, prompts, seeds, settings)
    scheduler = Scheduler(ctx, 3, CAPACITY)
    assert scheduler.state.cache.run_options is not None
    batch = [scheduler.job(p, s, dict(st), priority=1) for p, s, st in zip(prompts[:3], seeds[:3], settings[:3])]
    for job in batch:
        scheduler.add(job)
    scheduler.step()
    scheduler.step()
    assert not scheduler.interrupt_for(0)  # between steps there is no run to end

    interactive = scheduler.job(prompts[3], seeds[3], dict(settings[3]))
    real_step, arrivals = scheduling.step, []

    def step_during_which_it_arrives(ctx, state):
        if not arrivals:  # the job arrives while the batch rows' run is under way
            scheduler.add(interactive)
            arrivals.append(scheduler.interrupt_for(1))  # a batch line's arrival ends nothing
            arrivals.append(scheduler.interrupt_for(0))
        return real_step(ctx, state)

    monkeypatch.setattr(scheduling, "step", step_during_which_it_arrives)
    steps, tokens_before = scheduler.steps, [list(job.tokens) for job in batch]
    updates, ended = scheduler.step()
    assert arrivals == [False, True] and scheduler.interruptions == 1
    assert scheduler.steps == steps and not ended and not updates  # the run ended early: nothing of it kept
    assert [list(job.tokens) for job in batch] == tokens_before
    scheduler.step()  # the next boundary seats it, in the slot of the batch row last in preemption's order
    assert interactive in scheduler.holder.values() and batch[2].preemptions == 1
    assert not scheduler.interrupt_for(0)  # an interactive row runs now: no run ends for an equal priority
    while scheduler.busy:
        scheduler.step()
    assert scheduler.interruptions == 1
    for job, want in zip(batch + [interactive], expected):
        assert (job.reason, job.tokens) == (want.reason, want.tokens)
        np.testing.assert_allclose(job.logprobs, want.logprobs, rtol=0, atol=LOGPROB_TOLERANCE)


def test_the_server_s_submits_reach_a_running_step():
    """ContinuousBatcher.submit tells the scheduler each arrival's priority; the engine process's
    child reads the parent's from a queue on a thread of its own (its loop reads commands between
    steps only)."""
    import multiprocessing
    import threading

    from generation.engine.process import _interrupts

    class Recorded:
        def __init__(self):
            self.priorities, self.seen = [], threading.Event()

        def interrupt_for(self, priority):
            self.priorities.append(priority)
            if len(self.priorities) == 2:
                self.seen.set()
            return False

    scheduler = Recorded()
    urgent = multiprocessing.get_context("spawn").SimpleQueue()
    thread = threading.Thread(target=_interrupts, args=(urgent, scheduler), daemon=True)
    thread.start()
    urgent.put(1)
    urgent.put(0)
    assert scheduler.seen.wait(10) and scheduler.priorities == [1, 0]
