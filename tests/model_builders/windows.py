"""Build the sliding-window test models: a tiny random Mistral (every layer local) and GPT-Neo
(a global layer, then a local one), window 8 so that prompts and answers cross it, in the layouts
that run them:

``hf/mistral``, ``hf/gpt_neo``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``mistral-optimum``, ``gpt_neo-optimum``
    optimum ``text-generation-with-past``: ``model.onnx`` with ``position_ids`` (the append
    cache), the window computed over the buffer's columns.
``mistral-genai``
    onnxruntime-genai's builder: GroupQueryAttention with ``local_window_size`` 8 (in_place).

Folders under ``<cache root>/<windows_key()>-windows`` (the key hashes this file, common.py and
the package versions); built on demand, in this process (the genai build in a subprocess), under
an ``fcntl`` lock, into a temporary sibling renamed into place. ~10 s.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import common

WINDOW = 8
WINDOW_MODELS = ("hf/mistral", "hf/gpt_neo", "mistral-optimum", "gpt_neo-optimum", "mistral-genai")


def windows_key() -> str:
    return common.source_key([Path(__file__), common.HERE / "common.py"], common.versions_text())


def window_config(kind: str):
    """transformers config of the tiny ``kind`` (mistral, gpt_neo) and its model class."""
    import transformers as tf

    ids = dict(bos_token_id=common.BOS_ID, eos_token_id=common.EOS_ID, pad_token_id=common.PAD_ID)
    if kind == "mistral":
        return tf.MistralForCausalLM, tf.MistralConfig(
            vocab_size=common.TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=WINDOW,
            tie_word_embeddings=False, **ids)
    if kind == "gpt_neo":
        return tf.GPTNeoForCausalLM, tf.GPTNeoConfig(
            vocab_size=common.TINY_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], window_size=WINDOW, max_position_embeddings=256, **ids)
    raise ValueError(f"unknown sliding-window model kind {kind!r}")


def _build(tmp: Path) -> None:
    import torch

    from .text import build_genai

    torch.set_num_threads(1)
    tokenizer = common.build_tokenizer(common.TINY_VOCAB)
    for kind in ("mistral", "gpt_neo"):
        cls, config = window_config(kind)
        common.build_hf_model(cls, config, tmp / "hf" / kind, tokenizer, init_range=common.INIT_RANGE,
                              perturb=common.PERTURB)
        common.export_optimum(tmp / "hf" / kind, tmp / f"{kind}-optimum")
    build_genai(tmp / "hf" / "mistral", tmp / "mistral-genai", tmp / "logs")
    for f in tmp.rglob("*.onnx"):
        common.cap_ir_version(f)
    (tmp / "manifest.json").write_text(json.dumps({"models": list(WINDOW_MODELS), "key": windows_key()}))


def ensure_window_models(progress=print) -> dict[str, Path]:
    """Paths of the sliding-window models (WINDOW_MODELS), built when missing."""
    final = common.cache_root() / f"{windows_key()}-windows"
    paths = {k: final / k for k in WINDOW_MODELS}
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            with common.offline_environ():
                _build(tmp)
        common.locked_build(final, build, progress)
    return paths
