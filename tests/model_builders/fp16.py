"""Build the fp16 onnxruntime-genai test model: the tiny Llama of the text models (``hf/llama``)
through onnxruntime-genai's builder with ``-p fp16 -e cuda``, the build a CUDA node runs
(GroupQueryAttention, float16 weights, cache and logits; in_place). onnxruntime's CPU kernels
run it too, which is how the tests hold the fp16 path without a GPU.

``llama-genai-fp16`` under ``<cache root>/<fp16_key()>-fp16`` (the key hashes this file,
common.py, the text models' key and the package versions); built on demand, the builder in a
subprocess, under an ``fcntl`` lock, into a temporary sibling renamed into place. ~5 s.
(transformers.js fp16 variants, ``*_fp16.onnx``, are among the text and layout models already.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import common

FP16_MODELS = ("llama-genai-fp16",)


def fp16_key() -> str:
    from .text import cache_key

    return common.source_key([Path(__file__), common.HERE / "common.py"], cache_key(), common.versions_text())


def ensure_fp16_models(hf_llama: Path, progress=print) -> dict[str, Path]:
    """Paths of FP16_MODELS, built from the text models' ``hf/llama`` folder when missing."""
    final = common.cache_root() / f"{fp16_key()}-fp16"
    paths = {k: final / k for k in FP16_MODELS}
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            from .text import genai_command

            with common.offline_environ():
                command = genai_command(hf_llama, tmp / "llama-genai-fp16", tmp / "genai-cache")
                command[command.index("-p") + 1] = "fp16"
                command[command.index("-e") + 1] = "cuda"
                try:
                    common.run_logged(command, tmp / "llama-genai-fp16.log")
                finally:
                    shutil.rmtree(tmp / "genai-cache", ignore_errors=True)
            for f in tmp.rglob("*.onnx"):
                common.cap_ir_version(f)
            (tmp / "manifest.json").write_text(json.dumps({"models": list(FP16_MODELS), "key": fp16_key()}))
        common.locked_build(final, build, progress)
    return paths
