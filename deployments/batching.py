"""Continuous batching over the engine's decode-state verbs, free of Ray.

The decoder replica owns one `ContinuousBatcher`: a thread that admits waiting requests into
free slots at step boundaries (one batched prefill for all that fit), steps every live slot,
hands each request its tokens as they come, and frees the slots of finished or cancelled
requests, so a new request never waits for a whole batch to finish. Each request keeps its own
settings, seed and stops; its tokens are those `generation.generate` gives it alone.

    batcher = ContinuousBatcher(ctx, slots=8)
    request = batcher.submit([1, 2, 3], seed=0, settings={"temperature": 0.7, "do_sample": True})
    for token in request.stream(): ...        # or request.result(); request.events() with log-probs
    batcher.close()

A beam search request (num_beams > 1) holds num_beams slots while it runs; transformers'
`_beam_search` gives its tokens at the end, so they come all at once. A request with
`prompt_lookup_num_tokens` is decoded with prompt lookup (generation.assisted): while one runs,
each step verifies the live rows' candidates and may give a row several tokens, which stream in
order; the tokens are those of plain decoding. A context with a draft model (context(draft=...))
verifies the draft's proposals for every row at every step instead (greedy rows: the plain
tokens; sampling rows: the speculative sampling rule, or the plain tokens where the context
computes log-probabilities).

A failure is kept to the request it belongs to: when a batched admission raises, its requests
are admitted one at a time, and one that fails alone ends with finish_reason "error" (status
400 when its own data was at fault: a ValueError such as generation's SettingError; 500
otherwise); a row whose own part of a step fails (its processors, warpers, draw or stop
strings) ends the same way (500) while the others get the tokens they get alone. Only a
failure of the model's run over the batch ends every row of that step; the loop then goes on
with a fresh state. Every request gets its Completion, whatever happens to the loop.

Serving code never touches arrays: requests carry token id lists, results carry lists.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import generation
import numpy as np
from generation import assisted, limits
from generation.generate import check_prompts, check_seeds
from generation.prompt_logprobs import prompt_logprobs
from generation.settings import SettingError, check_integer
from generation.state import row_tokens

log = logging.getLogger(__name__)

_DONE = object()


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
    engine's setting when it is one; 500: the server was) for the decoder to answer with."""

    tokens: list[int]
    finish_reason: str
    error: str | None = None
    queued_seconds: float = 0.0
    first_token_seconds: float | None = None
    status: int | None = None
    field: str | None = None


@dataclass
class Request:
    """One submitted prompt; read it with `stream()` (tokens as they come) or `result()`."""

    id: int
    prompt: list[int]
    seed: int
    settings: object  # generation.Settings
    max_new: int
    submitted: float = field(default_factory=time.perf_counter)
    _tokens: list = field(default_factory=list)
    _events: queue.Queue = field(default_factory=queue.Queue)
    _done: threading.Event = field(default_factory=threading.Event)
    _cancelled: bool = False
    _completion: Completion | None = None
    _first: float | None = None
    _notify: object = None  # called (from the batcher's thread) after each event
    finished: float | None = None  # perf_counter() when it ended
    encoder: object = None  # an encoder-decoder request's EncoderOutputs (one row)
    beams: int = 1
    prompt_top: int | None = None  # echo with logprobs: the prompt's log-probabilities, with this many alternatives
    prompt_logprobs: object = None  # ... set before its first token (a generation.prompt_logprobs.PromptLogprobs)
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

    async def abatches(self):
        """For asyncio: lists of the Tokens made since the last list (one token when the reader
        keeps up; more when it falls behind, so a slow stream sends fewer, larger messages).
        The batcher's thread wakes the event loop; no thread waits per request."""
        import asyncio

        loop, ready = asyncio.get_running_loop(), asyncio.Event()
        self._notify = lambda: loop.call_soon_threadsafe(ready.set)
        try:
            while True:
                batch = []
                while True:
                    try:
                        item = self._events.get_nowait()
                    except queue.Empty:
                        break
                    if item is _DONE:
                        if batch:
                            yield batch
                        return
                    batch.append(item)
                if batch:
                    yield batch
                    continue
                await ready.wait()
                ready.clear()
        finally:
            self._notify = None

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self._completion

    def cancel(self) -> None:
        """Stop the request; its slot is freed at the next step (a client that went away)."""
        self._cancelled = True

    def _put(self, item) -> None:
        self._events.put(item)
        notify = self._notify
        if notify is not None:
            try:
                notify()
            except RuntimeError:  # the listener's event loop has closed: nobody is waiting
                self._notify = None

    def _emit(self, token: int, logprob: float | None = None, top: list | None = None) -> None:
        if self._first is None:
            self._first = time.perf_counter()
        self._tokens.append(token)
        self._put(Token(token, logprob, top, time.perf_counter()))

    def _finish(self, tokens: list[int], reason: str, error: str | None = None, started: float | None = None,
                status: int | None = None, field: str | None = None) -> None:
        with self._finishing:  # once: the first ending wins (the loop's last sweep may come after)
            if self._done.is_set():
                return
            self.finished = time.perf_counter()
            first = None if self._first is None else self._first - self.submitted
            self._completion = Completion(list(tokens), reason, error,
                                          queued_seconds=(started or time.perf_counter()) - self.submitted,
                                          first_token_seconds=first, status=status, field=field)
            self._done.set()
        self._put(_DONE)

    def _fail(self, error: BaseException, admitting: bool, started: float | None = None) -> None:
        """End with finish_reason "error": status 400 for a ValueError raised while admitting the
        request (its own settings, prompt or images), else 500 (logged with its traceback)."""
        fault = admitting and isinstance(error, ValueError)
        if not fault:
            log.error("request %d failed", self.id, exc_info=error)
        message = (str(error) or type(error).__name__) if fault else f"{type(error).__name__}: {error}"
        self._finish(self._tokens, "error", message, started, status=400 if fault else 500,
                     field=getattr(error, "setting", None) if fault else None)


class ContinuousBatcher:
    """The generation loop of one decoder: `slots` rows of `capacity` tokens (default: the
    model's context, at most 4096). `max_waiting` bounds the queue: `submit` raises
    `QueueFull` beyond it (the server answers 503)."""

    def __init__(self, ctx, slots: int = 8, capacity: int | None = None, max_waiting: int = 256):
        self.ctx, self.slots = ctx, slots
        self.capacity = capacity or min(ctx.model.max_context or 4096, 4096)
        self.max_waiting = max_waiting
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymuter-batcher", daemon=True)
        self.steps = 0  # decode steps run (for tests and metrics)
        self.running = 0  # requests in slots now (a beam search request counts once)
        self.waiting = 0  # requests queued
        self.occupied = 0  # slots held now (a beam search request holds num_beams)
        self._beams_held = 0  # slots reserved by beam searches running beside the loop
        self._held_lock = threading.Lock()
        self._next: Request | None = None  # a beam request waiting for enough free slots
        self._admitting: list[Request] = []  # taken from the queue by an admission, not yet seated
        from generation.budget import CostAware
        from generation.prompt_lookup import PromptLookup

        # rows with prompt_lookup_num_tokens verify their candidates, where they pay for the wider run;
        # a context with a draft model verifies the draft's for every row
        self._lookup = CostAware(PromptLookup(), max_slowdown=limits.MAX_STEP_SLOWDOWN)  # rows of other clients
        self._draft = assisted.candidates_for(ctx) if ctx.draft is not None else None  # text models (context)
        self._thread.start()

    # -- public -----------------------------------------------------------------------------
    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None) -> Request:
        """Queue a prompt (token ids) with its generation settings (any generation_config
        field: validated here, so a bad one raises ValueError naming it). An encoder-decoder
        model's request brings its source through the encoder: `encoder`, an EncoderOutputs of
        one row (the prompt is then the decoder's: decoder_start_token_id, ...)."""
        if self.ctx.model.is_seq2seq and (encoder is None or len(encoder) != 1):
            raise ValueError("an encoder-decoder request needs its encoder outputs (one row): encoder=")
        if self._stop.is_set():
            raise RuntimeError("the batcher is closed")
        if self._waiting.qsize() >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")
        prompt = check_prompts(self.ctx, [prompt])[0]
        seed = check_seeds([seed], 1)[0]
        if settings is not None and not (isinstance(settings, dict) and all(isinstance(k, str) for k in settings)):
            raise SettingError("settings", "settings must be an object of generation settings by name")
        resolved = self.ctx.with_settings(**(settings or {}))
        if not prompt:
            raise SettingError("prompt", "prompt is empty")
        if resolved.prompt_lookup_num_tokens and (resolved.num_beams > 1 or self.ctx.model.is_seq2seq
                                                  or getattr(self.ctx.model, "vision_session", None) is not None):
            raise SettingError("prompt_lookup_num_tokens", "prompt_lookup_num_tokens: prompt lookup runs decoder-only "
                                                           "text models with num_beams=1")
        if resolved.num_beams > self.slots:
            raise SettingError("num_beams", f"num_beams: {resolved.num_beams} beams need as many slots; this decoder "
                                            f"has {self.slots}")
        if resolved.new_tokens_for(len(prompt)) < 1:
            name = "max_new_tokens" if resolved.max_new_tokens is not None else "max_length"
            raise SettingError(name, f"{name}: the settings leave no new token for a prompt of {len(prompt)} tokens")
        max_new = min(resolved.new_tokens_for(len(prompt)), self.capacity - len(prompt))
        if max_new < 1:
            raise SettingError("prompt", f"the prompt has {len(prompt)} tokens; a slot holds {self.capacity}")
        if prompt_logprobs is not None:
            check_integer("prompt_logprobs", prompt_logprobs, 0, limits.MAX_LOGPROBS)
            if self.ctx.model.is_seq2seq or self.ctx.model.graph.has_inputs_embeds:
                raise SettingError("prompt_logprobs", "prompt_logprobs: the prompt's log-probabilities are given "
                                                      "for decoder-only text models")
        request = Request(next(self._ids), prompt, seed, resolved, max_new, beams=resolved.num_beams, encoder=encoder,
                          prompt_top=prompt_logprobs)
        self._waiting.put(request)
        if self._stop.is_set():  # the loop closed while this was queued: nobody will take it
            self._close_queued()
        self.waiting = self._waiting.qsize()
        self._wake.set()
        return request

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        holder: dict[int, Request] = {}  # slot -> request
        reason, error = "cancelled", "the batcher closed"
        try:
            self._run(holder)
        except BaseException as e:  # the loop itself broke: nothing may be left waiting for it
            log.exception("the batcher's loop stopped")
            reason, error = "error", f"the decoder stopped: {type(e).__name__}: {e}"
            raise
        finally:
            self._stop.set()
            for request in list(holder.values()) + self._admitting + self._drain():
                request._finish(request._tokens, reason, error, status=500 if reason == "error" else None)

    def _run(self, holder: dict) -> None:
        ctx = self.ctx
        state = generation.new_state(ctx, self.slots, self.capacity)
        started: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                state = self._admit(state, holder, started)
                for slot, request in list(holder.items()):
                    if request._cancelled:
                        self._end(state, holder, slot, "cancelled", started)
                self._count(holder)
                if not holder:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                if self._draft is not None:
                    state, outs = assisted.verify(ctx, state, self._draft)  # the draft's tokens, checked
                elif any(r.settings.prompt_lookup_num_tokens for r in holder.values()):
                    state, outs = assisted.verify(ctx, state, self._lookup)  # up to 1 + K tokens a row
                else:
                    state, out = generation.step(ctx, state)
                    outs = [out]
                self.steps += 1
                for out in outs:  # each position of the step in order, as plain steps give them
                    for slot, request in list(holder.items()):
                        if slot in out.failed:  # its own part of the step raised: it ends alone
                            self._end(state, holder, slot, "error", started, error=out.failed[slot])
                            continue
                        token = int(out.token[slot])
                        if token >= 0 and not request._cancelled:
                            request._emit(token, *_logprobs_of(out, slot))
                        if out.finished[slot]:
                            reason = "length" if len(request._tokens) >= request.max_new else "stop"
                            self._end(state, holder, slot, reason, started)
                # Let the threads that forward these tokens run now: a small model's steps are
                # mostly Python, and without this they wait for the GIL's 5 ms switch interval.
                time.sleep(0)
            except Exception as e:  # noqa: BLE001 - not one row's (the model's run): every row of the step ends
                log.error("a decode step failed; its %d requests end with an error", len(holder), exc_info=e)
                for slot, request in list(holder.items()) + [(None, r) for r in self._admitting]:
                    request._finish(request._tokens, "error", f"{type(e).__name__}: {e}", started.get(slot), status=500)
                holder.clear()
                self._admitting = []
                state = generation.new_state(ctx, self.slots, self.capacity)
            self._count(holder)

    def _count(self, holder: dict) -> None:
        self.running = len(holder) + self._beam_requests
        self.occupied = len(holder) + self._beams_held
        self.waiting = self._waiting.qsize() + (self._next is not None)

    _beam_requests = 0

    def _take(self, room: int) -> list[Request]:
        """Waiting requests that fit in `room` free slots, in arrival order; beam searches start
        on their own threads. A beam request that does not fit yet waits at the head."""
        batch = []
        while len(batch) < room:
            if self._next is not None:
                request, self._next = self._next, None
            else:
                try:
                    request = self._waiting.get_nowait()
                except queue.Empty:
                    break
            if request._cancelled:
                request._finish([], "cancelled")
            elif request.beams == 1:
                batch.append(request)
            elif request.beams <= room - len(batch):
                self._start_beams(request)
                room -= request.beams
            else:
                self._next = request  # later arrivals wait behind it, so it is not starved
                break
        return batch

    def _start_beams(self, request: Request) -> None:
        with self._held_lock:
            self._beams_held += request.beams
            self._beam_requests += 1

        def run():
            started = time.perf_counter()
            try:
                best = generation.beam_search(self.ctx, [request.prompt], [request.seed], [request.settings],
                                              encoder=request.encoder)[0]
                hypothesis = best[0] if best else generation.Hypothesis([], 0.0)
                logprobs = hypothesis.logprobs or [None] * len(hypothesis.tokens)
                if not request._cancelled:
                    for token, logprob in zip(hypothesis.tokens, logprobs):
                        request._emit(token, logprob)
                reason = "cancelled" if request._cancelled else (
                    "length" if len(hypothesis.tokens) >= request.max_new else "stop")
                request._finish(hypothesis.tokens, reason, started=started)
            except Exception as e:  # noqa: BLE001 - the request learns why
                request._fail(e, admitting=False, started=started)
            finally:
                with self._held_lock:
                    self._beams_held -= request.beams
                    self._beam_requests -= 1
                self._wake.set()

        threading.Thread(target=run, name=f"raymuter-beams-{request.id}", daemon=True).start()

    def _admit(self, state, holder: dict, started: dict):
        """Seat the waiting requests that fit: one batched admission, or, when that raises, one
        admission per request, so that only a request that fails alone fails."""
        free = [s for s in state.free_slots().tolist() if s not in holder]
        room = len(free) - self._beams_held
        batch = self._take(room) if room > 0 else []
        if not batch:
            return state
        self._admitting = batch
        now = time.perf_counter()
        batch = self._prompt_passes(batch, now)
        if not batch:
            self._admitting = []
            return state
        slots = free[:len(batch)]
        try:
            state, first = self._admit_batch(state, slots, batch)
            seated = [(slots, batch, first)]
        except Exception as e:  # noqa: BLE001 - someone's data, or the run: find out one by one
            seated = []
            if len(batch) == 1:
                batch[0]._fail(e, admitting=True, started=now)
            else:
                for slot, request in zip(slots, batch):
                    try:
                        state, first = self._admit_batch(state, [slot], [request])
                        seated.append(([slot], [request], first))
                    except Exception as alone:  # noqa: BLE001 - this request's own failure
                        request._fail(alone, admitting=True, started=now)
        for group in seated:
            for j, (slot, request) in enumerate(zip(*group[:2])):
                if j in group[2].failed:
                    request._fail(group[2].failed[j], admitting=True, started=now)
                elif group[2].token[j] >= 0:
                    request._emit(int(group[2].token[j]), *_logprobs_of(group[2], j))
        time.sleep(0)  # the first tokens go out before the next step (see _loop)
        for slots_, requests, first in seated:
            for j, (slot, request) in enumerate(zip(slots_, requests)):
                if request.done:
                    continue
                if first.finished[j]:  # ended at its first token: the slot stayed free
                    reason = "length" if len(request._tokens) >= request.max_new else "stop"
                    request._finish(request._tokens, reason, started=now)
                else:
                    started[slot] = now
                    holder[slot] = request
        self._admitting = []
        return state

    def _prompt_passes(self, batch: list[Request], now: float) -> list[Request]:
        """The prompt log-probabilities of the requests that asked (echo with logprobs), before
        they are seated: one more pass over each such prompt (generation.prompt_logprobs). The
        requests left to seat: those whose pass failed have ended."""
        for request in batch:
            if request.prompt_top is not None:
                try:
                    request.prompt_logprobs = prompt_logprobs(self.ctx, request.prompt, request.prompt_top)
                except Exception as e:  # noqa: BLE001 - this request's alone
                    request._fail(e, admitting=True, started=now)
        return [request for request in batch if not request.done]

    def _admit_batch(self, state, slots: list[int], batch: list[Request]):
        """generation.admit of `batch` into `slots` (all or nothing: the engine undoes a failed one)."""
        return generation.admit(self.ctx, state, slots, [r.prompt for r in batch], [r.seed for r in batch],
                                settings=[r.settings for r in batch], max_new=[r.max_new for r in batch],
                                encoder=_joined([r.encoder for r in batch]))

    def _end(self, state, holder: dict, slot: int, reason: str, started: dict,
             error: BaseException | None = None) -> None:
        request = holder.pop(slot)
        tokens = request._tokens if reason in ("cancelled", "error") else row_tokens(state, slot)
        generation.release(self.ctx, state, slot)
        if error is not None:
            request._fail(error, admitting=False, started=started.pop(slot, None))
        else:
            request._finish(tokens, reason, started=started.pop(slot, None))

    def _close_queued(self) -> None:
        while True:
            try:
                self._waiting.get_nowait()._finish([], "cancelled", "the batcher closed")
            except queue.Empty:
                return

    def _drain(self) -> list[Request]:
        out = [] if self._next is None else [self._next]
        self._next = None
        while True:
            try:
                out.append(self._waiting.get_nowait())
            except queue.Empty:
                return out


def _joined(encoders: list):
    """The requests' encoder outputs (EncoderOutputs) or images (PromptImages) as one batch's;
    None when no request has any."""
    if all(e is None for e in encoders):
        return None
    from generation.seq2seq import EncoderOutputs
    from generation.vision import PromptImages

    if isinstance(encoders[0], EncoderOutputs):
        ids = None if encoders[0].source_ids is None else [i for e in encoders for i in e.source_ids]
        return EncoderOutputs([h for e in encoders for h in e.hidden], ids)
    if any(e is None for e in encoders):  # text-only requests beside image ones: no features, index positions
        token = next(e for e in encoders if e is not None).image_token_id
        encoders = [e or PromptImages([np.zeros((0, 1), np.float32)], [None], token) for e in encoders]
    return PromptImages([f for e in encoders for f in e.features], [p for e in encoders for p in e.positions],
                        encoders[0].image_token_id)


def _logprobs_of(out, row: int) -> tuple:
    """(logprob, top) of one row of a StepTokens, or (None, None) without log-probabilities."""
    if out.logprob is None:
        return None, None
    top = None if out.top is None else list(zip(out.top_ids[row].tolist(), out.top[row].tolist()))
    return float(out.logprob[row]), top


class QueueFull(RuntimeError):
    """The batcher's queue is full: try again later (HTTP 503 with Retry-After)."""
