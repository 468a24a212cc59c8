"""Stream pacing, measured: what fewer, larger chunks save the serving processes and what they
cost a client, on `raymuter serve` (the real SmolLM2-135M genai build, --precision fp32 as
bench/peers.py runs it).

    PYTHONPATH=. .venv/bin/python bench/pacing.py [--concurrency 8,32] [--rounds 1]

Each setting is a server started with its flags (a chunk per token; about 60, 200 (the default)
and 1000 chunks a second from all streams together, each stream's at most every 100 ms), the
settings alternating in order each round. At each concurrency (2c requests, 32-token prompts,
64 new tokens, greedy, eos ignored; bench/peers.py's client): tokens/s, TTFT and TPOT p50 (TPOT:
a request's last token time less its first over its tokens less one), the client's chunk gap
p50 / p90 (ITL as a streaming client sees it: tokens of one chunk arrive together), tokens a
chunk, and the cores the processes took during the level: the Server replica (event loop,
HTTP, streams), the engine process, and the rest (HAProxy, Ray).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import peers  # noqa: E402 - bench/peers.py's servers, prompts and client

SETTINGS = {
    "a chunk per token": ["--stream-interval-ms", "0"],
    "60 chunks/s": ["--stream-chunks-per-second", "60"],
    "200 chunks/s (default)": [],
    "1000 chunks/s": ["--stream-chunks-per-second", "1000"],
}


def _named_cpu(server: peers.Managed) -> dict[str, float]:
    """CPU seconds so far of the Server replica, the engine process and the rest of the tree."""
    out = {"replica": 0.0, "engine": 0.0, "rest": 0.0}
    for pid, seconds in server.cpu_seconds().items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                line = f.read()
        except OSError:
            line = b""
        kind = "replica" if b"ServeReplica" in line else "engine" if b"spawn_main" in line else "rest"
        out[kind] += seconds
    return out


def one_server(name: str, flags: list[str], args, dirs, tokenizer, logs: Path, tag: str) -> dict:
    import serve as serving  # bench/serve.py

    server_args = argparse.Namespace(raymuter_arg=["--precision", "fp32", *flags], vllm_dtype="float32",
                                     start_timeout=600.0)
    server, url, model, _ = peers.start_server("raymuter", server_args, dirs, None, logs, tag)
    out = {}
    try:
        async def run():
            async with serving.client_for(max(args.levels), "aiohttp") as client:
                await peers.stream_level(client, url, model, peers.prompt_ids(tokenizer, "warm", 4, 32), 2, 64)
                for c in args.levels:
                    prompts = peers.prompt_ids(tokenizer, f"pacing-{c}-{tag}", 2 * c, 32)
                    before, started = _named_cpu(server), time.monotonic()
                    got = await peers.stream_level(client, url, model, prompts, c, 64)
                    after, seconds = _named_cpu(server), time.monotonic() - started
                    got["pss"] = 0
                    summary = peers.summarize([got])
                    summary["cores"] = {k: (after[k] - before[k]) / seconds for k in after}
                    out[c] = summary
                    print(f"[pacing] {tag} {name} c={c}: {summary['tok_s']:.1f} tok/s, chunks/request "
                          f"{summary['chunks']:.1f}, replica {summary['cores']['replica']:.2f} cores",
                          file=sys.stderr, flush=True)

        asyncio.run(run())
    finally:
        server.stop()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", default="8,32")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    from tokenizers import Tokenizer

    from decode_systems import model_dirs  # bench/real_models.py's folders, built once

    dirs = model_dirs("real")
    tokenizer = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    logs = Path(tempfile.mkdtemp(prefix="raymuter-pacing-"))
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            results[name].append(one_server(name, SETTINGS[name], args, dirs, tokenizer, logs, f"r{r}"))
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?")
    print(f"\n{model}, {os.cpu_count()} CPUs, SmolLM2-135M genai fp32, `raymuter serve` with each setting's flags, "
          f"{args.rounds} round(s) (medians); ratios to the default\n")
    for c in args.levels:
        print(f"c={c}:\n")
        print("| setting | tok/s | TTFT p50 ms | TPOT p50 ms | chunk gap p50 / p90 ms | tokens a chunk | "
              "replica cores | engine cores | rest cores |")
        print("|---|---|---|---|---|---|---|---|---|")
        med = {name: {k: statistics.median(run[c][k] for run in runs) for k in ("tok_s", "ttft_p50", "tpot_p50",
                                                                                "itl_p50", "itl_p90", "chunks")}
               for name, runs in results.items()}
        cores = {name: {k: statistics.median(run[c]["cores"][k] for run in runs) for k in ("replica", "engine", "rest")}
                 for name, runs in results.items()}
        base = med["200 chunks/s (default)"]
        for name in names:
            m, k = med[name], cores[name]
            print(f"| {name} | {m['tok_s']:.1f} ({m['tok_s'] / base['tok_s']:.2f}) | {m['ttft_p50'] * 1e3:.0f} | "
                  f"{m['tpot_p50'] * 1e3:.1f} ({m['tpot_p50'] / base['tpot_p50']:.2f}) | "
                  f"{m['itl_p50'] * 1e3:.0f} / {m['itl_p90'] * 1e3:.0f} | {64 / m['chunks']:.1f} | "
                  f"{k['replica']:.2f} | {k['engine']:.2f} | {k['rest']:.2f} |")
        print()
    print(f"logs in {logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
