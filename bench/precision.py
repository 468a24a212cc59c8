"""Each precision Raymuter runs on this CPU, beside vLLM's CPU build in bfloat16 and float32:
offline tokens/s at each batch size, where a decode step's time goes, and what each precision
costs in accuracy against transformers in float32 (optional, not run in CI or tests).

The model is SmolLM2-135M as `bench/real_models.py` builds it. Raymuter's rows:
  fp32        the onnxruntime-genai fp32 build as exported (in_place)
  int8        the same build at precision='int8' (generation.runtime.quantize: int8 weights per
              column, per-token int8 activations, MLAS's int8 kernels); what `auto` picks where
              the CPU has int8 dot products (VNNI, AMX)
  int4-acc4   the onnxruntime-genai int4 build (MatMulNBits, blocks of 32, accuracy level 4:
              int8 activations per block)
  int4-acc0   transformers.js' q4 (MatMulNBits, blocks of 32, accuracy level 0: float compute),
              fused (the LM head stays float32)
  fp16        the fused rewrite of the Optimum export in float16 (what CUDA runs), on the CPU
  bf16        asked of onnxruntime's CPU provider: it has no bfloat16 MatMul kernel (said, not timed)
vLLM (its own venv, bench/peers.py's offline worker; compute bound to every core, faster offline
here than its default `auto` binding): bfloat16 (its default on a CPU with AVX-512 BF16 or AMX)
and float32.

    PYTHONPATH=. .venv/bin/python bench/precision.py                     # ~25 min on 2 cores
    PYTHONPATH=. .venv/bin/python bench/precision.py --no-accuracy --batch 1,32
    PYTHONPATH=. .venv/bin/python bench/precision.py --no-vllm --profile 32

Speed: 32-token prompts, 64 new tokens, eos ignored, greedy; each system in a worker process of its
own (bench/peers.py's; the idle ones stopped by SIGSTOP); per batch size each is called once
untimed, then --repeats times in alternating order,
the median kept; tok/s = B x 64 / seconds. Accuracy (Raymuter's rows only): --prompts prompts of
32 tokens (English sentences), --tokens greedy tokens each; transformers float32 greedy is the
reference. `rows equal`: rows whose tokens all equal the reference's; `tokens to first
difference`: the mean share of a row before it parts from the reference; `KL`: the mean over
every position of KL(p_fp32 || p) of the next-token distribution, teacher-forced on the
reference's tokens (prompt and answer through the decoder at once); `|dlogp|`: the mean absolute
difference of the reference token's log-probability there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]
import peers  # noqa: E402  (bench/peers.py: vLLM's venv, its offline worker, the prompts)

FLAGS = ("amx_tile", "amx_int8", "amx_bf16", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "avx2")
SYSTEMS = ("fp32", "int8", "int4-acc4", "int4-acc0", "fp16")


def cpu_line() -> str:
    from generation.runtime.precision import cpu_flags

    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    flags = cpu_flags()
    return f"{model}, {len(os.sched_getaffinity(0))} cores; " + " ".join(f"{f}:{'yes' if f in flags else 'no'}"
                                                                          for f in FLAGS)


LOADS = {"fp32": ("genai", "fp32", None), "int8": ("genai", "int8", None), "int4-acc4": ("genai_int4", "auto", None),
         "int4-acc0": ("optimum_q4", "auto", "q4"), "fp16": ("optimum", "fp16", None)}  # folder, precision, variant


def load_system(name: str, dirs: dict):
    import generation

    if name not in LOADS:
        raise SystemExit(f"unknown system {name!r}")
    folder, precision, variant = LOADS[name]
    return generation.load(dirs[folder], provider="cpu", precision=precision, variant=variant)


def bf16_refusal() -> str:
    """onnxruntime's answer to a bfloat16 MatMul on its CPU provider."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    value = lambda n, shape: helper.make_tensor_value_info(n, TensorProto.BFLOAT16, shape)  # noqa: E731
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "bf16", [value("x", [2, 4]), value("w", [4, 4])],
                              [value("y", [2, 4])])
    try:
        ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString(),
                             providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - its message is the answer
        return str(e).split(" : ")[-1].strip()
    return "runs (time it: this onnxruntime has a bfloat16 MatMul)"


class Ours:
    """A Raymuter model, called as vLLM's worker is: prompts in, (seconds, token rows) out."""

    def __init__(self, model, **settings):
        self.model, self.contexts, self.settings = model, {}, settings or dict(eos_token_id=[])

    def call(self, prompts, new):
        import generation

        key = (len(prompts), new)
        if key not in self.contexts:
            ctx = generation.context(self.model, max_new_tokens=new, do_sample=False, **self.settings)
            self.contexts[key] = generation.compile(ctx, batch_size=len(prompts))
        t0 = time.perf_counter()
        rows = generation.generate(self.contexts[key], prompts, seeds=[0] * len(prompts))
        return {"seconds": time.perf_counter() - t0, "tokens": [[int(t) for t in r] for r in rows]}

    def close(self):
        pass


class Worker(peers.Worker):
    """An engine in a process of its own (bench/peers.py's offline worker), stopped while another
    runs: vLLM at `dtype`, or Raymuter's system `name` (its onnxruntime threads spin after each
    run, as a server's do, and would take the cores of the next system timed in one process)."""

    def __init__(self, args, dirs, logs: Path, dtype: str | None = None, name: str | None = None):
        if dtype is not None:
            command = [str(args.vllm_python), str(BENCH / "peers.py"), "--offline-worker", "vllm", "--model",
                       str(dirs["hf"]), "--dtype", dtype, "--max-seqs", str(max(args.batches))]
            env = peers.clean_env({**peers.VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": peers.bind_settings()[args.vllm_bind]},
                                  python_path=False)
            self.kind = f"vllm-{dtype}"
        else:
            folder, precision, variant = LOADS[name]
            command = [sys.executable, str(BENCH / "peers.py"), "--offline-worker", "raymuter", "--model",
                       str(dirs[folder]), "--precision", precision, *(["--variant", variant] if variant else [])]
            env = peers.clean_env({"PYTHONPATH": str(BENCH.parent)})
            self.kind = name
        self.process = peers.Managed(self.kind, command, env, logs / f"{self.kind}.log", stdin=__import__("subprocess").PIPE)
        self.answer()


def speed(args, systems: dict, tokenizer) -> dict:
    out = {}
    for b in args.batches:
        prompts = peers.prompt_ids(tokenizer, f"precision-B{b}", b, args.prompt)
        for system in systems.values():
            system.call(prompts, args.new)
        seconds = {name: [] for name in systems}
        for r in range(args.repeats):
            for name in (list(systems) if r % 2 == 0 else list(systems)[::-1]):
                seconds[name].append(systems[name].call(prompts, args.new)["seconds"])
        out[b] = {name: b * args.new / statistics.median(s) for name, s in seconds.items()}
        print(f"[precision] B={b}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[b].items()), file=sys.stderr, flush=True)
    return out


def transformers_model(dirs, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(dirs["hf"], dtype=getattr(torch, dtype)).eval()


def reference(dirs, prompts, tokens: int, dtype: str = "float32") -> list[list[int]]:
    """transformers' greedy rows in `dtype`, one prompt at a time."""
    import torch

    hf = transformers_model(dirs, dtype)
    rows = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                              do_sample=False, pad_token_id=hf.config.eos_token_id)
        rows.append(out[0, len(p):].tolist())
    return rows


def all_logits(model, sequence: list[int]) -> np.ndarray:
    """[len - 1, V] float32 logits at every position of `sequence`, one run through the decoder."""
    import generation
    from generation.cache.prefill import run_rows

    ctx = generation.context(model)
    got = []
    run_rows(model.session, model.graph, [sequence], [len(sequence)], ctx.settings.pad_token_id, ctx.max_position,
             on_logits=lambda logits, offset: got.append(np.array(logits[0, :len(sequence) - 1], np.float32)))
    return got[0]


def torch_logits(hf, sequence: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([sequence])).logits[0, :-1].float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def accuracy(args, models: dict, dirs, tokenizer) -> dict:
    prompts = peers.prompt_ids(tokenizer, "accuracy", args.prompts, args.prompt)
    t0 = time.monotonic()
    want = reference(dirs, prompts, args.tokens)
    print(f"[precision] transformers fp32 reference in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    base = models["fp32"]
    truth = [log_softmax(all_logits(base, p + w))[len(p) - 1:] for p, w in zip(prompts, want)]
    out = {}
    bf16 = transformers_model(dirs, "bfloat16")
    for name, model in [*models.items(), ("transformers-bf16", bf16)]:
        if model is bf16:  # vLLM's default dtype here, as transformers computes it (vLLM gives no whole distribution)
            rows = reference(dirs, prompts, args.tokens, "bfloat16")
        else:
            rows = Ours(model, min_new_tokens=args.tokens).call(prompts, args.tokens)["tokens"]  # as the reference: no eos
        first = [next((i for i, (a, b) in enumerate(zip(r, w)) if a != b), len(w)) / len(w) for r, w in zip(rows, want)]
        kl, dlogp = [], []
        for p, w, t in zip(prompts, want, truth):
            mine = log_softmax(torch_logits(bf16, p + w) if model is bf16 else all_logits(model, p + w))[len(p) - 1:]
            kl.append(float((np.exp(t) * (t - mine)).sum(axis=-1).mean()))
            picked = np.arange(len(w))
            dlogp.append(float(np.abs(t[picked, w] - mine[picked, w]).mean()))
        out[name] = {"rows_equal": sum(r == w for r, w in zip(rows, want)), "first_difference": float(np.mean(first)),
                     "kl": float(np.mean(kl)), "dlogp": float(np.mean(dlogp))}
        print(f"[precision] accuracy {name}: {out[name]}", file=sys.stderr, flush=True)
    return out


def profile(model, batch: int, past: int = 64) -> list[tuple[str, float]]:
    """(operator type, ms a decode step) of `model`'s graph at `batch` rows with `past` tokens
    cached, the cache bound in place (as the engine runs it), from onnxruntime's profile."""
    import collections
    import shutil
    import tempfile

    import onnxruntime as ort

    from generation.runtime.session import _rewritten_source

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = model.threads, 1
    options.log_severity_level = 3
    source = _rewritten_source(model.decoder_path, options, True, True)
    options.enable_profiling = True  # its file in a folder of its own, not the working directory
    folder = tempfile.mkdtemp(prefix="raymuter-profile-")
    options.profile_file_prefix = os.path.join(folder, "step")
    session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    graph, length = model.graph, past + 64
    feeds = {"input_ids": np.full((batch, 1), 500, np.int64), "attention_mask": np.ones((batch, past + 1), np.int64)}
    names = {i.name for i in session.get_inputs()}
    if "logits_positions" in names:
        feeds["logits_positions"] = np.zeros((batch, 1), np.int64)
    if "position_ids" in names:
        feeds["position_ids"] = np.full((batch, 1), past, np.int64)
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    for entry in graph.cache:
        buffer = ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, entry.heads, length, entry.head_dim), graph.cache_dtype))
        binding.bind_ortvalue_input(entry.past, buffer)
        binding.bind_ortvalue_output(entry.present, buffer)
    binding.bind_output("logits")
    for _ in range(13):
        session.run_with_iobinding(binding)
    with open(session.end_profiling()) as f:
        events = json.load(f)
    shutil.rmtree(folder, ignore_errors=True)
    by = collections.Counter()
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by[e["args"]["op_name"]] += e["dur"]
    return [(op, us / 13 / 1000) for op, us in by.most_common(8)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {','.join(SYSTEMS)}")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-vllm", dest="vllm", action="store_false")
    ap.add_argument("--vllm-python", type=Path, default=peers.VLLM_PYTHON)
    ap.add_argument("--vllm-bind", choices=["auto", "all"], default="all")
    ap.add_argument("--no-accuracy", dest="accuracy", action="store_false")
    ap.add_argument("--prompts", type=int, default=64, help="accuracy: prompts")
    ap.add_argument("--tokens", type=int, default=64, help="accuracy: greedy tokens a prompt")
    ap.add_argument("--profile", type=int, metavar="B", help="also print where a decode step of B rows goes, per precision")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batch.split(",")]
    import tempfile

    from tokenizers import Tokenizer

    from decode_systems import model_dirs
    from generation.runtime.precision import choose

    dirs = model_dirs("real")
    tokenizer = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    print(f"CPU: {cpu_line()}")
    auto = choose("auto", "cpu", dirs["genai"] / "model.onnx")
    print(f"auto picks: {auto.name} ({auto.reason})")
    print(f"bf16 on onnxruntime's CPU provider: {bf16_refusal()}")
    models = {}
    for name in args.systems.split(","):
        model = load_system(name, dirs)
        print(f"{name}: {model.decoder_path} ({model.graph.native_mode}, {model.precision or 'as exported'}: "
              f"{model.precision_reason})")
        if name in ("fp32", "int8", "fp16") and model.precision != name:
            print(f"{name}: not measured (it did not load at {name})")
            continue
        models[name] = model
    results = {"cpu": cpu_line(), "auto": auto.name}
    systems = {}
    logs = Path(tempfile.mkdtemp(prefix="raymuter-precision-"))
    try:
        for name in models:
            systems[name] = Worker(args, dirs, logs, name=name)
        if args.vllm:
            for dtype in ("bfloat16", "float32"):
                systems[f"vllm-{dtype}"] = Worker(args, dirs, logs, dtype=dtype)
        results["speed"] = speed(args, systems, tokenizer)
    finally:
        for system in systems.values():
            system.close()
    print(f"\nOffline tok/s (SmolLM2-135M; {args.prompt}-token prompts, {args.new} new, eos ignored; median of "
          f"{args.repeats}, alternating{'; vLLM bound to every core' if args.vllm_bind == 'all' else ''})\n")
    ref = "vllm-bfloat16" if args.vllm else "fp32" if "fp32" in systems else next(iter(systems))
    print("| system | " + " | ".join(f"B={b}" for b in args.batches) + " |")
    print("|---|" + "---|" * len(args.batches))
    for name in systems:
        cells = [f"{results['speed'][b][name]:.1f} ({results['speed'][b][name] / results['speed'][b][ref]:.2f}x)"
                 for b in args.batches]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"(ratio: to {ref})")
    if args.profile:
        print(f"\nWhere a decode step of {args.profile} rows goes (64 tokens cached; ms a step, by operator)\n")
        for name, model in models.items():
            print(f"{name}: " + ", ".join(f"{op} {ms:.2f}" for op, ms in profile(model, args.profile)))
    if args.accuracy:
        results["accuracy"] = accuracy(args, models, dirs, tokenizer)
        print(f"\nAccuracy against transformers fp32 greedy ({args.prompts} prompts x {args.tokens} tokens)\n")
        print("| precision | rows equal | tokens to first difference | KL (nats) | mean abs dlogp |")
        print("|---|---|---|---|---|")
        for name, a in results["accuracy"].items():
            print(f"| {name} | {a['rows_equal']}/{args.prompts} | {a['first_difference']:.1%} | {a['kl']:.2e} | "
                  f"{a['dlogp']:.2e} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
