"""Build the vision-language test models with transformers 4.57: a tiny random Qwen2-VL and its
ONNX parts in the onnx-community layout (torch exports; optimum has no Qwen2-VL export), and a
tiny ViT + GPT-2 vision-encoder-decoder (optimum export).

Keys of :data:`VISION_DIRS`, folders under ``<cache root>/<vision_key()>-vision`` (a sibling of
the text models' ``<cache_key>`` folder, built on demand by
``model_builders.text.ensure_test_models(vision=True)``; the key hashes this file and the text
models' key):

``hf/qwen2vl``
    ``Qwen2VLForConditionalGeneration`` (``save_pretrained``): text 64 wide, 2 layers, 4 heads
    (2 KV heads) of 16, M-RoPE sections [2, 3, 3], vocab 1000; vision 2 blocks 32 wide, 2 heads,
    patch 2, temporal patch 2, spatial merge 2 (an image of H x W pixels after the resize gives
    H*W/16 image tokens).  Image / video / vision_start / vision_end tokens 990 / 991 / 992 / 993
    (:data:`QWEN2VL_IDS`; the tokenizer's ``<|image_pad|>``, ``<|video_pad|>``, ``<|vision_start|>``,
    ``<|vision_end|>``, then ``<|im_start|>`` / ``<|im_end|>``; Qwen2-VL's chat template).  Init 0.3 plus N(0, 0.1) noise on every parameter.  Also
    ``preprocessor_config.json`` (``Qwen2VLImageProcessor``: patch 2, merge 2, min_pixels 64,
    max_pixels 576: images resize to 8-24 pixels a side) and the tiny byte-level tokenizer.
``qwen2vl-onnx``
    ``onnx/embed_tokens.onnx``: ``input_ids [B, S]`` -> ``inputs_embeds [B, S, 64]``.
    ``onnx/vision_encoder.onnx`` (any grid): ``pixel_values [N, 24]``, ``vision_position_ids
    [N, 2]`` (each patch's row and column in merge-block order), ``attention_bias [N, N]`` (0
    within a frame, -inf across) -> ``image_features [N / 4, 64]``.  The stock export bakes the
    grid in (its rotary positions and attention splits come from ``.tolist()`` of the grid):
    these two inputs carry them instead (``generation.families.vision.vision_inputs`` computes them).
    ``onnx/decoder_model_merged.onnx``: ``inputs_embeds [B, S, 64]``, ``attention_mask
    [B, P + S]``, ``position_ids [3, B, S]``, ``past_key_values.N.key/.value [B, 2, P, 16]``
    (P may be 0) -> ``logits``, ``present.N.key/.value``.  Meta files at the root.
``hf/vit-gpt2``
    ``VisionEncoderDecoderModel``: a ViT encoder (32 x 32 images, patch 8: 17 positions, 64 wide,
    2 layers) and a GPT-2 decoder that cross-attends (64 wide, 2 layers, 4 heads, vocab 1000,
    128 positions); decoder_start = bos 1, eos 2, pad 0.  Init 0.05 plus N(0, 0.05) noise (the
    encoder-decoder setting of model_builders.seq2seq: tiny random ones collapse otherwise).
    ``preprocessor_config.json``: ``ViTImageProcessor`` (32 x 32, bilinear, mean and std 0.5).
``hf/idefics3``
    ``Idefics3ForConditionalGeneration`` (SmolVLM's architecture): Llama text 64 wide, 2 layers,
    4 heads (2 KV heads), vocab 1000; vision 2 layers 32 wide, frames of 32 pixels, patch 4,
    scale factor 2 (16 image tokens a frame).  Its processor: ``Idefics3ImageProcessor`` (longest
    edge 64, frames of 32, splitting: up to 2 x 2 frames + the global one), image_seq_len 16,
    SmolVLM's chat template; the tokenizer's last 41 ids are its special tokens
    (:data:`IDEFICS3_TOKENS`: ``<image>`` = 960).  Init 0.3 plus N(0, 0.1) noise.
``idefics3-onnx``
    ``onnx/embed_tokens.onnx``, ``onnx/vision_encoder.onnx`` (``pixel_values [frames, 3, 32,
    32]`` -> ``image_features [frames, 16, 64]``; transformers' bucketized patch positions as a
    constant), ``onnx/decoder_model_merged.onnx`` (``inputs_embeds``, ``attention_mask``,
    ``position_ids [B, S]``, pasts).  Meta files at the root.
``idefics3-onnx5d``
    ``idefics3-onnx`` with onnx-community's SmolVLM vision encoder layout: ``pixel_values [B, N,
    3, 32, 32]`` and ``pixel_attention_mask [B, N, 32, 32]`` (bool) -> ``image_features [real
    frames, 16, 64]``, as transformers' ``get_image_features``: all-zero (padding) frames dropped,
    the patch mask from the pixel mask, each frame's bucketized positions from its real patches,
    attention only over them.  The other parts are ``idefics3-onnx``'s.
``vit-gpt2-optimum``
    ``optimum-cli export onnx --task image-to-text-with-past``: ``encoder_model.onnx``
    (``pixel_values [B, 3, 32, 32]`` -> ``last_hidden_state [B, 17, 64]``) and
    ``decoder_model_merged.onnx`` (``input_ids``, ``encoder_hidden_states``,
    ``past_key_values.N.key/.value``, ``use_cache_branch``: no cross cache, GPT-2 recomputes
    cross-attention from encoder_hidden_states every step).

Runs in a worker subprocess (``python -m model_builders.vision --build-into TMP``); no import-time side
effects; torch / transformers / onnx imported lazily.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import common as mb
from . import text

VISION_DIRS = {"hf/qwen2vl": "hf/qwen2vl", "qwen2vl-onnx": "qwen2vl-onnx",
               "hf/vit-gpt2": "hf/vit-gpt2", "vit-gpt2-optimum": "vit-gpt2-optimum",
               "hf/idefics3": "hf/idefics3", "idefics3-onnx": "idefics3-onnx", "idefics3-onnx5d": "idefics3-onnx5d"}
VIT_GPT2_INIT = (0.05, 0.05)
QWEN2VL_IDS = dict(image=990, video=991, vision_start=992, vision_end=993)
QWEN2VL_PIXELS = dict(min_pixels=64, max_pixels=576, patch_size=2, temporal_patch_size=2, merge_size=2)
# Qwen2-VL's special tokens at the ids above (a BPE of 990 ids, then these), and its chat
# template (Qwen2-VL-2B-Instruct's)
QWEN2VL_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>", "<|im_start|>", "<|im_end|>")
QWEN2VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
# Idefics3 (SmolVLM): frames of 32 x 32 pixels, patch 4, scale factor 2 -> 16 image tokens a
# frame; images resize to a longest edge of 64, so each splits into up to 2 x 2 frames + the
# global one.  Its tokens end the vocabulary (a BPE of 1000 - len(IDEFICS3_TOKENS) ids, then these).
IDEFICS3_FRAME, IDEFICS3_SEQ_LEN = 32, 16
IDEFICS3_TOKENS = (("<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>", "<|im_start|>")
                   + tuple(f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)))
IDEFICS3_PIXELS = dict(size={"longest_edge": 2 * IDEFICS3_FRAME}, max_image_size={"longest_edge": IDEFICS3_FRAME},
                       do_image_splitting=True)
# SmolVLM-256M-Instruct's chat template
IDEFICS3_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}{% if message['content'][0]['type'] == "
    "'image' %}{{':'}}{% else %}{{': '}}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}"
    "{{line['text']}}{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")


def qwen2vl_config():
    import transformers as tf

    i = QWEN2VL_IDS
    common = dict(bos_token_id=mb.BOS_ID, eos_token_id=mb.EOS_ID, pad_token_id=mb.PAD_ID)
    return tf.Qwen2VLConfig(
        text_config=dict(vocab_size=mb.TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0,
                         initializer_range=mb.INIT_RANGE, tie_word_embeddings=False, **common),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=2,
                           spatial_merge_size=2, temporal_patch_size=2, in_channels=3,
                           initializer_range=mb.INIT_RANGE),
        image_token_id=i["image"], video_token_id=i["video"], vision_start_token_id=i["vision_start"],
        vision_end_token_id=i["vision_end"], tie_word_embeddings=False, **common)


def build_qwen2vl_hf(out) -> int:
    """The tiny random Qwen2-VL -> ``save_pretrained(out)`` with its image processor and tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(mb.SEED)
    model = tf.Qwen2VLForConditionalGeneration(qwen2vl_config()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * mb.PERTURB)
    model.generation_config = tf.GenerationConfig(bos_token_id=mb.BOS_ID, eos_token_id=mb.EOS_ID,
                                                  pad_token_id=mb.PAD_ID)
    out = Path(out)
    model.save_pretrained(out)
    tf.Qwen2VLImageProcessor(**QWEN2VL_PIXELS).save_pretrained(out)
    tokenizer = special_tokenizer(QWEN2VL_TOKENS, QWEN2VL_IDS["image"])
    tokenizer.chat_template = QWEN2VL_CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def special_tokenizer(tokens, first: int):
    """The tiny byte-level BPE of `first` ids, then `tokens` as special tokens (ids first, first
    + 1, ...), then fillers up to the tiny vocabulary."""
    tokenizer = mb.build_tokenizer(first)
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    fill = mb.TINY_VOCAB - len(tokenizer)
    if fill:
        tokenizer.add_tokens([f"<vl_extra_{i}>" for i in range(fill)])
    assert tokenizer.convert_tokens_to_ids(list(tokens)) == list(range(first, first + len(tokens)))
    assert len(tokenizer) == mb.TINY_VOCAB, len(tokenizer)
    return tokenizer


def _export_text_parts(embed, lm, head, text, onnx_dir: Path, mrope: bool, generator) -> None:
    """``embed_tokens.onnx`` (TorchScript) and ``decoder_model_merged.onnx`` (dynamo: TorchScript
    dies on transformers 4.57's vmap masks) of a vision-language model's text side: `embed` its
    token embedding, `lm` its language model, `head` its LM head, `text` its text config;
    ``position_ids`` is [3, B, S] for M-RoPE (`mrope`), else [B, S]."""
    import torch
    from transformers import DynamicCache

    layers, kv, head_dim = text.num_hidden_layers, text.num_key_value_heads, text.hidden_size // text.num_attention_heads

    class Embed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = embed

        def forward(self, input_ids):
            return self.embed(input_ids)

    class Decoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lm, self.head = lm, head

        def forward(self, inputs_embeds, attention_mask, position_ids, *past):
            cache = DynamicCache()
            for i in range(layers):
                cache.update(past[2 * i], past[2 * i + 1], i)
            o = self.lm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=cache, use_cache=True)
            res = [self.head(o.last_hidden_state)]
            for i in range(layers):
                res += [o.past_key_values.layers[i].keys, o.past_key_values.layers[i].values]
            return tuple(res)

    with torch.no_grad():
        torch.onnx.export(Embed(), (torch.tensor([[5, 6, 7]]),), str(onnx_dir / "embed_tokens.onnx"), dynamo=False,
                          input_names=["input_ids"], output_names=["inputs_embeds"],
                          dynamic_axes={"input_ids": {0: "batch_size", 1: "sequence_length"},
                                        "inputs_embeds": {0: "batch_size", 1: "sequence_length"}})
        B, S, P = 2, 5, 3
        positions = torch.arange(P, P + S).view(1, S).expand(B, S)
        if mrope:
            positions = positions.view(1, B, S).expand(3, B, S)
        args = [torch.randn(B, S, text.hidden_size, generator=generator), torch.ones(B, P + S, dtype=torch.long),
                positions.contiguous()]
        in_names, out_names = ["inputs_embeds", "attention_mask", "position_ids"], ["logits"]
        for i in range(layers):
            for name in ("key", "value"):
                args.append(torch.randn(B, kv, P, head_dim, generator=generator))
                in_names.append(f"past_key_values.{i}.{name}")
                out_names.append(f"present.{i}.{name}")
        bs = torch.export.Dim("batch_size", min=1, max=64)
        sl = torch.export.Dim("sequence_length", min=1, max=1024)
        pl = torch.export.Dim("past_sequence_length", min=0, max=1024)
        tl = torch.export.Dim("total_sequence_length", min=1, max=2048)
        shapes = ({0: bs, 1: sl}, {0: bs, 1: tl}, {1: bs, 2: sl} if mrope else {0: bs, 1: sl},
                  tuple([{0: bs, 2: pl}] * (2 * layers)))
        program = torch.onnx.export(Decoder(), tuple(args), None, dynamo=True, input_names=in_names,
                                    output_names=out_names, dynamic_shapes=shapes, opset_version=18, optimize=True,
                                    verbose=False)
    program.save(str(onnx_dir / "decoder_model_merged.onnx"), external_data=False)


def export_qwen2vl(hf_dir, out) -> None:
    """The three ONNX parts of ``hf_dir`` into ``out/onnx`` (see the module docstring), meta
    files at ``out``: embed_tokens and the vision encoder by TorchScript, the decoder by dynamo
    (TorchScript dies on transformers 4.57's vmap masks)."""
    import torch
    import torch.nn.functional as F
    import transformers as tf
    from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

    model = tf.Qwen2VLForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    text = model.config.text_config

    class Vision(torch.nn.Module):
        """transformers' vision forward, with the grid-dependent parts (rotary positions, the
        per-frame attention split) as inputs."""

        def __init__(self):
            super().__init__()
            self.v = model.model.visual

        def forward(self, pixel_values, vision_position_ids, attention_bias):
            v = self.v
            x = v.patch_embed(pixel_values)
            freqs = (vision_position_ids[..., None].float() * v.rotary_pos_emb.inv_freq).flatten(1)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            for blk in v.blocks:
                a = blk.attn
                h = blk.norm1(x)
                n = h.shape[0]
                qkv = a.qkv(h).reshape(n, 3, a.num_heads, -1).permute(1, 0, 2, 3)
                q, k = apply_rotary_pos_emb_vision(qkv[0], qkv[1], cos, sin)
                q, k, val = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, qkv[2]))
                o = F.scaled_dot_product_attention(q, k, val, attn_mask=attention_bias, scale=a.scaling)
                x = x + a.proj(o.squeeze(0).transpose(0, 1).reshape(n, -1))
                x = x + blk.mlp(blk.norm2(x))
            return v.merger(x)

    onnx_dir = Path(out) / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        vc = model.config.vision_config
        width = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
        rows, cols = torch.meshgrid(torch.arange(4), torch.arange(4), indexing="ij")
        positions = torch.stack([rows.reshape(2, 2, 2, 2).permute(0, 2, 1, 3).flatten(),
                                 cols.reshape(2, 2, 2, 2).permute(0, 2, 1, 3).flatten()], -1)
        torch.onnx.export(Vision(), (torch.randn(16, width, generator=g), positions, torch.zeros(16, 16)),
                          str(onnx_dir / "vision_encoder.onnx"), dynamo=False,
                          input_names=["pixel_values", "vision_position_ids", "attention_bias"],
                          output_names=["image_features"],
                          dynamic_axes={"pixel_values": {0: "num_patches"}, "vision_position_ids": {0: "num_patches"},
                                        "attention_bias": {0: "num_patches", 1: "num_patches_k"},
                                        "image_features": {0: "num_image_tokens"}}, opset_version=17)
    _export_text_parts(model.model.language_model.embed_tokens, model.model.language_model, model.lm_head, text,
                       onnx_dir, mrope=True, generator=g)
    for f in onnx_dir.glob("*.onnx"):
        mb.cap_ir_version(f)
    mb.copy_hf_files(hf_dir, out)


def idefics3_ids() -> dict[str, int]:
    first = mb.TINY_VOCAB - len(IDEFICS3_TOKENS)
    return {token: first + i for i, token in enumerate(IDEFICS3_TOKENS)}


def build_idefics3_hf(out) -> int:
    """The tiny random Idefics3 (SmolVLM's architecture) -> ``save_pretrained(out)`` with its
    processor (image processor, tokenizer, image_seq_len, chat template)."""
    import torch
    import transformers as tf

    ids = idefics3_ids()
    common = dict(bos_token_id=mb.BOS_ID, eos_token_id=mb.EOS_ID, pad_token_id=mb.PAD_ID)
    config = tf.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=mb.TINY_VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, initializer_range=mb.INIT_RANGE, **common),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=IDEFICS3_FRAME, patch_size=4, initializer_range=mb.INIT_RANGE),
        image_token_id=ids["<image>"], scale_factor=2, **common)
    torch.manual_seed(mb.SEED)
    model = tf.Idefics3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * mb.PERTURB)
    model.generation_config = tf.GenerationConfig(**common)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer = special_tokenizer(IDEFICS3_TOKENS, min(ids.values()))
    tokenizer.chat_template = IDEFICS3_CHAT_TEMPLATE
    processor = tf.Idefics3Processor(tf.Idefics3ImageProcessor(**IDEFICS3_PIXELS), tokenizer,
                                     image_seq_len=IDEFICS3_SEQ_LEN, chat_template=IDEFICS3_CHAT_TEMPLATE)
    processor.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def export_idefics3(hf_dir, out) -> None:
    """``embed_tokens.onnx`` (ids -> embeddings), ``vision_encoder.onnx`` (``pixel_values
    [frames, 3, 32, 32]`` -> ``image_features [frames, 16, 64]``: whole frames only, as the image
    processor makes them; the patch positions are transformers' bucketized ones, a constant for
    whole frames) and ``decoder_model_merged.onnx`` (``inputs_embeds``, ``attention_mask``,
    ``position_ids [B, S]``, ``past_key_values.N.key/.value``) into ``out/onnx``; meta files at
    ``out``."""
    import torch
    import transformers as tf

    model = tf.Idefics3ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    text = model.config.text_config

    class Vision(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vm, self.connector = model.model.vision_model, model.model.connector
            side = IDEFICS3_FRAME // model.config.vision_config.patch_size
            # Idefics3VisionEmbeddings' positions of a whole frame (its bucketize: 0, 0, 1, ..., side - 2
            # on each axis, not an arange), computed once here as transformers computes them
            mask = torch.ones(1, side, side, dtype=torch.bool)
            probe = torch.zeros(1, 3, IDEFICS3_FRAME, IDEFICS3_FRAME)
            e = self.vm.embeddings
            calls = []
            hook = e.position_embedding.register_forward_hook(lambda m, i, o: calls.append(i[0].clone()))
            e(pixel_values=probe, patch_attention_mask=mask)
            hook.remove()
            self.register_buffer("positions", calls[0][0])

        def forward(self, pixel_values):
            e = self.vm.embeddings
            x = e.patch_embedding(pixel_values).flatten(2).transpose(1, 2) + e.position_embedding(self.positions)
            h = self.vm.encoder(inputs_embeds=x, attention_mask=None).last_hidden_state
            return self.connector(self.vm.post_layernorm(h))

    onnx_dir = Path(out) / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        torch.onnx.export(Vision(), (torch.randn(2, 3, IDEFICS3_FRAME, IDEFICS3_FRAME, generator=g),),
                          str(onnx_dir / "vision_encoder.onnx"), dynamo=False, input_names=["pixel_values"],
                          output_names=["image_features"], opset_version=17,
                          dynamic_axes={"pixel_values": {0: "num_images"}, "image_features": {0: "num_images"}})
    _export_text_parts(model.get_input_embeddings(), model.model.text_model, model.lm_head, text, onnx_dir,
                       mrope=False, generator=g)
    for f in onnx_dir.glob("*.onnx"):
        mb.cap_ir_version(f)
    mb.copy_hf_files(hf_dir, out)


def export_idefics3_5d(hf_dir, parts, out) -> None:
    """``vision_encoder.onnx`` in onnx-community's layout (see the module docstring) into
    ``out/onnx``; embed_tokens and the decoder copied from ``parts/onnx``; meta files at ``out``.

    transformers' own vision forward cannot be traced for it (Idefics3VisionEmbeddings loops over
    the frames in Python), so the wrapper writes get_image_features' steps without the loop: for a
    top-left rectangle of real patches (what the processor's padding makes), frame f's patch
    (i, j) has position bucket(i / rows_f) * side + bucket(j / cols_f), as the loop assigns."""
    import torch
    import transformers as tf
    from transformers.modeling_attn_mask_utils import _prepare_4d_attention_mask

    model = tf.Idefics3ForConditionalGeneration.from_pretrained(str(hf_dir)).eval()
    patch = model.config.vision_config.patch_size
    side = IDEFICS3_FRAME // patch

    class Vision(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.vm, self.connector = model.model.vision_model, model.model.connector
            self.register_buffer("boundaries", torch.arange(1 / side, 1.0, 1 / side))  # as the embeddings make them

        def forward(self, pixel_values, pixel_attention_mask):
            # pixel_values: [B, N, 3, F, F], pixel_attention_mask: [B, N, F, F]
            pv = pixel_values.reshape(-1, 3, IDEFICS3_FRAME, IDEFICS3_FRAME)
            mask = pixel_attention_mask.reshape(-1, IDEFICS3_FRAME, IDEFICS3_FRAME)
            real = (pv == 0.0).sum(dim=(-1, -2, -3)) != 3 * IDEFICS3_FRAME * IDEFICS3_FRAME
            pv, mask = pv[real], mask[real]
            patches = mask.reshape(-1, side, patch, side, patch).to(torch.int64).sum(dim=(2, 4)) > 0  # [n, side, side]
            index = torch.arange(side, dtype=torch.float32)
            rows = patches[:, :, 0].sum(-1, keepdim=True).to(torch.float32)  # [n, 1]
            cols = patches[:, 0, :].sum(-1, keepdim=True).to(torch.float32)
            # torch.bucketize(x, boundaries, right=True) is the count of boundaries <= x
            bucket_h = ((index / rows * (1 - 1e-6))[..., None] >= self.boundaries).sum(-1)  # [n, side]
            bucket_w = ((index / cols * (1 - 1e-6))[..., None] >= self.boundaries).sum(-1)
            positions = (bucket_h[:, :, None] * side + bucket_w[:, None, :]) * patches  # 0 where padded
            e = self.vm.embeddings
            x = e.patch_embedding(pv).flatten(2).transpose(1, 2) + e.position_embedding(positions.flatten(1))
            bias = _prepare_4d_attention_mask(patches.flatten(1), x.dtype)
            h = self.vm.encoder(inputs_embeds=x, attention_mask=bias).last_hidden_state
            return self.connector(self.vm.post_layernorm(h))

    onnx_dir = Path(out) / "onnx"
    onnx_dir.mkdir(parents=True, exist_ok=True)
    for name in ("embed_tokens.onnx", "decoder_model_merged.onnx"):
        shutil.copy2(Path(parts) / "onnx" / name, onnx_dir / name)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(2, 3, 3, IDEFICS3_FRAME, IDEFICS3_FRAME, generator=g)
    pixels[1, 2] = 0  # a padding frame
    mask = torch.ones(2, 3, IDEFICS3_FRAME, IDEFICS3_FRAME, dtype=torch.bool)
    mask[1, 2] = False
    with torch.no_grad():
        torch.onnx.export(Vision(), (pixels, mask), str(onnx_dir / "vision_encoder.onnx"), dynamo=False,
                          input_names=["pixel_values", "pixel_attention_mask"], output_names=["image_features"],
                          opset_version=17,
                          dynamic_axes={"pixel_values": {0: "batch_size", 1: "num_images"},
                                        "pixel_attention_mask": {0: "batch_size", 1: "num_images"},
                                        "image_features": {0: "num_real_images"}})
    mb.cap_ir_version(onnx_dir / "vision_encoder.onnx")
    mb.copy_hf_files(hf_dir, out)


def build_vit_gpt2_hf(out) -> int:
    """The tiny random ViT + GPT-2 vision-encoder-decoder -> ``save_pretrained(out)`` with its
    image processor and the tiny tokenizer."""
    import torch
    import transformers as tf

    init, noise = VIT_GPT2_INIT
    encoder = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=32, patch_size=8, initializer_range=init)
    decoder = tf.GPT2Config(vocab_size=mb.TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                            add_cross_attention=True, is_decoder=True, bos_token_id=mb.BOS_ID,
                            eos_token_id=mb.EOS_ID, pad_token_id=mb.PAD_ID, initializer_range=init)
    config = tf.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = mb.BOS_ID, mb.PAD_ID, mb.EOS_ID
    torch.manual_seed(mb.SEED)
    model = tf.VisionEncoderDecoderModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    out = Path(out)
    model.save_pretrained(out)
    tf.ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(out)
    mb.build_tokenizer(mb.TINY_VOCAB).save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def export_vit_gpt2(hf_dir, out, tmp) -> None:
    """optimum's image-to-text-with-past export; the merged decoder and the encoder kept."""
    from optimum.exporters.onnx import main_export

    main_export(str(hf_dir), output=str(tmp), task="image-to-text-with-past", library_name="transformers",
                local_files_only=True, do_validation=False)
    mb.copy_hf_files(hf_dir, out)
    for name in ("encoder_model.onnx", "decoder_model_merged.onnx"):
        shutil.copy2(Path(tmp) / name, Path(out) / name)
        mb.cap_ir_version(Path(out) / name)
    shutil.rmtree(tmp)


def build_all(root, progress=print) -> dict[str, Path]:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    import torch

    torch.set_num_threads(1)
    t0 = time.time()
    n = build_qwen2vl_hf(root / "hf" / "qwen2vl")
    progress(f"[test-models] hf/qwen2vl        {time.time() - t0:6.1f}s  ({n} params)")
    t0 = time.time()
    export_qwen2vl(root / "hf" / "qwen2vl", root / "qwen2vl-onnx")
    progress(f"[test-models] qwen2vl-onnx     {time.time() - t0:6.1f}s")
    t0 = time.time()
    n = build_idefics3_hf(root / "hf" / "idefics3")
    export_idefics3(root / "hf" / "idefics3", root / "idefics3-onnx")
    export_idefics3_5d(root / "hf" / "idefics3", root / "idefics3-onnx", root / "idefics3-onnx5d")
    progress(f"[test-models] idefics3         {time.time() - t0:6.1f}s  ({n} params)")
    t0 = time.time()
    n = build_vit_gpt2_hf(root / "hf" / "vit-gpt2")
    export_vit_gpt2(root / "hf" / "vit-gpt2", root / "vit-gpt2-optimum", root / "tmp-vit-gpt2")
    progress(f"[test-models] vit-gpt2         {time.time() - t0:6.1f}s  ({n} params)")
    return {k: root / v for k, v in VISION_DIRS.items()}


def vision_key() -> str:
    """Hash of this file and of the text models' key (:func:`model_builders.text.cache_key`: the
    shared tokenizer and init, the package versions)."""
    return mb.source_key([Path(__file__)], text.cache_key())


def _complete(folder: Path) -> bool:
    return (folder / "manifest.json").is_file() and all((folder / v).is_dir() for v in VISION_DIRS.values())


def ensure_vision_models(base: Path, progress=print) -> dict[str, Path]:
    """Paths of the vision test models under ``base/<vision_key()>-vision``, built (in one worker
    subprocess, into a temporary sibling renamed into place, under an ``fcntl`` lock) when missing."""
    import fcntl

    base = Path(base)
    key = vision_key()
    final = base / f"{key}-vision"
    paths = {k: final / v for k, v in VISION_DIRS.items()}
    if _complete(final):
        return paths
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}-vision.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if _complete(final):
                return paths
            for stale in base.glob(f".{key}-vision.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            shutil.rmtree(final, ignore_errors=True)
            tmp = base / f".{key}-vision.building-{os.getpid()}"
            tmp.mkdir()
            t0 = time.time()
            progress(f"[test-models] building into {final} (cache miss)")
            log = base / f"{key}-vision.log"
            with open(log, "wb") as out:
                proc = subprocess.run(mb.worker_command("vision", tmp), stdin=subprocess.DEVNULL, stdout=out,
                                      stderr=subprocess.STDOUT, env=mb.worker_env(), timeout=900)
            if proc.returncode != 0 or not _complete(tmp):
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"vision test model build failed (rc={proc.returncode}); log: {log}\n"
                                   + log.read_text(errors="replace")[-3000:])
            os.rename(tmp, final)
            progress(f"[test-models] vision models built in {time.time() - t0:.1f}s -> {final}")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return paths


def _worker(tmp: Path) -> int:
    t0 = time.time()
    paths = build_all(tmp)
    manifest = {"models": {k: str(p.relative_to(tmp)) for k, p in paths.items()},
                "versions": mb.package_versions(), "key": vision_key(),
                "build_seconds": round(time.time() - t0, 1),
                "files": sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--build-into":
        sys.exit(_worker(Path(sys.argv[2])))
    print(json.dumps({k: str(v) for k, v in ensure_vision_models(mb.cache_root()).items()}, indent=1))
