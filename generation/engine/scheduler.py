"""The engine's one loop: jobs in, their tokens out, over one decode state of fixed slots.

    scheduler = Scheduler(ctx, slots=8, capacity=4096)
    scheduler.add(scheduler.job([1, 2, 3], seed=0, settings={"do_sample": True}))
    while scheduler.busy:
        updates, ended = scheduler.step()     # tokens per position; jobs that ended, with results

Everything happens at a step boundary: cancelled jobs leave, waiting jobs that fit are admitted
in arrival order (one batched prefill for the plain ones; a beam search takes num_beams slots;
a job that does not fit waits at the head, so it is not starved by smaller ones; with a prefill
budget, a long prompt runs a chunk per step instead: `prefill_chunk_tokens`), then one model
run steps every row: plain rows (greedy, sampling, each with its own settings and seed) and
beam searches (each moves only its own rows, as transformers' `_beam_search`). When no beam
search runs, prompt-lookup rows (or every row, with a draft model) verify their candidates
instead, and may gain several tokens. `generate` and `beam_search` run a scheduler to
completion; the decoder deployment runs one on its thread.

A failure stays with its job: a batched admission that raises is redone one job at a time, and
a job that fails alone ends with its error (`Job.admitting`: raised while admitting it, so its
own data is at fault when the error is a ValueError); a row whose own part of a step failed ends
alone. A failure of the model's run ends the jobs of that run; the scheduler goes on with a
fresh state. A constrained row whose scores its constraint leaves without a token is no failure:
it ends with the tokens it has, reason "stop", `Job.note` saying why (constraints.DeadEnd).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import replace

import numpy as np

from ..assisted.verify import verify
from ..cache.cross import FirstStepStore
from ..cache.prefix import PrefixStore
from ..core.context import Context, assisted_refusal
from ..core.state import StepTokens, new_state, release, row_eos_logprob, row_logprobs, row_tokens
from ..core.step import advance, step
from ..logits.constraints import DeadEnd, Grammars
from ..params import limits
from ..params.inputs import check_prompts, check_seeds
from ..params.checks import SettingError, check_integer
from ..runtime.device import Ledger
from ..runtime.feeds import terminated
from ..search.beam import Hypothesis
from .admission import Admission
from .answers import KeptAnswers
from .budget import KVBudget
from .chunked import ChunkedPrefill
from .jobs import Job, Update, timestamp_rules
from .preemption import Preemption


class Scheduler(Admission, KVBudget, ChunkedPrefill, Preemption, KeptAnswers):
    """`slots` rows of `capacity` tokens. `lookup`: the candidate generator that verifies the
    rows of jobs with prompt_lookup_num_tokens; `assistant`: one that verifies every row's
    candidates at every step (a draft model's; generate's, where the context asks for one). `stream=False` reports no Update (the tokens come with each job's end), so runs of
    greedy steps need no step-by-step bookkeeping. `state`: an empty DecodeState to reuse.
    `isolate=False`: a failed admission or model run raises out of `step` as it is (generate's
    way: the whole call fails, naming the prompt by its index in the batch) instead of ending
    the jobs it concerns. `prefix_cache_bytes`: keep computed prompt prefixes within that many
    bytes (cache/prefix.py), so a prompt that starts as one seen before runs only its rest.

    Each concern is a part of its own, mixed in here: admission at a step boundary
    (engine/admission.py), the KV budget (`kv_cache_bytes`: engine/budget.py), chunked prefill
    (`prefill_chunk_tokens`: engine/chunked.py), preemption and priority (`interrupt_for`:
    engine/preemption.py). This class holds the jobs, the step and the endings."""

    def __init__(self, ctx: Context, slots: int, capacity: int, lookup=None, assistant=None, stream: bool = True,
                 state=None, isolate: bool = True, prefix_cache_bytes: int = 0, kv_cache_bytes: int | None = None,
                 prefill_chunk_tokens: int = 0):
        check_integer("prefill_chunk_tokens", prefill_chunk_tokens, 0, 1 << 31)
        self.ctx, self.slots, self.capacity, self.isolate = ctx, slots, capacity, isolate
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.lookup, self.assistant, self.stream = lookup, assistant, stream
        store = FirstStepStore if ctx.model.is_seq2seq else PrefixStore  # an encoder-decoder's: its first steps
        self.prefix = store(prefix_cache_bytes) if prefix_cache_bytes else None
        self.ledger = Ledger()  # what crosses host <-> device, across the states this scheduler makes
        if state:  # a state given (generate's spare one): its cache's ledger goes on
            self.ledger = state.cache.ledger or self.ledger
        self.state = state if state is not None else new_state(ctx, slots, capacity, self.prefix, self.ledger)
        self.waiting: deque[Job] = deque()
        self.holder: dict[int, Job] = {}  # slot -> the job of a plain row
        self.groups: dict[int, Job] = {}  # first slot -> the job of a beam search
        self.filling: dict[int, Job] = {}  # slot -> the job whose prompt runs in chunks (Job.partial)
        self.steps = 0  # model runs of decode steps (admissions not counted)
        self._admitting: list[Job] = []
        self._ended: list[Job] = []
        self._arrivals = itertools.count()
        self.preemptions = 0
        self.interruptions = 0
        self._interrupt_lock = threading.Lock()
        self._interruptible = None  # the RunOptions of the step running now, while another thread may end it
        self.budget = self._budget(kv_cache_bytes)
        self._answers_init()

    def _budget(self, kv_cache_bytes: int | None) -> int | None:
        """The checked budget, None where admission goes by slots (no budget, or a mode or model
        whose cache is not sized by classes or whose rows are not preempted)."""
        if kv_cache_bytes is not None:
            check_integer("kv_cache_bytes", kv_cache_bytes, 0, 1 << 62)
        if not kv_cache_bytes or not self.state:
            return None
        model, cache = self.ctx.model, self.state.cache
        if not cache.sized or model.is_seq2seq or model.graph.has_inputs_embeds:
            return None
        least = cache.footprint(1, self.capacity)
        if kv_cache_bytes < least:
            raise SettingError("kv_cache_bytes", f"kv_cache_bytes: {kv_cache_bytes} bytes do not hold one row of "
                                                 f"{self.capacity} tokens ({least} bytes in {cache.mode} mode); give "
                                                 "at least that, or a smaller capacity")
        return kv_cache_bytes

    # -- jobs -----------------------------------------------------------------------------
    def job(self, prompt, seed: int = 0, settings: dict | None = None, encoder=None,
            prompt_logprobs: int | None = None, key=None, timestamps: bool = False, untempered: bool = False,
            priority: int = 0, logprobs: bool = True) -> Job:
        """A checked Job: `settings` are generation_config fields by name over the context's;
        `timestamps`: a window decoded with its family's timestamp rules (`timestamp_rules`);
        `untempered`: its log-probabilities before the temperature (Whisper's fallback rates a
        window by them); `priority`: lower first (`add`); `logprobs=False`: its reader takes no
        log-probabilities (the steps compute none for its row, its tokens come without them).
        Anything wrong raises SettingError naming the field. Thread-safe (reads the context only)."""
        ctx = self.ctx
        if ctx.model.is_seq2seq and (encoder is None or len(encoder) != 1):
            raise ValueError("an encoder-decoder job needs its encoder outputs (one row): encoder=")
        prompt = check_prompts(ctx, [prompt])[0]
        seed = check_seeds([seed], 1)[0]
        check_integer("priority", priority, 0, 1 << 31)
        if settings is not None and not (isinstance(settings, dict) and all(isinstance(k, str) for k in settings)):
            raise SettingError("settings", "settings must be an object of generation settings by name")
        resolved = ctx.with_settings(**(settings or {}))
        if timestamps:
            resolved = replace(resolved, timestamp_rules=timestamp_rules(ctx.model))
        if untempered:
            resolved = replace(resolved, untempered_logprobs=True)
        elif not logprobs and ctx.token_logprobs:
            resolved = replace(resolved, no_logprobs=True)
        if not prompt:
            raise SettingError("prompt", "prompt is empty")
        vision = getattr(ctx.model, "vision_session", None) is not None
        refusal = resolved.prompt_lookup_num_tokens and assisted_refusal(ctx.model, "prompt_lookup_num_tokens",
                                                                         resolved.num_beams)
        if refusal:
            raise SettingError("prompt_lookup_num_tokens", refusal)
        if resolved.structured_outputs is not None:
            Grammars.of(ctx).check(resolved.structured_outputs)
        if resolved.num_beams > self.slots:
            raise SettingError("num_beams", f"num_beams: {resolved.num_beams} beams need as many slots; this decoder "
                                            f"has {self.slots}")
        prompt_only = resolved.max_new_tokens == 0
        if prompt_only and (ctx.model.is_seq2seq or vision):
            raise SettingError("max_new_tokens", "max_new_tokens: 0 (a prompt-only pass) runs decoder-only text models")
        if not prompt_only and resolved.new_tokens_for(len(prompt)) < 1:
            name = "max_new_tokens" if resolved.max_new_tokens is not None else "max_length"
            raise SettingError(name, f"{name}: the settings leave no new token for a prompt of {len(prompt)} tokens")
        max_new = 0 if prompt_only else min(resolved.new_tokens_for(len(prompt)), self.capacity - len(prompt))
        if max_new < 1 and not (prompt_only and len(prompt) <= self.capacity):
            raise SettingError("prompt", f"the prompt has {len(prompt)} tokens; a slot holds {self.capacity}")
        if prompt_logprobs is not None:
            check_integer("prompt_logprobs", prompt_logprobs, 0, limits.MAX_LOGPROBS)
            if ctx.model.is_seq2seq or ctx.model.graph.has_inputs_embeds:
                raise SettingError("prompt_logprobs", "prompt_logprobs: the prompt's log-probabilities are given "
                                                      "for decoder-only text models")
        return Job(prompt, seed, resolved, max_new, encoder, prompt_logprobs, key, priority=priority)

    def add(self, job: Job) -> None:
        """Queue a job (from the scheduler's own thread); it is admitted at a step boundary, after
        the jobs of lower priority values and, among its own, in arrival order (vLLM's priority
        policy). A waiting job takes the slot of a running plain row of a higher value: that row
        is preempted (core/preempt.py) and waits at its place, so batch rows (priority above 0)
        fill what interactive ones leave and an interactive row waits at most one step for them."""
        job.order = next(self._arrivals)
        self._enqueue(job)

    def _enqueue(self, job: Job) -> None:
        rank = job.rank
        at = len(self.waiting)
        if at and self.waiting[-1].rank > rank:
            at = next(i for i, waiting in enumerate(self.waiting) if waiting.rank > rank)
        self.waiting.insert(at, job)

    @staticmethod
    def cancel(job: Job) -> None:
        """End the job at the next step boundary (any thread)."""
        job.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.holder or self.groups or self.filling)

    @property
    def running(self) -> int:
        return len(self.holder) + len(self.groups) + len(self.filling)

    @property
    def occupied(self) -> int:
        return len(self.holder) + len(self.filling) + sum(job.beams for job in self.groups.values())

    def jobs(self) -> list[Job]:
        """Every job not ended yet: running, being prefilled or admitted, waiting."""
        return [*self.holder.values(), *self.groups.values(), *self.filling.values(), *self._admitting,
                *self.waiting]

    # -- the step -------------------------------------------------------------------------
    def step(self, admitted=None) -> tuple[list[Update], list[Job]]:
        """One step boundary and one model run. Returns the Updates (with stream) and the jobs
        that ended, with their results. `admitted(updates)`: given the admitted rows' first
        tokens before the model run (a server streams them a step sooner: a step of SmolLM2-135M
        is 14-24 ms); those Updates are then not returned."""
        updates: list[Update] = []
        self._ended = ended = []
        for slot, job in [*self.holder.items(), *self.groups.items()]:
            if job.cancelled:
                self._end_slot(slot, "cancelled")
        for slot, job in list(self.filling.items()):
            if job.cancelled:  # mid-prefill: its chunks so far are dropped
                del self.filling[slot]
                job.partial = None
                self._close(job, "cancelled")
        self._admit(updates)
        if admitted is not None and updates:
            admitted(updates)
            updates = []
        if self.budget is not None and (self.holder or self.groups):
            self._make_room()
        if self.holder or self.groups:
            try:
                self._run(updates)
            except Exception as e:  # noqa: BLE001 - not one row's (the model's run): every row of it ends
                if not self.isolate:
                    raise
                for slot in [*self.holder, *self.groups]:
                    job = self.holder.pop(slot, None) or self.groups.pop(slot)
                    self._close(job, "error", e)
                self.state = new_state(self.ctx, self.slots, self.capacity, self.prefix, self.ledger)
        return updates, ended

    def _run(self, updates: list[Update]) -> None:
        ctx, state = self.ctx, self.state
        if state.groups:  # beam rows step in the run with every other row; candidates wait
            state, out = step(ctx, state)
            outs = [out]
        elif self.assistant is not None:
            state, outs = verify(ctx, state, self.assistant)
        elif self.lookup is not None and any(j.settings.prompt_lookup_num_tokens for j in self.holder.values()):
            state, outs = verify(ctx, state, self.lookup)
        elif not self.stream:  # within the budget: the steps the buffers laid out for this one hold
            steps = 1 if self.filling else state.capacity if self.budget is None else self._reach()
            state, out = advance(ctx, state, max_steps=steps)  # (prompts part-way through go on at each step)
            outs = [out]
        else:
            stepped = self._step_interruptibly(ctx, state)
            if stepped is None:  # nothing of the step was kept: the next boundary runs it again
                self.interruptions += 1
                return
            state, out = stepped
            outs = [out]
        self.steps += 1
        for out in outs:  # each position of the step in order, as plain steps give them
            if self.stream and self.holder:
                updates.append(self._update(out))
            for slot, error in out.failed.items():
                if slot in self.groups:  # a beam search's own failure: the engine freed its slots
                    self._close(self.groups.pop(slot), "error", error)
                elif isinstance(error, DeadEnd):  # its constraint left it no token: it ends there
                    self.holder[slot].note = str(error)
                    self._end_slot(slot, "stop")
                else:
                    self._end_slot(slot, "error", error)
            if out.any_finished:
                for slot in np.flatnonzero(out.finished).tolist():
                    if slot in self.holder:
                        self._end_slot(slot, None)
        for slot, group in (outs[0].beams if outs else {}).items():  # the engine freed their slots
            self._end_beams(self.groups.pop(slot), group.hypotheses())

    def _step_interruptibly(self, ctx, state):
        """`step`, which `interrupt_for` may end early where the cache's runs can be (None then)."""
        options = state.cache.run_options
        if options is None:
            return step(ctx, state)
        with self._interrupt_lock:
            options.terminate, self._interruptible = False, options
        try:
            return step(ctx, state)
        except Exception as e:
            if not terminated(e):
                raise
            return None
        finally:
            with self._interrupt_lock:
                options.terminate, self._interruptible = False, None

    def _update(self, out: StepTokens) -> Update:
        slots = np.fromiter(self.holder, np.int64, len(self.holder))
        part = StepTokens(out.token[slots], out.finished[slots], out.any_finished)
        if out.logprob is not None:
            part.logprob = out.logprob[slots]
            if out.top is not None:
                part.top_ids, part.top = out.top_ids[slots], out.top[slots]
        if out.failed:
            part.failed = {i: out.failed[s] for i, s in enumerate(slots.tolist()) if s in out.failed}
        return Update(list(self.holder.values()), part)


    # -- endings --------------------------------------------------------------------------
    def _end_slot(self, slot: int, reason: str | None, error: BaseException | None = None) -> None:
        """End the job in `slot` (a plain row, or a beam search's first slot) and free its slots;
        reason None: it finished (stop or length)."""
        job = self.holder.pop(slot, None)
        if job is None:
            job = self.groups.pop(slot)
        else:
            if error is None:
                self._keep_answer(slot)
            job.tokens = row_tokens(self.state, slot)
            if self.ctx.token_logprobs:
                job.logprobs, job.top = row_logprobs(self.state, slot)
                job.eos_logprob = row_eos_logprob(self.state, slot)
        self.state = release(self.ctx, self.state, slot)
        self._trim_prefix()  # the row's decoded blocks went to the prefix store: within the budget
        self._close(job, reason or self._reason(job), error)

    def _end_beams(self, job: Job, hypotheses: list[Hypothesis]) -> None:
        best = hypotheses[0] if hypotheses else Hypothesis([], 0.0, [] if self.ctx.token_logprobs else None)
        job.hypotheses, job.tokens, job.logprobs = hypotheses, best.tokens, best.logprobs
        self._close(job, self._reason(job))

    @staticmethod
    def _reason(job: Job) -> str:
        return "length" if len(job.tokens) >= job.max_new else "stop"

    def _close(self, job: Job, reason: str, error: BaseException | None = None, admitting: bool = False) -> None:
        job.reason, job.error, job.admitting = reason, error, admitting
        if job.started is None:
            job.started = time.perf_counter()
        self._ended.append(job)
