"""Build the support matrix's other layouts from the tiny Hugging Face folders it already has
(:func:`model_builders.matrix.matrix_models`), in one worker process:

``genai/<arch>``
    onnxruntime-genai's builder (``-p fp32 -e cpu``, the version of constraints.txt), called in the
    worker's process for every matrix architecture it takes (:data:`GENAI`): ``model.onnx`` +
    ``model.onnx.data`` + ``genai_config.json`` + the tokenizer, as the builder writes them.
    Nemotron and Phi come from families.py's configs, whose heads rotate 16 of 32 dimensions: of the
    matrix's (8 of 16), the builder writes a graph onnxruntime's GroupQueryAttention refuses (its
    cos_cache must be a multiple of 8 wide); those are ``genai/<arch>-rotary8`` (:data:`REFUSED_BY_ORT`).
``onnx/<arch>``
    the transformers.js / onnx-community layout its ``scripts/convert.py`` writes today: the Optimum
    export as ``onnx/model.onnx`` beside ``model_q4.onnx`` (MatMulNBits, blocks of 32, symmetric),
    ``model_quantized.onnx`` (int8 dynamic) and ``model_fp16.onnx`` (float16 weights and I/O); the
    config and tokenizer at the top (:data:`ONNX_FOLDER`).
``merged/<arch>``
    the older transformers.js layout (the Xenova exports): ``onnx/decoder_model_merged.onnx``, optimum's
    decoder without a past (present outputs) and with one, merged by ``optimum.onnx.merge_decoders``
    into one If on ``use_cache_branch``, as optimum 1.x wrote it (:data:`MERGED`).

``manifest.json`` records each build's seconds and, for every matrix architecture the genai builder
does not build, the first line of its error (``refused``).

Folders under ``<cache root>/<layouts_key()>-layouts`` (the key hashes this file, common.py, the
keys of the sets the Hugging Face folders come from and the package versions); built on demand in a
worker process under :func:`common.locked_build`. ~6 s (an idle 2-core machine; torch's import is most of it).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

from . import common

#: every matrix architecture onnxruntime-genai 0.15's builder takes (smollm3 included: its builder
#: fails on NoPE layers, recorded in the manifest)
GENAI = ("gemma", "gemma2", "gemma3_text", "gpt_oss", "granite", "llama", "mistral", "nemotron", "olmo", "phi", "phi3",
         "qwen2", "qwen3", "smollm3")
#: genai builds from families.py's configs (16 of 32 dimensions rotary), and the matrix's own as <arch>-rotary8
FROM_FAMILIES = {"nemotron": "hf/nemotron", "phi": "hf/phi"}
REFUSED_BY_ORT = tuple(f"{arch}-rotary8" for arch in FROM_FAMILIES)
#: onnx/model{,_q4,_quantized,_fp16}.onnx: fused and windowed (no position_ids), fused, append
ONNX_FOLDER = ("gemma2", "qwen3", "gpt_neox")
ONNX_VARIANTS = ("q4", "quantized", "fp16")
#: onnx/decoder_model_merged.onnx: fused (packed q|k|v, partial rotary), append, append without position_ids (ALiBi)
MERGED = ("phi3", "gpt_neox", "bloom")


def layouts_key() -> str:
    from .families import families_key
    from .matrix import matrix_key
    from .text import cache_key
    from .windows import windows_key

    return common.source_key([Path(__file__), common.HERE / "common.py"], matrix_key(), families_key(), windows_key(),
                             cache_key(), common.versions_text())


def _hf_folders(progress=print) -> dict[str, Path]:
    """architecture -> the Hugging Face folder its layouts are built from (:data:`FROM_FAMILIES` for
    Nemotron's and Phi's genai builds, as ``<arch>-rotary16``)."""
    from .families import ensure_family_models
    from .matrix import matrix_models

    out = {arch: hf for arch, (_, hf) in matrix_models(progress).items()}
    families = ensure_family_models(progress)
    out.update({f"{arch}-rotary16": families[key] for arch, key in FROM_FAMILIES.items()})
    return out


def build_genai_here(hf_dir: Path, out: Path, cache: Path) -> None:
    """onnxruntime-genai's builder (``-p fp32 -e cpu``) called in this process: one torch import for
    every build, where ``python -m onnxruntime_genai.models.builder`` pays one each."""
    from onnxruntime_genai.models.builder import create_model, parse_extra_options

    try:
        extra = parse_extra_options(None, str(hf_dir), str(out), "fp32", "cpu", str(cache), [])
        create_model(None, str(hf_dir), str(out), "fp32", "cpu", str(cache), **extra)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def export_merged_optimum(hf_dir: Path, out: Path, work: Path) -> None:
    """``decoder_model_merged.onnx`` at ``out`` as optimum 1.x wrote it for transformers.js: optimum's
    decoder without a past (its present outputs kept) and with one, merged on ``use_cache_branch``."""
    import transformers
    from optimum.exporters.onnx.convert import export_models
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx import merge_decoders

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    config = TasksManager.get_exporter_config_constructor("onnx", model=model, task="text-generation-with-past",
                                                          library_name="transformers")
    first = config(model.config, task="text-generation", use_past=True, use_past_in_inputs=False)
    later = config(model.config, task="text-generation", use_past=True, use_past_in_inputs=True)
    export_models({"decoder_model": (model, first), "decoder_with_past_model": (model, later)}, work)
    out.parent.mkdir(parents=True, exist_ok=True)
    merge_decoders(work / "decoder_model.onnx", work / "decoder_with_past_model.onnx", strict=False, save_path=out)
    shutil.rmtree(work, ignore_errors=True)


def _build(tmp: Path) -> None:
    import torch

    from .matrix import BUILT, REUSED, matrix_models
    from .text import convert_fp16, quantize_int8, quantize_q4

    torch.set_num_threads(1)
    hf = _hf_folders()
    optimum = {arch: onnx for arch, (onnx, _) in matrix_models(progress=lambda _: None).items()}
    seconds, refused = {}, {}

    def timed(name, build):
        started = time.time()
        build()
        seconds[name] = round(time.time() - started, 1)
        print(f"[test-models] {name:<20} {seconds[name]:5.1f}s", file=sys.stderr, flush=True)

    for arch in sorted(set(BUILT) | {a for a in REUSED if a != "llama-merged"}):
        source = hf[f"{arch}-rotary16"] if arch in FROM_FAMILIES else hf[arch]
        try:
            timed(f"genai/{arch}", lambda: build_genai_here(source, tmp / "genai" / arch, tmp / "genai-cache"))
        except Exception as e:  # noqa: BLE001 - what the builder says is the record
            shutil.rmtree(tmp / "genai" / arch, ignore_errors=True)
            message = str(e).splitlines()[0].replace(str(source), f"hf/{arch}") if str(e) else ""
            refused[arch] = f"{type(e).__name__}: {message}"
    for arch in FROM_FAMILIES:
        timed(f"genai/{arch}-rotary8", lambda: build_genai_here(hf[arch], tmp / "genai" / f"{arch}-rotary8",
                                                                tmp / "genai-cache"))
    for arch in ONNX_FOLDER:
        def onnx_folder(arch=arch):
            folder = tmp / "onnx" / arch
            common.copy_meta(hf[arch], folder)
            (folder / "onnx").mkdir()
            for f in optimum[arch].glob("model.onnx*"):
                shutil.copy2(f, folder / "onnx" / f.name)
            for variant in ONNX_VARIANTS:
                make = {"q4": quantize_q4, "quantized": quantize_int8, "fp16": convert_fp16}[variant]
                make(folder / "onnx" / "model.onnx", folder / "onnx" / f"model_{variant}.onnx")
        timed(f"onnx/{arch}", onnx_folder)
    for arch in MERGED:
        def merged(arch=arch):
            folder = tmp / "merged" / arch
            common.copy_meta(hf[arch], folder)
            export_merged_optimum(hf[arch], folder / "onnx" / "decoder_model_merged.onnx", tmp / f"work-{arch}")
        timed(f"merged/{arch}", merged)
    for f in tmp.rglob("*.onnx"):
        common.cap_ir_version(f)
    (tmp / "manifest.json").write_text(json.dumps({"key": layouts_key(), "seconds": seconds, "refused": refused},
                                                  indent=1))


def ensure_layout_models(progress=print) -> Path:
    """The folder of the layouts (genai/, onnx/, merged/), built when missing: the Hugging Face
    folders first (each set in its own build), then these in one worker process."""
    _hf_folders(progress)
    final = common.cache_root() / f"{layouts_key()}-layouts"
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            common.run_logged(common.worker_command("layouts", tmp), final.parent / f"{final.name}.log",
                              env=common.worker_env())
        common.locked_build(final, build, progress)
    return final


def layout_models(progress=print) -> dict:
    """``{"root", "hf": {arch: folder}, "genai": {name: folder}, "onnx": {...}, "merged": {...},
    "refused": {arch: the builder's error}}``; ``hf`` has ``<arch>-rotary16`` for FROM_FAMILIES."""
    root = ensure_layout_models(progress)
    manifest = json.loads((root / "manifest.json").read_text())
    return {"root": root, "hf": _hf_folders(progress), "refused": manifest["refused"],
            **{kind: {p.name: p for p in sorted((root / kind).iterdir())} for kind in ("genai", "onnx", "merged")}}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--build-into":
        with common.offline_environ():
            _build(Path(sys.argv[2]))
    else:
        print(json.dumps({k: {n: str(p) for n, p in v.items()} if isinstance(v, dict) else str(v)
                          for k, v in layout_models().items()}, indent=1))
