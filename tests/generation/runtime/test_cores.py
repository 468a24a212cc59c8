"""Where the engine computes and where the rest of a server runs (generation/runtime/cores.py)."""

from __future__ import annotations

import os
import threading

import pytest

from generation.runtime import cores
from generation.runtime.cores import Placement, parse, placement, span


def test_small_machines_share_every_core_larger_ones_keep_one():
    assert placement(cores=[0]) == Placement((0,), (0,))
    assert placement(cores=[0, 1]).shared  # measured: keeping one of 2 cores serves less (docs/serving.md, Cores)
    assert placement(cores=[0, 1, 2]).shared
    assert placement(cores=[0, 1, 2, 3]) == Placement((1, 2, 3), (0,))
    assert placement(cores=range(16)) == Placement(tuple(range(1, 16)), (0,))
    assert placement(cores=[4, 5, 6, 7, 12]) == Placement((5, 6, 7, 12), (4,))  # a container's cpuset


def test_the_operator_overrides_it():
    assert placement(0, cores=range(8)).shared
    assert placement(3, cores=range(8)) == Placement((3, 4, 5, 6, 7), (0, 1, 2))
    assert placement(1, cores=[0, 1]) == Placement((1,), (0,))
    assert placement(engine=[2, 3], cores=range(4)) == Placement((2, 3), (0, 1))
    assert placement(engine=[0, 1], cores=[0, 1]).shared  # every core named: nothing kept
    # named cores outside this process's own are refused, naming the setting
    with pytest.raises(ValueError, match=r"engine_cores: 5-6 not among the cores this process may use \(0-3\)"):
        placement(engine=[5, 6], cores=range(4))
    with pytest.raises(ValueError, match=r"reserve_cores: 2 of this machine's 2 cores \(0-1\) leaves the engine none"):
        placement(2, cores=[0, 1])
    with pytest.raises(ValueError, match="engine_cores and reserve_cores: give one"):
        placement(1, [1], cores=[0, 1])


def test_core_lists_read_and_written():
    assert parse("1-3,6") == (1, 2, 3, 6) and parse(" 0 ") == (0,) and parse("3,1-2,2") == (1, 2, 3)
    for bad in ("", "a", "3-1", "-1", "1-x"):
        with pytest.raises(ValueError, match="--engine-cores: "):
            parse(bad, "--engine-cores")
    assert span([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and span([3]) == "3"
    assert "share cores 0-1" in placement(cores=[0, 1]).words()
    assert placement(cores=range(4)).words() == ("the engine on cores 1-3 (3 onnxruntime threads), "
                                                 "the HTTP stack and Ray on 0")
    assert "(2 onnxruntime threads)" in placement(cores=range(4)).words(threads=2)  # --threads says


def _masks() -> dict[int, str]:
    """Each live thread's affinity (a thread that ends between the listing and its read is left
    out, as cores.pin leaves it: the full suite's Ray and onnxruntime threads come and go)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                out[int(tid)] = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
        except FileNotFoundError:
            continue
    return out


def test_pin_moves_every_thread_of_the_process():
    before = tuple(sorted(os.sched_getaffinity(0)))  # the affinity itself (allowed() may cut it to a quota)
    started, stop = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: (started.set(), stop.wait()))
    thread.start()
    started.wait()
    try:
        cores.pin([before[-1]])
        masks = _masks()
        assert thread.native_id in masks and set(masks.values()) == {str(before[-1])}
        later = []
        t = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert later == [{before[-1]}]  # threads started afterwards inherit it
    finally:
        cores.pin(before)
        stop.set()
        thread.join()
    assert cores.allowed() == before and set(_masks().values()) == {span(before)}


def test_a_cgroup_cpu_quota_cuts_the_cores_and_the_default_threads(tmp_path, monkeypatch):
    """A container limited by quota (Kubernetes limits.cpu, no cpuset) sees every core of its host
    in its affinity: the engine takes as many cores as the quota holds (floor, at least 1)."""
    from generation.runtime.model import default_threads

    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    (v1 / "cpu").mkdir(parents=True)
    assert cores.cpu_quota(tmp_path / "none") is None
    for text, quota in [("max 100000", None), ("200000 100000", 2.0), ("150000 100000\n", 1.5), ("50000 100000", 0.5)]:
        (v2 / "cpu.max").write_text(text)
        assert cores.cpu_quota(v2) == quota
    for value, quota in [("-1", None), ("300000", 3.0)]:
        (v1 / "cpu" / "cpu.cfs_quota_us").write_text(value + "\n")
        (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
        assert cores.cpu_quota(v1) == quota
    affinity = tuple(sorted(os.sched_getaffinity(0)))
    (v2 / "cpu.max").write_text("150000 100000")
    assert cores.allowed(v2) == affinity[:1]
    (v2 / "cpu.max").write_text("max 100000")
    assert cores.allowed(v2) == affinity
    monkeypatch.setattr(cores, "CGROUP", str(v2))
    (v2 / "cpu.max").write_text("50000 100000")
    assert default_threads() == 1 and cores.placement() == Placement(affinity[:1], affinity[:1])
    (v2 / "cpu.max").write_text("max 100000")
    assert default_threads() == len(affinity)


def test_a_cgroup_memory_limit_cuts_the_default_kv_budget(tmp_path):
    """A container limited in memory (Kubernetes limits.memory) sees its host's memory in sysconf:
    the default KV budget is a quarter of the limit where that is lower (cgroup v2 and v1)."""
    import os

    from generation.engine.budget import default_kv_cache_bytes, memory_limit

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    v2, v1 = tmp_path / "v2", tmp_path / "v1"
    v2.mkdir()
    (v1 / "memory").mkdir(parents=True)
    assert memory_limit(tmp_path / "none") is None and default_kv_cache_bytes(cgroup=tmp_path / "none") == physical // 4
    (v2 / "memory.max").write_text("max\n")
    assert memory_limit(v2) is None and default_kv_cache_bytes(cgroup=v2) == physical // 4
    (v2 / "memory.max").write_text(f"{2 * 2**30}\n")
    assert memory_limit(v2) == 2 * 2**30 and default_kv_cache_bytes(cgroup=v2) == 2**29
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert memory_limit(v1) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{4 * 2**30}\n")
    assert default_kv_cache_bytes(cgroup=v1) == min(physical, 4 * 2**30) // 4
