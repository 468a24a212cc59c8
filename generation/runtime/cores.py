"""Which cores the engine computes on, and which the rest of a server keeps.

onnxruntime's intra-op threads meet at a barrier after every operator: when another process (the
HTTP stack, Ray's raylet and GCS, HAProxy, the replica's event loop) takes one thread's core for a
moment, every other thread waits for it. vLLM's CPU build keeps a core away from its compute
threads for its scheduler and API processes (`VLLM_CPU_OMP_THREADS_BIND=auto`). A `Placement`
says the same here: the engine process and its threads on `engine`, everything else on `service`.

Measured on 2 cores (bench/peers.py's model served at concurrency 32, docs/serving.md, "Cores"): one core
kept for the server (the engine on the other, one thread) served less than both cores shared,
so machines below RESERVE_FROM cores share them; from RESERVE_FROM on, one core is kept, as
vLLM keeps one (not measured here: no machine of this project has more than 2 cores).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

RESERVE_FROM = 4  # machines with at least this many cores keep one from the engine by default
CGROUP = "/sys/fs/cgroup"  # this process's cgroup, as a container sees it


@dataclass(frozen=True)
class Placement:
    """`engine`: the cores of the engine process (its onnxruntime threads and its loop);
    `service`: the cores of every other process of the server. Equal: shared, nothing pinned."""

    engine: tuple[int, ...]
    service: tuple[int, ...]

    @property
    def shared(self) -> bool:
        return self.engine == self.service

    def words(self, threads: int | None = None) -> str:
        """As a log line says it; `threads`: the engine's onnxruntime threads where given (else one a core)."""
        if self.shared:
            return f"the engine and the server share cores {span(self.engine)}"
        return (f"the engine on cores {span(self.engine)} ({threads or len(self.engine)} onnxruntime threads), "
                f"the HTTP stack and Ray on {span(self.service)}")


def allowed(cgroup: str | os.PathLike | None = None) -> tuple[int, ...]:
    """The cores this process may run on: its affinity, cut to its cgroup's CPU quota where one
    is set (a Kubernetes `limits.cpu` without a cpuset sees every core of its host: 64 spinning
    threads in a quota of 2 would spend it in a few milliseconds of each period)."""
    try:
        cores = tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        cores = tuple(range(os.cpu_count() or 1))
    quota = cpu_quota(cgroup)
    return cores if quota is None else cores[:max(1, int(quota))]


def cpu_quota(cgroup: str | os.PathLike | None = None) -> float | None:
    """The CPUs' worth of time the cgroup at `cgroup` may use per period (cgroup v2's cpu.max, or
    v1's cpu.cfs_quota_us over cpu.cfs_period_us, as Ray reads them; default: CGROUP); None: no quota."""
    root = Path(cgroup or CGROUP)
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota, period = ((root / "cpu" / name).read_text().strip() for name in ("cpu.cfs_quota_us",
                                                                                   "cpu.cfs_period_us"))
        except OSError:
            return None
    try:
        quota, period = float(quota), float(period)
    except ValueError:  # "max": none
        return None
    return quota / period if quota > 0 and period > 0 else None


def default_reserve(count: int) -> int:
    """Cores kept from the engine on a machine of `count` cores (the module's docstring: why)."""
    return 1 if count >= RESERVE_FROM else 0


def placement(reserve: int | None = None, engine=None, cores=None) -> Placement:
    """The placement on `cores` (default: this process's): `engine` the engine's cores as given
    (the server keeps the others; all of them: shared), else the first `reserve` cores kept for
    the server (None: default_reserve) and the engine on the rest. ValueError names the setting."""
    cores = tuple(sorted(set(cores if cores is not None else allowed())))
    if engine is not None:
        if reserve is not None:
            raise ValueError("engine_cores and reserve_cores: give one (engine_cores names the engine's cores, "
                             "the server keeps the rest)")
        engine = tuple(sorted(set(engine)))
        if not engine:
            raise ValueError("engine_cores: name at least one core")
        foreign = [c for c in engine if c not in cores]
        if foreign:
            raise ValueError(f"engine_cores: {span(foreign)} not among the cores this process may use ({span(cores)})")
        return Placement(engine, tuple(c for c in cores if c not in engine) or engine)
    reserve = default_reserve(len(cores)) if reserve is None else reserve
    if not 0 <= reserve < len(cores):
        raise ValueError(f"reserve_cores: {reserve} of this machine's {len(cores)} cores ({span(cores)}) leaves "
                         "the engine none; at most " + str(len(cores) - 1))
    if reserve == 0:
        return Placement(cores, cores)
    return Placement(cores[reserve:], cores[:reserve])


def pin(cores) -> None:
    """This process, every thread of it, onto `cores` (threads started later inherit it)."""
    cores = set(cores)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # pragma: no cover - not Linux
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cores)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def parse(text: str, setting: str = "engine_cores") -> tuple[int, ...]:
    """'1-3,6' -> (1, 2, 3, 6); ValueError naming `setting`."""
    out: set[int] = set()
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(f"{setting}: core numbers and ranges (e.g. 1-3,6), not {text!r}") from None
        if first < 0 or last < first:
            raise ValueError(f"{setting}: {part!r} is not a range of core numbers")
        out.update(range(first, last + 1))
    if not out:
        raise ValueError(f"{setting}: name at least one core (e.g. 1-3,6)")
    return tuple(sorted(out))


def span(cores) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    cores, parts = sorted(cores), []
    for c in cores:
        if parts and c == parts[-1][1] + 1:
            parts[-1][1] = c
        else:
            parts.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
