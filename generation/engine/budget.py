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
not fit, preempts the newest plain rows: `KVBudget` below, a part of the Scheduler (engine/scheduler.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..params import limits

# A quarter of the machine's memory for the KV cache of one decoder, by default, as vLLM sets a KV
# space aside (what gpu_memory_utilization leaves of a GPU past the weights; VLLM_CPU_KVCACHE_SPACE
# on CPUs). Several replicas on one machine each take their own: give them less. In a container
# the machine is what its cgroup's memory limit leaves (a pod's limits.memory), as the cores are
# what its CPU quota leaves (runtime/cores.py).
DEFAULT_SHARE = 0.25


def default_kv_cache_bytes(share: float = DEFAULT_SHARE, cgroup: str | os.PathLike | None = None) -> int:
    """`share` of the machine's physical memory, or of the cgroup's memory limit where lower, in
    bytes."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = memory_limit(cgroup)
    return int(share * (physical if limit is None else min(physical, limit)))


def memory_limit(cgroup: str | os.PathLike | None = None) -> int | None:
    """The bytes the cgroup at `cgroup` may use (cgroup v2's memory.max, or v1's
    memory/memory.limit_in_bytes; default: this process's, runtime.cores.CGROUP); None: no limit."""
    from pathlib import Path

    from ..runtime.cores import CGROUP

    root = Path(cgroup or CGROUP)
    for path in (root / "memory.max", root / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 1 << 60 else None  # "max", v1's page-rounded 2^63
    return None


AUTO_SLOTS = 256  # the most rows `slots=0` seats (vLLM's max_num_seqs default)
FIXED_SLOTS = 32  # `slots=0` where every row may grow to the capacity: at least these (the old default)


def resolved_slots(ctx, slots: int, capacity: int, budget_bytes: int | None) -> int:
    """`slots`, or for 0 what the KV budget seats. Where admission goes by memory (the in_place
    cache sized by classes, a budget that holds a row of the capacity) a row costs what it holds,
    so the budget decides how many run: AUTO_SLOTS, as vLLM's max_num_seqs with its KV blocks.
    Elsewhere (append, grow, seq2seq, vision, CUDA graphs' whole layout, or no budget) each row
    may grow to the capacity: the rows the budget holds so, at least FIXED_SLOTS, at most
    AUTO_SLOTS. The engine process's parent and child resolve it alike (same model, options and
    machine)."""
    if slots:
        return slots
    from ..cache.base import token_bytes

    model = ctx.model
    budget = default_kv_cache_bytes() if budget_bytes is None else budget_bytes
    row = token_bytes(model.graph) * capacity
    by_memory = (ctx.cache_mode == "in_place" and not model.is_seq2seq and not model.graph.has_inputs_embeds
                 and not model.cuda_graphs)
    if by_memory and budget >= row:
        return AUTO_SLOTS
    return max(FIXED_SLOTS, min(AUTO_SLOTS, budget // row if budget else 0))


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


class KVBudget:
    """The scheduler's rows within a KV cache budget (a part of the Scheduler, engine/scheduler.py).

    `kv_cache_bytes`: admission by memory. The in_place cache's buffers take bytes by the
    classes of the rows they hold (engine/budget.py); a waiting job is seated while the
    rows' needs with it fit the budget, and before a step whose needs do not fit, the newest
    plain rows are preempted (core/preempt.py: their tokens and random state kept, their cache
    recomputed when they are seated again, their tokens those of an uninterrupted run). Beam
    searches reserve their whole limit when seated and are not preempted. The prefix store
    (`prefix_cache_bytes`) counts in the same budget: it keeps at most what the rows' buffers
    leave of it, its least recently used prefixes giving way to rows (never the reverse). None
    (or 0): rows are admitted by slots, each growing to the capacity. Only the in_place mode's
    buffers shrink with the rows they hold (`cache.sized`): the append, grow and seq2seq modes
    and vision-language models admit by slots whatever the budget (`budget` is then None)."""

    def _lookahead(self, jobs) -> int:
        """The cache rows past its length that a row's next step may write: 1, or 1 and the most
        candidates a verifying step runs (every row runs as wide as the widest). A draft model's
        heuristic schedule may ask for more than limits.MAX_LOOKUP_TOKENS: the buffers then grow
        past the budget for that step, and the next boundary preempts."""
        if self.state.groups or any(job.beams > 1 for job in jobs):
            return 1  # beam searches step plainly, and every row with them
        if self.assistant is not None:
            return 1 + limits.MAX_LOOKUP_TOKENS
        if self.lookup is not None:
            return 1 + max((job.settings.prompt_lookup_num_tokens or 0 for job in jobs), default=0)
        return 1

    def _needs(self, seated) -> Needs:
        """What the running rows and the rows `seated` (slots, job) need of the cache: a plain
        row its length and the lookahead, a resumed one its paused length and the lookahead, a
        beam search its limit in each of its slots."""
        seated = [*(([slot], job) for slot, job in self.filling.items()), *seated]  # prompts part-way: seated
        lookahead = self._lookahead([*self.holder.values(), *(job for _, job in seated)])
        needs = Needs.of(self.state, lookahead)
        for slots, job in seated:
            if job.paused is not None:
                need = job.paused.length + lookahead
            elif job.beams > 1:
                need = min(len(job.prompt) + job.max_new, self.capacity)
            else:
                need = len(job.prompt) + lookahead
            needs = needs.with_row(slots, need)
        return needs

    def _make_room(self) -> None:
        """Before a step: while the rows' needs do not fit the budget, preempt the newest plain
        row (vLLM preempts the last arrived); then the buffers are laid out for the needs."""
        state, cache = self.state, self.state.cache
        longest = int(state.lengths.max()) + self._lookahead(self.holder.values())
        if longest <= cache.length and cache.footprint(cache.held, cache.length) <= self.budget:
            return  # most steps: the layout holds the rows' next tokens (and the beams' limits, since seated)
        needs = self._needs([])
        while not needs.fits(self.state.cache, self.budget) and (self.holder or self.filling):
            rows = {**self.holder, **self.filling}
            self._preempt(max(rows, key=lambda slot: rows[slot].rank))
            needs = self._needs([])
        self._lay_out(needs, self._limits([]))
        self._trim_prefix()

    def _trim_prefix(self) -> None:
        """The prefix store within what the rows' buffers leave of the budget."""
        if self.budget is not None and self.state.prefix is not None:
            self.state.prefix.shrink(self.budget - self.state.cache.nbytes)

    def _limits(self, seated) -> int:
        """The most cache rows a running row, or one of `seated` (slots, job), may come to hold:
        its limit (prompt and new tokens)."""
        state = self.state
        longest = int(state.limit[state.used].max(initial=0))
        for job in [*self.filling.values(), *(job for _, job in seated)]:
            limit = job.paused.limit if job.paused is not None else len(job.prompt) + job.max_new
            longest = max(longest, min(limit, self.capacity))
        return longest

    def _lay_out(self, needs: Needs, limits: int) -> None:
        """The buffers for `needs`, the first of these layouts that fits the budget (any, with
        none): the rows' whole limits (`limits`), so that no layout comes mid-run; the rows and
        length they have, grown to the needs (no churn as rows come and go); the needs alone
        (smaller: rows left). A row that would grow them inside a step or a prompt run finds
        them laid out already."""
        if not needs.top:
            return
        cache = self.state.cache
        top = max(needs.top, cache.held)
        for layout in (Needs(top, max(limits, needs.longest, cache.length)),
                       Needs(top, max(needs.longest, cache.length)), needs):
            if self.budget is None or layout.fits(cache, self.budget):
                break
        cache.fit(layout.top, layout.longest)

    def _reach(self) -> int:
        """The plain steps the buffers hold as laid out for this one (`_make_room`): until the
        longest row reaches their length."""
        return max(1, self.state.cache.length - int(self.state.lengths.max()))
