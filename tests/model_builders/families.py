"""Build the decoder families the fused rewrite learned after Llama / Qwen2 / Mistral: a tiny
random Qwen2 with a sliding window on its second layer (window 8, so prompts and answers cross
it), Qwen3 (per-head q/k norms), Granite (its four multipliers away from 1), Phi-3 (packed qkv
and gate_up, half of each head rotary), Gemma ((1 + w) norms, a scaled embedding, gelu-tanh),
Gemma 2 with caps small enough to change its tokens (scores capped at 1, logits at 2; exported
from its eager attention, the one transformers caps scores in), Gemma 3 with a scaled global
rotary base beside a local one, SmolLM3 with its NoPE layer windowed, OLMo with q/k/v clipped
(at 1.5, which changes its tokens), OLMo 2, and Nemotron and Phi with 16 of 32 dimensions of each
head rotary (what onnxruntime-genai's GroupQueryAttention rotates as it is: the support matrix's
Nemotron and Phi rotate 8 of 16, which the fused rewrite lays out for it):

``hf/<kind>``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``<kind>-optimum``
    optimum ``text-generation-with-past``: ``model.onnx`` with ``position_ids`` (not Gemma 2 / 3's).

:func:`genai_build` builds onnxruntime-genai's graph of one of them on demand (``bench/fusion.py``).

Folders under ``<cache root>/<families_key()>-families`` (the key hashes this file, common.py and
the package versions); built on demand in a worker process, under an ``fcntl`` lock, into a
temporary sibling renamed into place. ~30 s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import common

WINDOW = 8
FAMILIES = ("qwen2_window", "qwen3", "granite", "phi3", "gemma", "gemma2_capped", "gemma3_scaled", "smollm3_window",
            "olmo_clipped", "olmo2", "nemotron", "phi")
EAGER = ("gemma2_capped",)  # exported from transformers' eager attention (its default, sdpa, ignores the scores' cap)
FAMILY_MODELS = tuple(f"hf/{k}" for k in FAMILIES) + tuple(f"{k}-optimum" for k in FAMILIES)


def families_key() -> str:
    return common.source_key([Path(__file__), common.HERE / "common.py"], common.versions_text())


def family_config(kind: str):
    """transformers config of the tiny ``kind`` (one of FAMILIES) and its model class."""
    import transformers as tf

    shared = dict(vocab_size=common.TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False, bos_token_id=common.BOS_ID, eos_token_id=common.EOS_ID,
                  pad_token_id=common.PAD_ID)
    if kind == "qwen2_window":  # layer 0 sees everything, layer 1 the last WINDOW tokens
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(**shared, use_sliding_window=True, sliding_window=WINDOW,
                                                   max_window_layers=1)
    if kind == "qwen3":
        return tf.Qwen3ForCausalLM, tf.Qwen3Config(**shared, head_dim=16)
    if kind == "granite":
        return tf.GraniteForCausalLM, tf.GraniteConfig(**shared, embedding_multiplier=3.0, residual_multiplier=0.6,
                                                       attention_multiplier=0.2, logits_scaling=2.5)
    if kind == "phi3":
        # head_dim 32, 16 of it rotary: GroupQueryAttention takes rotary halves in multiples of 8
        return tf.Phi3ForCausalLM, tf.Phi3Config(**{**shared, "num_attention_heads": 2, "num_key_value_heads": 1},
                                                 original_max_position_embeddings=256, partial_rotary_factor=0.5)
    if kind == "gemma":
        return tf.GemmaForCausalLM, tf.GemmaConfig(**{**shared, "tie_word_embeddings": True}, head_dim=16)
    if kind == "gemma2_capped":  # layer 0 local; scores scaled by 32 ** -0.5 (not head_dim's)
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**shared, head_dim=16, sliding_window=WINDOW,
                                                     query_pre_attn_scalar=32, attn_logit_softcapping=1.0,
                                                     final_logit_softcapping=2.0)
    if kind == "gemma3_scaled":  # layer 0 local (base 100), layer 1 global (base 1e6, linear scaling 8)
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **shared, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=32,
            layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, final_logit_softcapping=3.0)
    if kind == "smollm3_window":  # layer 1 without rotary embedding, windowed
        return tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**shared, no_rope_layer_interval=2, use_sliding_window=True,
                                                       sliding_window=WINDOW)
    if kind == "olmo_clipped":
        return tf.OlmoForCausalLM, tf.OlmoConfig(**shared, clip_qkv=1.5)
    if kind == "olmo2":
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**shared)
    if kind == "nemotron":  # 4 heads of 32 (q and o 128 wide), half of each rotary
        return tf.NemotronForCausalLM, tf.NemotronConfig(**shared, head_dim=32, partial_rotary_factor=0.5)
    if kind == "phi":  # 2 heads of 32 (optimum exports phi with as many KV heads as heads), half rotary
        return tf.PhiForCausalLM, tf.PhiConfig(**{**shared, "num_attention_heads": 2, "num_key_value_heads": 2},
                                               partial_rotary_factor=0.5)
    raise ValueError(f"unknown family {kind!r}")


def _build(tmp: Path) -> None:
    import torch

    torch.set_num_threads(1)
    tokenizer = common.build_tokenizer(common.TINY_VOCAB)
    for kind in FAMILIES:
        cls, config = family_config(kind)
        common.build_hf_model(cls, config, tmp / "hf" / kind, tokenizer, init_range=common.INIT_RANGE,
                              perturb=common.PERTURB)
        if kind in EAGER:
            _export_eager(tmp / "hf" / kind, tmp / f"{kind}-optimum")
        else:
            common.export_optimum(tmp / "hf" / kind, tmp / f"{kind}-optimum")
    for f in tmp.rglob("*.onnx"):
        common.cap_ir_version(f)
    (tmp / "manifest.json").write_text(json.dumps({"models": list(FAMILY_MODELS), "key": families_key()}))


def _export_eager(hf_dir: Path, out: Path) -> None:
    """optimum's ``text-generation-with-past`` export of the model loaded with eager attention."""
    import transformers
    from optimum.exporters.onnx import onnx_export_from_model

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager")
    onnx_export_from_model(model, out, task="text-generation-with-past")
    common.copy_meta(hf_dir, out)


def ensure_family_models(progress=print) -> dict[str, Path]:
    """Paths of the family models (FAMILY_MODELS), built when missing (in a worker process:
    torch and the exporter stay out of the caller)."""
    final = common.cache_root() / f"{families_key()}-families"
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            common.run_logged(common.worker_command("families", tmp), final.parent / f"{final.name}.log",
                              env=common.worker_env())
        common.locked_build(final, build, progress)
    return {k: final / k for k in FAMILY_MODELS}


def genai_build(hf_dir: Path, progress=print) -> Path:
    """onnxruntime-genai's fp32 CPU build of the HF folder `hf_dir`, cached beside it."""
    from .text import build_genai

    final = Path(hf_dir).parent.parent / "genai" / Path(hf_dir).name
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            build_genai(hf_dir, tmp / "model", tmp)
            for f in tmp.rglob("*.onnx"):
                common.cap_ir_version(f)
            (tmp / "manifest.json").write_text("{}")
        common.locked_build(final, build, progress)
    return final / "model"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--build-into":
        _build(Path(sys.argv[2]))
    else:
        print(json.dumps({k: str(v) for k, v in ensure_family_models().items()}, indent=1))
