"""One request can never hurt another: a failure while admitting or stepping one row ends that
request alone (generation/engine/batching.py over generation/core/state.py and assisted.py).

Invariants: the request whose own processors, settings or admission raise ends with
finish_reason "error" (status 400 when a ValueError was raised while admitting it, 500
otherwise) and the tokens it had; every other request in the same batch gets exactly the tokens
`generation.generate` gives it alone; a request submitted afterwards works; a failed admission
leaves the decode state as it was (its slots free, the running rows unchanged), in every cache
mode; a failure of the model's run ends every row of that step and the loop goes on; whatever
breaks, every request gets its Completion.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import generation
from generation.engine.batching import ContinuousBatcher
from generation.core import insert as engine_state  # where an admission builds its rows
from generation.core.state import row_tokens

MARK = 999  # a prompt that starts with this token is the one that fails
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [17, 18]]
SETTINGS = [dict(), dict(do_sample=True, temperature=0.8, top_k=20), dict(repetition_penalty=1.3),
            dict(do_sample=True, top_p=0.9, no_repeat_ngram_size=2)]


class Boom(RuntimeError):
    pass


def failing(where: str, error=Boom, after: int = 3, gate: threading.Event | None = None):
    """A (state, process) pair that raises for the marked row: in `state` (so at admission) or in
    `process` once the row has made `after` tokens. Every other row's scores are unchanged.
    With `gate`, the state of prompt [4] waits for it (to hold the loop while others queue)."""
    def state(row):
        if gate is not None and row["prompt"] == [4]:
            gate.wait(10)
        marked = bool(row["prompt"]) and row["prompt"][0] == MARK
        if where == "state" and marked:
            raise error("the marked row's state")
        return np.array([len(row["generated"]), marked])

    def process(scores, states):
        if where == "process" and ((states[:, 1] == 1) & (states[:, 0] >= after)).any():
            raise error("the marked row's process")
        return scores
    return state, process


@pytest.fixture(scope="module", params=["llama-genai", "llama-optimum", "gpt2-grow"])
def model(request, test_models, load_model):
    return load_model(test_models[request.param])


def alone(model, processors, prompt, seed, settings):
    ctx = generation.context(model, max_new_tokens=12, processors=processors, **settings)
    return generation.generate(ctx, [prompt], seeds=[seed])[0]


def run_batch(model, processors, marked_prompt, gate=None):
    """The marked request and PROMPTS submitted to one batcher (held at a gate so they are
    admitted together); returns the marked one and the others."""
    ctx = generation.context(model, max_new_tokens=12, processors=processors)
    batcher = ContinuousBatcher(ctx, slots=6, capacity=64)
    try:
        holder = batcher.submit([4], settings=dict(max_new_tokens=2)) if gate is not None else None
        marked = batcher.submit(marked_prompt, seed=7, settings=dict(do_sample=True, eos_token_id=[]))
        others = [batcher.submit(p, seed=i, settings=s) for i, (p, s) in enumerate(zip(PROMPTS, SETTINGS))]
        if gate is not None:
            gate.set()
            assert holder.result(timeout=60).finish_reason in ("stop", "length")
        results = marked.result(timeout=60), [r.result(timeout=60) for r in others]
        late = batcher.submit([20, 21, 22], seed=3)
        assert late.result(timeout=60).tokens == alone(model, processors, [20, 21, 22], 3, {})
        assert batcher.occupied == 0 or _settles(batcher)
        return results
    finally:
        batcher.close()


def _settles(batcher) -> bool:
    import time

    for _ in range(100):
        if batcher.occupied == 0:
            return True
        time.sleep(0.01)
    return False


def check_others(model, processors, others):
    for i, done in enumerate(others):
        assert done.finish_reason in ("stop", "length") and done.status is None, (i, done)
        assert done.tokens == alone(model, processors, PROMPTS[i], i, SETTINGS[i]), i


def test_a_processor_failing_at_admission_ends_that_request_alone(model):
    gate = threading.Event()
    processors = [failing("state", gate=gate)]
    marked, others = run_batch(model, processors, [MARK, 5, 6], gate)
    assert (marked.finish_reason, marked.status, marked.field, marked.tokens) == ("error", 500, None, [])
    assert "Boom: the marked row's state" in marked.error
    check_others(model, processors, others)


def test_a_value_error_at_admission_is_the_requests_fault(model):
    processors = [failing("state", error=ValueError)]
    marked, others = run_batch(model, processors, [MARK, 5, 6])
    assert (marked.finish_reason, marked.status) == ("error", 400)
    assert marked.error == "the marked row's state"  # the request's own words, no type or internals
    check_others(model, processors, others)


def test_a_processor_failing_at_a_later_step_ends_that_request_alone(model):
    processors = [failing("process", after=3)]
    marked, others = run_batch(model, processors, [MARK, 5, 6])
    assert (marked.finish_reason, marked.status) == ("error", 500)
    assert "Boom: the marked row's process" in marked.error
    assert len(marked.tokens) == 3  # the tokens it had made before
    check_others(model, processors, others)


def test_an_admission_that_raises_outside_the_selection_is_retried_one_by_one(model, monkeypatch):
    """A batched admission that raises (here: building the rows' settings) is retried request by
    request: the request that fails alone ends, the others are admitted (their cache rows and
    slots as if the failed attempt never happened)."""
    real = engine_state.row_settings_of

    def row_settings(ctx, prompts, settings, limit, encoder_ids):
        if any(p and p[0] == MARK for p in prompts):
            raise ValueError("prompt: the marked one")
        return real(ctx, prompts, settings, limit, encoder_ids)

    monkeypatch.setattr(engine_state, "row_settings_of", row_settings)
    gate = threading.Event()
    processors = [failing("none", gate=gate)]
    marked, others = run_batch(model, processors, [MARK, 5, 6], gate)
    assert (marked.finish_reason, marked.status) == ("error", 400)
    check_others(model, processors, others)


@pytest.mark.parametrize("where", ["first_tokens_of", "_occupy"])
def test_a_failed_admission_leaves_the_state_as_it_was(model, monkeypatch, where):
    """admit is all or nothing: after one that raises (choosing the first tokens, after the
    in_place cache took the prompts; or seating the second row, after the first was seated),
    its slots are free and the running rows go on with the tokens they get without it, in
    every cache mode."""
    ctx = generation.context(model, max_new_tokens=10, eos_token_id=[])
    running = [[5, 6, 7], [8, 9]]
    real = getattr(engine_state, where)

    def broken(*args, **kwargs):
        if where == "_occupy" and args[1] == 2:  # _occupy(state, slot, prefix, j): the first is seated
            return real(*args, **kwargs)
        raise Boom("late")

    def run(interrupt: bool):
        state = generation.new_state(ctx, 4, 64)
        state, _ = generation.admit(ctx, state, [0, 1], running, [0, 1])
        state, _ = generation.step(ctx, state)
        if interrupt:
            with monkeypatch.context() as m:
                m.setattr(engine_state, where, broken)
                with pytest.raises(Boom):
                    generation.admit(ctx, state, [2, 3], [[10, 11, 12, 13], [14]], [2, 3])
            assert state.used.tolist() == [True, True, False, False]
            assert state.live_rows.tolist() == [0, 1]
        for _ in range(5):
            state, _ = generation.step(ctx, state)
        state, _ = generation.admit(ctx, state, [2, 3], [[10, 11, 12, 13], [14]], [2, 3])
        for _ in range(6):
            state, _ = generation.step(ctx, state)
        return [row_tokens(state, s) for s in range(4)]

    assert run(interrupt=True) == run(interrupt=False)


def test_step_reports_the_failed_row_and_generate_raises_it(model):
    processors = [failing("process", after=2)]
    ctx = generation.context(model, max_new_tokens=12, processors=processors, eos_token_id=[])
    state = generation.new_state(ctx, 3, 64)
    state, first = generation.admit(ctx, state, [0, 1, 2], [[5, 6], [MARK, 6], [7, 8, 9]], [0, 1, 2])
    assert not first.failed
    failed_at = None
    for step in range(6):
        state, out = generation.step(ctx, state)
        if out.failed:
            failed_at = step
            assert list(out.failed) == [1] and isinstance(out.failed[1], Boom)
            assert out.finished[1] and out.token[1] == -1 and not state.live[1]
            assert state.live[[0, 2]].all() and (out.token[[0, 2]] >= 0).all()
    assert failed_at == 1  # its third token (the first came at admission)
    with pytest.raises(Boom, match="the marked row's process"):
        generation.generate(ctx, [[5, 6], [MARK, 6]], seeds=[0, 1])


def test_prompt_lookup_rows_fail_alone_in_a_verify_step(test_models, load_model, monkeypatch):
    """The failure of a row verified with candidates (assisted.verify: the processors at every
    position) ends it alone; the other rows get their plain tokens."""
    from generation.assisted import budget

    for plan in ("plan_rows", "plan_shared"):  # verify every candidate
        monkeypatch.setattr(budget, plan, lambda gain, counts, slots, a, b, most=None: counts)
    model = load_model(test_models["llama-genai"])
    processors = [failing("process", after=3)]
    ctx = generation.context(model, max_new_tokens=12, processors=processors)
    looping = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        marked = batcher.submit([MARK] + looping, settings=dict(prompt_lookup_num_tokens=4, eos_token_id=[]))
        others = [batcher.submit(p, seed=i, settings={**s, "prompt_lookup_num_tokens": 3})
                  for i, (p, s) in enumerate(zip([looping, looping[1:], [8, 9]], SETTINGS))]
        done = marked.result(timeout=60)
        assert (done.finish_reason, done.status) == ("error", 500), done
        for i, request in enumerate(others):
            assert request.result(timeout=60).tokens == alone(model, processors, [looping, looping[1:], [8, 9]][i],
                                                              i, SETTINGS[i])
    finally:
        batcher.close()


def test_a_failed_model_run_ends_that_steps_rows_and_the_loop_goes_on(test_models, load_model, monkeypatch):
    model = load_model(test_models["llama-genai"])
    ctx = generation.context(model, max_new_tokens=30, eos_token_id=[])
    from generation.engine import scheduler

    real, calls = generation.step, []

    def step(ctx, state):
        calls.append(1)
        if len(calls) == 3:
            raise Boom("the run")
        return real(ctx, state)

    monkeypatch.setattr(scheduler, "step", step)  # the scheduler's model run
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        running = [batcher.submit(p, seed=i) for i, p in enumerate(PROMPTS[:2])]
        for request in running:
            done = request.result(timeout=60)
            assert (done.finish_reason, done.status) == ("error", 500) and "Boom: the run" in done.error
        late = batcher.submit([20, 21, 22], seed=3)
        assert late.result(timeout=60).tokens == generation.generate(ctx, [[20, 21, 22]], seeds=[3])[0]
    finally:
        batcher.close()


class Fatal(BaseException):
    pass


def test_every_request_gets_an_answer_even_when_the_loop_dies(test_models, load_model, monkeypatch):
    from generation.engine import scheduler

    model = load_model(test_models["llama-genai"])
    ctx = generation.context(model, max_new_tokens=200, eos_token_id=[])
    batcher = ContinuousBatcher(ctx, slots=1, capacity=256)
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the dying thread's traceback
    try:
        running = batcher.submit([5, 6, 7])
        next(running.stream(timeout=30))
        waiting = batcher.submit([8, 9])
        monkeypatch.setattr(scheduler, "step", lambda ctx, state: (_ for _ in ()).throw(Fatal()))
        for request in (running, waiting):
            done = request.result(timeout=30)
            assert (done.finish_reason, done.status) == ("error", 500), done
        with pytest.raises(RuntimeError, match="closed"):
            batcher.submit([5])
    finally:
        batcher.close()


def test_settings_errors_at_submit_name_their_setting(test_models, load_model):
    from generation.params.checks import SettingError

    model = load_model(test_models["llama-genai"])
    batcher = ContinuousBatcher(generation.context(model, max_new_tokens=4), slots=2, capacity=32)
    try:
        for kwargs, setting in ((dict(settings=dict(top_k=2**64)), "top_k"), (dict(settings=dict(num_beams=3)), "num_beams"),
                                (dict(prompt=list(range(3, 40))), "prompt"), (dict(prompt=[]), "prompt"),
                                (dict(seed=-1), "seed"),
                                (dict(settings=dict(prompt_lookup_num_tokens=2, num_beams=2)), "prompt_lookup_num_tokens")):
            with pytest.raises(SettingError) as info:
                batcher.submit(kwargs.pop("prompt", [5, 6]), **kwargs)
            assert info.value.setting == setting
        assert batcher.submit([5, 6]).result(timeout=30).status is None
    finally:
        batcher.close()
