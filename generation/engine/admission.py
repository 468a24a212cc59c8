"""Admission at a step boundary: the waiting jobs that fit are seated, in the order of the queue.

A part of the Scheduler (engine/scheduler.py), mixed into it: its methods work on the scheduler's
state, slots and queue. A batched admission that raises is redone one job at a time, so only a
job whose own data fails ends (`Job.admitting`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..core.insert import admit, admit_beams
from ..core.state import StepTokens
from ..logits.constraints import DeadEnd
from ..params.checks import SettingError
from .jobs import Job, Update, joined

# A boundary with no row stepping (an idle loop meeting a burst) runs this many times the prompt
# budget: a burst of 32 prompts of 32 tokens ran in 8 boundaries of 4 and took 1.15x as long as
# one batched prefill (in process, a ContinuousBatcher of 32 slots against generate on SmolLM2-135M
# fp32, 2 cores: 0.83-0.87x, 0.96-0.99x at this factor); arrivals meanwhile wait at most this
# longer boundary.
IDLE_PREFILL_FACTOR = 8


@dataclass
class Seating:
    """What one boundary seats: (slots, job) of plain rows, beam searches and resumed rows, and
    the chunks it runs (slot, job, tokens); `starting`: a prompt seated now runs in chunks."""

    plain: list = field(default_factory=list)
    beams: list = field(default_factory=list)
    resumed: list = field(default_factory=list)
    chunks: list = field(default_factory=list)
    starting: bool = False


class Admission:
    """Seating waiting jobs: plain rows in one batched prefill, beam searches in num_beams slots
    each, prompt-only jobs in one pass, preempted rows resumed; a job that does not fit waits at
    the head of the queue (so smaller ones behind it do not starve it)."""

    idle_prefill_factor = IDLE_PREFILL_FACTOR

    def _admit(self, updates: list[Update]) -> None:
        """Seat the waiting jobs that fit, in arrival order; prompt-only jobs (max_new 0) take no
        slot: they run together at once. With a prefill budget, the prompts part-way through run
        their chunks first, and a waiting job's prompt runs whole, in chunks or not yet as what
        is left of the budget says (the class docstring)."""
        passes = [job for job in self.waiting if job.max_new == 0 and not job.cancelled]
        if passes:
            taken = {id(job) for job in passes}
            self.waiting = deque(job for job in self.waiting if id(job) not in taken)
        seating = self._choose()
        plain, beams, resumed, chunks, starting = (seating.plain, seating.beams, seating.resumed, seating.chunks,
                                                   seating.starting)
        if not plain and not beams and not passes and not resumed and not chunks:
            return
        if self.state.cache.sized and (plain or beams or resumed or starting):  # before prompts run into the buffers
            seated = [*plain, *beams, *resumed]
            self._lay_out(self._needs(seated), self._limits(seated))
        now = time.perf_counter()
        self._admitting = [job for _, job in plain + beams + resumed] + passes
        for job in self._admitting:
            if job.started is None:  # a resumed job keeps its first admission's
                job.started = now
        if passes:  # their log-probabilities if asked, their KV rows into the prefix store
            for job in self._prompt_passes(passes, self.state.prefix):
                job.tokens, job.logprobs = [], [] if self.ctx.token_logprobs else None
                self._close(job, "length")
        wanting = {id(job) for job in self._prompt_passes([job for _, job in plain if job.prompt_top is not None])}
        plain = [(slots, job) for slots, job in plain if job.prompt_top is None or id(job) in wanting]
        if plain:
            self._admit_plain([slots[0] for slots, _ in plain], [job for _, job in plain], updates)
        for slots, job in beams:
            self._admit_beams(slots, job)
        for slots, job in resumed:
            self._resume(slots, job)
        self._fill(chunks, updates)
        self._admitting = []
        self._trim_prefix()

    def _choose(self) -> Seating:
        """The waiting jobs this boundary seats, in the order of the queue, and the chunks it runs
        (the prompts part-way through first where they come before a job in that order)."""
        free = [s for s in self.state.free_slots().tolist() if s not in self.filling]
        plain, beams, resumed = [], [], []
        left = self.prefill_chunk_tokens or None  # prompt tokens this boundary may still run (None: no budget)
        if left is not None and not self.holder and not self.groups and not self.filling:
            left *= self.idle_prefill_factor  # no row steps: no pace to keep (ChunkedPrefill's docstring)
        chunks = []  # (slot, job, tokens it runs now)
        ahead = sorted(self.filling.items(), key=lambda item: item[1].rank, reverse=True)  # part-way; the first last
        starting = False  # a prompt seated this boundary runs in chunks
        while self.waiting:
            job = self.waiting[0]
            while ahead and ahead[-1][1].rank < job.rank:  # the prompts part-way through before it go first
                left = self._give(ahead.pop(), left, chunks)
            if job.cancelled:
                self.waiting.popleft()
                self._close(job, "cancelled")
                continue
            if job.beams > self.slots:  # would wait forever
                self.waiting.popleft()
                self._close(job, "error", SettingError("num_beams", f"num_beams: {job.beams} beams need as many "
                                                                    f"slots; this scheduler has {self.slots}"), True)
                continue
            if job.beams > len(free):
                if self._yield_to(job, free):
                    continue
                break  # later arrivals wait behind it
            taken = free[:job.beams]
            if self.budget is not None and not self._needs([*plain, *beams, *resumed, (taken, job)]).fits(
                    self.state.cache, self.budget):
                if self._yield_to(job, free):
                    continue
                if self.holder or self.groups or self.filling or plain or beams or resumed:
                    break  # it waits for rows to end (or to be preempted: never for a waiting job)
                self.waiting.popleft()  # alone, it never fits
                self._close(job, "error", SettingError("kv_cache_bytes", f"kv_cache_bytes: {self.budget} bytes do not "
                                                                         f"hold the {job.beams} rows of this request"),
                            True)
                continue
            if left is not None:
                cost = job.paused.length if job.paused is not None else len(job.prompt)
                if cost > left and self._chunked(job):
                    if not left:
                        break  # the boundary's prompt budget is spent: it waits for the next
                    self.waiting.popleft()
                    free = free[1:]
                    self.filling[taken[0]] = job  # its slot held, its row not live until its prompt has run
                    if job.started is None:
                        job.started = time.perf_counter()
                    chunks.append((taken[0], job, left))
                    left, starting = 0, True
                    continue
                if cost > left and left < self.prefill_chunk_tokens:
                    break  # a prompt that runs whole only, longer than what is left: a boundary of its own
                left = max(0, left - cost)
            self.waiting.popleft()
            free = free[job.beams:]
            (resumed if job.paused is not None else plain if job.beams == 1 else beams).append((taken, job))
        while ahead:
            left = self._give(ahead.pop(), left, chunks)
        return Seating(plain, beams, resumed, chunks, starting)

    def _prompt_passes(self, jobs: list[Job], store=None) -> list[Job]:
        """The prompt log-probabilities of the jobs that asked (echo with logprobs, or a
        prompt-only job), one batched pass over their prompts (prompt_logprobs.prompt_passes),
        their KV rows into `store` when given; when it raises, one pass per job, so only a job
        that fails alone fails. Returns the jobs that did not fail (the others have ended)."""
        if not jobs:
            return []
        from ..logits.prompt_logprobs import prompt_passes

        groups = [jobs]
        done = []
        while groups:
            group = groups.pop()
            try:
                found = prompt_passes(self.ctx, [j.prompt for j in group], [j.prompt_top for j in group], store)
            except Exception as e:  # noqa: BLE001 - someone's prompt, or the run: find out one by one
                if not self.isolate:
                    raise
                if len(group) == 1:
                    self._close(group[0], "error", e, admitting=True)
                else:
                    groups += [[job] for job in group]
                continue
            for job, logprobs in zip(group, found):
                job.prompt_logprobs = logprobs
                done.append(id(job))
        return [job for job in jobs if id(job) in done]

    def _admit_plain(self, slots: list[int], jobs: list[Job], updates: list[Update], run=None) -> None:
        """One batched admission, or, when it raises, one per job, so only a job that fails alone
        fails. `run(slots, jobs)`: the admission, returning the first tokens (default: the prompts
        run whole; `_seat_batch`: prompts that ran in chunks)."""
        run = run or self._admit_batch
        try:
            seated = [(slots, jobs, run(slots, jobs))]
        except Exception as e:  # noqa: BLE001 - someone's data, or the run: find out one by one
            if not self.isolate:
                raise
            seated = []
            if len(jobs) == 1:
                self._close(jobs[0], "error", e, admitting=True)
            else:
                for slot, job in zip(slots, jobs):
                    try:
                        seated.append(([slot], [job], run([slot], [job])))
                    except Exception as alone:  # noqa: BLE001 - this job's own failure
                        self._close(job, "error", alone, admitting=True)
        token_logprobs = self.ctx.token_logprobs
        for group_slots, group_jobs, first in seated:
            if self.stream:
                updates.append(Update(group_jobs, first))
            for j, (slot, job) in enumerate(zip(group_slots, group_jobs)):
                job.cached_tokens = int(self.state.cached[slot])
                if isinstance(first.failed.get(j), DeadEnd):  # its constraint left no first token
                    job.tokens, job.note = [], str(first.failed[j])
                    job.logprobs, job.top = ([], None if first.top is None else []) if token_logprobs else (None, None)
                    self._close(job, "stop")
                elif j in first.failed:
                    self._close(job, "error", first.failed[j], admitting=True)
                elif first.finished[j]:  # ended at its first token: the slot stayed free
                    job.tokens = [int(first.token[j])] if first.token[j] >= 0 else []
                    if token_logprobs:
                        job.logprobs = [float(first.logprob[j])] if job.tokens else []
                        job.top = None if first.top is None else (
                            [list(zip(first.top_ids[j].tolist(), first.top[j].tolist()))] if job.tokens else [])
                    self._close(job, self._reason(job))
                else:
                    self.holder[slot] = job

    def _admit_batch(self, slots: list[int], jobs: list[Job]) -> StepTokens:
        self.state, first = admit(self.ctx, self.state, slots, [j.prompt for j in jobs], [j.seed for j in jobs],
                                  settings=[j.settings for j in jobs], max_new=[j.max_new for j in jobs],
                                  encoder=joined([j.encoder for j in jobs], self.ctx.model.hooks.join))
        return first

    def _admit_beams(self, slots: list[int], job: Job) -> None:
        try:
            self.state, stopped = admit_beams(self.ctx, self.state, slots, job.prompt, job.seed, job.settings,
                                              job.max_new, job.encoder)
        except Exception as e:  # noqa: BLE001 - this job's own failure (the engine freed its slots)
            self._close(job, "error", e, admitting=True)
            return
        job.cached_tokens = int(self.state.cached[slots[0]])
        if stopped is not None:
            self._end_beams(job, stopped.hypotheses())
        else:
            self.groups[slots[0]] = job
