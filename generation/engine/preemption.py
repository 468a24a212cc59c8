"""Preemption and priority: a running row gives its slot up, kept, and resumes exactly.

A part of the Scheduler (engine/scheduler.py), mixed into it (core/preempt.py pauses and resumes
a row; its tokens are those of an uninterrupted run).
"""

from __future__ import annotations

from ..core.preempt import pause, resume
from .jobs import Job


class Preemption:
    """Rows preempted for memory or for a job of a lower priority value, and steps ended early for one.

    `interrupt_for(priority)`, from another thread: a job of that priority has arrived; where
    the step now running runs only rows of higher priority values (a batch's), its model run
    ends early (in_place caches: `BaseCache.run_options`) and the step is run again after the
    next boundary, which seats the job (preempting a row for it where it must): its first token
    comes a prompt's run after it arrives, not after the batch's step. The rows' tokens are
    those of the step uninterrupted; `interruptions` counts the runs ended."""

    def interrupt_for(self, priority: int) -> bool:
        """A job of `priority` arrived (another thread): end the running step's model run if
        every row it runs has a higher priority value (the class docstring). Whether it did.
        (Only plain steps are interruptible: beam groups and verification never are.)"""
        with self._interrupt_lock:
            options = self._interruptible
            if options is None:
                return False
            if any(job.priority <= priority for job in list(self.holder.values())):
                return False
            options.terminate = True
            return True

    def _preempt(self, slot: int) -> None:
        """The row in `slot` leaves it, kept (core.preempt.pause), and waits at its place in
        the queue: before every job of its priority that arrived after it. A prompt part-way
        through its chunks drops them (it runs again from its start when seated)."""
        if slot in self.filling:
            job = self.filling.pop(slot)
            job.partial = None
        else:
            job = self.holder.pop(slot)
            job.paused = pause(self.ctx, self.state, slot)
        job.preemptions += 1
        self.preemptions += 1
        self._enqueue(job)

    def _yield_to(self, job: Job, free: list[int]) -> bool:
        """Make room for the waiting `job`: preempt the running plain row that is last in the
        order of preemption among those of a higher priority value than its own, its slot into
        `free`. False where none is (or the model's rows are not preempted: encoder-decoders,
        vision-language models; beam searches are never preempted)."""
        model = self.ctx.model
        if model.is_seq2seq or model.graph.has_inputs_embeds:
            return False
        rows = {**self.holder, **self.filling}  # a prompt part-way through its chunks gives its slot up too
        later = [slot for slot, running in rows.items() if running.priority > job.priority]
        if not later:
            return False
        slot = max(later, key=lambda s: rows[s].rank)
        self._preempt(slot)
        free.append(slot)
        return True

    def _resume(self, slots: list[int], job: Job) -> None:
        """A preempted job back into `slots`, its cache recomputed (core.preempt.resume)."""
        try:
            self.state = resume(self.ctx, self.state, slots, [job.paused], [job.settings],
                                None if job.partial is None else [job.partial.rows()])
        except Exception as e:  # noqa: BLE001 - this job's own failure (its slot is free again)
            if not self.isolate:
                raise
            self._close(job, "error", e)
            return
        job.paused = None
        self.holder[slots[0]] = job
