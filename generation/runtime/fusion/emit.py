"""Emit the fused decoder graph onnxruntime runs fastest: onnxruntime-genai's own layout.

Node for node what the genai builder writes for Llama and Qwen2 (read off its output):
SimplifiedLayerNormalization, one packed q|k|v MatMul (+ its bias; quantized projections stay
apart, as the source computes them), GroupQueryAttention with
rotary embedding inside and past and present sharing one buffer, SkipSimplifiedLayerNormalization
fusing each residual add into the next norm, and a SiLU-gated MLP. GroupQueryAttention counts
each row's valid cache rows from the attention mask's values, so the result runs in the
`in_place` cache mode.

The other families (families.py) add what the builder adds for them: a layer's sliding window
as local_window_size, Qwen3's per-head q/k norms (Split, Reshape, SimplifiedLayerNormalization
before GroupQueryAttention), Granite's multipliers folded into the embedding table, the o / down /
lm_head weights and the attention scale, Gemma's scaled embedding table and FastGelu gate.
"""

from __future__ import annotations

import math

import numpy as np

from .families import Family
from .weights import DecoderWeights, FusionError, Linear

IR_VERSION, OPSET = 10, 21  # what onnxruntime 1.20+ reads, as the genai builder writes


def rope_tables(config: dict, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [positions, rotary_dim / 2] of transformers 4.57's rotary embedding (the default,
    linear and llama3 rope types; float32 throughout, as its forward computes them). rotary_dim is
    head_dim * partial_rotary_factor: GroupQueryAttention rotates that many leading dimensions of
    each head, as Phi-3's apply_rotary_pos_emb does."""
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    dim = int(head_dim * float(config.get("partial_rotary_factor") or 1.0))
    if dim % 2 or dim <= 0:
        raise FusionError(f"partial_rotary_factor {config['partial_rotary_factor']} leaves {dim} rotary dimensions: "
                          "not rewritten (an even count is)")
    if dim < head_dim and dim % 16:
        raise FusionError(f"partial_rotary_factor {config['partial_rotary_factor']} rotates {dim} of {head_dim} "
                          "dimensions: GroupQueryAttention rotates a multiple of 16")
    base = float(config.get("rope_theta", 10000.0))
    exponents = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(base) ** exponents)).astype(np.float32)
    if kind == "linear":
        inv_freq = (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    elif kind == "llama3":
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old / low, inv_freq / factor, inv_freq)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / high) & ~(wavelen > old / low)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif kind == "longrope":  # its factors switch for the whole sequence once it passes the original length
        raise FusionError("rope_scaling of type 'longrope' is not rewritten: transformers switches every "
                          "position's frequencies once a sequence passes original_max_position_embeddings, "
                          "which one table of positions cannot hold")
    elif kind != "default":
        raise FusionError(f"rope_scaling of type '{kind}' is not rewritten (default, linear and llama3 are)")
    freqs = np.arange(positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def fused_graph(weights: DecoderWeights, config: dict, layout: Family):
    """The ModelProto of the fused decoder: inputs input_ids, attention_mask, past_key_values.N.key
    / .value; outputs logits, present.N.key / .value (names as the source graph had them).
    `layout`: families.family(config), what the family adds to Llama's block."""
    from onnx import NodeProto, TensorProto, helper, numpy_helper

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    positions = int(config.get("max_position_embeddings") or 4096)
    vocab = weights.embed.shape[0]
    nodes, inits = [], []

    def init(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "/node", domain=domain, **attrs))
        return outputs

    produced: set[str] = set()

    def project(linear: Linear, x: str, out: str, scope: str) -> str:
        """out = x @ linear (+ its bias): a MatMul, or the source's quantized nodes renamed into
        `scope` (projections of one input in one scope share its quantization node)."""
        if not linear.quantized:
            node("MatMul", [x, init(out + ".weight", linear.weight)], [out])
        else:
            rename = {linear.source_input: x, linear.source_output: out, "": ""}

            def renamed(name: str) -> str:
                if name not in rename:
                    rename[name] = f"{scope}/{name}"
                    if name in linear.constants and rename[name] not in produced:
                        copy = TensorProto()
                        copy.CopyFrom(linear.constants[name])
                        copy.name = rename[name]
                        inits.append(copy)
                        produced.add(copy.name)
                return rename[name]
            for source in linear.nodes:
                outputs = [renamed(name) for name in source.output]
                if outputs[0] in produced:
                    continue
                copy = NodeProto()
                copy.CopyFrom(source)
                copy.name = outputs[0] + "/node"
                del copy.input[:], copy.output[:]
                copy.input.extend(renamed(name) for name in source.input)
                copy.output.extend(outputs)
                nodes.append(copy)
                produced.update(outputs)
        if linear.bias is not None:
            return node("Add", [out, init(out + ".bias", linear.bias)], [out + "/biased"])[0]
        return out

    def scaled(linear: Linear, x: str, out: str, scope: str, factor: float) -> str:
        """project(...) * factor: folded into a float weight, a Mul after a quantized one."""
        if factor == 1.0:
            return project(linear, x, out, scope)
        if not linear.quantized:
            bias = None if linear.bias is None else (linear.bias * np.float32(factor)).astype(np.float32)
            return project(Linear((linear.weight * np.float32(factor)).astype(np.float32), bias, linear.shape), x,
                           out, scope)
        y = project(linear, x, out + "/unscaled", scope)
        return node("Mul", [y, init(out + ".scale", np.array(factor, np.float32))], [out])[0]

    def head_norm(x: str, weight: np.ndarray, name: str) -> str:
        """Qwen3's RMSNorm over each head of x [B, S, heads * head_dim]."""
        split = node("Reshape", [x, init(f"{name}/heads", np.array([0, 0, -1, head_dim], np.int64))],
                     [f"{name}/split"])[0]
        normed = node("SimplifiedLayerNormalization", [split, init(f"{name}/weight", weight)], [f"{name}/normed"],
                      axis=-1, epsilon=eps, stash_type=1)[0]
        return node("Reshape", [normed, init(f"{name}/joined", np.array([0, 0, -1], np.int64))], [f"{name}/output"])[0]

    # each row's valid cache rows - 1 (seqlens_k) and the mask's width, as GroupQueryAttention takes them
    one = init("/constants/one", np.array([1], np.int64))
    node("ReduceSum", ["attention_mask", one], ["/mask/sum"], keepdims=0)
    node("Sub", ["/mask/sum", one], ["/mask/seqlens"])
    node("Cast", ["/mask/seqlens"], ["/mask/seqlens_k"], to=TensorProto.INT32)
    node("Shape", ["attention_mask"], ["/mask/shape"])
    node("Gather", ["/mask/shape", init("/constants/axis1", np.array(1, np.int64))], ["/mask/width"], axis=0)
    node("Cast", ["/mask/width"], ["/mask/total_sequence_length"], to=TensorProto.INT32)
    cos, sin = rope_tables(config, head_dim, positions)
    init("cos_cache", cos)
    init("sin_cache", sin)

    embed = weights.embed if layout.embed_scale == 1.0 else (weights.embed * np.float32(layout.embed_scale))
    x = node("Gather", [init("embed_tokens.weight", embed.astype(np.float32)), "input_ids"], ["/embed/output"])[0]
    residual = None
    for i, layer in enumerate(weights.layers):
        p = f"/layers.{i}"
        if residual is None:
            normed = node("SimplifiedLayerNormalization", [x, init(f"{p}/input_norm", layer.input_norm)],
                          [f"{p}/input_norm/output"], axis=-1, epsilon=eps, stash_type=1)[0]
            residual = x
        else:
            normed, _, _, residual = node(
                "SkipSimplifiedLayerNormalization", [residual, x, init(f"{p}/input_norm", layer.input_norm)],
                [f"{p}/input_norm/output", "", "", f"{p}/input_norm/sum"], domain="com.microsoft", epsilon=eps)
        if any(x.quantized for x in (layer.q, layer.k, layer.v)):  # GroupQueryAttention takes them apart
            q, k, v = (project(x, normed, f"{p}/{name}/output", f"{p}/src")
                       for x, name in ((layer.q, "q"), (layer.k, "k"), (layer.v, "v")))
        else:  # one packed MatMul, as the genai builder writes it
            qkv = Linear(np.concatenate([x.weight for x in (layer.q, layer.k, layer.v)], axis=1), shape=(0, 0))
            if any(x.bias is not None for x in (layer.q, layer.k, layer.v)):
                qkv.bias = np.concatenate([x.bias if x.bias is not None else np.zeros(x.shape[1], np.float32)
                                           for x in (layer.q, layer.k, layer.v)])
            q, k, v = project(qkv, normed, f"{p}/qkv/output", f"{p}/src"), "", ""
            if layer.q_norm is not None:  # the norms need q and k apart
                q_size, kv_size = heads * head_dim, kv_heads * head_dim
                q, k, v = node("Split", [q, init(f"{p}/qkv/sizes", np.array([q_size, kv_size, kv_size], np.int64))],
                               [f"{p}/q/output", f"{p}/k/output", f"{p}/v/output"], axis=-1)
        if layer.q_norm is not None:
            q, k = head_norm(q, layer.q_norm, f"{p}/q_norm"), head_norm(k, layer.k_norm, f"{p}/k_norm")
        attention = node(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "/mask/seqlens_k",
             "/mask/total_sequence_length", "cos_cache", "sin_cache"],
            [f"{p}/attention/output", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
            num_heads=heads, kv_num_heads=kv_heads, scale=layout.attention_scale, do_rotary=1,
            rotary_interleaved=0, local_window_size=layout.windows[i])[0]
        x = scaled(layer.o, attention, f"{p}/o/output", f"{p}/src", layout.residual_scale)
        normed, _, _, residual = node(
            "SkipSimplifiedLayerNormalization", [residual, x, init(f"{p}/post_norm", layer.post_norm)],
            [f"{p}/post_norm/output", "", "", f"{p}/post_norm/sum"], domain="com.microsoft", epsilon=eps)
        gate = project(layer.gate, normed, f"{p}/gate/output", f"{p}/src")
        up = project(layer.up, normed, f"{p}/up/output", f"{p}/src")
        if layout.activation == "gelu_tanh":  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's tanh gelu
            active = node("FastGelu", [gate], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        elif layout.activation == "gelu":  # 0.5 g (1 + erf(g / sqrt(2)))
            active = node("Gelu", [gate], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        else:
            sigmoid = node("Sigmoid", [gate], [f"{p}/act/sigmoid"])[0]
            active = node("Mul", [gate, sigmoid], [f"{p}/act/silu"])[0]
        gated = node("Mul", [active, up], [f"{p}/mlp/gated"])[0]
        x = scaled(layer.down, gated, f"{p}/down/output", f"{p}/src", layout.residual_scale)
    normed = node("SkipSimplifiedLayerNormalization", [residual, x, init("/norm", weights.norm)],
                  ["/norm/output"], domain="com.microsoft", epsilon=eps)[0]
    scaled(weights.lm_head, normed, "logits", "/lm_head/src", layout.logits_scale)

    cache_shape = ["batch_size", kv_heads, "past_sequence_length", head_dim]
    present_shape = ["batch_size", kv_heads, "total_sequence_length", head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(len(weights.layers)):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    graph = helper.make_graph(nodes, "raymuter_fused_decoder", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
                              producer_name="raymuter.fusion")
    model.ir_version = IR_VERSION
    return model
