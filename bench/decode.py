"""Decode speed of raymuter's engine against onnxruntime-genai, a plain numpy loop and transformers.

Measures greedy decode tokens/s = batch * new / seconds of one whole generate call (the prompt
step included, as onnxruntime-genai's own benchmarks count), the best of the repeats (other jobs
on the machine and the spinning worker threads of the other systems only ever add time, so the
fastest sample is the steadiest estimate; the spread row shows how noisy each column was), for each model
x batch size, with the ratio to onnxruntime-genai's `og.Generator`. The systems (rows; see
bench/decode_systems.py) all run in this one process with the same intra-op thread count,
interleaved round-robin (A rep 1, B rep 1, ..., then rep 2, ...; the order rotates each rep) so
machine noise hits all alike. A sample of a short run is as many back-to-back calls as fill
--min-time seconds. The prompt is `--prompt` random token ids (seed 0, ids >= 3), the same for
every system; each system makes exactly `--new` tokens (eos ignored) and its tokens are checked,
row by row, on every sample, against transformers' where it runs (the oracle: onnxruntime-genai
itself can part from it on a near tie), else onnxruntime-genai's; 4-bit rows against their own
reference (bench/decode_systems.py REFERENCE). Prints a markdown table, then the
project's targets (PASS/FAIL) and whole-prompt vs pieces ratios.

    PYTHONPATH=. python bench/decode.py --quick     # tiny model, repeats 3, 32 new: ~15-30 s
    PYTHONPATH=. python bench/decode.py             # tiny + small, B=1,8: ~7 min on 2 cores
    PYTHONPATH=. python bench/decode.py --models small --batch 1 --systems in_place,genai

Models: "tiny" = the test fixtures (tests/model_builders/text.py), "small" = the ~125M Llama of
bench/models.py, built once into $RAYMUTER_BENCH_MODELS (default ~/.cache/raymuter/bench-models).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from decode_systems import DEFAULT, LOADERS, REFERENCE, SLOW, SYSTEMS, model_dirs  # noqa: E402  (bench/decode_systems.py)


def bench_batch(name, runs, batch, args, log):
    """Time every prepared system at one batch size: {system: {'tps', 'same', 'rows', 'error'}}."""
    prompts = np.random.default_rng(0).integers(3, runs["vocab"], (batch, args.prompt), dtype=np.int64)
    res = {k: {"tps": [], "same": None, "rows": [], "error": e} for k, e in runs["errors"].items()}
    ready, calls, first = {}, {}, {}
    for key, prepare in runs["loaded"].items():  # compile, then one untimed warm-up run
        res[key] = {"tps": [], "same": None, "rows": [], "error": None}
        try:
            ready[key] = prepare(prompts)
            t0 = time.perf_counter()
            first[key] = ready[key]()
            calls[key] = max(1, int(args.min_time / (time.perf_counter() - t0)))
            if first[key].shape != (batch, args.new):
                raise RuntimeError(f"made tokens of shape {first[key].shape}, not ({batch}, {args.new})")
        except Exception as e:  # noqa: BLE001 - reported under the table
            res[key]["error"] = f"{type(e).__name__}: {e}"
            ready.pop(key, None)
    oracle = "transformers" if "transformers" in ready else "genai"

    def compare(key, tokens):  # every run's tokens against its reference's, row by row
        other = REFERENCE.get(key, oracle)  # fp32: transformers where it ran (the oracle), else genai
        ref = first.get(other) if other in ready else None
        if ref is not None:
            rows = [i for i in range(batch) if not np.array_equal(tokens[i], ref[i])]
            res[key]["same"] = res[key]["same"] is not False and not rows
            res[key]["rows"] = sorted(set(res[key]["rows"]) | set(rows))
    for key in ready:
        compare(key, first[key])
    keys = list(ready)
    for rep in range(args.repeats):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:  # round-robin, rotated each rep
            if key not in ready or key in SLOW.get(name, ()) and rep >= args.slow_repeats:
                continue
            time.sleep(args.settle)  # let the last system's spinning worker threads go idle
            try:
                t0 = time.perf_counter()
                for _ in range(calls[key]):
                    tokens = ready[key]()
                seconds = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001
                res[key]["error"] = f"{type(e).__name__}: {e}"
                del ready[key]
                continue
            res[key]["tps"].append(calls[key] * batch * args.new / seconds)
            compare(key, tokens)
        log(f"[{name} B={batch}] rep {rep + 1}/{args.repeats} done")
    return res


def bench_model(name, systems, batches, args, log):
    """{batch: results of bench_batch} for one model, its systems loaded once."""
    dirs = model_dirs(name)
    runs = {"vocab": json.loads((dirs["hf"] / "config.json").read_text())["vocab_size"],
            "loaded": {}, "errors": {}}
    with tempfile.TemporaryDirectory(prefix="raymuter-bench-") as tmp:
        shared = {}
        for key in systems:
            t0 = time.perf_counter()
            try:
                runs["loaded"][key] = LOADERS[key](dirs, args.threads, args.new, tmp, shared)
            except Exception as e:  # noqa: BLE001
                runs["errors"][key] = f"load: {type(e).__name__}: {e}"
            log(f"[{name}] loaded {key} in {time.perf_counter() - t0:.1f}s")
        return {b: bench_batch(name, runs, b, args, log) for b in batches}


def best(r):
    return max(r["tps"]) if r and r["tps"] and not r["error"] else None


def report(all_res, systems, args, targets: bool = True):
    cols = [(m, b) for m in all_res for b in all_res[m]]
    print(f"\n## Decode tokens/s (best of {args.repeats}) and ratio to onnxruntime-genai\n"
          f"threads {args.threads}, prompt {args.prompt}, {args.new} new tokens, greedy, fp32, CPU\n")
    print("| system | " + " | ".join(f"{m} B={b}" for m, b in cols) + " | same tokens as the reference |")
    print("|---" * (len(cols) + 2) + "|")
    for key in systems:
        cells, differ = [], []
        for m, b in cols:
            r, g = all_res[m][b][key], best(all_res[m][b].get("genai"))
            v = best(r)
            cells.append("FAILED" if v is None else f"{v:.0f}" + (f" ({v / g:.2f})" if g else "")
                         + (" *" if r["same"] is False else ""))
            if r["same"] is False or v is None:
                differ.append(f"{m} B={b} " + (f"rows {r['rows']}" if v else "failed"))
        same = "no: " + "; ".join(differ) if differ else "yes" if "genai" in systems else "n/a"
        print(f"| {SYSTEMS[key]} | " + " | ".join(cells) + f" | {same} |")
    spread = [statistics.median([max(r["tps"]) / min(r["tps"]) for r in all_res[m][b].values() if best(r)] or [0])
              for m, b in cols]
    print("| spread: max/min over repeats, median over systems | " + " | ".join(f"{x:.2f}x" for x in spread) + " | |")
    oracle = "transformers" if "transformers" in systems else "genai"
    print(f"\n(* = tokens differ from the reference's: that speed is not comparable. The reference of an fp32 "
          f"row: {oracle}{' (the oracle)' if oracle == 'transformers' else ' (add transformers to check against the oracle)'})")
    if any(k in systems for m in all_res for k in SLOW.get(m, ())) and args.slow_repeats < args.repeats:
        print(f"(transformers on the small model: best of {args.slow_repeats} repeats, to save time)")
    for m, b in cols:
        for k, r in all_res[m][b].items():
            if r["error"]:
                print(f"FAILED {k} on {m} B={b}: {r['error'][:300]}")

    def ratios(num, den, only=None):  # [(column, ratio or None, tokens differ)]
        out = []
        for m, b in cols:
            if num in systems and den in systems and (only is None or (m, b) in only):
                r, s = all_res[m][b][num], all_res[m][b][den]
                x = best(r) / best(s) if best(r) and best(s) else None
                out.append((f"{m} B={b}", x, r["same"] is False))  # the measured system parts from the reference
        return out

    if not targets:
        return
    print("\n## Targets")
    for label, num, den, bound, only in (
            ("in_place (whole) / genai", "in_place", "genai", 0.95, None),
            ("append (whole) / plain numpy loop", "append", "numpy", 1.0, None),
            ("in_place / transformers, small B=1", "in_place", "transformers", 2.5, [("small", 1)])):
        got = ratios(num, den, only)
        ok = all(x is not None and x >= bound and not bad for _, x, bad in got)
        parts = ", ".join(f"{c} {'n/a' if x is None else f'{x:.3f}'}{' (tokens differ)' if bad else ''}"
                          for c, x, bad in got)
        print(f"- {label} >= {bound}: " + (f"{'PASS' if ok else 'FAIL'}  [{parts}]" if got else "n/a (not measured)"))
    print("\n## Whole prompt vs pieces (tokens/s ratio whole / pieces)")
    if args.prompt & (args.prompt - 1) == 0:
        print(f"(prompt {args.prompt} is a power of two: 'pieces' runs it as one piece, the same work as 'whole')")
    for num in ("in_place", "append"):
        if got := ratios(num, num + "_pieces"):
            print(f"- {num}: " + ", ".join(f"{c} {'n/a' if x is None else f'{x:.2f}'}" for c, x, _ in got))


def parse(argv=None):
    """The command line's arguments (args.systems: the systems to run, in table order)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,small")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--slow-repeats", type=int, default=3,
                    help="repeats of transformers on the small model (~4 s a batch-1 run)")
    ap.add_argument("--min-time", type=float, default=0.2,
                    help="one sample = as many generate calls as fill this many seconds (for short runs)")
    ap.add_argument("--settle", type=float, default=0.3,
                    help="seconds of pause before each sample, so worker threads of the system before "
                         "(onnxruntime and torch spin after a run) do not eat into it")
    ap.add_argument("--systems", default=",".join(DEFAULT), help=f"any of {','.join(SYSTEMS)}")
    ap.add_argument("--quick", action="store_true", help="tiny model only, repeats 3, new 32")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # explicit flags still win
        ap.set_defaults(models="tiny", repeats=3, new=32)
    args = ap.parse_args(argv)
    if unknown := set(args.systems.split(",")) - set(SYSTEMS):
        ap.error(f"unknown systems {sorted(unknown)}; choose from {','.join(SYSTEMS)}")
    args.systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    args.slow_repeats = min(args.slow_repeats, args.repeats)
    return args


def main(argv=None):
    args = parse(argv)
    systems = args.systems
    t_start = time.perf_counter()

    def log(msg):
        if not args.quiet:
            print(f"{time.perf_counter() - t_start:7.1f}s {msg}", file=sys.stderr, flush=True)

    batches = [int(b) for b in args.batch.split(",")]
    all_res = {m: bench_model(m, systems, batches, args, log) for m in args.models.split(",")}
    report(all_res, systems, args)
    print(f"\n(total {time.perf_counter() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
