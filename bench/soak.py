"""The server's memory over many requests: `raymuter serve` (the default layout unless told), a
closed loop of requests (whole completions, streamed completions and chats in turn, --concurrency
at a time), and each serving process's unique memory (USS: what it alone holds) after every
--every requests; the last line gives each one's growth over the second half of the run, where
caches have filled and only a leak would still add. Goal: flat (within a MB or two).

    python bench/soak.py                                  # 10,000 requests on the default model
    python bench/soak.py --requests 20000 --arena-max 2   # glibc's malloc held to two arenas
    python bench/soak.py --serve-args="--split"           # the two-deployment layout

What it found on the default model (2 cores, 10,000 requests): the Server replica's Python heap is
flat (tracemalloc over the replica: nothing of ours or Serve's grows), and what its USS adds comes
and goes with glibc's malloc: a malloc_trim(0) (through gdb) right after the warm-up returned 29 MB
to the system, and after the run the replica held 1.4 MB more than after that first trim, with
steps of +-5 MB between readings as glibc kept or returned freed memory. The engine process grows
by ~7 MB over the first ~7,000 requests (onnxruntime's arena meeting each batch shape) and is flat
after. --arena-max sets MALLOC_ARENA_MAX for the server's processes, which did not
change that picture (one run flat, one with a +5 MB step).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fuzz import start_server, stop_server  # noqa: E402


def serving_processes(pid: int) -> dict[str, "psutil.Process"]:
    """The replicas and the engine process of `raymuter serve` at `pid`, by a short name."""
    import psutil

    found = {}
    for p in psutil.Process(pid).children(recursive=True):
        try:
            name, command = p.name(), " ".join(p.cmdline())
        except psutil.Error:
            continue
        if name.startswith("ray::ServeReplica:raymuter:"):
            found[name.rsplit(":", 1)[1]] = p
        elif "spawn_main" in command:
            found["engine process"] = p
    return found


async def wave(url: str, count: int, concurrency: int, model: str) -> None:
    import httpx

    limit = asyncio.Semaphore(concurrency)
    completion = {"model": model, "prompt": "The list type", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "The list type"}], "max_tokens": 4}

    async def one(client, i):
        async with limit:
            if i % 3 == 0:
                async with client.stream("POST", url + "/v1/completions", json={**completion, "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
            else:
                r = await client.post(url + ("/v1/chat/completions" if i % 3 == 1 else "/v1/completions"),
                                      json=chat if i % 3 == 1 else completion)
                r.raise_for_status()

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=1000, help="requests between two memory readings")
    parser.add_argument("--warmup", type=int, default=500, help="requests before the first reading")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--model", help="a model folder (default: the default model)")
    parser.add_argument("--serve-args", default="", help="more arguments of raymuter serve")
    parser.add_argument("--arena-max", help="MALLOC_ARENA_MAX for the server's processes (default: glibc's)")
    args = parser.parse_args(argv)
    env = {}
    if args.arena_max is not None:
        env["MALLOC_ARENA_MAX"] = args.arena_max
    process, url = start_server(args.model, None, args.serve_args.split(), env)
    model = "raymuter-default" if args.model is None else os.path.basename(os.path.normpath(args.model))
    try:
        watched = serving_processes(process.pid)
        asyncio.run(wave(url, args.warmup, args.concurrency, model))
        names = sorted(watched)
        print("| requests | seconds | " + " | ".join(f"{n} USS MB" for n in names) + " |")
        print("|---" * (2 + len(names)) + "|")
        readings = []
        for done in range(args.every, args.requests + 1, args.every):
            started = time.perf_counter()
            asyncio.run(wave(url, args.every, args.concurrency, model))
            readings.append([watched[n].memory_full_info().uss / 2**20 for n in names])
            print(f"| {done} | {time.perf_counter() - started:.1f} | " +
                  " | ".join(f"{mb:.1f}" for mb in readings[-1]) + " |", flush=True)
        half = readings[len(readings) // 2 - 1] if len(readings) > 1 else readings[0]
        print("growth over the second half (MB): " +
              ", ".join(f"{n} {last - first:+.1f}" for n, first, last in zip(names, half, readings[-1])))
        return 0
    finally:
        stop_server(process)


if __name__ == "__main__":
    sys.exit(main())
