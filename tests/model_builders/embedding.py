"""Build the embedding test models: the tiny random Qwen2 and Llama of model_builders.text (their
``hf/qwen2`` and ``hf/llama`` weights, loaded as base models: no LM head) exported by optimum's
``--task feature-extraction`` (``input_ids``, ``attention_mask``, ``position_ids`` ->
``last_hidden_state``), with sentence-transformers configs:

``qwen2-embed``
    ``onnx/model.onnx`` (onnx-community's layout); ``modules.json``: Transformer, Pooling
    (``pooling_mode_lasttoken``), Normalize: Qwen3-Embedding's pipeline.
``llama-embed``
    ``model.onnx`` at the root (optimum's); Pooling ``pooling_mode_mean_tokens``, no Normalize.

Folders under ``<cache root>/<embedding_key()>-embed`` (the key hashes this file and the text
models' key); built on demand, in this process, under an ``fcntl`` lock, into a temporary sibling
renamed into place. The oracle loads the same ``hf/`` folders with transformers' AutoModel.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import common, text

EMBEDDING_MODELS = {"qwen2-embed": ("qwen2", "onnx/model.onnx", "pooling_mode_lasttoken", True),
                    "llama-embed": ("llama", "model.onnx", "pooling_mode_mean_tokens", False)}


def embedding_key() -> str:
    return common.source_key([Path(__file__)], text.cache_key())


def _write_sentence_transformers(folder: Path, mode: str, normalize: bool, hidden: int) -> None:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules, indent=1))
    (folder / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": hidden, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
               "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False, "include_prompt": True}
    pooling[mode] = True
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling, indent=1))


def _build(text_models: dict, tmp: Path) -> None:
    from optimum.exporters.onnx import main_export

    for key, (hf, graph, mode, normalize) in EMBEDDING_MODELS.items():
        source = text_models[f"{hf}-optimum"].parent / "hf" / hf
        export = tmp / f".{key}-export"
        main_export(str(source), str(export), task="feature-extraction", no_post_process=True)
        folder = tmp / key
        (folder / Path(graph).parent).mkdir(parents=True, exist_ok=True)
        shutil.move(str(export / "model.onnx"), str(folder / graph))
        for f in export.iterdir():
            if f.is_file():
                shutil.copy2(f, folder / f.name)
        shutil.rmtree(export)
        config = json.loads((folder / "config.json").read_text())
        _write_sentence_transformers(folder, mode, normalize, config["hidden_size"])
    (tmp / "manifest.json").write_text(json.dumps({"models": list(EMBEDDING_MODELS), "key": embedding_key()}))


def ensure_embedding_models(text_models: dict, progress=print) -> dict[str, Path]:
    """Paths of the embedding models (EMBEDDING_MODELS), built when missing."""
    final = common.cache_root() / f"{embedding_key()}-embed"
    paths = {k: final / k for k in EMBEDDING_MODELS}
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            with common.offline_environ():
                _build(text_models, tmp)
        common.locked_build(final, build, progress)
    return paths
