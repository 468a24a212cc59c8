"""Admission by memory: what a decode state's rows need of the KV cache, against a byte budget.

The in_place cache lays its buffers out by size classes (cache/base.size_class) of the rows
they hold and of the longest row's cache (`cache.footprint(rows, length)` says how many bytes;
`cache.sized`), so what the rows take is a function of two numbers: the slots up to the highest
one used, and the cache rows the longest of them needs. A row needs its length plus the tokens
the next step writes (one, or one and its candidates where a step verifies some); a beam
search's rows reserve their whole limit when admitted, so that they never need more than was
granted (their rows are not preempted: see core/preempt.py).

    needs = Needs.of(state, lookahead=1)
    needs.top, needs.longest                           # slots [0, top) used; cache rows of the longest
    needs.with_row([4], 40).fits(state.cache, budget)  # with a row needing 40 cache rows in slot 4

The scheduler admits a waiting job while the rows' needs with it fit the budget (vLLM admits
by the blocks a request needs now, not by its whole length) and, before a step whose needs do
not fit, preempts the newest plain rows (generation/engine/scheduler.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

# A quarter of the machine's memory for the KV cache of one decoder, by default, as vLLM sets a KV
# space aside (what gpu_memory_utilization leaves of a GPU past the weights; VLLM_CPU_KVCACHE_SPACE
# on CPUs). Several replicas on one machine each take their own: give them less.
DEFAULT_SHARE = 0.25


def default_kv_cache_bytes(share: float = DEFAULT_SHARE) -> int:
    """`share` of the machine's physical memory, in bytes."""
    return int(share * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass
class Needs:
    """What the rows of a state need of its cache for the next step: the slots [0, top) and
    `longest` cache rows. Rows seated on top of them (`with_row`) add their slots and need."""

    top: int
    longest: int

    @classmethod
    def of(cls, state, lookahead: int = 1) -> "Needs":
        """The state's rows: plain rows their length plus `lookahead` (the tokens the next step
        writes: 1, or 1 + the most candidates a verifying step runs), beam rows their limit."""
        used = np.flatnonzero(state.used)
        if not used.size:
            return cls(0, 0)
        need = state.lengths[used] + lookahead
        for group in state.groups.values():  # few: one per beam search
            need[np.isin(used, group.slots)] = state.limit[group.slots[0]]
        return cls(int(used[-1]) + 1, int(need.max()))

    def with_row(self, slots, need: int) -> "Needs":
        return Needs(max(self.top, max(slots) + 1), max(self.longest, need))

    def bytes(self, cache) -> int:
        return cache.footprint(max(self.top, 1), max(self.longest, 1))

    def fits(self, cache, budget: int) -> bool:
        return self.bytes(cache) <= budget
