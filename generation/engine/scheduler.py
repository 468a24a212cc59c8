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
from dataclasses import dataclass, field, replace

import numpy as np

from ..assisted.verify import verify
from ..cache.cross import FirstStepStore
from ..cache.prefix import PrefixStore
from ..core.chunks import begin, extend, seat
from ..core.context import Context, assisted_refusal
from ..core.preempt import pause, resume
from ..core.state import (
    StepTokens,
    admit,
    admit_beams,
    advance,
    new_state,
    release,
    row_eos_logprob,
    row_logprobs,
    row_tokens,
    step,
    with_logprobs,
)
from ..logits.constraints import DeadEnd, Grammars
from ..logits.selection import LogProbs
from ..params import limits
from ..params.inputs import check_prompts, check_seeds
from ..params.settings import SettingError, Settings, check_integer
from ..runtime.device import Ledger
from ..runtime.feeds import terminated
from ..search.beam import Hypothesis
from .budget import Needs


@dataclass(eq=False)
class Job:
    """One prompt to run, and, once it ended, what it got: `reason` is "stop" (eos or a stop
    string), "length" (max_new tokens), "cancelled" or "error" (`error`, the exception).
    `tokens` are its new tokens without the eos token (a beam search's: its best hypothesis;
    `hypotheses` all it returns), with their `logprobs` and `top` alternatives when the
    context computes them. `key` is the caller's own."""

    prompt: list[int]
    seed: int
    settings: Settings
    max_new: int
    encoder: object = None  # one row of EncoderOutputs (an encoder-decoder's source) or PromptImages
    prompt_top: int | None = None  # also the prompt's log-probabilities, with this many alternatives
    key: object = None
    cancelled: bool = False
    reason: str | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top: list | None = None
    hypotheses: list[Hypothesis] | None = None
    error: BaseException | None = None
    admitting: bool = False  # the error came while admitting the job
    prompt_logprobs: object = None  # a prompt_logprobs.PromptLogprobs, before the first token
    started: float | None = None  # perf_counter() when it was admitted (or ended waiting)
    eos_logprob: float | None = None  # the log-probability of the eos token it ended at (token_logprobs)
    cached_tokens: int = 0  # prompt tokens that came from the prefix cache (OpenAI's usage.prompt_tokens_details)
    note: str | None = None  # why a "stop" came before its eos: its constraint left no token (constraints.DeadEnd)
    order: int = 0  # its place in arrival order (the newest running rows are preempted first)
    priority: int = 0  # lower first: waits behind lower values, and gives its slot up to them
    paused: object = None  # a preempted row waiting to resume (core.preempt.Paused)
    preemptions: int = 0  # times it was preempted
    partial: object = None  # its prompt part-way through a prefill in chunks (core.chunks.Partial)

    @property
    def beams(self) -> int:
        return self.settings.num_beams

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def rank(self) -> tuple[int, int]:
        """Its place in the queue and, running, in the order of preemption (the last first)."""
        return self.priority, self.order


@dataclass
class Update:
    """One position of a step (or an admission's first tokens) for the jobs it concerns: row i
    of `out` (a StepTokens) is `jobs[i]`'s."""

    jobs: list[Job]
    out: StepTokens

    def tokens(self) -> list[tuple[Job, int, float | None, list | None]]:
        """(job, token id, its log-probability or None, the top alternatives [(id, logprob)] or
        None) of each job that got a token, as Python values."""
        out = self.out
        got = [i for i in np.flatnonzero(out.token >= 0).tolist() if i not in out.failed]
        token = out.token[got].tolist()
        read = [not self.jobs[i].settings.no_logprobs for i in got]  # rows whose step computed them
        logprob = [None] * len(got) if out.logprob is None else [
            lp if r else None for lp, r in zip(out.logprob[got].tolist(), read)]
        top = [None] * len(got) if out.top is None else [
            list(zip(ids, lps)) if r else None
            for ids, lps, r in zip(out.top_ids[got].tolist(), out.top[got].tolist(), read)]
        return [(self.jobs[i], t, lp, tp) for i, t, lp, tp in zip(got, token, logprob, top)]


class Scheduler:
    """`slots` rows of `capacity` tokens. `lookup`: the candidate generator that verifies the
    rows of jobs with prompt_lookup_num_tokens; `assistant`: one that verifies every row's
    candidates at every step (a draft model's; generate's, where the context asks for one). `stream=False` reports no Update (the tokens come with each job's end), so runs of
    greedy steps need no step-by-step bookkeeping. `state`: an empty DecodeState to reuse.
    `isolate=False`: a failed admission or model run raises out of `step` as it is (generate's
    way: the whole call fails, naming the prompt by its index in the batch) instead of ending
    the jobs it concerns. `prefix_cache_bytes`: keep computed prompt prefixes within that many
    bytes (cache/prefix.py), so a prompt that starts as one seen before runs only its rest.

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
    and vision-language models admit by slots whatever the budget (`budget` is then None).

    `prefill_chunk_tokens`: the prompt tokens a step boundary may run (vLLM's chunked prefill;
    0: none, every seated prompt runs whole at once). Prompts that are part-way through take
    theirs first, in the order of the queue, then waiting jobs in order: a prompt that fits what
    is left runs whole (batched, as without a budget); a longer one is seated into its slot and
    runs what is left now and a chunk at each later boundary (core/chunks.py), its row not live
    until its last chunk, whose logits choose its first token (its tokens those of the prompt
    run whole); once nothing is left, the next waiting jobs wait. So the running rows step at
    every boundary, each boundary's prompt work bounded, whatever arrives. A preempted row
    resuming runs its tokens the same way. Rows whose prompt does not run in chunks are seated
    whole, in a boundary whose budget is untouched when they are longer than it: beam
    searches, prompt log-probabilities (`prompt_logprobs`), encoder-decoders and
    vision-language models (prompt-only jobs run as without a budget). A prompt part-way
    through holds its slot and its share of the KV budget (its whole prompt); it may be
    cancelled, and is preempted (its chunks dropped) as a running row of its place would be.

    `interrupt_for(priority)`, from another thread: a job of that priority has arrived; where
    the step now running runs only rows of higher priority values (a batch's), its model run
    ends early (in_place caches: `BaseCache.run_options`) and the step is run again after the
    next boundary, which seats the job (preempting a row for it where it must): its first token
    comes a prompt's run after it arrives, not after the batch's step. The rows' tokens are
    those of the step uninterrupted; `interruptions` counts the runs ended."""

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

    # -- admission ------------------------------------------------------------------------
    def _admit(self, updates: list[Update]) -> None:
        """Seat the waiting jobs that fit, in arrival order; prompt-only jobs (max_new 0) take no
        slot: they run together at once. With a prefill budget, the prompts part-way through run
        their chunks first, and a waiting job's prompt runs whole, in chunks or not yet as what
        is left of the budget says (the class docstring)."""
        passes = [job for job in self.waiting if job.max_new == 0 and not job.cancelled]
        if passes:
            taken = {id(job) for job in passes}
            self.waiting = deque(job for job in self.waiting if id(job) not in taken)
        free = [s for s in self.state.free_slots().tolist() if s not in self.filling]
        plain, beams, resumed = [], [], []
        left = self.prefill_chunk_tokens or None  # prompt tokens this boundary may still run (None: no budget)
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
                    job.partial = begin(self.ctx, tokens, store if job.paused is None else None)
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

    # -- memory ---------------------------------------------------------------------------
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

    # -- endings --------------------------------------------------------------------------
    def _end_slot(self, slot: int, reason: str | None, error: BaseException | None = None) -> None:
        """End the job in `slot` (a plain row, or a beam search's first slot) and free its slots;
        reason None: it finished (stop or length)."""
        job = self.holder.pop(slot, None)
        if job is None:
            job = self.groups.pop(slot)
        else:
            job.tokens = row_tokens(self.state, slot)
            if self.ctx.token_logprobs:
                job.logprobs, job.top = row_logprobs(self.state, slot)
                job.eos_logprob = row_eos_logprob(self.state, slot)
        self.state = release(self.ctx, self.state, slot)
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


def joined(encoders: list, join):
    """The jobs' encoder outputs (EncoderOutputs) or images (PromptImages) as one batch's, as the
    model's family joins them (`join`: its hooks' `join`); None when no job has any."""
    if all(e is None for e in encoders):
        return None
    return join(encoders)


def timestamp_rules(model) -> tuple[int, int, int]:
    """The timestamp rule ids of a timestamped row of `model`, as its family gives them (its
    hooks' `timestamp_rules`); ValueError when the family decodes no timestamps."""
    if model.hooks.timestamp_rules is None:
        raise ValueError(f"{model.folder}: its model family decodes no timestamps")
    return model.hooks.timestamp_rules(model)


def spread(update: Update, rows: np.ndarray, size: int, finished: np.ndarray) -> StepTokens:
    """An Update over `size` rows (its job i is row rows[i]; -1 and nan elsewhere), with
    `finished` (all rows so far) as its finished flags."""
    out = update.out
    tokens = np.full(size, -1, np.int64)
    tokens[rows] = out.token
    lp = None if out.logprob is None else LogProbs(out.logprob, out.top_ids, out.top)
    return with_logprobs(StepTokens(tokens, finished.copy(), bool(out.finished.any())), rows, size, lp)
