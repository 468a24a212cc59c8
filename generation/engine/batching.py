"""Continuous batching for the decoder replica, free of Ray: the engine's Scheduler on a thread.

The decoder replica owns one `ContinuousBatcher`: a thread that runs `generation.engine.scheduler`'s
Scheduler (the same loop `generation.generate` runs to completion). Requests are admitted into
free slots at step boundaries, every live slot steps together, each request gets its tokens as
they come, and the slots of finished or cancelled requests are freed, so a new request never
waits for a whole batch to finish. Each request keeps its own settings, seed and stops; its
tokens are those `generation.generate` gives it alone.

    batcher = ContinuousBatcher(ctx, slots=8)        # a compiled context (generation.front.loading loads one)
    request = batcher.submit([1, 2, 3], seed=0, settings={"temperature": 0.7, "do_sample": True})
    for token in request.stream(): ...        # or request.result(); request.events() with log-probs
    batcher.close()

A beam search request (num_beams > 1) holds num_beams slots while it runs, and its rows step in
the same model runs as every other request's; transformers' `_beam_search` settles its tokens
only at the end, so they come all at once. A request with `prompt_lookup_num_tokens` is decoded
with prompt lookup (generation.assisted.verify): while one runs (and no beam search does), each step
verifies the live rows' candidates and may give a row several tokens, which stream in order;
the tokens are those of plain decoding. A context with a draft model (context(draft=...))
verifies the draft's proposals for every row at every step instead (greedy rows: the plain
tokens; sampling rows: the speculative sampling rule, or the plain tokens where the context
computes log-probabilities).

A failure is kept to the request it belongs to (the Scheduler's rules): one that fails alone
ends with finish_reason "error" (status 400 when its own data was at fault while admitting it:
a ValueError such as generation's SettingError; 500 otherwise); a row whose own part of a step
fails ends the same way (500) while the others get the tokens they get alone. Only a failure of
the model's run over the batch ends every row of that run; the loop then goes on with a fresh
state. Every request gets its Completion, whatever happens to the loop.

Serving code never touches arrays: requests carry token id lists, results carry lists.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from generation.assisted import verify as assisted
from generation.params import limits
from .adapters import AdapterCalls
from .budget import default_kv_cache_bytes, resolved_slots
from .scheduler import Scheduler
from generation.params.checks import SettingError

log = logging.getLogger(__name__)

_DONE = object()
# How long an idle loop waits before it looks again unasked: a submit and a close wake it at once,
# so this only bounds a missed wake-up. 50 ms cost the engine process ~0.3% of a core with no request.
IDLE_TICK_SECONDS = 1.0
# The prompt tokens a step boundary may run (Scheduler's prefill_chunk_tokens): a long prompt runs in
# chunks between the running rows' steps. 128 by measurement (bench/chunked_prefill.py --direct,
# SmolLM2-135M fp32, 2 shared cores, 64 new tokens, prompts of 32 and, 1 in 4, of 512 tokens): at
# concurrency 32 the time to first token p50 is 0.16 s (whole prompts 0.41 s, a budget of 256 0.34 s),
# 1.0 s with the long prompts (whole 11.2 s); inter-token p99 0.19-0.25 s (whole 0.38-4.7 s, 256
# 0.28-0.36 s); tokens/s 0.95x whole's with short prompts only, 1.95x with the long ones.
DEFAULT_PREFILL_CHUNK_TOKENS = 128


@dataclass(frozen=True, slots=True)
class Token:
    """One new token, with its log-probability and the step's top alternatives [(id, logprob)]
    when the batcher's context computes them."""

    id: int
    logprob: float | None = None
    top: list | None = None
    at: float = 0.0  # perf_counter() when the batcher made it


@dataclass
class Completion:
    """A finished request: its new tokens (without the eos token) and why it ended: "stop"
    (eos or a stop string), "length" (its max_new_tokens), "cancelled", or "error". An error
    has its message, an HTTP `status` (400: the request was at fault, `field` then names the
    engine's setting when it is one; 500: the server was) for the decoder to answer with. A
    "stop" with a message: its constraint left no token (the scheduler's Job.note)."""

    tokens: list[int]
    finish_reason: str
    error: str | None = None
    queued_seconds: float = 0.0
    first_token_seconds: float | None = None
    status: int | None = None
    field: str | None = None
    cached_tokens: int = 0  # prompt tokens that came from the replica's prefix cache


@dataclass
class Request:
    """One submitted prompt; read it with `stream()` (tokens as they come) or `result()`."""

    id: int
    prompt: list[int]
    seed: int
    settings: object  # generation.Settings
    max_new: int
    submitted: float = field(default_factory=time.perf_counter)
    emitted: list = field(default_factory=list)  # the token ids made so far
    _events: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)
    _cancelled: bool = False
    _completion: Completion | None = None
    _first: float | None = None
    _notify: object = None  # wakes the reader's event loop (abatches), called from the batcher's thread
    _wanted: str | None = None  # what the reader waits for: "any" event, only the "done" one, or None (not waiting)
    finished: float | None = None  # perf_counter() when it ended
    encoder: object = None  # an encoder-decoder request's EncoderOutputs (one row)
    beams: int = 1
    job: object = None  # the scheduler's generation.engine.scheduler.Job
    prompt_top: int | None = None  # echo with logprobs: the prompt's log-probabilities, with this many alternatives
    prompt_logprobs: object = None  # ... set before its first token (a generation.logits.prompt_logprobs.PromptLogprobs)
    _finishing: threading.Lock = field(default_factory=threading.Lock)

    def events(self, timeout: float | None = None):
        """Yield each new Token as the batcher makes it; ends when the request does."""
        while True:
            item = self._events.get(timeout=timeout)
            if item is _DONE:
                return
            yield item

    def stream(self, timeout: float | None = None):
        """Yield each new token id as the batcher makes it; ends when the request does."""
        return (token.id for token in self.events(timeout))

    async def abatches(self, interval: float = 0.0):
        """For asyncio: lists of the Tokens made since the last list (one token when the reader
        keeps up; more when it falls behind, so a slow stream sends fewer, larger messages).
        `interval` (seconds, or a function giving them at each list): after a list, the next
        one waits that long, so the tokens made meanwhile go together (the first list goes at
        once, and the last as soon as the request ends). The batcher's thread wakes the event
        loop only when the reader waits for what it put (not for every token); no thread waits
        per request."""
        import asyncio

        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        self._notify = lambda: loop.call_soon_threadsafe(ready.set)
        events = self._events
        try:
            while True:
                batch = []
                while True:
                    try:
                        item = events.get_nowait()
                    except queue.Empty:
                        break
                    if item is _DONE:
                        if batch:
                            yield batch
                        return
                    batch.append(item)
                if batch:
                    yield batch
                    wait = interval() if callable(interval) else interval
                    if wait > 0:  # hold the next list back, unless the request ends meanwhile
                        ready.clear()
                        self._wanted = "done"
                        if not self._done.is_set():
                            timer = loop.call_later(wait, ready.set)
                            try:
                                await ready.wait()
                            finally:
                                timer.cancel()
                        self._wanted = None
                    continue
                ready.clear()
                self._wanted = "any"  # then look again: what the batcher put before it read this is seen here
                if events.empty():
                    await ready.wait()
                self._wanted = None
        finally:
            self._wanted = None
            self._notify = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self._completion

    @property
    def cancelled(self) -> bool:
        """Whether its reader cancelled it (the loop frees its slot at the next step)."""
        return self._cancelled

    def cancel(self) -> None:
        """Stop the request; its slot is freed at the next step (a client that went away)."""
        self._cancelled = True
        if self.job is not None:
            self.job.cancelled = True

    def _put(self, item) -> None:
        self._events.put(item)
        wanted = self._wanted  # read after the put: a reader that flags later finds the item in the queue
        if wanted is not None and (wanted == "any" or item is _DONE):
            notify = self._notify
            if notify is not None:
                self._wanted = None
                try:
                    notify()
                except RuntimeError:  # the listener's event loop has closed: nobody is waiting
                    self._notify = None

    def emit(self, token: int, logprob: float | None = None, top: list | None = None) -> None:
        if self._first is None:
            self._first = time.perf_counter()
        self.emitted.append(token)
        self._put(Token(token, logprob, top, time.perf_counter()))

    def finish(self, tokens: list[int], reason: str, error: str | None = None, started: float | None = None,
                status: int | None = None, field: str | None = None) -> None:
        first = None if self._first is None else self._first - self.submitted
        self.settle(Completion(list(tokens), reason, error,
                                queued_seconds=(started or time.perf_counter()) - self.submitted,
                                first_token_seconds=first, status=status, field=field,
                                cached_tokens=getattr(self.job, "cached_tokens", 0)))

    def settle(self, completion: Completion) -> None:
        with self._finishing:  # once: the first ending wins (the loop's last sweep may come after)
            if self._done.is_set():
                return
            self.finished = time.perf_counter()
            self._completion = completion
            self._done.set()
        self._put(_DONE)

    def fail(self, error: BaseException, admitting: bool, started: float | None = None) -> None:
        """End with finish_reason "error": status 400 for a ValueError raised while admitting the
        request (its own settings, prompt or images), else 500 (logged with its traceback)."""
        fault = admitting and isinstance(error, ValueError)
        if not fault:
            log.error("request %d failed", self.id, exc_info=error)
        message = (str(error) or type(error).__name__) if fault else f"{type(error).__name__}: {error}"
        self.finish(self.emitted, "error", message, started, status=400 if fault else 500,
                     field=getattr(error, "setting", None) if fault else None)


class ContinuousBatcher(AdapterCalls):
    """The generation loop of one decoder: a `generation.engine.scheduler.Scheduler` of `slots` rows
    of `capacity` tokens (default: the model's context, at most 4096) run on a thread of its
    own. `max_waiting` bounds the queue of interactive requests (priority 0): `submit` raises
    `QueueFull` beyond it (the server answers 503). Requests of a later priority (a batch's lines)
    wait in a queue of their own that it does not bound: their sender bounds them (the Batches
    runner's lines in flight, --batch-concurrency), and they never take an interactive request's
    place in the queue. `kv_cache_bytes`: the KV cache's budget (the Scheduler's; default a quarter of
    the machine's memory, engine.budget.default_kv_cache_bytes; 0: none, each slot may hold the
    whole capacity): rows are admitted while what they hold fits it, up to `slots` rows.
    `prefill_chunk_tokens`: the prompt tokens a step may run (the Scheduler's; default
    DEFAULT_PREFILL_CHUNK_TOKENS; 0: every prompt whole at once), so a burst or a long prompt
    does not hold the running rows' next tokens up for all its prompts."""

    def __init__(self, ctx, slots: int = 8, capacity: int | None = None, max_waiting: int = 256,
                 prefix_cache_bytes: int = 0, kv_cache_bytes: int | None = None,
                 prefill_chunk_tokens: int | None = None):
        from generation.assisted.budget import CostAware
        from generation.assisted.prompt_lookup import PromptLookup

        self.capacity = capacity or min(ctx.model.max_context or 4096, 4096)
        self.ctx, self.slots = ctx, resolved_slots(ctx, slots, self.capacity, kv_cache_bytes)
        slots = self.slots
        self.max_waiting = max_waiting
        # rows with prompt_lookup_num_tokens verify their candidates, where they pay for the wider run;
        # a context with a draft model verifies the draft's for every row
        def scheduler(budget):
            return Scheduler(ctx, slots, self.capacity,
                             lookup=CostAware(PromptLookup(), max_slowdown=limits.MAX_STEP_SLOWDOWN),
                             assistant=assisted.candidates_for(ctx) if ctx.draft is not None else None,
                             prefix_cache_bytes=prefix_cache_bytes, kv_cache_bytes=budget,
                             prefill_chunk_tokens=DEFAULT_PREFILL_CHUNK_TOKENS if prefill_chunk_tokens is None
                             else prefill_chunk_tokens)

        if kv_cache_bytes is not None:
            self.scheduler = scheduler(kv_cache_bytes)
        else:  # a share of the machine's memory; a small machine's may not hold one row of the capacity
            try:
                self.scheduler = scheduler(default_kv_cache_bytes())
            except SettingError as e:
                if e.setting != "kv_cache_bytes":
                    raise
                log.warning("the default KV budget is too small (%s): admitting by slots", e)
                self.scheduler = scheduler(0)
        self.prefix = self.scheduler.state.prefix  # the prompt prefixes kept (None: off, or a model that cannot)
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymuter-batcher", daemon=True)
        self.running = 0  # requests in slots now (a beam search request counts once)
        self.waiting = 0  # requests queued
        # interactive requests (priority 0): queued here (submit's thread adds, the loop's takes), waiting in
        # the scheduler and running (the loop's thread counts both at each step)
        self._queued_interactive, self._queue_lock = 0, threading.Lock()
        self.interactive_waiting = self.interactive_running = 0
        self.occupied = 0  # slots held now (a beam search request holds num_beams)
        self.preemptions = 0  # rows preempted to keep the KV cache within its budget, so far
        self._thread.start()

    @property
    def transfers(self) -> dict | None:
        """The cache's host <-> device ledger (runtime.device.Ledger.stats), where its mode counts one."""
        ledger = self.scheduler.state.cache.ledger if self.scheduler.state else None
        return ledger.stats() if ledger is not None else None

    @property
    def steps(self) -> int:
        """Model runs of decode steps so far (for tests and metrics)."""
        return self.scheduler.steps

    # -- public -----------------------------------------------------------------------------
    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None, timestamps: bool = False, untempered: bool = False,
               job=None, priority: int = 0, logprobs: bool = True) -> Request:
        """Queue a prompt (token ids) with its generation settings (any generation_config
        field: validated here, so a bad one raises ValueError naming it). An encoder-decoder
        model's request brings its source through the encoder: `encoder`, an EncoderOutputs of
        one row (the prompt is then the decoder's: decoder_start_token_id, ...). `timestamps`: a
        Whisper window, decoded with the timestamp rules; `untempered`: its log-probabilities
        before the temperature (the window's temperature fallback rates it by them). `priority`:
        lower first (Scheduler.add: batch rows above 0 give their slots up). `job`: the
        scheduler's Job of these, checked already (engine_process: in the parent). `logprobs=False`:
        the reader takes none (its row's steps compute none)."""
        if self._stop.is_set():
            raise RuntimeError("the batcher is closed")
        interactive = (job.priority if job is not None else priority) <= 0
        if interactive and self._queued_interactive + self.interactive_waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")
        if job is None:
            job = self.scheduler.job(prompt, seed, settings, encoder, prompt_logprobs, timestamps=timestamps,
                                     untempered=untempered, priority=priority, logprobs=logprobs)
        request = Request(next(self._ids), job.prompt, job.seed, job.settings, job.max_new, job=job,
                          beams=job.beams, encoder=encoder, prompt_top=prompt_logprobs)
        job.key = request
        if interactive:
            with self._queue_lock:
                self._queued_interactive += 1
        self._waiting.put(request)
        if self._stop.is_set():  # the loop closed while this was queued: nobody will take it
            self._close_queued()
        self.waiting = self._waiting.qsize() + len(self.scheduler.waiting)
        self._wake.set()
        self.scheduler.interrupt_for(job.priority)  # a step of batch rows only ends early for it
        return request

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        """Whether its loop runs (the decoder's health check)."""
        return self._thread.is_alive()

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        reason, error = "cancelled", "the batcher closed"
        try:
            self._run()
        except BaseException as e:  # the loop itself broke: nothing may be left waiting for it
            log.exception("the batcher's loop stopped")
            reason, error = "error", f"the decoder stopped: {type(e).__name__}: {e}"
            raise
        finally:
            self._stop.set()
            for request in [job.key for job in self.scheduler.jobs()] + self._drain():
                request.finish(request.emitted, reason, error, status=500 if reason == "error" else None)

    def _run(self) -> None:
        scheduler = self.scheduler
        while not self._stop.is_set():
            self._take_waiting()
            if not scheduler.busy:
                self._count()
                if not scheduler.tidy():  # idle work first (engine/answers.py), then a wait
                    self._idle()
                continue
            updates, ended = scheduler.step(admitted=self._admitted)
            self._forward(updates)
            for job in ended:
                self._ended(job)
            self._count()
            # Let the threads that forward these tokens run now: a small model's steps are
            # mostly Python, and without this they wait for the GIL's 5 ms switch interval.
            time.sleep(0)

    def _forward(self, updates) -> None:
        for update in updates:  # each position in order, as plain steps give them
            for job, token, logprob, top in update.tokens():
                request = job.key
                if not request.cancelled:
                    request.prompt_logprobs = job.prompt_logprobs
                    request.emit(token, logprob, top)

    def _admitted(self, updates) -> None:
        """The first tokens of the rows a step admitted, streamed before its model run."""
        self._forward(updates)

    def _take_waiting(self) -> None:
        """The queue, into the scheduler (it admits at the step boundary)."""
        while True:
            try:
                job = self._waiting.get_nowait().job
            except queue.Empty:
                return
            self.scheduler.add(job)
            if job.priority <= 0:
                with self._queue_lock:
                    self._queued_interactive -= 1
                self.interactive_waiting += 1  # until _count counts the scheduler's queue again

    def _idle(self) -> None:
        """Nothing to step: wait for a submit or close (each sets _wake; the tick is a backstop)."""
        self._wake.wait(timeout=IDLE_TICK_SECONDS)
        self._wake.clear()

    def _ended(self, job) -> None:
        """The request's Completion from its job's ending."""
        request = job.key
        request.prompt_logprobs = job.prompt_logprobs
        if job.reason == "error":
            request.fail(job.error, admitting=job.admitting, started=job.started)
        elif job.reason == "cancelled":
            request.finish(request.emitted, "cancelled", started=job.started)
        else:
            if job.hypotheses is not None and not request.cancelled:  # a beam search's tokens come at its end
                for token, logprob in zip(job.tokens, job.logprobs or [None] * len(job.tokens)):
                    request.emit(token, logprob)
            request.finish(job.tokens, job.reason, job.note, started=job.started)  # note: a constraint's dead end

    def _count(self) -> None:
        scheduler = self.scheduler
        self.running, self.occupied = scheduler.running, scheduler.occupied
        self.preemptions = scheduler.preemptions
        self.waiting = self._waiting.qsize() + len(scheduler.waiting)
        self.interactive_waiting = sum(job.priority <= 0 for job in scheduler.waiting)
        self.interactive_running = sum(job.priority <= 0 for job in (
            *scheduler.holder.values(), *scheduler.groups.values(), *scheduler.filling.values()))

    def _close_queued(self) -> None:
        while True:
            try:
                self._waiting.get_nowait().finish([], "cancelled", "the batcher closed")
            except queue.Empty:
                return

    def _drain(self) -> list[Request]:
        out = []
        while True:
            try:
                out.append(self._waiting.get_nowait())
            except queue.Empty:
                return out


class QueueFull(RuntimeError):
    """The batcher's queue is full: try again later (HTTP 503 with Retry-After)."""
