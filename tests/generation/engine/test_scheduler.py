"""The engine's one loop (generation/engine/scheduler.py).

Invariants: in one scheduler run that mixes greedy, sampling, prompt-lookup and beam search
jobs (two searches of different num_beams), in every cache mode, each job gets exactly what it
gets alone (`generate` / `beam_search`: tokens, scores, hypotheses), and the beam rows run in
the same model runs as the other rows; a beam job admitted into a running batch, or waiting at
the head for slots, changes no other job; a cancelled beam job frees all its slots.
"""

from __future__ import annotations

import pytest

import generation
from generation.assisted.prompt_lookup import PromptLookup
from generation.engine.scheduler import Scheduler

MODES = [("llama-genai", "in_place"), ("llama-optimum", "append"), ("llama-genai", "grow"), ("gpt2-grow", "grow")]

# (name, settings, prompt): the lookup prompt repeats itself, so its candidates are found
JOBS = [
    ("greedy", dict(), [5, 6, 7, 8, 9]),
    ("sampling", dict(do_sample=True, temperature=0.8, top_k=20), [30, 31]),
    ("lookup", dict(prompt_lookup_num_tokens=3), [40, 41, 42, 43, 40, 41, 42, 43, 40, 41]),
    ("beams2", dict(num_beams=2, max_new_tokens=10), [50, 51, 52]),
    ("beams4", dict(num_beams=4, length_penalty=0.5, num_return_sequences=2, max_new_tokens=12,
                    sequence_bias={(2,): 2.0}), [60, 61, 62, 63, 64, 65, 66]),
    ("penalties", dict(repetition_penalty=1.3, no_repeat_ngram_size=2, max_new_tokens=9), [70]),
]


@pytest.fixture(scope="module")
def models(test_models, load_model):
    return {f: load_model(test_models[f]) for f in {f for f, _ in MODES}}


def alone(model, mode, settings, prompt, seed):
    """What generate (or beam_search) gives the job by itself: tokens, or all hypotheses."""
    ctx = generation.context(model, cache_mode=mode, **{"max_new_tokens": 16, **settings})
    if settings.get("num_beams", 1) > 1:
        return generation.beam_search(ctx, [prompt], [seed])[0]
    return generation.generate(ctx, [prompt], seeds=[seed])[0]


class RunLog:
    """Records, for every model run of a state's cache, its beam slots and its plain live rows."""

    def __init__(self, scheduler: Scheduler):
        self.runs: list[tuple[frozenset, frozenset]] = []
        for verb in ("decode", "verify"):
            if hasattr(scheduler.state.cache, verb):
                self._wrap(scheduler, verb)

    def _wrap(self, scheduler, verb):
        cache = scheduler.state.cache
        run = getattr(cache, verb)

        def recorded(*args):
            state = scheduler.state
            beams = frozenset(s for g in state.groups.values() for s in g.slots.tolist())
            self.runs.append((beams, frozenset(state.live_rows.tolist())))
            return run(*args)

        setattr(cache, verb, recorded)


def run_all(scheduler: Scheduler):
    ended = []
    while scheduler.busy:
        ended += scheduler.step()[1]
    return ended


def test_admitted_rows_first_tokens_come_before_the_run(models):
    """step(admitted=...) hands over the admitted rows' first tokens before the step's model
    run and returns only the run's; every job's tokens are what it gets alone."""
    model = models["llama-genai"]
    ctx = generation.context(model, max_new_tokens=6, do_sample=False, eos_token_id=[])
    scheduler = Scheduler(ctx, 4, 64)
    runs, decode = [], scheduler.state.cache.decode
    scheduler.state.cache.decode = lambda *a: runs.append(1) or decode(*a)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    jobs = [scheduler.job(p) for p in prompts]
    for job in jobs:
        scheduler.add(job)
    tokens = {id(job): [] for job in jobs}
    seen = []

    def take(updates, into=None):
        for update in updates:
            for job, token, _, _ in update.tokens():
                tokens[id(job)].append(token)
                if into is not None:
                    into.append(token)

    while scheduler.busy:
        first: list = []
        updates, _ = scheduler.step(admitted=lambda u: seen.append(len(runs)) or take(u, first))
        if first:
            assert len(first) == 2 and seen == [0]  # both first tokens, before any run
            assert sum(1 for u in updates for _ in u.tokens()) == 2 and len(runs) == 1  # the run's
        take(updates)
    assert [tokens[id(j)] for j in jobs] == [alone(model, "in_place", dict(max_new_tokens=6, eos_token_id=[]), p, 0)
                                             for p in prompts]


@pytest.mark.parametrize("folder, mode", MODES, ids=[f"{f}-{m}" for f, m in MODES])
def test_a_mixed_run_gives_each_job_what_it_gets_alone(models, folder, mode):
    model = models[folder]
    ctx = generation.context(model, cache_mode=mode, max_new_tokens=16)
    slots = sum(s.get("num_beams", 1) for _, s, _ in JOBS)
    scheduler = Scheduler(ctx, slots=slots, capacity=64, lookup=PromptLookup(), stream=True)
    log = RunLog(scheduler)
    jobs = {name: scheduler.job(prompt, seed=i, settings=settings, key=name)
            for i, (name, settings, prompt) in enumerate(JOBS)}
    for job in jobs.values():
        scheduler.add(job)
    ended = run_all(scheduler)
    assert sorted(j.key for j in ended) == sorted(jobs)
    for i, (name, settings, prompt) in enumerate(JOBS):
        job, expected = jobs[name], alone(model, mode, settings, prompt, i)
        assert job.error is None, (name, job.error)
        if settings.get("num_beams", 1) > 1:
            assert [h.tokens for h in job.hypotheses] == [h.tokens for h in expected], name
            # (append: the padded buffer's width follows the batch, so the last float bits may move)
            assert [h.score for h in job.hypotheses] == pytest.approx([h.score for h in expected], rel=1e-5), name
            assert job.tokens == expected[0].tokens
        else:
            assert job.tokens == expected, name
    # the beam rows of both searches ran in the same model runs as plain rows
    both = [plain for beams, plain in log.runs if len(beams) == 6 and plain]
    assert both, log.runs
    assert not scheduler.state.groups and not scheduler.state.used.any()
    # one run per step for everyone: fewer runs than the jobs took alone, one after the other
    assert scheduler.steps < sum(len(j.tokens) for j in ended)


def test_beam_jobs_join_a_running_batch_and_wait_at_the_head(models):
    model = models["llama-genai"]
    ctx = generation.context(model, max_new_tokens=16)
    scheduler = Scheduler(ctx, slots=5, capacity=64)
    plain = [scheduler.job([7, 8, 9], seed=0, settings=dict(do_sample=True, max_new_tokens=20, eos_token_id=[])),
             scheduler.job([3, 4], seed=1, settings=dict(max_new_tokens=6, eos_token_id=[]))]
    for job in plain:
        scheduler.add(job)
    for _ in range(3):
        scheduler.step()
    wide = scheduler.job([11, 12, 13], seed=2, settings=dict(num_beams=4, max_new_tokens=5))
    late = scheduler.job([21, 22], seed=3, settings=dict(max_new_tokens=4))
    scheduler.add(wide)
    scheduler.add(late)
    scheduler.step()
    # 3 free slots < 4 beams: it waits at the head, and the job behind it waits too
    assert wide in scheduler.waiting and late in scheduler.waiting and not scheduler.groups
    while not scheduler.groups:  # the short job leaves at 6 tokens: the search starts beside the long one
        scheduler.step()
    assert plain[0] in scheduler.holder.values() and scheduler.occupied == 5
    run_all(scheduler)
    assert wide.hypotheses == alone(model, None, dict(num_beams=4, max_new_tokens=5), [11, 12, 13], 2)
    assert plain[0].tokens == alone(model, None, dict(do_sample=True, max_new_tokens=20, eos_token_id=[]), [7, 8, 9], 0)
    assert late.tokens == alone(model, None, dict(max_new_tokens=4), [21, 22], 3)


def test_a_cancelled_beam_job_frees_all_its_slots(models):
    ctx = generation.context(models["llama-genai"], max_new_tokens=30)
    scheduler = Scheduler(ctx, slots=4, capacity=64)
    job = scheduler.job([5, 6, 7], settings=dict(num_beams=3, eos_token_id=[]))
    scheduler.add(job)
    scheduler.step()
    assert scheduler.occupied == 3 and scheduler.state.used.sum() == 3
    scheduler.cancel(job)
    _, ended = scheduler.step()
    assert ended == [job] and job.reason == "cancelled"
    assert not scheduler.state.used.any() and not scheduler.state.groups and scheduler.occupied == 0


@pytest.mark.parametrize("fails_at", [0, 2], ids=["admission", "third-step"])
def test_a_failing_beam_job_ends_alone(models, monkeypatch, fails_at):
    """A beam search whose own scores raise (at its admission, or at a later step) ends with its
    error; another search and a plain job beside it get what they get alone."""
    from generation.search import beam

    model = models["llama-genai"]
    ctx = generation.context(model, max_new_tokens=8)
    scheduler = Scheduler(ctx, slots=6, capacity=64)
    real = beam._scores

    def scores(ctx, state, groups, logits):
        if any(g.prompt_length == 3 and g.cur - g.prompt_length >= fails_at for g in groups):
            raise RuntimeError("this search's own failure")
        return real(ctx, state, groups, logits)

    monkeypatch.setattr(beam, "_scores", scores)
    bad = scheduler.job([1, 2, 3], settings=dict(num_beams=2))
    other = scheduler.job([9, 8, 7, 6], seed=2, settings=dict(num_beams=3))
    good = scheduler.job([4, 5], seed=1)
    for job in (bad, other, good):
        scheduler.add(job)
    run_all(scheduler)
    assert bad.reason == "error" and "own failure" in str(bad.error) and bad.admitting == (fails_at == 0)
    assert other.hypotheses == alone(model, None, dict(num_beams=3, max_new_tokens=8), [9, 8, 7, 6], 2)
    assert good.tokens == alone(model, None, dict(max_new_tokens=8), [4, 5], 1)
    assert not scheduler.state.used.any() and not scheduler.state.groups
