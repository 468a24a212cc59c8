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

Where the child computes is the front's to say (`engine_cores` / `reserve_cores`,
generation/runtime/cores.py): it pins itself there before loading, one onnxruntime thread a core.

Decoder-only text models only: an encoder-decoder's or a vision model's request carries arrays
(encoder outputs, image features) and Whisper reads its rows' Jobs back; those stay in process.

If the child dies, every request not ended gets finish_reason "error" with status 503 (the client
may retry: nothing of its own was at fault), and a new child starts at once with the same
arguments; until it is ready, submits raise EngineRestarting (503 with Retry-After). A child that
dies RESTARTS times within RESTART_WINDOW seconds, or fails to start, stops the batcher for good:
`alive` turns false, the decoder's health check fails and Serve replaces the replica. If this
process dies, the child reads the end of the pipe and exits.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from collections import deque
from dataclasses import replace

from generation.logits.constraints import Grammars

from . import batching
from .adapters import AdapterCalls
from .batching import Completion, QueueFull, Request
from .budget import resolved_slots

log = logging.getLogger(__name__)

_TOKEN, _PROMPT, _END = 0, 1, 2  # the kinds of a step's events: (kind, request id, payload)
# A child that dies this many times within this many seconds is not started again.
RESTARTS, RESTART_WINDOW = 3, 300.0


class EngineRestarting(QueueFull):
    """The engine process died and a new one is starting: the request may be sent again soon
    (HTTP 503 with Retry-After, as a full queue)."""


class EngineProcess(AdapterCalls):
    """ContinuousBatcher's interface over a child process that runs one. `ctx`: the model's
    context in this process (settings and checks only); `options`: the front's EngineOptions
    (its slots, capacity, queue bound and prefix budget are read here; the child's loop takes
    them whole); `load`: the arguments of `loader` (the front's batcher_from_model: a function
    the child imports by name) for the child's model (source, options, cores, settings)."""

    def __init__(self, ctx, options, load: dict, start_timeout: float = 600.0, *, loader):
        from generation.engine.scheduler import Scheduler

        self.capacity = options.capacity or min(ctx.model.max_context or 4096, 4096)
        self.ctx, self.slots = ctx, resolved_slots(ctx, options.slots, self.capacity, options.kv_cache_bytes)
        self.max_waiting = options.max_waiting
        self._checks = Scheduler(ctx, self.slots, self.capacity, state=False)  # job() reads the context only
        self.prefix = _PrefixStats() if options.prefix_cache_bytes else None
        self.preemptions = 0  # the child's batcher's, as its steps report them
        self.transfers = None  # the child's cache ledger (Ledger.stats), as its steps report it
        self.lora_counts = (0, 0)  # the child's LoRA bank: adapters resident, evictions (adapter_counts)
        self.running = self.waiting = self.occupied = self.steps = 0
        self.interactive_running = 0  # the child's running rows of priority 0, as its last step message said
        self._requests: dict[int, _Request] = {}
        self._interactive = 0  # the requests of priority 0 among _requests: max_waiting bounds their queue
        self._ids = itertools.count()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # a submit against the reader ending every request of a dead child
        self._stopped: str | None = None  # why the batcher ended for good
        self._restarting: str | None = None  # why a new child is starting
        self._deaths: deque[float] = deque(maxlen=RESTARTS)
        self.restarts = 0
        self.start_timeout = start_timeout
        self.load = load
        self.loader = loader
        self._conn, self.process = self._start_child()
        self._thread = threading.Thread(target=self._read, name="raymuter-engine-reader", daemon=True)
        self._thread.start()

    def _start_child(self):
        """A new child loading the model, once it says it is ready: (its pipe, its process)."""
        spawn = multiprocessing.get_context("spawn")
        conn, child = spawn.Pipe()
        # each submit's priority, read at once by a thread of the child (its loop reads the pipe
        # between steps only): a step of batch rows ends early for an interactive request
        self._urgent = spawn.SimpleQueue()
        process = spawn.Process(target=_child_main, args=(child, self.load, self._urgent, self.loader),
                                name="raymuter-engine", daemon=True)
        process.start()
        child.close()  # the child's end lives in the child only: its exit is this end's EOF
        if not conn.poll(self.start_timeout):
            process.kill()
            raise RuntimeError(f"the engine process did not start within {self.start_timeout:.0f} s")
        try:
            ready = conn.recv()
        except EOFError:
            ready = ("failed", f"it exited with code {process.join(5) or process.exitcode}")
        if ready[0] != "ready":
            raise RuntimeError(f"the engine process could not load the model: {ready[1]}")
        return conn, process

    @property
    def alive(self) -> bool:
        """Whether it serves or will again (a new child starting counts)."""
        return self._stopped is None

    # -- ContinuousBatcher's interface -----------------------------------------------------------
    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None, timestamps: bool = False, untempered: bool = False,
               priority: int = 0, logprobs: bool = True) -> Request:
        """As ContinuousBatcher.submit (settings checked here, ValueError naming the field)."""
        if self._stopped:
            raise RuntimeError(f"the batcher is closed ({self._stopped})")
        if encoder is not None or timestamps or untempered:
            raise ValueError("the engine process runs decoder-only text requests")
        job = self._checks.job(prompt, seed, settings, None, prompt_logprobs, priority=priority, logprobs=logprobs)
        request = _Request(next(self._ids), job.prompt, job.seed, job.settings, job.max_new, beams=job.beams,
                           prompt_top=prompt_logprobs)
        request.engine, request.interactive = self, priority <= 0
        with self._lock:
            if self._restarting:
                raise EngineRestarting(f"the engine process is restarting ({self._restarting})")
            # as ContinuousBatcher: only interactive requests count against max_waiting (a batch's lines
            # wait in a queue of their own, bounded by their sender)
            if request.interactive and self._interactive - self.interactive_running >= self.max_waiting:
                raise QueueFull(f"{self.max_waiting} requests are waiting already")
            self._requests[request.id] = request
            self._interactive += request.interactive
        try:
            self._send(("submit", request.id, job))
            self._urgent.put(priority)  # after the submit: the step it ends finds the job at its boundary
        except OSError:  # the child is gone: the reader is about to start another (or has stopped for good)
            self._forget(request.id)
            if self._stopped:
                raise RuntimeError(f"the batcher is closed ({self._stopped})") from None
            raise EngineRestarting("the engine process is restarting (it exited)") from None
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

    def load_adapter(self, name: str, path: str) -> None:
        """Checked here (this process's model has the adapter path too), then loaded in the child."""
        super().load_adapter(name, path)
        self._send(("lora_load", name, path))
        self._restart_with_adapters()

    def unload_adapter(self, name: str) -> None:
        super().unload_adapter(name)
        self._send(("lora_unload", name))
        self._restart_with_adapters()

    def adapter_counts(self) -> tuple[int, int]:
        """The child's, as its last step message gave them (its bank places the adapters)."""
        return self.lora_counts

    def _restart_with_adapters(self) -> None:
        """A child started after this one loads the adapters known now."""
        known = {name: str(path) for name, path in self.ctx.model.lora.known.items()}
        self.load = {**self.load, "options": self.load["options"].with_adapters(known)}

    # -- the pipe --------------------------------------------------------------------------------
    def _send(self, message) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _read(self) -> None:
        """The children's messages, one child after another: each death ends its requests (503)
        and starts the next, until close() or too many deaths."""
        while True:
            self._read_child(self._conn)
            code = self.process.exitcode
            if self._stopped is None:
                reason = f"the engine process exited with code {code}"
                self._end_requests(reason + "; retry: a new one is starting", restarting=reason)
                self._deaths.append(time.monotonic())
                if len(self._deaths) == RESTARTS and self._deaths[-1] - self._deaths[0] < RESTART_WINDOW:
                    self._stopped = f"{reason}, {RESTARTS} times within {RESTART_WINDOW:.0f} s"
                else:
                    self._restart(reason)
            if self._stopped is not None:
                log.error("%s; the batcher stopped", self._stopped)
                self._end_requests(self._stopped)
                return

    def _read_child(self, conn) -> None:
        requests = self._requests
        try:
            while True:
                events, counts, prefix = conn.recv()
                (self.running, self.occupied, self.waiting, self.steps, self.preemptions,
                 self.interactive_running, self.transfers, self.lora_counts) = counts
                if prefix is not None and self.prefix is not None:
                    self.prefix.queries, self.prefix.hits, self.prefix.bytes = prefix
                for kind, rid, payload in events:
                    request = requests.get(rid)
                    if request is None:
                        continue
                    if kind == _TOKEN:
                        request.emit(*payload)
                    elif kind == _PROMPT:
                        request.prompt_logprobs = payload
                    else:  # the child's Completion, its seconds measured there
                        self._forget(rid)
                        request.settle(payload)
        except (EOFError, OSError):
            pass
        except BaseException:
            log.exception("the engine process's reader stopped")
            self.process.kill()
        finally:
            self.process.join(timeout=5)  # reaped, for its exit code
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)

    def _end_requests(self, reason: str, restarting: str | None = None) -> None:
        """Every request of the child that is gone ends with `reason` and 503: none of them was at
        fault, and the client may send it again. With `restarting`, submits are refused (503)
        until the next child is ready."""
        with self._lock:
            if restarting is not None:
                self._restarting = restarting
            ended = list(self._requests.values())
            self._requests.clear()
            self._interactive = 0
        self.running = self.occupied = self.waiting = self.interactive_running = 0
        if ended:
            log.error("%s: its %d requests end (503)", reason, len(ended))
        for request in ended:
            request.finish(request.emitted, "error", reason, status=503)

    def _forget(self, rid: int) -> None:
        """A request that has ended (or never reached the child), out of the counts."""
        with self._lock:
            request = self._requests.pop(rid, None)
            if request is not None:
                self._interactive -= request.interactive

    def _restart(self, reason: str) -> None:
        log.error("%s; starting a new one", reason)
        started = time.monotonic()
        try:
            conn, process = self._start_child()
        except Exception as e:  # noqa: BLE001 - then Serve replaces the replica
            self._stopped = f"{reason}, and a new one failed to start ({e})"
            return
        if self._stopped is not None:  # closed meanwhile
            conn.close()
            process.kill()
            return
        self._conn, self.process = conn, process
        self.restarts += 1
        with self._lock:
            self._restarting = None
        log.warning("a new engine process serves (started in %.1f s)", time.monotonic() - started)


class _PrefixStats:
    """The child's prefix store's counters, as its last step message gave them (for the metrics)."""

    queries = hits = bytes = 0


class _Request(Request):
    """A request whose tokens the engine process makes; cancel() tells it."""

    engine: EngineProcess | None = None
    interactive: bool = True  # priority 0: counted against max_waiting

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
    the loop's counts. A submit whose constraint this process has not compiled yet (the parent
    compiled and checked it in its own) compiles on a worker thread first, and joins the batch
    at the step boundary after: a compile never holds the loop."""

    conn = None  # set in the child before the loop starts
    _last: tuple = (0, 0, 0, 0, 0, 0, None, (0, 0))  # the counts the parent has (its own start at nothing)
    requests: dict = {}  # the parent's id -> the live request (for its cancel)
    _compiler = None  # a ThreadPoolExecutor, once a constraint needs compiling
    _compiling: dict = {}  # the parent's id -> its job, while its constraint compiles
    _compiled = None  # queue.Queue of (parent's id, job) whose constraint compiled

    def __init__(self, ctx, **loop) -> None:
        super().__init__(ctx, **loop)
        self.max_waiting = 1 << 30  # the parent's queue bounds the requests: each one it sends waits here

    def _take_waiting(self) -> None:
        conn = self.conn
        try:
            while conn.poll(0):
                self._command(conn.recv())
        except (EOFError, OSError):  # the parent is gone
            self._stop.set()
        self._take_compiled()
        super()._take_waiting()

    def _idle(self) -> None:
        try:
            if self.conn.poll(0.002 if self._compiling else batching.IDLE_TICK_SECONDS):  # a compile's end: often
                self._command(self.conn.recv())
        except (EOFError, OSError):
            self._stop.set()

    def _command(self, command) -> None:
        requests = _ForwardingBatcher.requests
        if command[0] == "submit":
            _, rid, job = command
            constraint = job.settings.structured_outputs
            if constraint is not None and not Grammars.of(self.ctx).compiled(constraint):
                self._compile(rid, job)
                return
            self._submit(rid, job)
        elif command[0] == "cancel":
            request = requests.pop(command[1], None)
            if request is not None:
                request.cancel()
            elif command[1] in self._compiling:  # it joins the batch cancelled, and ends at once
                self._compiling[command[1]].cancelled = True
        elif command[0] == "lora_load":  # checked by the parent already
            try:
                self.load_adapter(command[1], command[2])
            except (ValueError, OSError):
                log.exception("adapter %r could not be loaded in the engine process", command[1])
        elif command[0] == "lora_unload":
            self.unload_adapter(command[1])
        elif command[0] == "close":
            self._stop.set()

    def _submit(self, rid: int, job) -> None:
        _Forwarded.next_rid = rid
        try:
            request = self.submit(job.prompt, job=job)
        except Exception as e:  # noqa: BLE001 - the parent checked it already: the server's fault
            _Forwarded.outbox.append((_END, rid, Completion([], "error", f"{type(e).__name__}: {e}", status=500)))
            return
        _ForwardingBatcher.requests[rid] = request  # until its end (_Forwarded._put drops it)

    def _compile(self, rid: int, job) -> None:
        """The job's constraint compiled on a worker thread (into this process's Grammars, where
        its row finds it), then the job submitted from the loop's thread (_take_compiled)."""
        if self._compiler is None:
            import concurrent.futures
            import queue

            self._compiler = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="raymuter-grammar")
            self._compiling, self._compiled = {}, queue.Queue()
        self._compiling[rid] = job

        def compile_it():
            try:
                Grammars.of(self.ctx).check(job.settings.structured_outputs)
            except Exception:  # noqa: BLE001, S110 - its admission then ends it with the error
                pass
            self._compiled.put(rid)

        self._compiler.submit(compile_it)

    def _take_compiled(self) -> None:
        while self._compiled is not None and not self._compiled.empty():
            rid = self._compiled.get_nowait()
            self._submit(rid, self._compiling.pop(rid))

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
        events, counts = _Forwarded.outbox, (self.running, self.occupied, self.waiting, self.steps, self.preemptions,
                                             self.interactive_running, self.transfers if self.steps else None,
                                             self.adapter_counts())
        if not events and counts == self._last:
            return
        _Forwarded.outbox, self._last = [], counts
        prefix = self.prefix
        stats = None if prefix is None else (prefix.queries, prefix.hits, prefix.bytes)
        try:
            self.conn.send((events, counts, stats))
        except OSError:  # the parent is gone
            self._stop.set()


def _interrupts(urgent, scheduler) -> None:
    """The parent's submits' priorities as they come: Scheduler.interrupt_for each."""
    while True:
        try:
            priority = urgent.get()
        except (EOFError, OSError):  # the parent is gone
            return
        scheduler.interrupt_for(priority)


def _child_main(conn, load: dict, urgent, loader) -> None:
    """Load the model (`loader`, with `load`) and run its loop until the parent closes it or goes."""
    _ForwardingBatcher.conn = conn
    batching.Request = _Forwarded  # what ContinuousBatcher.submit makes, in this process
    try:
        batcher = loader(_ForwardingBatcher, **load)
    except BaseException as e:  # noqa: BLE001 - the parent says why it could not start
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    if urgent is not None:
        threading.Thread(target=_interrupts, args=(urgent, batcher.scheduler), name="raymuter-interrupts",
                         daemon=True).start()
    batcher._thread.join()
    conn.close()


def parent_context(ctx, slots: int):
    """The context this process keeps (sized for `slots`, never warmed up: it does not run)."""
    return replace(ctx, batch_size=slots, spare_states=[])
