"""The model that ships with Raymuter, for commands run without a model (`raymuter generate`
now, `raymuter serve` later): readable text on a machine that cannot reach a model hub.

`generation/default_model/files/` holds a small Llama trained on the Python documentation (its
README.md is the model card; `python -m generation.default_model.train` rebuilds it): the Hugging Face
checkpoint and the transformers.js export at the top, an onnxruntime-genai build in `genai/`.
"""

from __future__ import annotations

from pathlib import Path

from ..runtime.model import ModelError

FOLDER = Path(__file__).resolve().parent / "files"


def default_model_path(variant: str | None = None) -> Path:
    """The folder to load when no model is named: the onnxruntime-genai build (GroupQueryAttention,
    the `in_place` cache mode, the fastest); with a `variant`, the transformers.js export (`FOLDER`),
    whose loader names the variants it has."""
    path = FOLDER if variant else FOLDER / "genai"
    if not (path / ("onnx/decoder_model_merged.onnx" if variant else "genai_config.json")).is_file():
        raise ModelError(f"the default model is missing from {path}: reinstall raymuter, or rebuild it with "
                         f"`python -m generation.default_model.train --out {FOLDER}`")
    return path
