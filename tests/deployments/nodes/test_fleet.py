"""The fleet simulation's pieces (bench/fleet.py runs them at size): the fake engine's modelled
step cost and the open-loop arrival schedule."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import fleet  # noqa: E402  (bench/fleet.py)

from deployments.fake import FakeBatcher  # noqa: E402
from generation.front import EngineOptions  # noqa: E402


@pytest.mark.parametrize("rows", [1, 4])
def test_a_fake_step_costs_a_plus_b_per_row(rows):
    batcher = FakeBatcher(EngineOptions(slots=4, max_waiting=64), step_seconds=0.01, step_seconds_per_row=0.01)
    try:
        t0 = time.perf_counter()
        requests = [batcher.submit([97 + i] * 3, settings={"max_new_tokens": 10}) for i in range(rows)]
        completions = [r.result(timeout=30) for r in requests]
        elapsed = time.perf_counter() - t0
    finally:
        batcher.close()
    assert all(len(c.tokens) == 10 for c in completions)
    modelled = 10 * (0.01 + 0.01 * rows)
    assert modelled * 0.9 < elapsed < modelled * 1.6 + 0.05, (rows, elapsed, modelled)


def test_the_burst_schedule_is_poisson_at_its_rates_and_seeded():
    schedule = fleet.burst_schedule(2.0, 100, 50, 100, factor=10, seed=1)
    assert schedule == fleet.burst_schedule(2.0, 100, 50, 100, factor=10, seed=1)
    times = [t for t, _ in schedule]
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 250
    counts = {p: sum(1 for _, q in schedule if q == p) for p in ("before", "burst", "after")}
    assert 150 < counts["before"] < 250 and 150 < counts["after"] < 250  # 200 expected
    assert 850 < counts["burst"] < 1150  # 1000 expected: 10x the rate for half the time
    assert all(100 <= t < 150 for t, p in schedule if p == "burst")
