"""Chunked prefill's budget (`raymuter serve --prefill-chunk-tokens`), served: time to first token
and inter-token latency at each budget on the real SmolLM2-135M (issue 42; optional, not in CI).

bench/peers.py's server, client and prompts, without vLLM: `raymuter serve` on the genai fp32
build of `bench/real_models.py`, its defaults plus `--prefill-chunk-tokens B`, requests streamed
through /v1/completions, greedy, 64 new tokens with ignore_eos (every budget does equal work),
every prompt its own (no prefix cache hit). Two workloads, each at every concurrency level:
- short: every prompt 32 tokens (issue 42's and bench/peers.py's);
- long: one request in four has a prompt of --long tokens (default 512), the rest 32: long
  prompts arrive while rows decode, the case chunks are for.
Each round starts one server per budget in turn (the order rotates by round, so each budget
meets the machine in several states), warms it up, runs every level of both workloads, stops it.

    PYTHONPATH=. .venv/bin/python bench/chunked_prefill.py                        # 0,32,64,128,256,512; ~25 min
    PYTHONPATH=. .venv/bin/python bench/chunked_prefill.py --budgets 0,64 --rounds 1 --concurrency 8

Columns, each the median over the rounds of one round's value (a shared machine's load comes and
goes: a median of runs is steadier than percentiles over all of them): TTFT p50 / p90 (send to the
first chunk with text), ITL p50 / p90 / p99 (gaps between a request's chunks with text, or its
tokens with --direct: a running row's pace, and its stalls), tokens/s (completion tokens over the
level's wall time). Compare budgets within one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import peers  # noqa: E402 - bench/peers.py: its server, client and prompts
import serve as serving  # noqa: E402 - bench/serve.py: the HTTP client


def long_ids(tokenizer, key: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids, each beginning with its own number, the rest
    peers.SENTENCES in a seeded order (as many as it takes)."""
    out = []
    for i in range(count):
        rnd = random.Random(f"{key}/{i}")
        text = f"Note {key} {i}."
        ids: list[int] = []
        while len(ids) < length:
            text += " " + " ".join(rnd.sample(peers.SENTENCES, len(peers.SENTENCES)))
            ids = tokenizer.encode(text, add_special_tokens=False).ids
        out.append(ids[:length])
    return out


def workloads(tokenizer, levels: list[int], long: int, tag: str = "") -> dict[tuple[str, int], list[list[int]]]:
    """(workload, concurrency) -> its prompts: 2 x concurrency requests (at least 16); `tag` makes
    them others (a server that keeps prefixes never sees one twice)."""
    work = {}
    for c in levels:
        count = max(16, 2 * c)
        work[("short", c)] = peers.prompt_ids(tokenizer, f"short{c}{tag}", count, 32)
        mixed = peers.prompt_ids(tokenizer, f"mix{c}{tag}", count, 32)
        for i, prompt in enumerate(long_ids(tokenizer, f"long{c}{tag}", count // 4, long)):
            mixed[4 * i + 1] = prompt  # the long ones spread through the queue, not first
        work[("long", c)] = mixed
    return work


def session(args, dirs, logs, budget: int, tag: str, work: dict) -> dict:
    """One server at `budget`: start, warm up, every level of `work`, stop."""
    args.raymuter_arg = [*args.extra, f"--prefill-chunk-tokens={budget}"]
    print(f"[chunked] {tag}: starting raymuter serve --prefill-chunk-tokens={budget}", file=sys.stderr, flush=True)
    server, url, model, startup = peers.start_server("raymuter", args, dirs, None, logs, f"{tag}-b{budget}")
    out = {}
    try:
        async def run():
            async with serving.client_for(max(c for _, c in work), "aiohttp") as client:
                await peers.stream_level(client, url, model, work[("short", min(c for _, c in work))][:2], 2,
                                        args.new)
                for (kind, c), prompts in work.items():
                    got = await peers.stream_level(client, url, model, prompts, c, args.new)
                    got["pss"] = 0
                    out[(kind, c)] = got
                    s = peers.summarize([got])
                    print(f"[chunked] {tag}: budget {budget} {kind} c={c}: TTFT p50 {peers._ms(s['ttft_p50'])} ms, "
                          f"ITL p50 {peers._ms(s['itl_p50'])} ms, {s['tok_s']:.1f} tok/s, errors {s['errors']}",
                          file=sys.stderr, flush=True)

        asyncio.run(run())
    finally:
        server.stop()
    return out


def direct_level(batcher, prompts: list[list[int]], concurrency: int, new: int) -> dict:
    """The prompts through the batcher in this process (the loop a decoder replica runs), at most
    `concurrency` at once (a closed loop of that many clients); per request the times of its
    tokens as the batcher made them (Token.at), in stream_level's shape."""
    import threading

    rows: list[dict] = [{} for _ in prompts]
    queue = iter(range(len(prompts)))
    lock = threading.Lock()

    def client():
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return
            request = batcher.submit(prompts[i], settings={"max_new_tokens": new, "eos_token_id": []})
            result = request.result(timeout=3600)
            times = [token.at for token in request.events()]
            rows[i] = dict(start=request.submitted, end=request.finished, times=times, tokens=len(result.tokens),
                           text="", error=result.error)

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return dict(rows=rows, seconds=time.perf_counter() - started, pss=0)


def direct(args, dirs, budgets: list[int], work: dict, tokenizer) -> dict[int, list[dict]]:
    """--direct: one batcher (raymuter serve's engine defaults), the budgets in turn at each level
    of each round (the order rotating), so each budget meets the machine as the others do; each
    run's prompts its own (its prefix store finds none of another run's)."""
    from generation.engine.batching import ContinuousBatcher

    batcher = ContinuousBatcher.from_model(str(dirs["genai"]), slots=32, prefix_cache_bytes=256 * 2**20,
                                           max_logprobs=20, threads=args.threads)
    results: dict[int, list[dict]] = {b: [] for b in budgets}
    try:
        direct_level(batcher, work[("short", 8)][:4], 4, args.new)  # warm-up
        for r in range(args.rounds):
            got = {b: {} for b in budgets}
            for k, key in enumerate(work):
                turn = (r + k) % len(budgets)
                for budget in budgets[turn:] + budgets[:turn]:
                    batcher.scheduler.prefill_chunk_tokens = budget  # between levels: the loop is idle
                    prompts = workloads(tokenizer, [key[1]], args.long, f"-r{r}-b{budget}")[key]
                    level = direct_level(batcher, prompts, key[1], args.new)
                    got[budget][key] = level
                    s = peers.summarize([level])
                    print(f"[chunked] round{r}: budget {budget} {key[0]} c={key[1]}: TTFT p50 "
                          f"{peers._ms(s['ttft_p50'])} ms, ITL p50 {peers._ms(s['itl_p50'])} ms, "
                          f"{s['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
            for budget in budgets:
                results[budget].append(got[budget])
    finally:
        batcher.close()
    return results


def itl_p99(levels: list[dict]) -> float | None:
    gaps = [b - a for level in levels for r in level["rows"] if r["times"] for a, b in zip(r["times"], r["times"][1:])]
    return peers._pct(gaps, 0.99)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budgets", default="0,32,64,128,256,512", help="prefill chunk budgets (0: whole prompts)")
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--long", type=int, default=512, help="tokens of the long workload's long prompts")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--raymuter-arg", dest="extra", action="append", default=[], metavar="FLAG",
                    help="a flag added to every `raymuter serve`")
    ap.add_argument("--json", type=Path, help="also write every measure here")
    ap.add_argument("--direct", action="store_true",
                    help="the engine's batching loop in this process (ContinuousBatcher, raymuter serve's engine "
                         "defaults), the budgets alternating level by level: no server start per budget, token "
                         "times as the loop made them (ITL per token)")
    ap.add_argument("--threads", type=int, help="--direct: onnxruntime threads (default: all CPUs, as raymuter serve)")
    args = ap.parse_args(argv)
    budgets = [int(b) for b in args.budgets.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    import tempfile

    from decode_systems import model_dirs
    from tokenizers import Tokenizer

    logs = Path(tempfile.mkdtemp(prefix="raymuter-chunked-"))
    dirs = model_dirs("real")
    tokenizer = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    work = workloads(tokenizer, sorted(set(levels) | {8}), args.long)
    work = {key: prompts for key, prompts in work.items() if key[1] in levels or key == ("short", 8)}
    results: dict[int, list[dict]] = {b: [] for b in budgets}
    began = time.monotonic()
    signal.signal(signal.SIGTERM, peers._interrupt)  # a stopped bench stops its servers too
    try:
        if args.direct:
            results = direct(args, dirs, budgets, work, tokenizer)
        else:
            for r in range(args.rounds):
                order = budgets[r % len(budgets):] + budgets[:r % len(budgets)]
                for budget in order:
                    results[budget].append(session(args, dirs, logs, budget, f"round{r}", work))
    except KeyboardInterrupt:
        print("[chunked] interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        for managed in list(peers.STARTED):
            managed.stop(grace=20)
    how = ("the batching loop in process (--direct)" if args.direct
           else "raymuter serve defaults + --prefill-chunk-tokens")
    print(f"\nSmolLM2-135M fp32 (genai build), {how}; greedy, "
          f"{args.new} new tokens; {args.rounds} rounds; long: 1 in 4 prompts of {args.long} tokens, the rest 32\n")
    print("| workload | c | budget | TTFT p50 ms | TTFT p90 ms | ITL p50 ms | ITL p90 ms | ITL p99 ms | tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    table = []
    for kind in ("short", "long"):
        for c in levels:
            for budget in budgets:
                runs = [got[(kind, c)] for got in results[budget] if (kind, c) in got]
                if not runs:
                    continue
                each = [dict(peers.summarize([run]), itl_p99=itl_p99([run])) for run in runs]
                row = dict(workload=kind, c=c, budget=budget, rounds=each,
                           **{k: statistics.median(e[k] for e in each) for k in (
                               "ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "itl_p99", "tok_s")})
                table.append(row)
                errors = sum(e["errors"] for e in each)
                print(f"| {kind} | {c} | {budget or 'whole'} | {peers._ms(row['ttft_p50'])} | "
                      f"{peers._ms(row['ttft_p90'])} | {peers._ms(row['itl_p50'])} | {peers._ms(row['itl_p90'])} | "
                      f"{peers._ms(row['itl_p99'])} | {row['tok_s']:.1f} |" + (f" errors {errors}" if errors else ""))
    print(f"\n{time.strftime('%Y-%m-%d %H:%M')}; took {(time.monotonic() - began) / 60:.1f} min; logs in {logs}")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
