"""Build the support matrix: every decoder-only text architecture optimum-onnx 0.1.0 exports for
``text-generation-with-past``, tiny (hidden 64, 2 layers, 4 heads, 2 KV heads where the
architecture groups them (falcon and gpt_bigcode: one, as multi-query; phi: four, as optimum
exports it), a sliding window of 8 where it has one, so prompts and answers cross it),
in the plain Optimum layout:

``hf/<arch>``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``<arch>-optimum``
    optimum ``text-generation-with-past``: ``model.onnx``, with ``position_ids`` where the exporter
    gives them (not for bloom and mpt, ALiBi, nor gemma2, gemma3_text, gpt_oss and nemotron).

Architectures another builder already makes are not built again: :func:`matrix_models` takes
them from there (:data:`REUSED`: llama, its merged decoder and gpt2 from text.py, mistral and gpt_neo
from windows.py, qwen2 (with its window), qwen3, granite, phi3 and gemma from families.py).
optimum-onnx 0.1.0 writes no merged decoder for these: Llama's ``llama-merged`` is the one merged
layout here; :mod:`model_builders.layouts` makes the other layouts (genai builds, transformers.js's
``onnx/`` folder and merged decoder) from these Hugging Face folders.

Folders under ``<cache root>/<matrix_key()>-matrix`` (the key hashes this file, common.py and the
package versions); built on demand in a worker process, under an ``fcntl`` lock, into a temporary
sibling renamed into place; ``manifest.json`` records each architecture's build seconds.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from . import common

WINDOW = 8
#: architecture -> (builder module, its folder of the Optimum export, its oracle folder)
REUSED = {
    "llama": ("text", "llama-optimum", "hf/llama"),
    "llama-merged": ("text", "llama-merged", "hf/llama"),  # the merged decoder (transformers.js layout)
    "gpt2": ("text", "gpt2-optimum", "hf/gpt2"),
    "mistral": ("windows", "mistral-optimum", "hf/mistral"),
    "gpt_neo": ("windows", "gpt_neo-optimum", "hf/gpt_neo"),
    "qwen2": ("families", "qwen2_window-optimum", "hf/qwen2_window"),
    "qwen3": ("families", "qwen3-optimum", "hf/qwen3"),
    "granite": ("families", "granite-optimum", "hf/granite"),
    "phi3": ("families", "phi3-optimum", "hf/phi3"),
    "gemma": ("families", "gemma-optimum", "hf/gemma"),
}
#: the architectures built here
BUILT = ("arcee", "bloom", "codegen", "cohere", "deepseek_v3", "falcon", "gemma2", "gemma3_text", "glm",
         "gpt_bigcode", "gpt_neox", "gpt_oss", "gptj", "helium", "mpt", "nemotron", "olmo", "olmo2", "opt", "phi",
         "qwen3_moe", "smollm3", "stablelm")


def matrix_key() -> str:
    return common.source_key([Path(__file__), common.HERE / "common.py"], common.versions_text())


def matrix_config(kind: str):
    """transformers config of the tiny ``kind`` (one of BUILT) and its model class."""
    import transformers as tf

    ids = dict(bos_token_id=common.BOS_ID, eos_token_id=common.EOS_ID, pad_token_id=common.PAD_ID)
    llama_like = dict(vocab_size=common.TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False, **ids)
    gpt_like = dict(vocab_size=common.TINY_VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=4, **ids)
    if kind == "arcee":  # relu² MLP without a gate
        return tf.ArceeForCausalLM, tf.ArceeConfig(**llama_like)
    if kind == "bloom":  # ALiBi
        return tf.BloomForCausalLM, tf.BloomConfig(vocab_size=common.TINY_VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                                   **ids)
    if kind == "codegen":
        return tf.CodeGenForCausalLM, tf.CodeGenConfig(**gpt_like, n_ctx=256, rotary_dim=8, tie_word_embeddings=False)
    if kind == "cohere":  # parallel attention and MLP, LayerNorm, interleaved rotary, logit scale
        return tf.CohereForCausalLM, tf.CohereConfig(**llama_like)
    if kind == "deepseek_v3":  # multi-head latent attention; layer 0 dense, layer 1 routed experts
        return tf.DeepseekV3ForCausalLM, tf.DeepseekV3Config(
            **{**llama_like, "num_key_value_heads": 4}, moe_intermediate_size=32, n_shared_experts=1,
            n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    if kind == "falcon":  # Falcon-7B's: multi-query attention, parallel attention and MLP
        return tf.FalconForCausalLM, tf.FalconConfig(
            vocab_size=common.TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            multi_query=True, max_position_embeddings=256, **ids)
    # Gemma 2 and 3 untied: tied, the scaled embedding outweighs the sandwiched blocks and the tiny
    # model echoes its last token, whatever the attention sees
    if kind == "gemma2":  # soft-capped scores and logits; layer 0 local, layer 1 global
        return tf.Gemma2ForCausalLM, tf.Gemma2Config(**llama_like, head_dim=16, sliding_window=WINDOW,
                                                     query_pre_attn_scalar=16)
    if kind == "gemma3_text":  # per-head q/k norms, two rotary bases; layer 0 local, layer 1 global
        return tf.Gemma3ForCausalLM, tf.Gemma3TextConfig(
            **llama_like, head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"])
    if kind == "glm":  # half of each head rotary (interleaved), q/k/v biases
        return tf.GlmForCausalLM, tf.GlmConfig(**llama_like, head_dim=16, partial_rotary_factor=0.5,
                                               attention_bias=True)
    if kind == "gpt_bigcode":  # multi-query attention, one key|value cache tensor per layer
        return tf.GPTBigCodeForCausalLM, tf.GPTBigCodeConfig(**gpt_like, multi_query=True)
    if kind == "gpt_neox":
        return tf.GPTNeoXForCausalLM, tf.GPTNeoXConfig(
            vocab_size=common.TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, rotary_pct=0.5, max_position_embeddings=256, tie_word_embeddings=False, **ids)
    if kind == "gpt_oss":  # experts, attention sinks; layer 0 local, layer 1 global
        # swiglu_limit as the released checkpoints' config.json has it: transformers 4.57 clamps the
        # experts at 7.0 whatever the config says, onnxruntime-genai's builder only where it says so
        return tf.GptOssForCausalLM, tf.GptOssConfig(
            **llama_like, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
            swiglu_limit=7.0)
    if kind == "gptj":
        return tf.GPTJForCausalLM, tf.GPTJConfig(**gpt_like, rotary_dim=8, tie_word_embeddings=False)
    if kind == "helium":
        return tf.HeliumForCausalLM, tf.HeliumConfig(**llama_like, head_dim=16)
    if kind == "mpt":  # ALiBi
        return tf.MptForCausalLM, tf.MptConfig(vocab_size=common.TINY_VOCAB, d_model=64, n_heads=4, n_layers=2,
                                               expansion_ratio=2, max_seq_len=256, tie_word_embeddings=False, **ids)
    if kind == "nemotron":  # relu² MLP, (1 + w) LayerNorm, half of each head rotary
        return tf.NemotronForCausalLM, tf.NemotronConfig(**llama_like, head_dim=16, partial_rotary_factor=0.5)
    if kind == "olmo":  # LayerNorm without weights
        return tf.OlmoForCausalLM, tf.OlmoConfig(**llama_like)
    if kind == "olmo2":  # q/k norms across heads, norms after attention and the MLP
        return tf.Olmo2ForCausalLM, tf.Olmo2Config(**llama_like)
    if kind == "opt":  # learned positions offset by 2, from the attention mask
        return tf.OPTForCausalLM, tf.OPTConfig(
            vocab_size=common.TINY_VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128, num_attention_heads=4,
            word_embed_proj_dim=64, max_position_embeddings=256, tie_word_embeddings=False, **ids)
    if kind == "phi":  # parallel attention and MLP, half of each head rotary
        return tf.PhiForCausalLM, tf.PhiConfig(**{**llama_like, "num_key_value_heads": 4}, partial_rotary_factor=0.5)
    if kind == "qwen3_moe":
        return tf.Qwen3MoeForCausalLM, tf.Qwen3MoeConfig(
            **llama_like, head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True)
    if kind == "smollm3":  # layer 1 without rotary embedding (NoPE)
        return tf.SmolLM3ForCausalLM, tf.SmolLM3Config(**llama_like, no_rope_layer_interval=2)
    if kind == "stablelm":  # LayerNorm, partial rotary
        return tf.StableLmForCausalLM, tf.StableLmConfig(**llama_like, partial_rotary_factor=0.5)
    raise ValueError(f"unknown matrix architecture {kind!r}")


def _build(tmp: Path, kinds=BUILT) -> None:
    import torch

    torch.set_num_threads(1)
    tokenizer = common.build_tokenizer(common.TINY_VOCAB)
    seconds = {}
    for kind in kinds:
        started = time.time()
        cls, config = matrix_config(kind)
        common.build_hf_model(cls, config, tmp / "hf" / kind, tokenizer, init_range=common.INIT_RANGE,
                              perturb=common.PERTURB)
        common.export_optimum(tmp / "hf" / kind, tmp / f"{kind}-optimum")
        seconds[kind] = round(time.time() - started, 1)
        print(f"[test-models] {kind:<12} {seconds[kind]:5.1f}s", file=sys.stderr, flush=True)
    for f in tmp.rglob("*.onnx"):
        common.cap_ir_version(f)
    (tmp / "manifest.json").write_text(json.dumps({"key": matrix_key(), "seconds": seconds}))


def ensure_matrix_models(progress=print) -> Path:
    """The folder of the architectures built here (BUILT), built when missing (in a worker
    process: torch and the exporter stay out of the caller)."""
    final = common.cache_root() / f"{matrix_key()}-matrix"
    if not (final / "manifest.json").is_file():
        def build(tmp: Path) -> None:
            common.run_logged(common.worker_command("matrix", tmp), final.parent / f"{final.name}.log",
                              env=common.worker_env())
        common.locked_build(final, build, progress)
    return final


def matrix_models(progress=print) -> dict[str, tuple[Path, Path]]:
    """architecture -> (its Optimum export, its torch model): BUILT from this build, REUSED from
    the builders that make them (each built when missing)."""
    from .families import ensure_family_models
    from .text import ensure_test_models
    from .windows import ensure_window_models

    sets = {"text": ensure_test_models(), "windows": ensure_window_models(progress),
            "families": ensure_family_models(progress)}
    folder = ensure_matrix_models(progress)
    out = {arch: (sets[where][onnx], sets[where][hf]) for arch, (where, onnx, hf) in REUSED.items()}
    out.update({kind: (folder / f"{kind}-optimum", folder / "hf" / kind) for kind in BUILT})
    return out


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "--build-into":
        _build(Path(sys.argv[2]), tuple(sys.argv[3:]) or BUILT)
    else:
        print(json.dumps({k: [str(p) for p in v] for k, v in matrix_models().items()}, indent=1))
