"""Image-text-to-text latency of raymuter beside transformers on the same Qwen2-VL-shaped model,
split into preprocessing, vision encoder, prefill and decode.

One prompt: `--text` random token ids, one random `--image` (HxW) image, then `--text` more ids;
`--new` greedy tokens (min_new_tokens = new on both sides, so eos never ends a run early). Each
stage is the best of `--repeats` runs (other jobs only ever add time), both systems on the same
`--threads` intra-op threads, interleaved run by run:

    preprocessing   raymuter `images.qwen2vl_pixels` | Qwen2VLImageProcessor (PIL, numpy)
    vision encoder  `vision.encode_images` (ONNX)     | `model.model.visual` (torch) as generate
                                                        runs it (forward hooks on it)
    prefill         prompt in, first token out: `generate` up to its first on_token call
                    (the features given) | generate's first streamed token minus that vision
                    encoder run (a separate call of `model.model.visual` before generate is
                    slower than the one inside, by up to 600 ms on 1 thread: subtracting
                    its time understated transformers' prefill, even below zero)
    decode          the later tokens' mean time per token, from the same calls

and the tokens of both are compared (`same tokens`).

The model ("qwen2vl-small", built once into $RAYMUTER_BENCH_MODELS or
~/.cache/raymuter/bench-models, a few minutes on 2 cores; never by the tests): text as the
bench's small Llama (vocab 32000, hidden 768, 12 layers, 12 heads, 4 KV heads, intermediate
2048), M-RoPE sections [8, 12, 12]; vision 12 blocks 640 wide, 10 heads, patch 14, temporal
patch 2, spatial merge 2 (Qwen2-VL-2B: 32 blocks 1280 wide); default random init; Qwen2-VL's
image processor defaults (a 448 x 448 image: 1024 patches, 256 image tokens). Exported as
tests/model_builders/vision.py exports the tiny one (onnx-community layout, any-grid vision encoder).

    PYTHONPATH=. python bench/vision.py                      # ~1 min once the model is built
    PYTHONPATH=. python bench/vision.py --image 640x480 --new 64 --repeats 5
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

from models import builders  # bench/models.py

ROOT = Path(__file__).resolve().parent.parent
IDS = dict(image=31990, video=31991, vision_start=31992, vision_end=31993)


def small_config():
    import transformers as tf

    common = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return tf.Qwen2VLConfig(
        text_config=dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]}, rope_theta=1000000.0,
                         tie_word_embeddings=False, **common),
        vision_config=dict(depth=12, embed_dim=640, hidden_size=768, num_heads=10, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3),
        image_token_id=IDS["image"], video_token_id=IDS["video"], vision_start_token_id=IDS["vision_start"],
        vision_end_token_id=IDS["vision_end"], tie_word_embeddings=False, **common)


def build(root: Path, progress=print) -> dict[str, Path]:
    """ROOT/qwen2vl-small/{hf,onnx}, each built into a temporary sibling and renamed into place."""
    import shutil

    import torch
    import transformers as tf

    base = root / "qwen2vl-small"
    paths = {"hf": base / "hf", "onnx": base / "onnx"}
    if not (paths["hf"] / "model.safetensors").is_file():
        t0 = time.time()
        tmp = base / ".hf.building"
        shutil.rmtree(tmp, ignore_errors=True)
        torch.manual_seed(0)
        model = tf.Qwen2VLForConditionalGeneration(small_config()).eval()
        model.generation_config = tf.GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
        model.save_pretrained(tmp)
        tf.Qwen2VLImageProcessor().save_pretrained(tmp)
        shutil.rmtree(paths["hf"], ignore_errors=True)
        tmp.rename(paths["hf"])
        n = sum(p.numel() for p in model.parameters())
        progress(f"[bench-models] qwen2vl-small/hf   {time.time() - t0:6.1f}s  ({n / 1e6:.1f}M parameters)")
    if not (paths["onnx"] / "onnx" / "decoder_model_merged.onnx").is_file():
        t0 = time.time()
        tmp = base / ".onnx.building"
        shutil.rmtree(tmp, ignore_errors=True)
        builders().vision.export_qwen2vl(paths["hf"], tmp)
        shutil.rmtree(paths["onnx"], ignore_errors=True)
        tmp.rename(paths["onnx"])
        progress(f"[bench-models] qwen2vl-small/onnx {time.time() - t0:6.1f}s")
    return paths


class Timer:
    """Times of on_token calls / streamer puts: the first new token, then the last."""

    def __init__(self):
        self.start = time.perf_counter()
        self.marks = []

    def mark(self, *_):
        self.marks.append(time.perf_counter())

    def put(self, value):  # a transformers streamer: the prompt first, then each new token
        self.mark()

    def end(self):
        pass


def run_raymuter(model, ctx, image, text, config):
    from generation.engine.generate import generate
    from generation.families.images import qwen2vl_pixels
    from generation.families.vision import PromptImages, VisionTokens, encode_images, rope_positions, split_features

    times = {}
    t0 = time.perf_counter()
    pixels, grids = qwen2vl_pixels([image], config)
    times["preprocessing"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    features = encode_images(model, pixels, grids)
    times["vision encoder"] = time.perf_counter() - t0
    tokens = VisionTokens.of(model.config)
    ids = text[0] + [tokens.vision_start] + [tokens.image] * len(features) + [tokens.vision_end] + text[1]
    positions, _ = rope_positions([ids], tokens, image_grids=grids)
    inputs = PromptImages(split_features([ids], features, tokens.image), positions, tokens.image)
    timer = Timer()
    out = generate(ctx, [ids], seeds=[0], on_token=timer.mark, encoder=inputs)[0]
    times["prefill"] = timer.marks[0] - timer.start
    times["decode"] = (timer.marks[-1] - timer.marks[0]) / (len(timer.marks) - 1)
    return times, out, len(ids)


def run_transformers(hf, processor, image, text, new):
    import torch

    times = {}
    t0 = time.perf_counter()
    inputs = processor(images=[image], return_tensors="pt")
    times["preprocessing"] = time.perf_counter() - t0
    with torch.no_grad():
        count = int(inputs["image_grid_thw"].prod()) // 4
        ids = torch.tensor([text[0] + [IDS["vision_start"]] + [IDS["image"]] * count + [IDS["vision_end"]] + text[1]])
        timer, inside = Timer(), []
        hooks = [hf.model.visual.register_forward_pre_hook(lambda *_: inside.append(time.perf_counter())),
                 hf.model.visual.register_forward_hook(lambda *_: inside.append(time.perf_counter()))]
        try:
            out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=inputs["pixel_values"],
                              image_grid_thw=inputs["image_grid_thw"], do_sample=False, max_new_tokens=new,
                              min_new_tokens=new, pad_token_id=0, streamer=timer)
        finally:
            for hook in hooks:
                hook.remove()
    new_marks = timer.marks[1:]  # (the first put is the prompt)
    times["vision encoder"] = inside[1] - inside[0]
    times["prefill"] = new_marks[0] - timer.start - times["vision encoder"]
    times["decode"] = (new_marks[-1] - new_marks[0]) / (len(new_marks) - 1)
    return times, out[0, ids.shape[1]:].tolist()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", default="448x448", help="HxW of the random image")
    parser.add_argument("--text", type=int, default=16, help="random token ids before and after the image")
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import json

    import torch
    import transformers as tf

    import generation

    root = Path(os.environ.get("RAYMUTER_BENCH_MODELS", Path.home() / ".cache" / "raymuter" / "bench-models"))
    paths = build(root, progress=lambda m: print(m, file=sys.stderr, flush=True))
    torch.set_num_threads(args.threads)
    hf = tf.Qwen2VLForConditionalGeneration.from_pretrained(paths["hf"], dtype=torch.float32).eval()
    processor = tf.Qwen2VLImageProcessor.from_pretrained(paths["hf"])
    model = generation.load(paths["onnx"], threads=args.threads)
    ctx = generation.context(model, max_new_tokens=args.new, min_new_tokens=args.new)
    config = json.loads((paths["onnx"] / "preprocessor_config.json").read_text())
    height, width = (int(x) for x in args.image.lower().split("x"))
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    text = [rng.integers(3, 30000, args.text).tolist() for _ in range(2)]
    best = {"raymuter": {}, "transformers": {}}
    same = True
    for _ in range(args.repeats + 1):  # the first run of each warms up, untimed
        ours, tokens, length = run_raymuter(model, ctx, image, text, config)
        theirs, ref = run_transformers(hf, processor, image, text, args.new)
        same &= tokens == ref
        if _:
            for name, times in (("raymuter", ours), ("transformers", theirs)):
                for stage, seconds in times.items():
                    best[name][stage] = min(best[name].get(stage, seconds), seconds)
    print(f"Qwen2-VL-shaped random model ({sum(p.numel() for p in hf.parameters()) / 1e6:.0f}M parameters), "
          f"one {height}x{width} image, prompt {length} tokens, {args.new} new tokens, {args.threads} threads, "
          f"best of {args.repeats}; same tokens: {'yes' if same else 'NO'}\n")
    print("| stage | raymuter (ms) | transformers (ms) | transformers / raymuter |")
    print("|---|---:|---:|---:|")
    for stage in ("preprocessing", "vision encoder", "prefill", "decode"):
        ours, theirs = best["raymuter"][stage] * 1e3, best["transformers"][stage] * 1e3
        label = "decode (per token)" if stage == "decode" else stage
        print(f"| {label} | {ours:.1f} | {theirs:.1f} | {theirs / ours:.2f} |")
    total = {k: sum(v[s] for s in ("preprocessing", "vision encoder", "prefill")) + v["decode"] * (args.new - 1)
             for k, v in best.items()}
    print(f"| total ({args.new} tokens) | {total['raymuter'] * 1e3:.1f} | {total['transformers'] * 1e3:.1f} | "
          f"{total['transformers'] / total['raymuter']:.2f} |")


if __name__ == "__main__":
    main()
