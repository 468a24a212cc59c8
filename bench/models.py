"""The benchmark model: a ~125M-parameter random-weight Llama, in three layouts.

    ROOT/small/hf       transformers save_pretrained + tokenizer (byte-level BPE, 32000 ids)
    ROOT/small/optimum  optimum text-generation-with-past export: model.onnx (with position_ids)
    ROOT/small/genai    onnxruntime-genai builder, fp32, cpu: model.onnx + model.onnx.data +
                        genai_config.json + tokenizer files

Llama: vocab 32000, hidden 768, 12 layers, 12 heads, 4 KV heads (head_dim 64), intermediate
2048, untied embeddings: 124.7M parameters (~500 MB per fp32 copy).  Default (random) init.
Nothing is downloaded.  Takes a minute or two on 2 cores; never built by the tests.

usage: python bench/models.py ROOT [--force]
"""
from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

SMALL_VOCAB = 32000


def builders():
    """The test models' builders: the package tests/model_builders/ (``.common``, ``.text``,
    ``.vision``), tests/ put on the import path for it."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.append(tests)
    import model_builders.common
    import model_builders.text
    import model_builders.vision

    return model_builders


def small_config():
    import transformers as tf

    return tf.LlamaForCausalLM, tf.LlamaConfig(
        vocab_size=SMALL_VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def small_corpus(n_lines=20000, n_words=60000, seed=0):
    """Generated text with enough distinct words for a 32000-id BPE (no fillers needed)."""
    import random

    rnd = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rnd.choice(letters) for _ in range(rnd.randint(2, 9))) for _ in range(n_words)]
    for _ in range(n_lines):
        line = " ".join(
            words[min(int(rnd.paretovariate(0.7)) - 1, n_words - 1)] if rnd.random() < 0.5
            else rnd.choice(words) for _ in range(24))
        yield line + rnd.choice(".!?,") + f" {rnd.randint(0, 9999)}"


def _complete(kind: str, d: Path) -> bool:
    need = {"hf": ["config.json", "model.safetensors", "tokenizer.json"],
            "optimum": ["config.json", "model.onnx", "tokenizer.json"],
            "genai": ["genai_config.json", "model.onnx", "model.onnx.data", "tokenizer.json"]}
    return all((d / f).is_file() for f in need[kind])


def build_part(final: Path, label: str, fn, *, force: bool, complete, progress) -> None:
    """``fn(tmp)`` builds one part into an empty temporary sibling of ``final``, renamed into
    place when it returns; skipped when ``complete(final)`` (unless ``force``)."""
    if not force and complete(final):
        return
    t0 = time.time()
    tmp = final.parent / f".{final.name}.building"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fn(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    progress(f"[bench-models] {label:<16} {time.time() - t0:6.1f}s")


def build_small(root, *, force: bool = False, progress=None) -> dict[str, Path]:
    """Build ``ROOT/small/{hf,optimum,genai}`` (each part skipped when already complete,
    unless ``force``).  Each part is built into a temporary sibling and renamed into place."""
    b = builders()
    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    base = Path(root) / "small"
    base.mkdir(parents=True, exist_ok=True)
    paths = {k: base / k for k in ("hf", "optimum", "genai")}

    def build(kind, fn):
        build_part(paths[kind], f"small/{kind}", fn, force=force, complete=lambda d: _complete(kind, d),
                   progress=progress)

    def hf(out):
        cls, cfg = small_config()
        tok = b.common.build_tokenizer(SMALL_VOCAB, small_corpus())
        n = b.common.build_hf_model(cls, cfg, out, tok)
        progress(f"[bench-models] small/hf: {n / 1e6:.1f}M parameters")

    def optimum(out):
        b.common.export_optimum(paths["hf"], out)

    def genai(out):
        b.text.build_genai(paths["hf"], out, base)
        (base / f"{out.name}.log").unlink(missing_ok=True)

    build("hf", hf)
    build("optimum", optimum)
    build("genai", genai)
    return paths


def build_command(build, usage: str) -> None:
    """`python bench/<module>.py ROOT [--force]`: build(ROOT, force=...) and print its folders."""
    args = [a for a in sys.argv[1:] if a != "--force"]
    if len(args) != 1:
        sys.exit(usage)
    for k, v in build(args[0], force="--force" in sys.argv).items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    build_command(build_small, __doc__)
