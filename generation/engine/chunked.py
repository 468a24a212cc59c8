"""Chunked prefill: a long prompt runs a chunk per step boundary instead of all at once.

A part of the Scheduler (engine/scheduler.py), mixed into it (core/chunks.py runs the chunks).
"""

from __future__ import annotations

from ..cache.prefix import PrefixStore
from ..core.chunks import begin, extend, seat
from ..core.insert import hold_place
from ..core.state import StepTokens
from .jobs import Job, Update


class ChunkedPrefill:
    """Prompts that run in chunks, a boundary's prompt budget at a time.

    `prefill_chunk_tokens`: the prompt tokens a step boundary may run (vLLM's chunked prefill;
    0: none, every seated prompt runs whole at once). Prompts that are part-way through take
    theirs first, in the order of the queue, then waiting jobs in order: a prompt that fits what
    is left runs whole (batched, as without a budget); a longer one is seated into its slot and
    runs what is left now and a chunk at each later boundary (core/chunks.py), its row not live
    until its last chunk, whose logits choose its first token (its tokens those of the prompt
    run whole); once nothing is left, the next waiting jobs wait. So the running rows step at
    every boundary, each boundary's prompt work bounded, whatever arrives; a boundary with no
    row stepping (nothing part-way either) runs up to IDLE_PREFILL_FACTOR times the budget, as
    there is no pace to keep (a burst arriving at an idle loop runs batched). A preempted row
    resuming runs its tokens the same way. Rows whose prompt does not run in chunks are seated
    whole, in a boundary whose budget is untouched when they are longer than it: beam
    searches, prompt log-probabilities (`prompt_logprobs`), encoder-decoders and
    vision-language models (prompt-only jobs run as without a budget). A prompt part-way
    through holds its slot and its share of the KV budget (its whole prompt); it may be
    cancelled, and is preempted (its chunks dropped) as a running row of its place would be."""

    def _chunked(self, job: Job) -> bool:
        """Whether the job's prompt may run in chunks: a plain row of a decoder-only text model
        (or a preempted one resuming) whose prompt log-probabilities nobody asked for."""
        model = self.ctx.model
        return (job.beams == 1 and job.prompt_top is None and not model.is_seq2seq
                and not model.graph.has_inputs_embeds)

    def _give(self, filling: tuple[int, Job], left: int, chunks: list) -> int:
        """A chunk of what is `left` of the boundary's prompt budget to a prompt part-way through
        (`filling`: its slot and job; one preempted meanwhile gets none), into `chunks`; what is
        left then."""
        slot, job = filling
        if left and self.filling.get(slot) is job:
            chunks.append((slot, job, min(left, job.partial.left)))
            left -= chunks[-1][2]
        return left

    def _fill(self, chunks: list, updates: list[Update]) -> None:
        """Run this boundary's chunks (slot, job, tokens to run), each prompt from where it
        stopped (core/chunks.py: a new one from its start in the prefix store); the rows whose
        prompts have run are seated at once (so the prompts after them find them in the prefix
        store), their first tokens into `updates` as an admission's. A chunk that raises ends its
        job alone (its slot is free again)."""
        store = self.state.prefix if isinstance(self.state.prefix, PrefixStore) else None
        for slot, job, count in chunks:
            if self.filling.get(slot) is not job:  # preempted after its chunk was given (for a lower priority value)
                continue
            try:
                if job.partial is None:  # a resumed row's tokens are nobody's prompt: not looked up
                    tokens = job.prompt if job.paused is None else job.paused.tokens[:job.paused.length].tolist()
                    job.partial = begin(self.ctx, tokens, store if job.paused is None else None,
                                        hold_place(self.ctx, self.state, slot, job.settings))
                job.partial = extend(self.ctx, job.partial, min(count, job.partial.left))
            except Exception as e:  # noqa: BLE001 - its own prompt, or the run: it ends alone
                if not self.isolate:
                    raise
                del self.filling[slot]
                job.partial = None
                self._close(job, "error", e, admitting=True)
                continue
            if job.partial.left:
                continue
            self._admitting.append(self.filling.pop(slot))
            if job.paused is None:
                self._admit_plain([slot], [job], updates, self._seat_batch)
            else:
                self._resume([slot], job)
            job.partial = None

    def _seat_batch(self, slots: list[int], jobs: list[Job]) -> StepTokens:
        self.state, first = seat(self.ctx, self.state, slots, [j.partial for j in jobs], [j.seed for j in jobs],
                                 [j.settings for j in jobs], [j.max_new for j in jobs])
        return first
