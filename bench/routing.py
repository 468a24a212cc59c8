"""Prefix-aware routing with 2 decoder replicas: how much of the prompts the replicas' prefix
caches hold, with the prefix router against Serve's round robin and power of two choices,
side by side in one run.

A local Ray serves the model with 2 decoder replicas (prefix cache on, its default budget), once
per router. The workload: --systems system prompts of about --system tokens, each asked
--questions short questions; the requests go in a shuffled order (the same for every router),
--concurrency at a time, through the application's handle. The table gives the hit rate (prompt
tokens the replica found cached, from each response's usage, over all prompt tokens), the hit rate
an ideal router reaches (everything after each system prompt's first request), and p50 / p95 of
the request's latency, and the prompt tokens the replicas computed (not found cached).

    PYTHONPATH=. python bench/routing.py                  # the default model, ~2 min on 2 cores
    PYTHONPATH=. python bench/routing.py --model FOLDER --system 1000
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]
ROUTERS = ("prefix", "round_robin", "power_of_two")


def workload(tokenizer, systems: int, system_tokens: int, questions: int, seed: int = 0) -> list[tuple[int, str]]:
    """(system index, prompt) pairs in a shuffled order."""
    rng = random.Random(seed)
    words = "list tuple dict set frozenset bytes str int float complex range slice iterator generator".split()
    prompts = []
    for s in range(systems):
        text = f"System {s}: you answer questions about Python's built-in types."
        while len(tokenizer.encode(text).ids) < system_tokens:
            text += " " + " ".join(rng.choice(words) for _ in range(8)) + "."
        for q in range(questions):
            prompts.append((s, f"{text}\nQuestion {q}: what is a {rng.choice(words)}?\nAnswer:"))
    rng.shuffle(prompts)
    return prompts


def run_router(router: str, model: str, prompts, concurrency: int, new: int) -> dict:
    from ray import serve

    import deployments.app as app
    from deployments.schema import GenerateRequest
    from deployments.services.routing import ROUTERS as CLASSES
    from ray.serve.config import RequestRouterConfig

    cfg = app.AppConfig(model=model, slots=4, threads=1, settings={"max_new_tokens": new})
    decoder = app.Decoder.options(num_replicas=2, request_router_config=RequestRouterConfig(
        request_router_class=CLASSES[router]))
    handle = serve.run(app.Ingress.bind(decoder.bind(cfg.model_dump()), cfg.model_dump()), name=router,
                       route_prefix=f"/{router}")

    def one(prompt: str):
        started = time.perf_counter()
        out = handle.generate.remote(GenerateRequest(prompt=prompt, seed=0)).result(timeout_s=600)
        return time.perf_counter() - started, out.prompt_tokens, out.cached_tokens

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(one, [p for _, p in prompts]))
    finally:
        serve.delete(router)
    seconds = sorted(r[0] for r in results)
    return {"hit": sum(r[2] for r in results) / sum(r[1] for r in results),
            "p50": statistics.median(seconds), "p95": seconds[int(0.95 * (len(seconds) - 1))],
            "run": sum(r[1] - r[2] for r in results)}  # prompt tokens the replicas computed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model folder (default: the default model)")
    parser.add_argument("--systems", type=int, default=12)
    parser.add_argument("--system", type=int, default=400, help="tokens of each system prompt")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--new", type=int, default=4)
    args = parser.parse_args()

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve

    import generation
    from generation.default_model import default_model_path
    from generation.text.tokenizer import model_tokenizer

    model = args.model or str(default_model_path())
    tokenizer = model_tokenizer(generation.load(model, threads=1))
    prompts = workload(tokenizer, args.systems, args.system, args.questions)
    root = str(Path(__file__).resolve().parent.parent)
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root}})
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    rows = {router: run_router(router, model, prompts, args.concurrency, args.new) for router in ROUTERS}
    ray.shutdown()

    system_tokens = statistics.mean(len(tokenizer.encode(p).ids) for _, p in prompts)
    first = args.systems / len(prompts)  # each system prompt's first request finds nothing
    ideal = (1 - first) * (args.system // 16 * 16) / system_tokens
    print(f"{len(prompts)} requests: {args.systems} system prompts of ~{args.system} tokens x {args.questions} "
          f"questions, shuffled, {args.concurrency} at a time, 2 decoder replicas; ideal hit rate ~{ideal:.0%}")
    print(f"{'router':<14}{'hit rate':>10}{'tokens run':>12}{'vs prefix':>11}{'p50 s':>9}{'p95 s':>9}")
    for router, row in rows.items():
        print(f"{router:<14}{row['hit']:>10.1%}{row['run']:>12}{row['run'] / rows['prefix']['run']:>10.2f}x"
              f"{row['p50']:>9.2f}{row['p95']:>9.2f}")


if __name__ == "__main__":
    main()
