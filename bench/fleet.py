"""A fleet simulation: what one machine cannot hold, with the real deployments, ingress, router and
autoscaler over the known-output fake engine whose step costs what a real engine's does.

A Ray cluster of --nodes worker nodes and a head is started on this machine (ray.cluster_utils):
each worker node takes one decoder replica (resource "decoder"), the head the controller, the
HTTP proxy and the ingress. The fake engine sleeps a + b x rows a step instead of computing it
(deployments/fake.py), a and b measured on the real engine (--measure FOLDER: its decode steps at
batch 1 and at --slots rows; default: SmolLM2-135M-Instruct's in_place steps on 2 threads, from
bench/real.py). Then:

  1. Throughput against replicas: N = 1, 2, 4, ... decoder replicas under a closed loop of
     N x slots x 1.5 streams; tokens/s and efficiency = tok/s / (N x one replica's).
  2. A burst through the autoscaler: the decoder autoscales from 1 to --nodes replicas (its
     occupancy policy, deployments/autoscaling.py); open-loop Poisson arrivals at half of one
     replica's capacity, then 10x that for --burst seconds, then back; p50 / p95 time to first
     token before, during and after the burst, replicas over time, requests lost.
  3. The Ray hops: time to first token of a lone request minus the engine's modelled first step.

    PYTHONPATH=. python bench/fleet.py                     # 8 nodes, ~6 minutes on 2 cores
    PYTHONPATH=. python bench/fleet.py --nodes 16 --burst 30
    PYTHONPATH=. python bench/fleet.py --measure generation/default_model/... --slots 8

Every request asks max_tokens tokens and gets exactly them (the fake ignores eos), so a lost or
cut request is one whose text differs from the fake's known output.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# SmolLM2-135M-Instruct, raymuter in_place, 2 threads (bench/real.py, 2026-12-02): 26 ms a step
# at batch 1, 46 ms at batch 8
REAL_STEP = (0.0231, 0.0029)


def measure_step(folder: str, slots: int) -> tuple[float, float]:
    """(a, b) of a decode step's seconds = a + b x rows, from greedy runs at batch 1 and `slots`."""
    import generation

    model = generation.load(folder)
    times = {}
    for rows in (1, slots):
        ctx = generation.compile(generation.context(model, max_new_tokens=65, eos_token_id=[], do_sample=False),
                                 batch_size=rows)
        prompts = [[5 + i, 6, 7, 8] for i in range(rows)]
        short = generation.context(model, max_new_tokens=1, eos_token_id=[], do_sample=False)
        best = []
        for _ in range(3):
            t0 = time.perf_counter()
            generation.generate(short, prompts)
            t1 = time.perf_counter()
            generation.generate(ctx, prompts)
            best.append((time.perf_counter() - t1 - (t1 - t0)) / 64)  # 64 steps after the prompt's
        times[rows] = min(best)
    b = max(0.0, (times[slots] - times[1]) / (slots - 1))
    return times[1] - b, b


def poisson_arrivals(rate: float, seconds: float, rng: random.Random) -> list[float]:
    """Arrival times (s) of a Poisson process of `rate` per second over [0, seconds)."""
    out, t = [], rng.expovariate(rate)
    while t < seconds:
        out.append(t)
        t += rng.expovariate(rate)
    return out


def burst_schedule(base: float, before: float, burst: float, after: float, factor: float = 10.0,
                   seed: int = 0) -> list[tuple[float, str]]:
    """(arrival time, phase) of open-loop arrivals: `base` per second, `factor` x that during the burst."""
    rng = random.Random(seed)
    out = [(t, "before") for t in poisson_arrivals(base, before, rng)]
    out += [(before + t, "burst") for t in poisson_arrivals(base * factor, burst, rng)]
    out += [(before + burst + t, "after") for t in poisson_arrivals(base, after, rng)]
    return out


async def one_stream(client, url: str, prompt: str, tokens: int, stream: bool = True) -> dict:
    """One completion, streamed (its time to first token) or whole: its text, whether it ended whole."""
    from deployments.fake import fake_tokens

    body = dict(model="fake", prompt=prompt, max_tokens=tokens, stream=stream)
    start, first, text, error = time.perf_counter(), None, [], None
    want = "".join(chr(t) for t in fake_tokens([ord(c) for c in prompt], 0, {"max_new_tokens": tokens}))
    if not stream:
        try:
            response = await client.post(url + "/v1/completions", json=body, timeout=300)
            got = response.json()["choices"][0]["text"] if response.status_code == 200 else ""
        except Exception as e:  # noqa: BLE001 - a lost request, counted
            got, error = "", f"{type(e).__name__}: {e}"
        return {"ttft": None, "whole": got == want, "error": error, "tokens": len(got),
                "seconds": time.perf_counter() - start}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            if response.status_code != 200:
                return {"ttft": None, "whole": False, "error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("message")
                    continue
                piece = event["choices"][0]["text"]
                if piece and first is None:
                    first = time.perf_counter() - start
                text.append(piece)
    except Exception as e:  # noqa: BLE001 - a lost request, counted
        error = f"{type(e).__name__}: {e}"
    return {"ttft": first, "whole": "".join(text) == want, "error": error, "tokens": len("".join(text)),
            "seconds": time.perf_counter() - start}


class Fleet:
    """The simulated cluster and one application on it."""

    def __init__(self, nodes: int, port: int):
        os.environ.update(RAY_SERVE_ENABLE_HA_PROXY="0", RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
        import ray
        from ray import serve
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"front": 4}, "include_dashboard": False, "object_store_memory": 100 * 2**20})
        for _ in range(nodes):
            self.cluster.add_node(num_cpus=1, resources={"decoder": 1}, object_store_memory=80 * 2**20)
        ray.init(address=self.cluster.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        # one HTTP proxy, on the head: on one machine every node's proxy would share the port
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        self.url = f"http://127.0.0.1:{port}"
        self.serve = serve

    def deploy(self, args: dict, replicas: int | None = None, ingress_replicas: int = 1):
        from deployments.app import AppConfig, Decoder, Ingress

        cfg = AppConfig(**args)
        config = cfg.model_dump()
        options = dict(max_replicas_per_node=1, ray_actor_options={"num_cpus": 0.5, "resources": {"decoder": 0.01}})
        if cfg.autoscaling.get("decoder"):
            options["autoscaling_config"] = cfg.autoscaling["decoder"].serve_config("decoder")
        else:
            options["num_replicas"] = replicas
        decoder = Decoder.options(**options)
        ingress = Ingress.options(num_replicas=ingress_replicas,
                                  ray_actor_options={"num_cpus": 0.5, "resources": {"front": 0.01}})
        self.serve.run(ingress.bind(decoder.bind(config), config), name="fleet", route_prefix="/")

    def decoder_replicas(self) -> int:
        status = self.serve.status().applications["fleet"].deployments["Decoder"]
        return status.replica_states.get("RUNNING", 0)

    def close(self):
        import ray

        self.serve.shutdown()
        ray.shutdown()
        self.cluster.shutdown()


async def closed_loop(url: str, streams: int, seconds: float, tokens: int, stream: bool) -> dict:
    """`streams` clients, each sending its next request when the last ends, for `seconds`."""
    import httpx

    done, deadline = [], time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        async def client_loop(i):
            k = 0
            while time.perf_counter() < deadline:
                done.append(await one_stream(client, url, f"{chr(97 + i % 26)}{i} loop {k}", tokens, stream))
                k += 1
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(streams)))
        elapsed = time.perf_counter() - t0
    tokens_done = sum(r["tokens"] for r in done)
    return {"tok_s": tokens_done / elapsed, "requests": len(done), "lost": sum(1 for r in done if not r["whole"])}


async def open_loop(url: str, schedule, tokens: int, fleet: Fleet) -> tuple[list, list]:
    import httpx

    results, replicas = [], []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=2000, max_keepalive_connections=200)) as client:
        t0 = time.perf_counter()

        async def launch(at, phase, i):
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            result = await one_stream(client, url, f"{chr(97 + i % 26)}{i} open", tokens)
            results.append({**result, "phase": phase})

        async def watch():
            while len(results) < len(schedule):
                replicas.append((time.perf_counter() - t0, await asyncio.to_thread(fleet.decoder_replicas)))
                await asyncio.sleep(1.0)
        await asyncio.gather(watch(), *(launch(at, phase, i) for i, (at, phase) in enumerate(schedule)))
    return results, replicas


def pct(values, q):
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else float("nan")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="tokens a request asks (and gets)")
    ap.add_argument("--measure", help="a model folder whose decode step cost the fake engine takes")
    ap.add_argument("--step", type=float, nargs=2, metavar=("A", "B"), help="a step's seconds = A + B x rows")
    ap.add_argument("--seconds", type=float, default=20, help="each closed-loop measurement")
    ap.add_argument("--burst", type=float, default=20, help="seconds of the 10x burst")
    ap.add_argument("--port", type=int, default=28931)
    ap.add_argument("--stream-interval-ms", type=float, default=50.0,
                    help="a stream's chunks at most this often (AppConfig.stream_interval_ms; the first at once): "
                         "every message of every stream crosses this one machine's proxy, ingress and clients")
    args = ap.parse_args(argv)
    if args.step:
        a, b, source = *args.step, "--step"
    elif args.measure:
        (a, b), source = measure_step(args.measure, args.slots), f"measured on {args.measure}"
    else:
        (a, b), source = REAL_STEP, "SmolLM2-135M-Instruct in_place, 2 threads (bench/real.py)"
    print(f"step cost: {a * 1e3:.1f} ms + {b * 1e3:.2f} ms x rows ({source}); {args.slots} slots, "
          f"{args.tokens} tokens a request, {args.nodes} worker nodes, chunks every {args.stream_interval_ms:.0f} ms "
          "at most", flush=True)
    fleet = Fleet(args.nodes, args.port)
    base_args = dict(engine="fake", name="fake", slots=args.slots, step_seconds=a, step_seconds_per_row=b,
                     max_waiting=4096, gpu="no", stream_interval_ms=args.stream_interval_ms)
    try:
        # 3. the hops: a lone request's time to first token against the modelled first step
        fleet.deploy(base_args, replicas=1)
        lone = [asyncio.run(_lone(fleet.url, args.tokens)) for _ in range(10)]
        hops = statistics.median(lone) - (a + b)
        # 1. throughput against replicas
        rows, one = [], None
        counts = [n for n in (1, 2, 4, 8, 16) if n <= args.nodes]
        for n in counts:
            fleet.deploy(base_args, replicas=n, ingress_replicas=max(1, n // 4))
            row = {}
            for stream in (False, True):
                got = asyncio.run(closed_loop(fleet.url, int(n * args.slots * 1.5), args.seconds, args.tokens,
                                              stream))
                row[stream] = got
                print(f"  {n} replicas, {'streamed' if stream else 'whole'}: {got['tok_s']:.0f} tok/s, "
                      f"{got['requests']} requests, {got['lost']} lost", flush=True)
            one = one or {k: v["tok_s"] for k, v in row.items()}
            rows.append((n, row, {k: row[k]["tok_s"] / (n * one[k]) for k in row}))
        # 2. a burst through the autoscaler
        capacity = args.slots / (args.tokens * (a + b * args.slots))  # requests/s one replica finishes
        scaling = dict(min_replicas=1, max_replicas=args.nodes, initial_replicas=1, upscale_delay_s=1,
                       downscale_delay_s=30, metrics_interval_s=0.5, look_back_period_s=2, target_occupancy=0.75)
        fleet.serve.delete("fleet")  # from one replica, not the last measurement's
        fleet.deploy({**base_args, "autoscaling": {"decoder": scaling}}, ingress_replicas=2)
        schedule = burst_schedule(0.5 * capacity, 20, args.burst, 30)
        results, replicas = asyncio.run(open_loop(fleet.url, schedule, args.tokens, fleet))
    finally:
        fleet.close()
    report(rows, results, replicas, hops, lone, args, capacity, a + b)


async def _lone(url: str, tokens: int) -> float:
    import httpx

    async with httpx.AsyncClient() as client:
        result = await one_stream(client, url, "lone request", tokens)
    return result["ttft"]


def report(rows, results, replicas, hops, lone, args, capacity, first_step):
    print("\n## Throughput against decoder replicas (closed loop, 1.5 x slots clients a replica)\n")
    print("Whole: one answer per request; streamed: a server-sent event per token (every message through the")
    print("one machine's proxy, ingress and clients). Efficiency: tok/s / (N x one replica's).\n")
    print("| replicas | whole tok/s | efficiency | streamed tok/s | efficiency | requests | lost |")
    print("|---|---|---|---|---|---|---|")
    for n, row, eff in rows:
        print(f"| {n} | {row[False]['tok_s']:.0f} | {eff[False]:.2f} | {row[True]['tok_s']:.0f} | {eff[True]:.2f} | "
              f"{row[False]['requests'] + row[True]['requests']} | {row[False]['lost'] + row[True]['lost']} |")
    print(f"\n## A 10x burst through the autoscaler (1 to {args.nodes} replicas; base rate "
          f"{0.5 * capacity:.2f} requests/s, half of one replica's)\n")
    print("| phase | requests | p50 TTFT (s) | p95 TTFT (s) | lost |")
    print("|---|---|---|---|---|")
    for phase in ("before", "burst", "after"):
        part = [r for r in results if r["phase"] == phase]
        ttft = [r["ttft"] for r in part]
        print(f"| {phase} | {len(part)} | {pct(ttft, 0.5):.3f} | {pct(ttft, 0.95):.3f} | "
              f"{sum(1 for r in part if not r['whole'])} |")
    peak = max((n for _, n in replicas), default=0)
    trace = ", ".join(f"{t:.0f}s:{n}" for t, n in replicas[::5])
    print(f"\nDecoder replicas (every 5 s): {trace}; peak {peak}")
    print(f"\n## The Ray hops\n\nA lone request's time to first token: median {statistics.median(lone) * 1e3:.1f} ms "
          f"over 10; the engine's modelled first step {first_step * 1e3:.1f} ms: the HTTP proxy, the ingress and the "
          f"Ray hops add {hops * 1e3:.1f} ms a request")


if __name__ == "__main__":
    main()
