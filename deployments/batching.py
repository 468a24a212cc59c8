"""Continuous batching over the engine's decode-state verbs, free of Ray.

The decoder replica owns one `ContinuousBatcher`: a thread that admits waiting requests into
free slots at step boundaries (one batched prefill for all that fit), steps every live slot,
hands each request its tokens as they come, and frees the slots of finished or cancelled
requests, so a new request never waits for a whole batch to finish. Each request keeps its own
settings, seed and stops; its tokens are those `generation.generate` gives it alone.

    batcher = ContinuousBatcher(ctx, slots=8)
    request = batcher.submit([1, 2, 3], seed=0, settings={"temperature": 0.7, "do_sample": True})
    for token in request.stream(): ...        # or request.result()
    batcher.close()

Serving code never touches arrays: requests carry token id lists, results carry lists.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field

import generation
from generation.generate import check_prompts, check_seeds
from generation.state import row_tokens

_DONE = object()


@dataclass
class Completion:
    """A finished request: its new tokens (without the eos token) and why it ended: "stop"
    (eos or a stop string), "length" (its max_new_tokens), "cancelled", or "error"."""

    tokens: list[int]
    finish_reason: str
    error: str | None = None
    queued_seconds: float = 0.0
    first_token_seconds: float | None = None


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

    def stream(self, timeout: float | None = None):
        """Yield each new token as the batcher makes it; ends when the request does."""
        while True:
            item = self._events.get(timeout=timeout)
            if item is _DONE:
                return
            yield item

    def result(self, timeout: float | None = None) -> Completion:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        return self._completion

    def cancel(self) -> None:
        """Stop the request; its slot is freed at the next step (a client that went away)."""
        self._cancelled = True

    def _emit(self, token: int) -> None:
        if self._first is None:
            self._first = time.perf_counter()
        self._tokens.append(token)
        self._events.put(token)

    def _finish(self, tokens: list[int], reason: str, error: str | None = None, started: float | None = None) -> None:
        self._completion = Completion(list(tokens), reason, error,
                                      queued_seconds=(started or time.perf_counter()) - self.submitted,
                                      first_token_seconds=None if self._first is None else self._first - self.submitted)
        self._events.put(_DONE)
        self._done.set()


class ContinuousBatcher:
    """The generation loop of one decoder: `slots` rows of `capacity` tokens (default: the
    model's context, at most 4096). `max_waiting` bounds the queue: `submit` raises
    `QueueFull` beyond it (the server answers 503)."""

    def __init__(self, ctx, slots: int = 8, capacity: int | None = None, max_waiting: int = 256):
        if ctx.model.is_seq2seq:
            raise ValueError("the batcher runs decoder-only models; encoder-decoder requests go through "
                             "generation.tasks")
        self.ctx, self.slots = ctx, slots
        self.capacity = capacity or min(ctx.model.max_context or 4096, 4096)
        self.max_waiting = max_waiting
        self._waiting: queue.Queue[Request] = queue.Queue()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymuter-batcher", daemon=True)
        self.steps = 0  # decode steps run (for tests and metrics)
        self.running = 0  # requests in slots now
        self._thread.start()

    # -- public -----------------------------------------------------------------------------
    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None) -> Request:
        """Queue a prompt (token ids) with its generation settings (any generation_config
        field: validated here, so a bad one raises ValueError naming it)."""
        if self._stop.is_set():
            raise RuntimeError("the batcher is closed")
        if self._waiting.qsize() >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")
        prompt = check_prompts(self.ctx, [prompt])[0]
        seed = check_seeds([seed], 1)[0]
        resolved = self.ctx.with_settings(**(settings or {}))
        if resolved.num_beams > 1:
            raise ValueError("num_beams > 1 runs through generation.beam_search, not the batcher")
        if not prompt:
            raise ValueError("prompt is empty")
        max_new = min(resolved.new_tokens_for(len(prompt)), self.capacity - len(prompt))
        if max_new < 1:
            raise ValueError(f"the prompt has {len(prompt)} tokens; a slot holds {self.capacity}")
        request = Request(next(self._ids), prompt, seed, resolved, max_new)
        self._waiting.put(request)
        self._wake.set()
        return request

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        ctx = self.ctx
        state = generation.new_state(ctx, self.slots, self.capacity)
        holder: dict[int, Request] = {}  # slot -> request
        started: dict[int, float] = {}
        while not self._stop.is_set():
            try:
                state = self._admit(state, holder, started)
                for slot, request in list(holder.items()):
                    if request._cancelled:
                        self._end(state, holder, slot, "cancelled", started)
                if not holder:
                    self._wake.wait(timeout=0.05)
                    self._wake.clear()
                    continue
                state, out = generation.step(ctx, state)
                self.steps += 1
                for slot, request in list(holder.items()):
                    token = int(out.token[slot])
                    if token >= 0 and not request._cancelled:
                        request._emit(token)
                    if out.finished[slot]:
                        reason = "length" if len(request._tokens) >= request.max_new else "stop"
                        self._end(state, holder, slot, reason, started)
            except Exception as e:  # noqa: BLE001 - every held request learns why, none hangs
                for slot, request in list(holder.items()):
                    request._finish(request._tokens, "error", f"{type(e).__name__}: {e}", started.get(slot))
                holder.clear()
                state = generation.new_state(ctx, self.slots, self.capacity)
            self.running = len(holder)
        for request in list(holder.values()) + self._drain():
            request._finish(request._tokens, "cancelled", "the batcher closed")

    def _admit(self, state, holder: dict, started: dict):
        free = [s for s in state.free_slots().tolist() if s not in holder]
        batch = []
        while free and len(batch) < len(free):
            try:
                request = self._waiting.get_nowait()
            except queue.Empty:
                break
            if not request._cancelled:
                batch.append(request)
            else:
                request._finish([], "cancelled")
        if not batch:
            return state
        slots = free[:len(batch)]
        now = time.perf_counter()
        state, first = generation.admit(self.ctx, state, slots, [r.prompt for r in batch], [r.seed for r in batch],
                                        settings=[r.settings for r in batch], max_new=[r.max_new for r in batch])
        for j, (slot, request) in enumerate(zip(slots, batch)):
            started[slot] = now
            if first.token[j] >= 0:
                request._emit(int(first.token[j]))
            if first.finished[j]:  # ended at its first token: the slot stayed free
                reason = "length" if len(request._tokens) >= request.max_new else "stop"
                request._finish(request._tokens, reason, started=now)
            else:
                holder[slot] = request
        return state

    def _end(self, state, holder: dict, slot: int, reason: str, started: dict) -> None:
        request = holder.pop(slot)
        tokens = request._tokens if reason == "cancelled" else row_tokens(state, slot)
        generation.release(self.ctx, state, slot)
        request._finish(tokens, reason, started=started.pop(slot, None))

    def _drain(self) -> list[Request]:
        out = []
        while True:
            try:
                out.append(self._waiting.get_nowait())
            except queue.Empty:
                return out


class QueueFull(RuntimeError):
    """The batcher's queue is full: try again later (HTTP 503 with Retry-After)."""
