"""The decoder's continuous batching loop (deployments/batching.py) over the real engine.

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
from deployments.batching import ContinuousBatcher, QueueFull


@pytest.fixture(scope="module")
def ctx(test_models, load_model):
    model = load_model(test_models["llama-genai"])
    return generation.context(model, max_new_tokens=16)


def prompts_of(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 1000, int(rng.integers(1, 20))).tolist() for _ in range(count)]


SETTINGS = [dict(), dict(do_sample=True, temperature=0.8, top_k=20), dict(repetition_penalty=1.3, max_new_tokens=9),
            dict(do_sample=True, top_p=0.9, no_repeat_ngram_size=2), dict(eos_token_id=[7, 8], max_new_tokens=30)]


def test_concurrent_requests_equal_each_request_alone(ctx):
    prompts = prompts_of(24)
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


def test_a_late_request_starts_before_the_running_ones_finish(ctx):
    batcher = ContinuousBatcher(ctx, slots=4, capacity=128)
    try:
        long = [batcher.submit(p, settings=dict(max_new_tokens=100, eos_token_id=[])) for p in prompts_of(2)]
        next(long[0].stream(timeout=30))  # running
        late = batcher.submit([5, 6, 7], settings=dict(max_new_tokens=3, eos_token_id=[]))
        assert late.result(timeout=30).finish_reason == "length"
        assert not long[0]._done.is_set() and not long[1]._done.is_set()  # they still run
        assert [len(r.result(timeout=60).tokens) for r in long] == [100, 100]
    finally:
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
