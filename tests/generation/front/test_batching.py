"""The decoder's continuous batching loop (generation/engine/batching.py) over the real engine.

Invariants: every request completes exactly once with the tokens `generate` gives it alone
(greedy or seeded sampling, whatever else runs); a request submitted mid-generation starts
before the running ones finish; a cancelled request frees its slot; bad settings fail at
submit, naming the field; a full queue raises QueueFull.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import generation
from generation.engine.batching import ContinuousBatcher, QueueFull


@pytest.fixture(scope="module")
def ctx(test_models, load_model):
    model = load_model(test_models["llama-genai"])
    return generation.context(model, max_new_tokens=16)


SETTINGS = [dict(), dict(do_sample=True, temperature=0.8, top_k=20), dict(repetition_penalty=1.3, max_new_tokens=9),
            dict(do_sample=True, top_p=0.9, no_repeat_ngram_size=2), dict(eos_token_id=[7, 8], max_new_tokens=30)]


def test_concurrent_requests_equal_each_request_alone(ctx, prompts_of):
    prompts = prompts_of(24, seed=0)
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        requests = []
        threads = [threading.Thread(target=lambda i=i: requests.append(
            (i, batcher.submit(prompts[i], seed=i, settings=SETTINGS[i % len(SETTINGS)])))) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, request in sorted(requests):
            done = request.result(timeout=60)
            alone = generation.generate(generation.context(ctx.model, **{**dict(max_new_tokens=16), **SETTINGS[i % 5]}),
                                        [prompts[i]], seeds=[i])[0]
            assert done.tokens == alone, i
            assert list(request.stream(timeout=1)) == alone  # streamed the same tokens, then ended
            assert done.finish_reason in ("stop", "length")
    finally:
        batcher.close()


def test_a_burst_past_the_kv_budget_is_seated_by_memory_and_each_request_is_exact(ctx, prompts_of):
    """32 slots under a budget that holds 4 rows of the whole capacity: a burst of 24 requests
    (greedy and seeded sampling, prompt lookup among them) is seated as far as what the rows hold
    fits, rows that outgrow it are preempted and resumed, and each request gets the tokens
    `generate` gives it alone."""
    from generation.engine.scheduler import Scheduler

    budget = Scheduler(ctx, 32, 128).state.cache.footprint(4, 128)
    batcher = ContinuousBatcher(ctx, slots=32, capacity=128, kv_cache_bytes=budget)
    settings = [dict(s, max_new_tokens=40 + 7 * (i % 8), eos_token_id=[]) for i, s in
                enumerate(SETTINGS * 5)][:24]
    settings[5]["prompt_lookup_num_tokens"] = 3
    prompts = prompts_of(list(range(6, 30)), seed=4)
    most, step = {"rows": 0, "bytes": 0}, batcher.scheduler.step

    def step_and_count(*args, **kwargs):  # on the batcher's thread, after each step
        out = step(*args, **kwargs)
        most["rows"] = max(most["rows"], batcher.scheduler.occupied)
        most["bytes"] = max(most["bytes"], batcher.scheduler.state.cache.nbytes)
        return out

    batcher.scheduler.step = step_and_count
    try:
        requests = [batcher.submit(p, seed=i, settings=s) for i, (p, s) in enumerate(zip(prompts, settings))]
        for i, request in enumerate(requests):
            alone = generation.generate(generation.context(ctx.model, **settings[i]), [prompts[i]], seeds=[i])[0]
            assert request.result(timeout=60).tokens == alone, i
        assert most["rows"] > 4 and most["bytes"] <= budget and batcher.preemptions > 0, (most, batcher.preemptions)
    finally:
        batcher.close()


def test_a_late_request_starts_before_the_running_ones_finish(ctx, prompts_of):
    batcher = ContinuousBatcher(ctx, slots=4, capacity=128)
    try:
        long = [batcher.submit(p, settings=dict(max_new_tokens=100, eos_token_id=[])) for p in prompts_of(2, seed=0)]
        next(long[0].stream(timeout=30))  # running
        late = batcher.submit([5, 6, 7], settings=dict(max_new_tokens=3, eos_token_id=[]))
        assert late.result(timeout=30).finish_reason == "length"
        assert not long[0]._done.is_set() and not long[1]._done.is_set()  # they still run
        assert [len(r.result(timeout=60).tokens) for r in long] == [100, 100]
    finally:
        batcher.close()


def test_a_first_token_streams_before_the_steps_model_run(ctx):
    """The prefill's token of an admitted request goes out at once, not after the step's run
    that makes its second token (held here until the first token has arrived)."""
    batcher = ContinuousBatcher(ctx, slots=2, capacity=64)
    held, run = threading.Event(), batcher.scheduler._run

    def after_release(updates):
        held.wait(30)
        return run(updates)
    batcher.scheduler._run = after_release
    try:
        request = batcher.submit([5, 6, 7], settings=dict(max_new_tokens=3, eos_token_id=[]))
        first = next(request.events(timeout=10))
        assert not held.is_set() and batcher.steps == 0  # no model run yet
        held.set()
        done = request.result(timeout=30)
        assert done.tokens[0] == first.id and len(done.tokens) == 3
        assert done.tokens == generation.generate(generation.context(ctx.model, max_new_tokens=3, eos_token_id=[]),
                                                  [[5, 6, 7]], seeds=[0])[0]
    finally:
        held.set()
        batcher.close()


def test_cancel_frees_the_slot(ctx):
    batcher = ContinuousBatcher(ctx, slots=1, capacity=256)
    try:
        first = batcher.submit([5, 6], settings=dict(max_new_tokens=200, eos_token_id=[]))
        waiting = batcher.submit([9, 10], settings=dict(max_new_tokens=4, eos_token_id=[]))
        next(first.stream(timeout=30))
        first.cancel()
        assert first.result(timeout=30).finish_reason == "cancelled"
        assert len(waiting.result(timeout=30).tokens) == 4  # it got the one slot
    finally:
        batcher.close()


def test_bad_requests_fail_at_submit_and_the_queue_is_bounded(ctx):
    batcher = ContinuousBatcher(ctx, slots=1, capacity=32, max_waiting=2)
    try:
        with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
            batcher.submit([5], settings=dict(top_p=2.0))
        with pytest.raises(ValueError, match=r"prompts\[0\]\[0\] = 5000 is not a token id"):
            batcher.submit([5000])
        with pytest.raises(ValueError, match="a slot holds 32"):
            batcher.submit(list(range(3, 40)))
        with pytest.raises(QueueFull):
            for _ in range(50):
                batcher.submit([5, 6], settings=dict(max_new_tokens=30, eos_token_id=[]))
    finally:
        batcher.close()


def test_batch_rows_wait_in_a_queue_of_their_own_that_max_waiting_does_not_bound(ctx):
    """Requests of a later priority (a batch's lines, priority 1) never count against max_waiting
    nor are refused by it: beside any number of them, interactive requests (priority 0) are taken
    up to max_waiting waiting, and refused beyond."""
    batcher = ContinuousBatcher(ctx, slots=1, capacity=64, max_waiting=2)
    long = dict(max_new_tokens=40, eos_token_id=[])
    try:
        lines = [batcher.submit([5, 6], settings=long, priority=1) for _ in range(8)]  # 7 waiting, past the bound
        interactive = [batcher.submit([7, 8], settings=long) for _ in range(2)]
        with pytest.raises(QueueFull):
            for _ in range(10):  # one of them may have taken the slot meanwhile: a third waits then
                interactive.append(batcher.submit([7, 8], settings=long))
        assert 2 <= len(interactive) <= 3
        for request in lines + interactive:
            request.cancel()
        assert all(r.result(timeout=30).finish_reason in ("cancelled", "length") for r in lines + interactive)
    finally:
        batcher.close()


def test_events_carry_the_engines_log_probabilities(test_models, load_model, prompts_of):
    model = load_model(test_models["llama-genai"])
    ctx = generation.context(model, max_new_tokens=8, top_logprobs=3)
    batcher = ContinuousBatcher(ctx, slots=2, capacity=64)
    try:
        prompts = prompts_of(3, seed=4)
        requests = [batcher.submit(p, seed=i, settings=dict(do_sample=True)) for i, p in enumerate(prompts)]
        for i, request in enumerate(requests):
            events = list(request.events(timeout=30))
            alone = generation.generate(generation.context(model, max_new_tokens=8, top_logprobs=3, do_sample=True),
                                        [prompts[i]], seeds=[i])[0]
            assert [e.id for e in events] == alone.tokens
            np.testing.assert_allclose([e.logprob for e in events], alone.logprobs, rtol=1e-5, atol=1e-6)
            assert all(len(e.top) == 3 and e.top[0][1] >= e.top[-1][1] for e in events)
    finally:
        batcher.close()


@pytest.mark.parametrize("logprobs_of", ["processed", "raw"])
def test_rows_that_take_no_log_probabilities_compute_none_beside_rows_that_do(test_models, load_model, prompts_of,
                                                                              logprobs_of, monkeypatch):
    """A server's context computes log-probabilities, but a request without `logprobs` reads none:
    its row's steps skip them (they cost a vocabulary pass a row), its tokens are unchanged, and the
    rows that ask get each their own, equal to theirs alone."""
    import generation.core.rows as state_module  # where a step reads log-probabilities
    import generation.logits.selection as selection

    rows_seen, rows_computed, plain = [0], [0], selection.logprobs

    def counted(scores, tokens, top=0, rows=None):
        rows_seen[0] += len(scores)
        rows_computed[0] += len(scores) if rows is None else int(rows.sum())
        return plain(scores, tokens, top, rows)

    monkeypatch.setattr(selection, "logprobs", counted)
    monkeypatch.setattr(state_module, "logprobs", counted)
    model = load_model(test_models["llama-genai"])
    common = dict(max_new_tokens=8, top_logprobs=3, logprobs_of=logprobs_of)
    ctx = generation.context(model, **common)
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        prompts = prompts_of(6, seed=7)
        rows = [dict(settings=SETTINGS[i % 2], logprobs=i % 3 == 0) for i in range(6)]
        requests = [batcher.submit(p, seed=i, settings=r["settings"], logprobs=r["logprobs"])
                    for i, (p, r) in enumerate(zip(prompts, rows))]
        for i, (request, row) in enumerate(zip(requests, rows)):
            events = list(request.events(timeout=30))
            alone = generation.generate(generation.context(model, **common, **row["settings"]), [prompts[i]],
                                        seeds=[i])[0]
            assert [e.id for e in events] == alone.tokens, i
            if row["logprobs"]:
                np.testing.assert_allclose([e.logprob for e in events], alone.logprobs, rtol=1e-5, atol=1e-6)
                assert all(len(e.top) == 3 for e in events)
            else:
                assert all(e.logprob is None and e.top is None for e in events), i
        assert 0 < rows_computed[0] < rows_seen[0]
    finally:
        batcher.close()


def test_a_beam_request_holds_num_beams_slots_and_equals_beam_search_alone(ctx, prompts_of):
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        prompts = prompts_of(5, seed=7)
        beams = batcher.submit(prompts[0], settings=dict(num_beams=3, max_new_tokens=10))
        others = [batcher.submit(p, seed=i, settings=SETTINGS[i]) for i, p in enumerate(prompts[1:])]
        expected = generation.beam_search(generation.context(ctx.model, max_new_tokens=10, num_beams=3),
                                          [prompts[0]], [0])[0][0]
        assert beams.result(timeout=60).tokens == expected.tokens
        assert list(beams.stream(timeout=1)) == expected.tokens
        for i, request in enumerate(others):
            alone = generation.generate(generation.context(ctx.model, **{"max_new_tokens": 16, **SETTINGS[i]}),
                                        [prompts[i + 1]], seeds=[i])[0]
            assert request.result(timeout=60).tokens == alone
        with pytest.raises(ValueError, match="num_beams: 5 beams need as many slots; this decoder has 4"):
            batcher.submit(prompts[0], settings=dict(num_beams=5))
    finally:
        batcher.close()


def test_beams_wait_for_free_slots_and_count_as_occupied(ctx, prompts_of):
    batcher = ContinuousBatcher(ctx, slots=4, capacity=256)
    try:
        long = [batcher.submit(p, settings=dict(max_new_tokens=150, eos_token_id=[])) for p in prompts_of(2, seed=1)]
        next(long[0].stream(timeout=30))
        beams = batcher.submit([5, 6, 7], settings=dict(num_beams=3, max_new_tokens=4))
        assert len(beams.result(timeout=60).tokens) <= 4
        assert beams.result().first_token_seconds is not None
        # 2 free slots < 3 beams: it started only once a long request had left its slot
        assert beams._first >= min(r.result(timeout=60) and r.finished for r in long)
    finally:
        batcher.close()


def test_encoder_decoder_requests_join_the_running_batch(test_models, load_model, prompts_of):
    """Marian rows admitted at different steps (different decoder lengths, different source
    lengths) each equal text_to_text alone; beams too."""
    from model_builders.text import ensure_test_models
    from generation.runtime.encoders import encode_text
    from generation.families.seq2seq import decoder_start

    s2s = ensure_test_models(seq2seq=True)
    model = load_model(s2s["marian-optimum"])
    ctx = generation.context(model, max_new_tokens=12)
    sources = prompts_of(6, seed=3)
    batcher = ContinuousBatcher(ctx, slots=3, capacity=64)
    try:
        start = [decoder_start(ctx)]
        settings = [dict(), dict(do_sample=True, top_k=5), dict(num_beams=2), dict(repetition_penalty=1.5),
                    dict(no_repeat_ngram_size=2), dict(do_sample=True, temperature=0.7)]
        requests = []
        for i, source in enumerate(sources):
            requests.append(batcher.submit(start, seed=i, settings=settings[i], encoder=encode_text(model, [source])))
            if i == 1:
                next(requests[0].stream(timeout=30))  # later ones join a running batch
        for i, request in enumerate(requests):
            alone_ctx = generation.context(model, **{"max_new_tokens": 12, **settings[i]})
            alone = generation.generate(alone_ctx, [start], seeds=[i], encoder=encode_text(model, [sources[i]]))[0]
            assert request.result(timeout=60).tokens == alone, i
        with pytest.raises(ValueError, match="needs its encoder outputs"):
            batcher.submit(start)
    finally:
        batcher.close()


def test_prompt_lookup_requests_equal_plain_decoding_in_fewer_steps(monkeypatch):
    """On the default model (trained text: it continues these prompts by copying their earlier
    text), rows with prompt_lookup_num_tokens get several tokens in a step, stream them in
    order, and equal plain greedy decoding; a row without it beside them is unchanged. (Every
    candidate is verified here: which ones pay for their run is test_budget's matter.)"""
    from generation.assisted import budget
    from generation.default_model import default_model_path
    from test_assisted import GREEDY, grounded

    for plan in ("plan_rows", "plan_shared"):
        monkeypatch.setattr(budget, plan, lambda gain, counts, slots, a, b, most=None: counts)

    model = generation.load(default_model_path(), threads=1)
    ctx = generation.context(model, max_new_tokens=30, **GREEDY)
    prompts = grounded(model)
    plain = generation.generate(ctx, prompts, seeds=[0] * 4)
    batcher = ContinuousBatcher(ctx, slots=4, capacity=512)
    try:
        requests = [batcher.submit(p, settings=dict(prompt_lookup_num_tokens=4) if i < 3 else None)
                    for i, p in enumerate(prompts)]
        assert [r.result(timeout=120).tokens for r in requests] == plain
        assert [list(r.stream(timeout=1)) for r in requests] == plain
        before = batcher.steps
        alone = [batcher.submit(p, settings=dict(prompt_lookup_num_tokens=4)) for p in prompts[:3]]
        assert [r.result(timeout=120).tokens for r in alone] == plain[:3]
        assert batcher.steps - before < max(len(t) for t in plain[:3]) - 1  # candidates were kept
        with pytest.raises(ValueError, match="prompt_lookup_num_tokens: prompt lookup runs decoder-only text models"):
            batcher.submit(prompts[0], settings=dict(prompt_lookup_num_tokens=4, num_beams=2))
    finally:
        batcher.close()


def test_a_draft_model_assists_every_request(test_models, load_model, prompts_of):
    """A context with a draft (`raymuter serve --draft`): every step verifies the draft's
    proposals. With a draft of the model's own weights (another export) every candidate is
    kept, so greedy rows finish in fewer steps; greedy, seeded sampling (the context computes
    log-probabilities, so sampling rows keep the plain tokens) and beam requests all equal
    what each gives alone without a draft."""
    model = load_model(test_models["llama-genai"])
    common = dict(max_new_tokens=16, token_logprobs=True)
    ctx = generation.context(model, num_assistant_tokens=4, draft=load_model(test_models["llama-optimum"]), **common)
    prompts = prompts_of(6, seed=3)
    settings = [dict(), dict(do_sample=True, temperature=0.8, top_k=20), dict(repetition_penalty=1.3)] * 2
    alone = [generation.generate(generation.context(model, **common, **s), [p], seeds=[i])[0].tokens
             for i, (p, s) in enumerate(zip(prompts, settings))]
    batcher = ContinuousBatcher(ctx, slots=4, capacity=64)
    try:
        requests = [batcher.submit(p, seed=i, settings=s) for i, (p, s) in enumerate(zip(prompts, settings))]
        assert [r.result(timeout=120).tokens for r in requests] == alone
        assert [list(r.stream(timeout=1)) for r in requests] == alone
        before = batcher.steps
        greedy = batcher.submit(prompts[0])
        assert greedy.result(timeout=120).tokens == alone[0]
        assert batcher.steps - before <= len(alone[0]) // 2  # 4 candidates a step, all kept
        beams = batcher.submit(prompts[1], settings=dict(num_beams=2))
        plain_ctx = generation.context(model, **common)
        expected = generation.beam_search(plain_ctx, [prompts[1]], [0], [plain_ctx.with_settings(num_beams=2)])
        assert beams.result(timeout=120).tokens == expected[0][0].tokens
    finally:
        batcher.close()


def test_a_draft_needs_a_decoder_only_text_model(s2s, test_models, vision_paths, load_model):
    with pytest.raises(ValueError, match="draft: assisted decoding with a draft runs decoder-only models"):
        generation.context(load_model(s2s["marian-optimum"]), draft=load_model(test_models["llama-genai"]))
    vision = load_model(vision_paths["qwen2vl-onnx"])
    with pytest.raises(ValueError, match="draft: assisted decoding with a draft runs text models; this one reads images"):
        generation.context(vision, draft=vision)
