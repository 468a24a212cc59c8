"""Batch inference on the real model: `raymuter batch` against the engine's offline `generate`,
and an interactive request's first token with and without a server batch running.

    PYTHONPATH=. .venv/bin/python bench/batch.py                 # both parts: ~10 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/batch.py --lines 64 --no-served

The model is SmolLM2-135M fp32 as `bench/real_models.py` builds it (its genai folder, in_place),
greedy, `--prompt` tokens a prompt, `--new` new tokens a line (ignore_eos: every line is as long).

1. Throughput. The same `--lines` prompts run, alternately (`--rounds`):
   - offline: `generation.generate` over the compiled context at `--slots` rows a call (the
     engine at full slots, in a worker process of its own: bench/peers.py's);
   - `raymuter batch INPUT OUTPUT --replicas 1 --slots N`: the command as a user runs it (a local
     Ray, its engine actor, Ray Data reading and writing). Two rates: whole (tokens over the
     command's wall time, Ray's and the model's start included) and steady (while the answers
     come: the tokens of the lines from the first N answers seen in OUTPUT to the last, over the
     seconds between; OUTPUT is polled every 0.2 s).
   The goal (issue 41): steady >= 0.95x offline.
2. Interactive first tokens under a batch. `raymuter serve` (its defaults); `--probes` streamed
   completions one after another, a `--gap` apart: their TTFT p50 alone, then again while a batch
   of `--served-lines` lines runs through /v1/files + /v1/batches (batch rows have priority 1:
   interactive ones take their slots at the next step), then alone again once it has ended (the
   alone p50 is of both: a machine that slowed or sped up meanwhile shows as two alones apart). The goal: <= 1.2x. The batch's own
   tokens/s as the server ran it is printed too.

The machine is shared and noisy: read the ratios of one run, measured interleaved.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def batch_file(path: Path, prompts: list[list[int]], new: int, model: str) -> None:
    with path.open("w") as out:
        for i, prompt in enumerate(prompts):
            body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, ignore_eos=True)
            out.write(json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
                                  "body": body}) + "\n")


def run_command(dirs, prompts, args, logs: Path, tag: str) -> dict:
    """`raymuter batch` over the prompts: its wall seconds, tokens, and its steady tokens/s: the
    lines' tokens over the time they took to come, from the first `--slots` answers seen in
    OUTPUT (the command appends them as they come) to the last (Ray's start, the model's load and
    the first rows' prompts before; the shut-down after)."""
    work = Path(tempfile.mkdtemp(prefix=f"batch-{tag}-", dir=logs))
    source, output = work / "in.jsonl", work / "out.jsonl"
    batch_file(source, prompts, args.new, dirs["genai"].name)  # the served name: the folder's
    command = [str(Path(sys.executable).with_name("raymuter")), "batch", str(source), str(output),
               "--model", str(dirs["genai"]), "--slots", str(args.slots), "--replicas", "1", "--quiet",
               *args.raymuter_arg]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    began = time.monotonic()
    seen = []  # (seconds, lines in OUTPUT)
    with open(logs / f"batch-{tag}.log", "w") as log:
        proc = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            time.sleep(0.2)
            if output.exists():
                with output.open("rb") as f:
                    seen.append((time.monotonic() - began, sum(1 for _ in f)))
    seconds = time.monotonic() - began
    if proc.returncode != 0:
        raise RuntimeError(f"raymuter batch failed ({proc.returncode}); see {logs / f'batch-{tag}.log'}")
    tokens = 0
    for text in output.read_text().splitlines():
        line = json.loads(text)
        tokens += line["response"]["body"]["usage"]["completion_tokens"]
    first = next(((t, c) for t, c in seen if c >= args.slots), None)
    last = next(((t, c) for t, c in seen if c >= len(prompts)), None)
    steady = None
    if first and last and last[0] > first[0]:
        steady = (last[1] - first[1]) * args.new / (last[0] - first[0])
    return dict(seconds=seconds, tokens=tokens, steady=steady)


def throughput(args, dirs, tokenizer, logs: Path) -> dict:
    from peers import Worker, prompt_ids  # bench/peers.py

    prompts = prompt_ids(tokenizer, "batch", args.lines, args.prompt)
    offline_rates, batch_rates, steady_rates = [], [], []
    worker = Worker("raymuter", argparse.Namespace(), dirs, None, logs)
    try:
        worker.call(prompts[:args.slots], args.new)  # compiles the context at this batch size
        for r in range(args.rounds):
            for kind in (("offline", "batch") if r % 2 == 0 else ("batch", "offline")):
                if kind == "offline":
                    seconds, tokens = 0.0, 0
                    for i in range(0, len(prompts), args.slots):
                        answer = worker.call(prompts[i:i + args.slots], args.new)
                        seconds += answer["seconds"]
                        tokens += sum(len(row) for row in answer["tokens"])
                    offline_rates.append(tokens / seconds)
                    print(f"[batch] round {r}: offline {tokens / seconds:.1f} tok/s", file=sys.stderr, flush=True)
                else:
                    got = run_command(dirs, prompts, args, logs, f"round{r}")
                    batch_rates.append(got["tokens"] / got["seconds"])
                    steady_rates.append(got["steady"])
                    print(f"[batch] round {r}: raymuter batch {batch_rates[-1]:.1f} tok/s whole "
                          f"({got['seconds']:.1f} s), steady {got['steady'] or 0:.1f}", file=sys.stderr, flush=True)
    finally:
        worker.close()
    return dict(offline=_median(offline_rates), whole=_median(batch_rates), steady=_median(steady_rates))


async def _probe(client, url: str, model: str, prompt: list[int], new: int) -> float | None:
    """One streamed completion; seconds to its first text."""
    import serve as serving  # bench/serve.py

    body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True)
    start = time.perf_counter()
    async for line in serving.lines(client, url + "/v1/completions", body):
        if line.startswith("data: {") and json.loads(line[6:]).get("choices", [{}])[0].get("text"):
            return time.perf_counter() - start
    return None


async def probes(url: str, model: str, prompts, args) -> list[float]:
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for prompt in prompts:
            ttft = await _probe(client, url, model, prompt, args.probe_new)
            if ttft is not None:
                out.append(ttft)
            await asyncio.sleep(args.gap)
    return out


def served(args, dirs, tokenizer, logs: Path) -> dict:
    """TTFT p50 of the probes alone and beside a server batch; the batch's tok/s."""
    import httpx

    from peers import prompt_ids, start_server

    server, url, model, _ = start_server("raymuter", args, dirs, None, logs, "batch")
    try:
        warm = prompt_ids(tokenizer, "warm", 2, args.prompt)
        asyncio.run(probes(url, model, warm, args))
        alone = asyncio.run(probes(url, model, prompt_ids(tokenizer, "alone", args.probes, args.prompt), args))
        source = logs / "served-batch.jsonl"
        batch_file(source, prompt_ids(tokenizer, "served", args.served_lines, args.prompt), args.new, model)
        with source.open("rb") as f:
            uploaded = httpx.post(url + "/v1/files", files={"file": ("batch.jsonl", f)}, data={"purpose": "batch"},
                                  timeout=60)
        uploaded.raise_for_status()
        created = httpx.post(url + "/v1/batches", timeout=60, json={
            "input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"})
        created.raise_for_status()
        batch_id = created.json()["id"]
        began = time.monotonic()
        while _batch(url, batch_id)["request_counts"]["completed"] < 1:  # rows under way
            time.sleep(0.2)
        beside = asyncio.run(probes(url, model, prompt_ids(tokenizer, "beside", args.probes, args.prompt), args))
        status = _batch(url, batch_id)
        still_running = status["status"] == "in_progress"
        while status["status"] not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.5)
            status = _batch(url, batch_id)
        seconds = time.monotonic() - began
        counts = status["request_counts"]
        # alone again, after the batch: a machine whose speed drifted meanwhile shows as two alones apart
        after = asyncio.run(probes(url, model, prompt_ids(tokenizer, "after", args.probes, args.prompt), args))
    finally:
        server.stop()
    import serve as serving

    return dict(alone=serving.percentile(alone + after, 0.5), before=serving.percentile(alone, 0.5),
                after=serving.percentile(after, 0.5), beside=serving.percentile(beside, 0.5),
                batch_tok_s=counts["completed"] * args.new / seconds, batch_status=status["status"],
                counts=counts, overlapped=still_running)


def _batch(url: str, batch_id: str) -> dict:
    import httpx

    answer = httpx.get(f"{url}/v1/batches/{batch_id}", timeout=60)
    answer.raise_for_status()
    return answer.json()


def _median(values):
    import statistics

    values = [v for v in values if v]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=512, help="prompts of the throughput part")
    parser.add_argument("--slots", type=int, default=32, help="rows at once (offline batch size, --slots)")
    parser.add_argument("--prompt", type=int, default=32, help="tokens a prompt")
    parser.add_argument("--new", type=int, default=64, help="new tokens a line")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probes", type=int, default=12, help="interactive requests, each phase")
    parser.add_argument("--probe-new", type=int, default=8, help="new tokens an interactive request")
    parser.add_argument("--gap", type=float, default=0.5, help="seconds between interactive requests")
    parser.add_argument("--served-lines", type=int, default=256, help="lines of the server's batch")
    parser.add_argument("--no-throughput", dest="throughput", action="store_false")
    parser.add_argument("--no-served", dest="served", action="store_false")
    parser.add_argument("--raymuter-arg", action="append", default=[],
                        help="one more argument for raymuter serve / batch (repeat)")
    parser.add_argument("--start-timeout", type=float, default=300)
    parser.add_argument("--logs", type=Path)
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="raymuter-batch-bench-"))
    logs.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(BENCH)]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    from tokenizers import Tokenizer

    from decode_systems import model_dirs  # bench/real_models.py's folders, built once

    dirs = model_dirs("real")
    tokenizer = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    print(f"[batch] model {dirs['genai']}; logs in {logs}", file=sys.stderr, flush=True)
    rows = []
    if args.throughput:
        t = throughput(args, dirs, tokenizer, logs)
        rows += [("offline generate, tok/s (median)", f"{t['offline']:.1f}", ""),
                 ("raymuter batch whole, tok/s", f"{t['whole']:.1f}", f"{t['whole'] / t['offline']:.2f}x"),
                 ("raymuter batch steady, tok/s", f"{t['steady']:.1f}", f"{t['steady'] / t['offline']:.2f}x "
                                                                      "(goal >= 0.95x)")]
    if args.served:
        s = served(args, dirs, tokenizer, logs)
        rows += [("interactive TTFT p50 alone (before the batch, after it), ms", f"{s['alone'] * 1e3:.0f}",
                  f"{s['before'] * 1e3:.0f} before, {s['after'] * 1e3:.0f} after"),
                 ("interactive TTFT p50 beside a batch, ms", f"{s['beside'] * 1e3:.0f}",
                  f"{s['beside'] / s['alone']:.2f}x (goal <= 1.2x)"
                  + ("" if s["overlapped"] else "; the batch ended before the probes did")),
                 ("server batch, tok/s", f"{s['batch_tok_s']:.1f}", f"{s['batch_status']} {s['counts']}")]
    from machine import cpu  # bench/machine.py

    print(f"\nSmolLM2-135M fp32, {args.prompt}-token prompts, {args.new} new tokens a line, "
          f"{args.slots} slots, {args.lines} lines; {cpu()}\n")
    print("| measure | value | ratio |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
