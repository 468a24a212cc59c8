"""Build the project's decoder-only test models (and, in the same worker, the encoder-decoders
of :mod:`model_builders.seq2seq`): tiny random-weight Hugging Face models and their ONNX exports in
every layout the engine must serve.  Nothing is downloaded; everything is built from a
``transformers`` config with random weights.

Layouts (keys of :data:`MODEL_DIRS`, relative folders under the cache folder):

``hf/llama``, ``hf/qwen2``, ``hf/gpt2``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``llama-optimum``, ``qwen2-optimum``, ``gpt2-optimum``
    ``optimum`` ``text-generation-with-past`` export: root ``model.onnx`` with ``position_ids``.
``gpt2-grow``
    root ``model.onnx`` WITHOUT ``position_ids`` (positions come from the cache length).
``llama-merged``
    transformers.js / onnx-community layout: ``onnx/decoder_model_merged.onnx``
    (``use_cache_branch`` bool[1] + one If node), ``onnx/decoder_model_merged_quantized.onnx``
    (int8 dynamic quantization) and ``onnx/decoder_model_merged_fp16.onnx`` (float16 weights
    and float16 past / present / logits).
``llama-genai``, ``qwen2-genai``
    ``onnxruntime_genai.models.builder -p fp32 -e cpu``: ``model.onnx`` + ``model.onnx.data`` +
    ``genai_config.json`` + tokenizer files, exactly as the builder writes them (no config.json).

``llama-merged`` and ``gpt2-grow`` are made by the default model's exporter
(``generation.default_model.export``: ``export_decoder`` and ``merge``), the code that exports
the model Raymuter ships.

Entry points:

* :func:`ensure_test_models` -> ``dict[str, Path]``: cached build (see its docstring);
  ``seq2seq=True`` adds the encoder-decoders, ``vision=True`` the vision-language models.
* :func:`build_all` builds everything into a folder, in this process (heavy imports).
* ``python -m model_builders.text [--root DIR]`` (from tests/): ensure the cache, print the paths as
  JSON.

This module has no import-time side effects and imports torch / transformers / onnx lazily.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from .common import (BOS_ID, DEFAULT_MODEL_EXPORT, EOS_ID, HERE, INIT_RANGE, MAX_IR_VERSION, PAD_ID, PERTURB,
                     TINY_VOCAB, build_hf_model, build_tokenizer, cache_root, cap_ir_version, copy_meta,
                     export_optimum, offline_env, package_versions, run_logged, source_key, versions_text,
                     worker_command, worker_env)
from .seq2seq import SEQ2SEQ_DIRS, SEQ2SEQ_KINDS, build_seq2seq_hf, export_seq2seq

#: key -> folder relative to the cache folder
MODEL_DIRS = {
    "hf/llama": "hf/llama",
    "hf/qwen2": "hf/qwen2",
    "hf/gpt2": "hf/gpt2",
    "llama-optimum": "llama-optimum",
    "qwen2-optimum": "qwen2-optimum",
    "gpt2-optimum": "gpt2-optimum",
    "gpt2-grow": "gpt2-grow",
    "llama-merged": "llama-merged",
    "llama-genai": "llama-genai",
    "qwen2-genai": "qwen2-genai",
}


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def tiny_config(kind: str):
    """transformers config of the tiny ``kind`` model (llama, qwen2, gpt2) and its model class."""
    import transformers as tf

    common = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=INIT_RANGE, **common)
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, max_window_layers=2, use_sliding_window=False,
            initializer_range=INIT_RANGE, **common)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
            initializer_range=INIT_RANGE, **common)
    raise ValueError(f"unknown tiny model kind {kind!r}")

def build_tiny_hf(kind, out, tokenizer) -> int:
    cls, cfg = tiny_config(kind)
    return build_hf_model(cls, cfg, out, tokenizer, init_range=INIT_RANGE, perturb=PERTURB)


# --------------------------------------------------------------------------------------------
# ONNX layouts
# --------------------------------------------------------------------------------------------
def _causal_lm(hf_dir):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()


def export_grow(hf_dir, out):
    """``gpt2-grow``: the with-past decoder WITHOUT ``position_ids`` (positions come from the
    past length), by the default model's exporter (``generation.default_model.export``)."""
    from generation.default_model.export import export_decoder

    export_decoder(_causal_lm(hf_dir), Path(out), past=True, position_ids=False)


def export_merged(hf_dir, out):
    """``decoder_model_merged.onnx`` at ``out``: the default model's merged-graph builder
    (``generation.default_model.export``: ``export_decoder`` without and with the past, then
    ``merge``), its weights left in each branch as transformers.js exports have them (not
    ``compact``-ed: the int8 and fp16 variants are made from this graph)."""
    import tempfile

    import onnx

    from generation.default_model.export import export_decoder, merge

    model = _causal_lm(hf_dir)
    with tempfile.TemporaryDirectory(dir=Path(out).parent) as work:
        no_past, with_past = Path(work) / "decoder_model.onnx", Path(work) / "decoder_with_past_model.onnx"
        export_decoder(model, no_past, past=False)
        export_decoder(model, with_past, past=True)
        merged = merge(onnx.load(str(no_past)), onnx.load(str(with_past)))
    onnx.checker.check_model(merged)
    onnx.save(merged, str(out))


def quantize_int8(src, dst):
    """int8 dynamic quantization of the weights (MatMulInteger), If subgraphs included."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     extra_options={"EnableSubgraph": True})
    cap_ir_version(dst)


def quantize_q4(src, dst, block_size=32):
    """4-bit weights (MatMulNBits, symmetric, blocks of 32), If subgraphs included, as
    transformers.js makes its ``*_q4.onnx`` exports (onnxruntime's MatMulNBitsQuantizer)."""
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(str(src)), block_size=block_size, is_symmetric=True)
    quantizer.process()
    model = quantizer.model.model
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    onnx.save(model, str(dst), save_as_external_data=Path(src).stat().st_size > 2**30)


def convert_fp16(src, dst):
    """float16 weights AND float16 graph inputs/outputs (past, present, logits), as in
    transformers.js ``*_fp16.onnx`` exports; integer / bool inputs are unchanged."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    m = onnx.load(str(src))
    m16 = convert_float_to_float16(m, keep_io_types=False)
    m16.ir_version = min(m.ir_version, MAX_IR_VERSION)
    onnx.save(m16, str(dst))


def genai_command(hf_dir, out, cache_dir):
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
            "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache_dir)]


def build_genai(hf_dir, out, work_dir):
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE``."""
    work_dir = Path(work_dir)
    cache = work_dir / f"genai-cache-{Path(out).name}"
    try:
        run_logged(genai_command(hf_dir, out, cache), work_dir / f"{Path(out).name}.log")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# whole build
# --------------------------------------------------------------------------------------------
def _stderr_progress(msg):
    print(msg, file=sys.stderr, flush=True)


def build_all(root, progress=_stderr_progress, seq2seq_root=None) -> dict[str, Path]:
    """Build every test model into ``root`` (not atomic; see :func:`ensure_test_models`), the
    encoder-decoders (:data:`SEQ2SEQ_DIRS`) into ``seq2seq_root`` (default: ``root`` too).

    Runs in this process (imports torch, transformers, optimum, onnx); the two genai builds
    run as subprocesses in parallel with the torch exports.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    s2s = Path(seq2seq_root) if seq2seq_root is not None else root
    s2s.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    for k, v in offline_env().items():
        os.environ.setdefault(k, v)
    lock = threading.Lock()

    def report(key, t0, extra=""):
        with lock:
            progress(f"[test-models] {key:<16} {time.time() - t0:6.1f}s{extra}")

    @contextlib.contextmanager
    def step(key, extra=""):
        t0 = time.time()
        yield
        report(key, t0, extra)

    t0 = time.time()
    import torch  # (timed here: the import dominates the first step)

    # one intra-op thread: the models are tiny, and on a busy 2-core machine a 2-thread OpenMP
    # pool waits for a time slice on every op (encoder-decoder exports 1.6-2.1 s -> 0.8-1.0 s)
    torch.set_num_threads(1)

    tok = build_tokenizer(TINY_VOCAB)
    for kind in ("llama", "qwen2", "gpt2"):
        n = build_tiny_hf(kind, root / "hf" / kind, tok)
        report(f"hf/{kind}", t0, f"  ({n} params)")
        t0 = time.time()

    # genai builds: subprocesses (own torch import), one after the other, in a thread, so
    # they overlap with the single-threaded torch exports below.
    genai_errors = []

    def genai_thread():
        for kind in ("llama", "qwen2"):
            t1 = time.time()
            try:
                build_genai(root / "hf" / kind, root / f"{kind}-genai", logs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                genai_errors.append(e)
                return
            report(f"{kind}-genai", t1)

    th = threading.Thread(target=genai_thread, name="genai-builder", daemon=True)
    th.start()
    try:
        for kind in ("llama", "qwen2", "gpt2"):
            with step(f"{kind}-optimum"):
                export_optimum(root / "hf" / kind, root / f"{kind}-optimum")

        with step("gpt2-grow"):
            export_grow(root / "hf" / "gpt2", root / "gpt2-grow" / "model.onnx")
            copy_meta(root / "hf" / "gpt2", root / "gpt2-grow")

        with step("llama-merged"):
            d = root / "llama-merged"
            onnx_dir = d / "onnx"
            onnx_dir.mkdir(parents=True, exist_ok=True)
            merged = onnx_dir / "decoder_model_merged.onnx"
            export_merged(root / "hf" / "llama", merged)
            quantize_int8(merged, onnx_dir / "decoder_model_merged_quantized.onnx")
            convert_fp16(merged, onnx_dir / "decoder_model_merged_fp16.onnx")
            copy_meta(root / "hf" / "llama", d)

        for kind in SEQ2SEQ_KINDS:  # encoder-decoders: 0.1 s + one ~1 s export each
            t0 = time.time()
            n = build_seq2seq_hf(kind, s2s / "hf" / kind)
            report(f"hf/{kind}", t0, f"  ({n} params)")
            t0 = time.time()
            keys = export_seq2seq(kind, s2s / "hf" / kind, s2s, s2s / "tmp-export")
            report(f"{kind}-optimum", t0, f"  ({', '.join(keys)})")
        shutil.rmtree(s2s / "tmp-export", ignore_errors=True)
    finally:
        th.join()
    if genai_errors:
        raise genai_errors[0]

    paths = {k: root / v for k, v in MODEL_DIRS.items()}
    paths.update({k: s2s / v for k, v in SEQ2SEQ_DIRS.items()})
    missing = [k for k, p in paths.items() if not p.is_dir()]
    if missing:
        raise RuntimeError(f"build finished without {missing}")
    for f in sorted(set(root.rglob("*.onnx")) | set(s2s.rglob("*.onnx"))):
        cap_ir_version(f)
    return paths


# --------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------
def cache_key() -> str:
    """Hash of the source of what builds these models (this file, seq2seq.py, common.py and
    ``generation/default_model/export.py``) and of the versions of the packages that build them.
    No other file (a test, conftest.py, the vision or embedding builders) changes it."""
    return source_key([Path(__file__), HERE / "seq2seq.py", HERE / "common.py", DEFAULT_MODEL_EXPORT],
                      versions_text())



def seq2seq_folder(folder) -> Path:
    """The encoder-decoders' folder next to a build folder: ``<folder>-seq2seq``.  (A sibling,
    not a subfolder: the decoder-only folder holds exactly the :data:`MODEL_DIRS` models.)"""
    folder = Path(folder)
    return folder.with_name(folder.name + "-seq2seq")


def _complete(folder: Path) -> bool:
    s2s = seq2seq_folder(folder)
    return ((folder / "manifest.json").is_file()
            and all((folder / v).is_dir() for v in MODEL_DIRS.values())
            and (s2s / "manifest.json").is_file()
            and all((s2s / v).is_dir() for v in SEQ2SEQ_DIRS.values()))


def ensure_test_models(root=None, *, progress=_stderr_progress,
                       seq2seq=False, vision=False) -> dict[str, Path]:
    """Paths of all test models (keys of :data:`MODEL_DIRS`, plus those of
    :data:`SEQ2SEQ_DIRS` with ``seq2seq=True``), building them only when missing.
    ``vision=True`` adds the vision-language models (:data:`model_builders.vision.VISION_DIRS`: their
    own build, on demand, into the sibling ``<vision key>-vision``; see :mod:`model_builders.vision`).

    Cache folder: ``$RAYMUTER_TEST_MODELS`` (else ``~/.cache/raymuter/test-models``) /
    :func:`cache_key`, the encoder-decoders in its sibling ``<cache_key>-seq2seq``; ONE build
    makes both.  The build runs in ONE worker subprocess (``python -m model_builders.text
    --build-into TMP``) into temporary sibling folders that are renamed into place when
    complete, under an ``fcntl`` lock so concurrent processes build once.  A failed build
    leaves its log at ``<cache root>/<key>.failed.log`` and raises ``RuntimeError``.
    """
    import fcntl

    base = Path(root).expanduser().absolute() if root is not None else cache_root()
    key = cache_key()
    final = base / key
    paths = {k: final / v for k, v in MODEL_DIRS.items()}
    if seq2seq:
        paths.update({k: seq2seq_folder(final) / v for k, v in SEQ2SEQ_DIRS.items()})
    if vision:
        from . import vision as vision_builders

        paths.update(vision_builders.ensure_vision_models(base, progress))
    if _complete(final):
        return paths
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if _complete(final):  # built by another process while we waited
                return paths
            # we hold the lock: any leftover temp folder of this key is from a dead build
            for stale in base.glob(f".{key}.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            for old in (final, seq2seq_folder(final)):
                if old.exists():  # incomplete (files deleted by hand?): rebuild
                    shutil.rmtree(old)
            tmp = base / f".{key}.building-{os.getpid()}"
            tmp.mkdir()
            t0 = time.time()
            progress(f"[test-models] building into {final} (cache miss)")
            proc = subprocess.run(worker_command("text", tmp), stdin=subprocess.DEVNULL, env=worker_env(),
                                  timeout=1800)
            if proc.returncode != 0 or not _complete(tmp):
                failed_log = base / f"{key}.failed.log"
                log = tmp / "logs" / "build.log"
                if log.exists():
                    shutil.copy2(log, failed_log)
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.rmtree(seq2seq_folder(tmp), ignore_errors=True)
                raise RuntimeError(f"test model build failed (rc={proc.returncode}); "
                                   f"log: {failed_log}")
            os.rename(seq2seq_folder(tmp), seq2seq_folder(final))
            os.rename(tmp, final)
            progress(f"[test-models] all built in {time.time() - t0:.1f}s -> {final}")
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    return paths


def _worker(tmp: Path) -> int:
    """Subprocess body: build into ``tmp``; library noise goes to ``tmp/logs/build.log``,
    progress lines to the original stderr."""
    import traceback

    t0 = time.time()
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    progress_fd = os.dup(2)
    progress_out = os.fdopen(progress_fd, "w", buffering=1)
    log = open(tmp / "logs" / "build.log", "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)

    def progress(msg):
        progress_out.write(msg + "\n")
        print(msg, flush=True)  # into the log too

    try:
        paths = build_all(tmp, progress=progress, seq2seq_root=seq2seq_folder(tmp))
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        progress_out.write("[test-models] BUILD FAILED:\n"
                           + "".join(traceback.format_exc()[-3000:]) + "\n")
        return 1
    for folder, dirs in ((tmp, MODEL_DIRS), (seq2seq_folder(tmp), SEQ2SEQ_DIRS)):
        manifest = {
            "models": {k: str(paths[k].relative_to(folder)) for k in dirs},
            "versions": package_versions(),
            "cache_key": cache_key(),
            "build_seconds": round(time.time() - t0, 1),
            "files": sorted(str(f.relative_to(folder)) for f in folder.rglob("*")
                            if f.is_file() and f.parts[len(folder.parts)] != "logs"),
        }
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="cache root (default $RAYMUTER_TEST_MODELS or "
                                   "~/.cache/raymuter/test-models)")
    ap.add_argument("--key", choices=sorted({**MODEL_DIRS, **SEQ2SEQ_DIRS}),
                    help="print only this model's folder")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.build_into:
        return _worker(Path(a.build_into))
    paths = ensure_test_models(a.root, seq2seq=True)
    if a.key:
        print(paths[a.key])
    else:
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
