"""The batching loop in a process of its own, beside the replica's routes.

In one process the routes' event loop and the engine's host Python (sampling, admission, the
step's bookkeeping) share one GIL: on a small model, whose step is mostly Python, every request's
HTTP work delays the next step, and every step delays the next request's bytes. vLLM runs its
engine core in a process of its own for the same reason. `EngineProcess` is a ContinuousBatcher
for TextGenerator whose loop runs in a child process (multiprocessing's spawn): the child loads
the model and runs a ContinuousBatcher; each step, it sends the step's events (tokens, ends) and
the loop's counts in one message over a pipe; a thread here hands them to the Requests that
`submit` gave out, which stream as the in-process ones do (`abatches`, `result`, `cancel`).

This process keeps the model's context, never run, for what the routes ask of it before a
request is queued: its settings, checked here by the scheduler's own `job` (a bad setting raises
ValueError naming it, synchronously), and the model's tokenizer and config. It loads the model
(on the CPU, one thread) to read its graph, then drops the session: the weights are in host
memory once, in the child (SmolLM2-135M: this process 80 MB, 700 MB with the session).

Decoder-only text models only: an encoder-decoder's or a vision model's request carries arrays
(encoder outputs, image features) and Whisper reads its rows' Jobs back; those stay in process.

If the child dies, every request not ended gets finish_reason "error" (500), later submits raise,
and the decoder's health check fails (Serve restarts the replica). If this process dies, the
child reads the end of the pipe and exits.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
from dataclasses import replace

from . import batching
from .batching import Completion, QueueFull, Request

log = logging.getLogger(__name__)

_TOKEN, _PROMPT, _END = 0, 1, 2  # the kinds of a step's events: (kind, request id, payload)


class EngineProcess:
    """ContinuousBatcher's interface over a child process that runs one. `ctx`: the model's
    context in this process (settings and checks only); `load`: ContinuousBatcher.from_model's
    arguments for the child's model (source, threads, settings, ...)."""

    def __init__(self, ctx, load: dict, slots: int = 8, capacity: int | None = None, max_waiting: int = 256,
                 prefix_cache_bytes: int = 0, start_timeout: float = 600.0):
        from generation.core.scheduler import Scheduler

        self.ctx, self.slots = ctx, slots
        self.capacity = capacity or min(ctx.model.max_context or 4096, 4096)
        self.max_waiting = max_waiting
        self._checks = Scheduler(ctx, slots, self.capacity, state=False)  # job() reads the context only
        self.prefix = _PrefixStats() if prefix_cache_bytes else None
        self.running = self.waiting = self.occupied = self.steps = 0
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._stopped: str | None = None  # why the child is gone
        spawn = multiprocessing.get_context("spawn")
        self._conn, child = spawn.Pipe()
        self.load = load = dict(load, slots=slots, capacity=self.capacity, prefix_cache_bytes=prefix_cache_bytes)
        self.process = spawn.Process(target=_child_main, args=(child, load), name="raymuter-engine", daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child only: its exit is this end's EOF
        if not self._conn.poll(start_timeout):
            self.process.kill()
            raise RuntimeError(f"the engine process did not start within {start_timeout:.0f} s")
        try:
            ready = self._conn.recv()
        except EOFError:
            ready = ("failed", f"it exited with code {self.process.join(5) or self.process.exitcode}")
        if ready[0] != "ready":
            raise RuntimeError(f"the engine process could not load the model: {ready[1]}")
        self._thread = threading.Thread(target=self._read, name="raymuter-engine-reader", daemon=True)
        self._thread.start()

    # -- ContinuousBatcher's interface -----------------------------------------------------------
    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None, timestamps: bool = False, untempered: bool = False) -> Request:
        """As ContinuousBatcher.submit (settings checked here, ValueError naming the field)."""
        if self._stopped:
            raise RuntimeError(f"the batcher is closed ({self._stopped})")
        if encoder is not None or timestamps or untempered:
            raise ValueError("the engine process runs decoder-only text requests")
        if len(self._requests) - self.running >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")
        job = self._checks.job(prompt, seed, settings, None, prompt_logprobs)
        request = _Request(next(self._ids), job.prompt, job.seed, job.settings, job.max_new, beams=job.beams,
                           prompt_top=prompt_logprobs)
        request.engine = self
        self._requests[request.id] = request
        try:
            self._send(("submit", request.id, job))
        except OSError:
            self._requests.pop(request.id, None)
            raise RuntimeError(f"the batcher is closed ({self._stopped or 'the engine process is gone'})") from None
        return request

    def close(self) -> None:
        if self._stopped is None:
            self._stopped = "the batcher closed"
        try:
            self._send(("close",))
        except OSError:
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
        self._thread.join(timeout=5)

    # -- the pipe --------------------------------------------------------------------------------
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        requests, conn = self._requests, self._conn
        try:
            while True:
                events, counts, prefix = conn.recv()
                self.running, self.occupied, self.waiting, self.steps = counts
                if prefix is not None and self.prefix is not None:
                    self.prefix.queries, self.prefix.hits, self.prefix.bytes = prefix
                for kind, rid, payload in events:
                    request = requests.get(rid)
                    if request is None:
                        continue
                    if kind == _TOKEN:
                        request._emit(*payload)
                    elif kind == _PROMPT:
                        request.prompt_logprobs = payload
                    else:  # the child's Completion, its seconds measured there
                        del requests[rid]
                        request._settle(payload)
        except (EOFError, OSError):
            pass
        except BaseException:
            log.exception("the engine process's reader stopped")
        finally:
            self.process.join(timeout=1)  # reaped, for its exit code
            code = self.process.exitcode
            if self._stopped is None:
                self._stopped = f"the engine process exited (code {code})"
                log.error("%s; its %d requests end with an error", self._stopped, len(requests))
            for request in list(requests.values()):
                request._finish(request._tokens, "error", self._stopped, status=500)
            requests.clear()


class _PrefixStats:
    """The child's prefix store's counters, as its last step message gave them (for the metrics)."""

    queries = hits = bytes = 0


class _Request(Request):
    """A request whose tokens the engine process makes; cancel() tells it."""

    engine: EngineProcess | None = None

    def cancel(self) -> None:
        super().cancel()
        try:
            self.engine._send(("cancel", self.id))
        except (OSError, AttributeError):
            pass


# -- the child -------------------------------------------------------------------------------------
class _Forwarded(Request):
    """A child-side request: its events go to the step's message instead of a queue."""

    outbox: list = []  # the events since the last message (the loop's thread appends, and swaps it)
    next_rid = -1  # the parent's id of the request being submitted (only the command thread submits)
    _prompt_sent: bool = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.rid = _Forwarded.next_rid

    def _put(self, item) -> None:
        if self.prompt_logprobs is not None and not self._prompt_sent:  # before its first token, or its end
            self._prompt_sent = True
            _Forwarded.outbox.append((_PROMPT, self.rid, self.prompt_logprobs))
        if item is batching._DONE:
            _ForwardingBatcher.requests.pop(self.rid, None)
            _Forwarded.outbox.append((_END, self.rid, self._completion))
        else:
            _Forwarded.outbox.append((_TOKEN, self.rid, (item.id, item.logprob, item.top)))


class _ForwardingBatcher(batching.ContinuousBatcher):
    """The child's loop, on one thread: the parent's commands read from the pipe at each step
    boundary (blocking while idle), and after each step one message with the step's events and
    the loop's counts."""

    conn = None  # set in the child before the loop starts
    _last: tuple = (0, 0, 0, 0)  # the counts the parent has (its own start at nothing)
    requests: dict = {}  # the parent's id -> the live request (for its cancel)

    def _take_waiting(self) -> None:
        conn = self.conn
        try:
            while conn.poll(0):
                self._command(conn.recv())
        except (EOFError, OSError):  # the parent is gone
            self._stop.set()
        super()._take_waiting()

    def _idle(self) -> None:
        try:
            if self.conn.poll(0.05):
                self._command(self.conn.recv())
        except (EOFError, OSError):
            self._stop.set()

    def _command(self, command) -> None:
        requests = _ForwardingBatcher.requests
        if command[0] == "submit":
            _, rid, job = command
            _Forwarded.next_rid = rid
            try:
                request = self.submit(job.prompt, job=job)
            except Exception as e:  # noqa: BLE001 - the parent checked it already: the server's fault
                _Forwarded.outbox.append((_END, rid, Completion([], "error", f"{type(e).__name__}: {e}", status=500)))
                return
            requests[rid] = request  # until its end (_Forwarded._put drops it)
        elif command[0] == "cancel":
            request = requests.pop(command[1], None)
            if request is not None:
                request.cancel()
        elif command[0] == "close":
            self._stop.set()

    def _count(self) -> None:
        super()._count()
        self._flush()

    def _admitted(self, updates) -> None:
        super()._admitted(updates)
        self._count()  # the first tokens go now, not after the step's run

    def _loop(self) -> None:
        try:
            super()._loop()
        finally:
            self._flush()

    def _flush(self) -> None:
        events, counts = _Forwarded.outbox, (self.running, self.occupied, self.waiting, self.steps)
        if not events and counts == self._last:
            return
        _Forwarded.outbox, self._last = [], counts
        prefix = self.prefix
        stats = None if prefix is None else (prefix.queries, prefix.hits, prefix.bytes)
        try:
            self.conn.send((events, counts, stats))
        except OSError:  # the parent is gone
            self._stop.set()


def _child_main(conn, load: dict) -> None:
    """Load the model and run its loop until the parent closes it or goes."""
    _ForwardingBatcher.conn = conn
    batching.Request = _Forwarded  # what ContinuousBatcher.submit makes, in this process
    try:
        batcher = _ForwardingBatcher.from_model(**load, max_waiting=1 << 30)
    except BaseException as e:  # noqa: BLE001 - the parent says why it could not start
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    batcher._thread.join()
    conn.close()


def parent_context(ctx, slots: int):
    """The context this process keeps (sized for `slots`, never warmed up: it does not run)."""
    return replace(ctx, batch_size=slots, spare_states=[])
