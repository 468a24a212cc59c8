"""The decoder on its device: greedy tokens checked, tokens/s beside onnxruntime-genai's own
generator on the same build, and the bytes a decode step moves between host and device.

On a CUDA machine (`--provider cuda`, the default where onnxruntime has CUDA): the real
SmolLM2-135M genai build (bench/real_models.py; `--model` names another genai folder, such as a
`-p fp16 -e cuda` build) loads on the GPU with device-owned buffers (cache/in_place_device.py);
its greedy tokens are checked against the same model on the CPU in fp32 (host buffers) and
against transformers where the folder's `hf` sibling and torch are there. Then, at each batch
size, tokens/s of raymuter (device buffers) beside og.Generator on the same folder and provider
(interleaved A B A B, best of `--repeats`), and the ledger's bytes per decode step by cause.
With `--provider cpu` the same script runs on the CPU (device buffers are CPU OrtValues, beside
the host buffers), so it is known to work up to the provider.

    PYTHONPATH=. python bench/device.py --provider cpu --model tiny --batch 1,8 --new 16   # ~10 s
    PYTHONPATH=. python bench/device.py                       # the real model; cuda where available
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
import generation  # noqa: E402


def folders(name: str) -> dict[str, Path]:
    """{'genai', 'hf'?} of `name`: 'tiny' (the test fixtures), 'real' (bench/real_models.py) or a folder."""
    if name == "tiny":
        import models as bench_models  # bench/models.py

        paths = bench_models.builders().text.ensure_test_models()
        return {"genai": paths["llama-genai"], "hf": paths["hf/llama"]}
    if name == "real":
        import real_models  # bench/real_models.py

        root = Path(os.environ.get("RAYMUTER_BENCH_MODELS") or Path.home() / ".cache" / "raymuter" / "bench-models")
        paths = real_models.build_real(root.expanduser())
        return {"genai": paths["genai"], "hf": paths["hf"]}
    folder = Path(name)
    hf = folder.parent / "hf"
    return {"genai": folder, **({"hf": hf} if (hf / "config.json").exists() else {})}


def greedy_rows(model, prompts, new: int, buffers: str):
    ctx = generation.context(model, buffers=buffers, max_new_tokens=new, eos_token_id=[], do_sample=False)
    ctx = generation.compile(ctx, batch_size=len(prompts))
    return ctx, generation.generate(ctx, prompts, seeds=[0] * len(prompts))


def transformers_rows(hf: Path, prompts, new: int):
    try:
        import torch
        from transformers import AutoModelForCausalLM
    except ImportError:
        return None
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=model.config.pad_token_id or 0)
            rows.append(out[0, len(prompt):].tolist())
    return rows


def genai_runner(folder: Path, provider: str, prompts, new: int):
    """A function that runs og.Generator over `prompts` for `new` tokens, or the reason it cannot."""
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        return f"onnxruntime-genai not installed ({e})"
    try:
        config = og.Config(str(folder))
        config.clear_providers()
        if provider == "cuda":
            config.append_provider("cuda")
        model = og.Model(config)
    except Exception as e:  # noqa: BLE001 - reported in the table
        return f"{type(e).__name__}: {e}"
    batch = np.array(prompts, np.int32)

    def run():
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=batch.shape[1] + new, min_length=batch.shape[1] + new, do_sample=False,
                                  batch_size=len(batch))
        generator = og.Generator(model, params)
        generator.append_tokens(batch)
        while not generator.is_done():
            generator.generate_next_token()
        return generator
    return run


def timed(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv=None) -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--provider", choices=("cpu", "cuda"),
                    default="cuda" if "CUDAExecutionProvider" in ort.get_available_providers() else "cpu")
    ap.add_argument("--model", default="real", help="tiny, real, or a genai build's folder")
    ap.add_argument("--batch", default="1,8,32,64")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    paths = folders(args.model)
    model = generation.load(paths["genai"], provider=args.provider)
    if model.provider != args.provider:
        raise SystemExit(f"asked for {args.provider}, the session runs on {model.provider}")
    from machine import cpu  # bench/machine.py

    device_name = ort.get_device() if args.provider == "cuda" else cpu()
    print(f"# {paths['genai']} on {args.provider} ({device_name}), onnxruntime {ort.__version__}, "
          f"cache {np.dtype(model.graph.cache_dtype).name}, prompt {args.prompt}, {args.new} new tokens")

    # 1. greedy tokens: the device run against the CPU fp32 host run and transformers
    rng = np.random.default_rng(0)
    check = [rng.integers(3, model.vocab_size, n).tolist() for n in (5, 17, args.prompt, 40)]
    _, ours = greedy_rows(model, check, args.new, "device")
    cpu = model if args.provider == "cpu" else generation.load(paths["genai"], provider="cpu")
    _, reference = greedy_rows(cpu, check, args.new, "host")
    same = sum(a == b for a, b in zip(ours, reference))
    print(f"greedy rows equal to the CPU fp32 run (host buffers): {same}/{len(check)}")
    if "hf" in paths:
        theirs = transformers_rows(paths["hf"], check, args.new)
        if theirs is not None:
            print(f"greedy rows equal to transformers (fp32, CPU): {sum(a == b for a, b in zip(ours, theirs))}/{len(check)}")

    # 2. tokens/s beside og.Generator, and the ledger per step
    print("\n| B | raymuter device tok/s | raymuter host tok/s | og.Generator tok/s | device / og | "
          "logits B/step | inputs B/step | other B/step |")
    print("|---|---|---|---|---|---|---|---|")
    for batch in batches:
        prompts = rng.integers(3, model.vocab_size, (batch, args.prompt)).tolist()
        runs = {}
        for buffers in ("device", "host") if args.provider == "cpu" else ("device",):
            ctx = generation.compile(generation.context(model, buffers=buffers, max_new_tokens=args.new,
                                                        eos_token_id=[], do_sample=False), batch_size=batch)
            runs[buffers] = (lambda c=ctx: generation.generate(c, prompts, seeds=[0] * batch))
            runs[buffers]()
        genai = genai_runner(paths["genai"], args.provider, prompts, args.new)
        if callable(genai):
            runs["genai"] = genai
            genai()
        seconds = {k: float("inf") for k in runs}
        for _ in range(args.repeats):  # interleaved: machine noise hits all alike
            for key, run in runs.items():
                seconds[key] = min(seconds[key], timed(run, 1))
        rates = {k: batch * args.new / s for k, s in seconds.items()}
        ctx = generation.context(model, buffers="device", eos_token_id=[])
        state = generation.new_state(ctx, batch, args.prompt + args.new + 8)
        state, _ = generation.admit(ctx, state, list(range(batch)), prompts, [0] * batch, max_new=[args.new] * batch)
        before = state.cache.ledger.bytes
        for _ in range(8):
            state, _ = generation.step(ctx, state)
        after = state.cache.ledger.bytes
        moved = {c: (after[c] - before[c]) / 8 for c in after}
        other = sum(v for c, v in moved.items() if c not in ("logits", "inputs"))
        og_text = f"{rates['genai']:.0f}" if "genai" in rates else f"- ({genai})"
        ratio = f"{rates['device'] / rates['genai']:.2f}x" if "genai" in rates else "-"
        host = f"{rates['host']:.0f}" if "host" in rates else "-"
        print(f"| {batch} | {rates['device']:.0f} | {host} | {og_text} | {ratio} | {moved['logits']:.0f} | "
              f"{moved['inputs']:.0f} | {other:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
