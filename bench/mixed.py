"""Beam searches inside the shared batch against beam searches on threads of their own.

A mixed workload: 32 clients, each sending one request after another (a closed loop); 1 in 4
requests is a beam search (num_beams 4), the rest sample (temperature 0.8, top_k 40); every
request gets --new tokens (no eos), prompts of 8-32 tokens. Two designs serve it, in turns, in
one process:

- "shared": deployments' ContinuousBatcher, the engine's Scheduler: a beam search holds 4 slots
  of the decode state and its rows step in the same model run as every other row.
- "side threads": the design before issue 18 (`SideThreads` below, the old batcher's loop
  reduced to what this workload uses): the batch steps its sampling rows, and each beam search
  runs `generation.beam_search` alone on a thread of its own, its 4 slots held as a count.

The table gives each design's tokens per second (all requests' tokens over the round's wall
time) and its requests' p50 / p95 latency, the median over the rounds, and the ratio to
"side threads" (the machine is shared and noisy: read the ratios). Goal: shared >= 1.3x.

    PYTHONPATH=. python bench/mixed.py                       # ~125M model, ~3 min on 2 cores
    PYTHONPATH=. python bench/mixed.py --model tiny --rounds 2
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402
from decode_systems import model_dirs  # noqa: E402
from generation.engine.batching import ContinuousBatcher  # noqa: E402

SAMPLING = dict(do_sample=True, temperature=0.8, top_k=40)
BEAMS = dict(num_beams=4)


class SideThreads:
    """The old batcher's design: plain rows step in one decode state; a beam request starts
    `generation.beam_search` on its own thread once num_beams slots are free, and holds them
    (as a count) until it ends. `submit(...).result()` as ContinuousBatcher's."""

    def __init__(self, ctx, slots: int, capacity: int):
        self.ctx, self.slots, self.capacity = ctx, slots, capacity
        self._queue: queue.Queue = queue.Queue()
        self._held = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def submit(self, prompt, seed: int, settings: dict):
        request = _Pending(prompt, seed, self.ctx.with_settings(**settings))
        self._queue.put(request)
        return request

    def close(self):
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self):
        ctx = self.ctx
        state = generation.new_state(ctx, self.slots, self.capacity)
        holder, head = {}, None
        while not self._stop.is_set():
            free = state.free_slots().tolist()
            room = len(free) - self._held
            batch = []
            while room > 0:
                if head is None:
                    try:
                        head = self._queue.get_nowait()
                    except queue.Empty:
                        break
                if head.settings.num_beams == 1:
                    batch.append(head)
                    room -= 1
                elif head.settings.num_beams <= room:
                    self._start_beams(head)
                    room -= head.settings.num_beams
                else:
                    break
                head = None
            if batch:
                slots = free[:len(batch)]
                state, first = generation.admit(ctx, state, slots, [r.prompt for r in batch], [r.seed for r in batch],
                                                settings=[r.settings for r in batch],
                                                max_new=[r.settings.max_new_tokens for r in batch])
                holder.update(zip(slots, batch))
            if not holder:
                time.sleep(0.001)
                continue
            state, out = generation.step(ctx, state)
            for slot in np.flatnonzero(out.finished).tolist():
                holder.pop(slot).finish(generation.core.state.row_tokens(state, slot))
                state = generation.release(ctx, state, slot)
            time.sleep(0)

    def _start_beams(self, request):
        with self._lock:
            self._held += request.settings.num_beams

        def run():
            try:
                best = generation.beam_search(self.ctx, [request.prompt], [request.seed], [request.settings])[0]
                request.finish(best[0].tokens)
            finally:
                with self._lock:
                    self._held -= request.settings.num_beams

        threading.Thread(target=run, daemon=True).start()


class _Pending:
    def __init__(self, prompt, seed, settings):
        self.prompt, self.seed, self.settings = prompt, seed, settings
        self._done, self.tokens = threading.Event(), None

    def finish(self, tokens):
        self.tokens = tokens
        self._done.set()

    def result(self, timeout=None):
        self._done.wait(timeout)
        return self


def workload(count: int, vocab: int, new: int, seed: int = 0) -> list[tuple[list[int], int, dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        settings = dict(BEAMS if i % 4 == 0 else SAMPLING, max_new_tokens=new, eos_token_id=[])
        out.append((rng.integers(3, vocab, int(rng.integers(8, 33))).tolist(), i, settings))
    return out


def run_round(server, requests, clients: int) -> dict:
    """Every request once, by `clients` threads that each send their next when the last ended."""
    todo = queue.Queue()
    for r in requests:
        todo.put(r)
    latencies, tokens = [], []
    lock = threading.Lock()

    def client():
        while True:
            try:
                prompt, seed, settings = todo.get_nowait()
            except queue.Empty:
                return
            started = time.perf_counter()
            got = server.submit(prompt, seed, settings).result(timeout=600).tokens
            with lock:
                latencies.append(time.perf_counter() - started)
                tokens.append(len(got))

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    q = np.quantile(latencies, [0.5, 0.95])
    return {"tokens/s": sum(tokens) / wall, "p50 s": float(q[0]), "p95 s": float(q[1]), "tokens": sum(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="small (~125M, default) or tiny")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="requests per round")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--new", type=int, default=24, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime intra-op threads")
    args = parser.parse_args()

    model = generation.load(model_dirs(args.model)["genai"], threads=args.threads)
    ctx = generation.context(model)
    capacity = 32 + args.new + 1
    requests = workload(args.requests, model.vocab_size, args.new)
    designs = {"shared": lambda: ContinuousBatcher(ctx, slots=args.slots, capacity=capacity),
               "side threads": lambda: SideThreads(ctx, args.slots, capacity)}
    results = {name: [] for name in designs}
    warm = requests[:4]
    for name, make in designs.items():  # onnxruntime sets up its kernels for every batch shape once
        server = make()
        run_round(server, warm, 4)
        server.close()
    for r in range(args.rounds):
        for name, make in designs.items():
            server = make()
            results[name].append(run_round(server, requests, args.clients))
            server.close()
            print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[name][-1].items()),
                  file=sys.stderr, flush=True)

    base = {k: statistics.median(x[k] for x in results["side threads"]) for k in ("tokens/s", "p50 s", "p95 s")}
    print(f"\n{args.requests} requests per round ({args.requests // 4} beam searches of 4 beams), {args.clients} "
          f"clients, {args.slots} slots, {args.new} new tokens, model {args.model}, {args.rounds} rounds (medians)\n")
    print("| design | tokens/s | vs side threads | p50 latency s | p95 latency s |")
    print("|---|---|---|---|---|")
    for name in designs:
        m = {k: statistics.median(x[k] for x in results[name]) for k in ("tokens/s", "p50 s", "p95 s")}
        print(f"| {name} | {m['tokens/s']:.1f} | {m['tokens/s'] / base['tokens/s']:.2f}x | {m['p50 s']:.2f} "
              f"| {m['p95 s']:.2f} |")


if __name__ == "__main__":
    main()
