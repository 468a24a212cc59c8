"""Each family's fused rewrite against onnxruntime-genai's build of the same weights.

For every family the rewrite knows (generation.runtime.fusion.families), the tiny test model
(tests/model_builders: text for Llama, windows for Mistral, families for the rest) runs as
  fused   raymuter over its Optimum export as `load` gives it (the fused rewrite: in_place)
  append  raymuter over the same export as exported (`fuse=False`)
  genai   onnxruntime-genai `og.Generator` over its builder's graph (built here once, cached)
greedy, prompt --prompt tokens, --new new tokens, eos ignored, tok/s = batch * new / seconds of a
whole generate call, best of --repeats, the three interleaved (the order rotating). Prints a
markdown table with fused / genai (target >= 0.95) and whether fused and genai made the same tokens
up to each row's first eos (fused's are transformers' by
tests/generation/runtime/test_fusion_families.py; genai's builder
gives Qwen2's window to every layer, so it parts from transformers on a Qwen2 whose window is
only on some layers; its Gemma 2 puts the window on the odd layers where transformers puts it on
the even ones). The builder fails on SmolLM3's layers without rotary embedding: its row times
genai's build of the same weights with rotary on every layer (`no_rope_layers` all 1: the same
operators but one rotation per NoPE layer), its tokens not compared. "append" is the export as
it runs unfused (grow for Gemma 2 / 3 and Nemotron: Optimum exports them without position_ids).
The builder does not know OLMo 2 (its row: fused and append only); its OLMo leaves out clip_qkv,
and it reads OLMo's, Nemotron's and Phi's norm epsilon as 1e-6 (rms_norm_eps, which they do not
have; transformers: 1e-5), so its tokens may part from transformers' there. gpt_oss is the support
matrix's (tests/model_builders/matrix.py: 4 experts, 2 per token, sinks, a window of 8 on layer 0;
"append" is grow: its Optimum export has no position_ids); the builder clamps its experts only
where config.json has swiglu_limit (the matrix's does), so without it its tokens part from
transformers', which clamps at 7 whatever the config says.

    PYTHONPATH=. python bench/fusion.py                 # all families, B=1 and 8: ~3 min on 2 cores
    PYTHONPATH=. python bench/fusion.py --families qwen3,gemma --batch 1
"""
from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]
from decode_systems import load_genai, load_raymuter  # noqa: E402  (bench/decode_systems.py)
from models import builders  # noqa: E402  (bench/models.py: tests/ on the path)

FAMILIES = ("llama", "mistral", "qwen2_window", "qwen3", "granite", "phi3", "gemma", "gemma2_capped", "gemma3_scaled",
            "smollm3_window", "olmo_clipped", "olmo2", "nemotron", "phi", "gpt_oss")
SYSTEMS = {"fused": load_raymuter("fused"), "append": load_raymuter("append"), "genai": load_genai}


def family_dirs(name: str) -> dict[str, Path]:
    """{'hf', 'optimum', 'genai'} folders of the tiny `name`, the genai build made when missing."""
    text = builders().text  # tests/ on the import path
    from model_builders.families import ensure_family_models, genai_build

    if name == "llama":
        paths = text.ensure_test_models()
        return {"hf": paths["hf/llama"], "optimum": paths["llama-optimum"], "genai": paths["llama-genai"]}
    if name == "mistral":
        from model_builders.windows import ensure_window_models

        paths = ensure_window_models()
        return {"hf": paths["hf/mistral"], "optimum": paths["mistral-optimum"], "genai": paths["mistral-genai"]}
    if name == "gpt_oss":
        from model_builders.matrix import matrix_models

        optimum, hf = matrix_models()["gpt_oss"]
        return {"hf": hf, "optimum": optimum, "genai": genai_build(hf)}
    paths = ensure_family_models()
    dirs = {"hf": paths[f"hf/{name}"], "optimum": paths[f"{name}-optimum"]}
    try:
        dirs["genai"] = genai_build(_with_rope_everywhere(dirs["hf"]) if name.startswith("smollm3") else dirs["hf"])
    except RuntimeError as e:  # the builder does not know it: the row shows fused and append only
        print(f"[bench] no onnxruntime-genai build of {name}: {str(e).splitlines()[0]}", file=sys.stderr)
    return dirs


def _with_rope_everywhere(hf: Path) -> Path:
    """A copy of the SmolLM3 folder `hf` (weights linked) whose config rotates every layer: the
    genai builder fails on NoPE layers (0.15: a RotaryEmbedding without position_ids)."""
    import json

    out = hf.parent.parent / "proxy" / "hf" / f"{hf.name}-rope"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        for f in hf.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        config = json.loads((hf / "config.json").read_text())
        config["no_rope_layers"] = [1] * int(config["num_hidden_layers"])
        (out / ".config.json").write_text(json.dumps(config, indent=1))
        (out / ".config.json").rename(out / "config.json")
    return out


def same_until_eos(ours: np.ndarray, genai: np.ndarray, eos: int = 2) -> bool:
    """Rows equal up to each one's first eos: both ignore it, but onnxruntime-genai's min_length
    bans it (as transformers' min_new_tokens does) where raymuter's empty eos_token_id only runs on."""
    for a, b in zip(ours, genai):
        end = next((i for i, t in enumerate(a) if t == eos), len(a))
        if not np.array_equal(a[:end], b[:end]):
            return False
    return True


def bench(name: str, batch: int, args, tmp: Path) -> dict:
    dirs = family_dirs(name)
    prompts = np.random.default_rng(0).integers(3, 1000, (batch, args.prompt), dtype=np.int64)
    runs, tokens, shared, errors = {}, {}, {}, {}
    for key, loader in SYSTEMS.items():
        try:
            folder = tmp / f"{name}-{batch}-{key}"
            folder.mkdir()
            run = loader(dirs, args.threads, args.new, folder, shared)(prompts)
            tokens[key] = run()  # warm-up, and the tokens compared
            runs[key] = run
        except Exception as e:  # noqa: BLE001 - shown in the table
            errors[key] = f"{type(e).__name__}: {e}"
    best = {key: float("inf") for key in runs}
    keys = list(runs)
    for rep in range(args.repeats):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                runs[key]()
            best[key] = min(best[key], (time.perf_counter() - t0) / args.calls)
    tps = {key: batch * args.new / seconds for key, seconds in best.items()}
    same = None if "genai" not in tokens or "fused" not in tokens or name.startswith("smollm3") else \
        same_until_eos(tokens["fused"], tokens["genai"])
    return {"tps": tps, "same": same, "errors": errors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5, help="generate calls a sample times")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families.split(","):
            rows.append((name, {b: bench(name, b, args, Path(tmp)) for b in batches}))

    def cell(result, key):
        value = result["tps"].get(key)
        return f"{value:.0f}" if value else "-"

    head = "| family | " + " | ".join(f"fused B={b} | append B={b} | genai B={b} | fused/genai B={b}" for b in batches)
    print(head + " | same tokens as genai |")
    print("|" + "---|" * (1 + 4 * len(batches) + 1))
    notes = []
    for name, results in rows:
        cells = []
        for b in batches:
            r = results[b]
            ratio = r["tps"]["fused"] / r["tps"]["genai"] if {"fused", "genai"} <= set(r["tps"]) else None
            cells += [cell(r, "fused"), cell(r, "append"), cell(r, "genai"), f"{ratio:.2f}" if ratio else "-"]
            notes += [f"{name} B={b} {key}: {error}" for key, error in r["errors"].items()]
        same = {results[b]["same"] for b in batches}
        agree = "-" if same == {None} else "yes" if same == {True} else "no"
        print(f"| {name} | " + " | ".join(cells) + f" | {agree} |")
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
