"""Serving overhead and continuous batching, measured side by side in one run.

Table 1: time to first token (median, p90) and throughput at each concurrency, over HTTP (the
Ray Serve application: HAProxy -> Ingress -> Decoder over gRPC, streamed server-sent events; with
--proxy ray, Serve's Python proxy and actor calls; with --colocate, HAProxy -> Server, the
routes and the decoder in one replica) beside the engine called directly in this process (the
same TextGenerator and batching loop, no Ray), with the same requests, in alternating rounds of
--waves x concurrency requests so both see the same machine; "added" is the HTTP median TTFT
minus the direct one. Table 2: continuous batching (requests join free slots at step
boundaries) against static batching (the same loop admitting a new wave only when the whole
previous wave has finished) on a mix of short and long requests, all sent at once; tokens/s and
the ratio.

    PYTHONPATH=. python bench/serve.py                    # the default model as `raymuter serve` lays it out, ~2 min
    PYTHONPATH=. python bench/serve.py --split            # an Ingress and a Decoder deployment
    PYTHONPATH=. python bench/serve.py --model DIR --slots 8 --requests 32
    PYTHONPATH=. python bench/serve.py --colocate         # `raymuter serve --colocate`
    PYTHONPATH=. python bench/serve.py --colocate --engine-process   # the batching loop in a child process

The HTTP client is aiohttp (`--client httpx` for httpx, heavier on a 2-core machine, where the
client shares the cores with the server).

Every request ignores eos (its length is exactly its max_tokens) so the systems do equal work.
Targets (issue 7): added median TTFT at concurrency 1 <= 10 ms; continuous / static >= 1.5.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROMPTS = ["The list type", "A dictionary maps", "Exceptions are raised when", "The for statement",
           "Modules can import", "A class defines", "Strings are immutable", "The with statement"]


def requests_for(count: int, new: int, seed: int = 0) -> list[dict]:
    rnd = random.Random(seed)
    return [dict(prompt=rnd.choice(PROMPTS), max_tokens=new, seed=i) for i in range(count)]


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


# -- the engine called directly and over HTTP, alternating -----------------------------------
async def direct_run(generator, requests: list[dict], concurrency: int):
    """TTFTs, tokens and seconds of the requests through the TextGenerator in this process."""
    from deployments.schema import Delta, Finish, GenerateRequest

    ttft, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def one(r):
        nonlocal tokens
        async with gate:
            start = time.perf_counter()
            first = None
            request = GenerateRequest(prompt=r["prompt"], seed=r["seed"],
                                      settings={"max_new_tokens": r["max_tokens"], "eos_token_id": []})
            async for event in generator.stream(request):
                if first is None and isinstance(event, Delta) and event.token_ids:
                    first = time.perf_counter() - start
                if isinstance(event, Finish):
                    tokens += event.completion_tokens
            ttft.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return ttft, tokens, time.perf_counter() - start


async def lines(client, url: str, body: dict):
    """A streamed response's lines, through httpx or aiohttp (the client this bench is given)."""
    if hasattr(client, "stream"):  # httpx.AsyncClient
        async with client.stream("POST", url, json=body) as response:
            async for line in response.aiter_lines():
                yield line
        return
    async with client.post(url, json=body) as response:  # aiohttp.ClientSession
        async for raw in response.content:
            yield raw.decode().rstrip("\r\n")


async def http_run(client, url: str, model: str, requests: list[dict], concurrency: int):
    """The same over HTTP: streamed /v1/completions, TTFT at the first chunk with text."""
    ttft, tokens = [], 0
    gate = asyncio.Semaphore(concurrency)

    async def one(r):
        nonlocal tokens
        async with gate:
            body = dict(model=model, prompt=r["prompt"], max_tokens=r["max_tokens"], seed=r["seed"],
                        ignore_eos=True, stream=True, stream_options={"include_usage": True})
            start = time.perf_counter()
            first = None
            async for line in lines(client, url + "/v1/completions", body):
                if first is None and line.startswith("data: {") and '"text": ""' not in line:
                    first = time.perf_counter() - start
                if '"usage"' in line and line.startswith("data: {") and '"choices": []' in line:
                    tokens += json.loads(line[6:])["usage"]["completion_tokens"]
            ttft.append(first)

    start = time.perf_counter()
    await asyncio.gather(*(one(r) for r in requests))
    return ttft, tokens, time.perf_counter() - start


def client_for(concurrency: int, kind: str):
    if kind == "httpx":
        import httpx

        return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency + 4))
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                 connector=aiohttp.TCPConnector(limit=concurrency + 4))


async def level_run(generator, url: str, model: str, requests: list[dict], concurrency: int, waves: int = 4,
                    kind: str = "aiohttp"):
    """Direct and HTTP in alternating rounds of at least 8 requests and `waves` x `concurrency`,
    so both systems see the same state of a noisy machine; one warm-up round of each first. A
    round of `concurrency` requests (waves 1) is one wave that starts and ends together: its
    time is the slowest request's, and a fixed cost per request (the hops before the first token)
    counts in full against throughput; with more waves the closed loop runs at its steady state
    between a ramp up and a tail."""
    size = max(8, waves * concurrency)
    rounds = [requests[i:i + size] for i in range(0, len(requests), size)]
    out = {"direct": ([], 0, 0.0), "http": ([], 0, 0.0)}
    async with client_for(concurrency, kind) as client:
        await direct_run(generator, rounds[0][:2], 2)
        await http_run(client, url, model, rounds[0][:2], 2)
        for work in rounds:
            for kind in ("direct", "http"):
                got = await (direct_run(generator, work, concurrency) if kind == "direct" else
                             http_run(client, url, model, work, concurrency))
                ttft, tokens, seconds = out[kind]
                out[kind] = (ttft + got[0], tokens + got[1], seconds + got[2])
    return {kind: (ttft, tokens / seconds) for kind, (ttft, tokens, seconds) in out.items()}


# -- continuous vs static ----------------------------------------------------------------------
def mix(count: int, short: int, long: int, seed: int = 1) -> list[dict]:
    rnd = random.Random(seed)
    out = [dict(prompt=rnd.choice(PROMPTS), max_tokens=long if i % 4 == 0 else short, seed=i) for i in range(count)]
    rnd.shuffle(out)
    return out


def batching_run(batcher, tokenizer, requests: list[dict], static: bool) -> float:
    """Tokens/s of the loop: all requests at once (continuous), or wave by wave (static)."""
    waves = [requests[i:i + batcher.slots] for i in range(0, len(requests), batcher.slots)] if static else [requests]
    tokens = 0
    start = time.perf_counter()
    for wave in waves:
        handles = [batcher.submit(tokenizer.encode(r["prompt"]).ids, seed=r["seed"],
                                  settings={"max_new_tokens": r["max_tokens"], "eos_token_id": []}) for r in wave]
        tokens += sum(len(h.result(timeout=600).tokens) for h in handles)
    return tokens / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model folder (default: the default model)")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime threads of the decoder (both systems)")
    parser.add_argument("--no-spin", dest="spin", action="store_false",
                        help="the decoder's idle onnxruntime threads sleep between runs (both systems; raymuter serve --no-spin)")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", type=int, default=32,
                        help="requests per concurrency level (at least two rounds: 2 x max(8, waves x concurrency))")
    parser.add_argument("--waves", type=int, default=4,
                        help="a round's requests per concurrency (1: each round is one wave, as before)")
    parser.add_argument("--new", type=int, default=32, help="tokens per request in table 1")
    parser.add_argument("--mix", default="64,16,256", help="requests,short,long tokens for table 2 (1 in 4 long)")
    parser.add_argument("--stream-interval-ms", type=float, default=10.0, help="the server's stream_interval_ms")
    parser.add_argument("--proxy", choices=["haproxy", "ray"], default="haproxy",
                        help="the request path, as `raymuter serve --proxy` (deployments.cli.environment.serving_environment)")
    parser.add_argument("--colocate", action="store_true", default=None,
                        help="the routes in the decoder's replica (AppConfig.colocate)")
    parser.add_argument("--split", action="store_true",
                        help="an Ingress and a Decoder deployment (default: the layout `raymuter serve` picks: "
                             "a decoder-only text model colocated, its loop in a child process)")
    parser.add_argument("--client", choices=["aiohttp", "httpx"], default="aiohttp",
                        help="the HTTP client (aiohttp: the lighter, as vLLM's serving benchmark)")
    parser.add_argument("--engine-process", action="store_true", default=None,
                        help="the decoder's batching loop in a child process of its replica (AppConfig.engine_process)")
    args = parser.parse_args()
    from deployments.cli.arguments import layout

    args.engine = "onnx"  # the real engine: layout() picks as `raymuter serve` does for it
    picked = layout(args)
    args.colocate, args.engine_process = picked["colocate"], picked["engine_process"]

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from deployments.cli.environment import use_serving_environment

    use_serving_environment(args.proxy)
    from generation.default_model import default_model_path
    from generation.text.tokenizer import model_tokenizer

    from deployments.services.generator import TextGenerator

    model = args.model or str(default_model_path())
    levels = [int(c) for c in args.concurrency.split(",")]
    generator = TextGenerator.from_model(model, name="bench", slots=args.slots, threads=args.threads,
                                         spin=args.spin, max_logprobs=5)
    tokenizer = model_tokenizer(generator.batcher.ctx.model)

    # Table 2 first, before Ray starts (in-process loop, nothing else running)
    count, short, long = (int(x) for x in args.mix.split(","))
    work = mix(count, short, long)
    batching_run(generator.batcher, tokenizer, work[: args.slots], static=False)  # warm-up
    rates = {"static": [], "continuous": []}
    for _ in range(3):
        for kind in ("static", "continuous"):
            rates[kind].append(batching_run(generator.batcher, tokenizer, work, static=kind == "static"))

    import ray
    from ray import serve

    from deployments.app import build

    ray.init(address="local", num_cpus=8, include_dashboard=False,  # its own Ray, whatever else runs here
             log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)}})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(dict(model=model, name="bench", slots=args.slots, threads=args.threads, spin=args.spin,
                         max_logprobs=5, stream_interval_ms=args.stream_interval_ms, colocate=args.colocate,
                         engine_process=args.engine_process)),
              name="bench", route_prefix="/")
    url = f"http://127.0.0.1:{port}"

    rows = []
    for level in levels:
        work = requests_for(max(args.requests, 2 * max(8, args.waves * level)), args.new, seed=level)
        got = asyncio.run(level_run(generator, url, "bench", work, level, args.waves, args.client))
        rows.append((level, *got["direct"], *got["http"]))
    serve.shutdown()
    ray.shutdown()
    generator.close()

    print(f"\nmodel: {model}   slots {args.slots}   threads {args.threads}{'' if args.spin else ' (not spinning)'}   {args.new} tokens per request   "
          f"stream_interval_ms {args.stream_interval_ms}   proxy {args.proxy}   colocate {args.colocate}   engine_process {args.engine_process}   client {args.client}   rounds of {args.waves} waves\n")
    print("| concurrency | system | TTFT p50 ms | TTFT p90 ms | tokens/s | HTTP/direct tokens/s | added TTFT p50 ms |")
    print("|---|---|---|---|---|---|---|")
    added_at_1 = None
    for level, d_ttft, d_rate, h_ttft, h_rate in rows:
        added = 1000 * (statistics.median(h_ttft) - statistics.median(d_ttft))
        if level == 1:
            added_at_1 = added
        print(f"| {level} | direct | {1000 * statistics.median(d_ttft):.1f} | {1000 * percentile(d_ttft, 0.9):.1f} | "
              f"{d_rate:.0f} | | |")
        print(f"| {level} | HTTP | {1000 * statistics.median(h_ttft):.1f} | {1000 * percentile(h_ttft, 0.9):.1f} | "
              f"{h_rate:.0f} | {h_rate / d_rate:.2f} | {added:.1f} |")
    best = {k: max(v) for k, v in rates.items()}
    print(f"\n{count} requests, 1 in 4 of {long} tokens, the rest {short}; slots {args.slots}; best of 3\n")
    print("| batching | tokens/s | ratio |")
    print("|---|---|---|")
    print(f"| static (waves) | {best['static']:.0f} | 1.00 |")
    print(f"| continuous | {best['continuous']:.0f} | {best['continuous'] / best['static']:.2f} |")
    if added_at_1 is not None:
        print(f"\ntarget: added median TTFT at concurrency 1 <= 10 ms: {added_at_1:.1f} ms "
              f"{'PASS' if added_at_1 <= 10 else 'FAIL'}")
    ratio = best["continuous"] / best["static"]
    print(f"target: continuous / static >= 1.5: {ratio:.2f} {'PASS' if ratio >= 1.5 else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
