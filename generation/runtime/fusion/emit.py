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
lm_head weights and the attention scale, Gemma's scaled embedding table and FastGelu gate,
Gemma 2 / 3's norms of each block's output (SimplifiedLayerNormalization before the residual's
SkipSimplifiedLayerNormalization), soft-capped scores (GroupQueryAttention's softcap) and logits
(Div, Tanh, Mul), Gemma 3's second rotary table for its local layers, SmolLM3's layers without
rotary embedding (do_rotary=0, no tables); OLMo, Nemotron and Phi's LayerNorms (LayerNormalization
and SkipLayerNormalization with their biases, as the builder writes them), OLMo's Clip of q|k|v,
OLMo 2's q / k norms over all heads and its residual adds after each block's norm (Add: no norm
follows them), Nemotron's and Phi's MLP without a gate (relu squared: Relu, Mul), Phi's attention
and MLP on one norm's output, summed (Add) into the next norm's residual, and partial rotary
dimensions laid out for GroupQueryAttention where it cannot rotate them as they are (gqa_rotary).
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


def gqa_rotary(cos: np.ndarray, sin: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The tables GroupQueryAttention takes for transformers' `cos`, `sin` [positions, r], and the
    order of each head's q and k dimensions that makes its rotation transformers' (None: as they are).

    transformers rotates a head's first 2r dimensions, pairing dimension j with j + r (its
    rotate_half); GroupQueryAttention pairs j with j + T for tables of T columns, T a multiple of 8.
    Where r is not, the tables get T - r more columns of cos 1 and sin 0 (pairs left as they are),
    and each head's dimensions are laid out so that transformers' pairs meet: [0, r) stay, [r, 2r)
    move to [T, T + r), the dimensions past 2r fill the rest in order. q and k (their projections'
    columns) take the same order, so every score q . k sums the same products.

    Example: head_dim 16, 2r = 8 rotary (r = 4, T = 8); the new place of each dimension:
        dimension  0 1 2 3 | 4 5 6 7    | 8 9 10 11 | 12 13 14 15
        place      0 1 2 3 | 8 9 10 11  | 4 5 6 7   | 12 13 14 15
    so GroupQueryAttention's pair (1, 9) is transformers' (1, 5), and (5, 13) two dimensions it
    leaves alone (8 and 12 here: cos 1, sin 0)."""
    r = cos.shape[1]
    if r % 8 == 0:
        return cos, sin, None
    t = -(-r // 8) * 8
    if 2 * t > head_dim:
        raise FusionError(f"{2 * r} rotary dimensions of {head_dim}: GroupQueryAttention rotates a multiple of 16, "
                          f"and {2 * t} do not fit a head")
    rows = len(cos)
    cos = np.concatenate([cos, np.ones((rows, t - r), np.float32)], axis=1)
    sin = np.concatenate([sin, np.zeros((rows, t - r), np.float32)], axis=1)
    rest = list(range(2 * r, head_dim))
    order = list(range(r)) + rest[:t - r] + list(range(r, 2 * r)) + rest[t - r:]
    return cos, sin, np.array(order, np.int64)


def _reordered(weights: DecoderWeights, order: np.ndarray, heads: int, kv_heads: int) -> DecoderWeights:
    """`weights` with each head's q and k dimensions in `order` (gqa_rotary): the q / k projections'
    columns and biases, and their norms' weights."""
    from dataclasses import replace

    head_dim = len(order)

    def columns(count: int) -> np.ndarray:
        return (np.arange(count)[:, None] * head_dim + order[None, :]).ravel()

    def linear(x: Linear, count: int, name: str) -> Linear:
        if x.quantized:
            raise FusionError(f"a quantized {name}_proj with partial rotary dimensions GroupQueryAttention cannot "
                              "rotate as they are: not rewritten")
        index = columns(count)
        return Linear(np.ascontiguousarray(x.weight[:, index]), None if x.bias is None else x.bias[index], x.shape)

    def norm(w: np.ndarray | None, count: int) -> np.ndarray | None:
        return None if w is None else w[order] if len(w) == head_dim else w[columns(count)]

    layers = [replace(layer, q=linear(layer.q, heads, "q"), k=linear(layer.k, kv_heads, "k"),
                      q_norm=norm(layer.q_norm, heads), k_norm=norm(layer.k_norm, kv_heads))
              for layer in weights.layers]
    return replace(weights, layers=layers)


def fused_graph(weights: DecoderWeights, config: dict, layout: Family):
    """The ModelProto of the fused decoder: inputs input_ids, attention_mask, past_key_values.N.key
    / .value; outputs logits, present.N.key / .value (names as the source graph had them).
    `layout`: families.family(config), what the family adds to Llama's block."""
    from onnx import NodeProto, TensorProto, helper, numpy_helper

    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    eps = layout.eps
    if layout.name == "nemotron":  # NemotronRotaryEmbedding is 'default' whatever rope_scaling says
        config = {**config, "rope_scaling": None}
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
        `scope` (projections of one input in one scope share its quantization node). The result is
        named `out` (a graph output: Phi's biased logits)."""
        product = out if linear.bias is None else f"{out}/product"
        if not linear.quantized:
            node("MatMul", [x, init(out + ".weight", linear.weight)], [product])
        else:
            rename = {linear.source_input: x, linear.source_output: product, "": ""}

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
            return node("Add", [product, init(out + ".bias", linear.bias)], [out])[0]
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

    def qk_norm(x: str, weight: np.ndarray, name: str) -> str:
        """q's or k's RMSNorm: over each head (head_norm), or over all heads together (OLMo 2)."""
        if layout.qk_norm_span == "head":
            return head_norm(x, weight, name)
        return node("SimplifiedLayerNormalization", [x, init(f"{name}/weight", weight)], [f"{name}/output"],
                    axis=-1, epsilon=eps, stash_type=1)[0]

    def first_norm(x: str, weight: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """The first layer's input norm: an RMSNorm, or a LayerNorm with its bias where the family's are."""
        if layout.layer_norm:
            beta = bias if bias is not None else np.zeros_like(weight)
            return node("LayerNormalization", [x, init(name, weight), init(f"{name}.bias", beta)], [f"{name}/output"],
                        axis=-1, epsilon=eps, stash_type=1)[0]
        return node("SimplifiedLayerNormalization", [x, init(name, weight)], [f"{name}/output"], axis=-1,
                    epsilon=eps, stash_type=1)[0]

    def skip_norm(residual: str, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str,
                  keep_sum: bool = True) -> tuple[str, str]:
        """(norm(residual + x), residual + x) in one node, as first_norm's kind of norm."""
        sums = [f"{name}/sum"] if keep_sum else []
        if layout.layer_norm:
            beta = bias if bias is not None else np.zeros_like(weight)
            out = node("SkipLayerNormalization", [residual, x, init(name, weight), init(f"{name}.bias", beta)],
                       [f"{name}/output", "", "", *sums], domain="com.microsoft", epsilon=eps)
        else:
            out = node("SkipSimplifiedLayerNormalization", [residual, x, init(name, weight)],
                       [f"{name}/output", "", "", *sums], domain="com.microsoft", epsilon=eps)
        return out[0], out[-1]

    def activate(g: str, p: str) -> str:
        """The MLP's activation of g."""
        if layout.activation == "gelu_tanh":  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's tanh gelu
            return node("FastGelu", [g], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        if layout.activation == "gelu":  # 0.5 g (1 + erf(g / sqrt(2)))
            return node("Gelu", [g], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        if layout.activation == "relu2":  # Nemotron's relu(g)^2
            relu = node("Relu", [g], [f"{p}/act/relu"])[0]
            return node("Mul", [relu, relu], [f"{p}/act/relu2"])[0]
        sigmoid = node("Sigmoid", [g], [f"{p}/act/sigmoid"])[0]
        return node("Mul", [g, sigmoid], [f"{p}/act/silu"])[0]

    # each row's valid cache rows - 1 (seqlens_k) and the mask's width, as GroupQueryAttention takes them
    one = init("/constants/one", np.array([1], np.int64))
    node("ReduceSum", ["attention_mask", one], ["/mask/sum"], keepdims=0)
    node("Sub", ["/mask/sum", one], ["/mask/seqlens"])
    node("Cast", ["/mask/seqlens"], ["/mask/seqlens_k"], to=TensorProto.INT32)
    node("Shape", ["attention_mask"], ["/mask/shape"])
    node("Gather", ["/mask/shape", init("/constants/axis1", np.array(1, np.int64))], ["/mask/width"], axis=0)
    node("Cast", ["/mask/width"], ["/mask/total_sequence_length"], to=TensorProto.INT32)
    rotary = layout.rotary or ("global",) * len(weights.layers)
    tables = {"global": ("cos_cache", "sin_cache"), "local": ("cos_cache_local", "sin_cache_local"), "none": ("", "")}
    order = None  # each head's q / k dimensions as GroupQueryAttention rotates them (gqa_rotary)
    for kind in sorted(set(rotary) - {"none"}):
        # Gemma 3's local layers: rope_local_base_freq, unscaled (as its rotary_emb_local)
        source = config if kind == "global" else {**config, "rope_theta": config.get("rope_local_base_freq", 10000.0),
                                                  "rope_scaling": None}
        cos, sin = rope_tables(source, head_dim, positions)
        cos, sin, order = gqa_rotary(cos, sin, head_dim)
        init(tables[kind][0], cos)
        init(tables[kind][1], sin)
    softcap = {"softcap": layout.attention_softcap} if layout.attention_softcap and weights.scores_softcapped else {}

    if "global" in rotary and order is not None:  # partial rotary GroupQueryAttention cannot rotate as it is
        weights = _reordered(weights, order, heads, kv_heads)

    embed = weights.embed if layout.embed_scale == 1.0 else (weights.embed * np.float32(layout.embed_scale))
    x = node("Gather", [init("embed_tokens.weight", embed.astype(np.float32)), "input_ids"], ["/embed/output"])[0]
    residual = None
    for i, layer in enumerate(weights.layers):
        p = f"/layers.{i}"
        if layer.input_norm is None:  # OLMo 2: attention reads the residual stream as it is
            residual = x if residual is None else node("Add", [residual, x], [f"{p}/residual"])[0]
            normed = residual
        elif residual is None:
            normed, residual = first_norm(x, layer.input_norm, layer.input_norm_bias, f"{p}/input_norm"), x
        else:
            normed, residual = skip_norm(residual, x, layer.input_norm, layer.input_norm_bias, f"{p}/input_norm")
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
        if layout.clip_qkv:  # OLMo's clip_qkv: q, k and v (packed or apart) clamped
            bounds = [init(f"{p}/clip/min", np.array(-layout.clip_qkv, np.float32)),
                      init(f"{p}/clip/max", np.array(layout.clip_qkv, np.float32))]
            q, k, v = (node("Clip", [t, *bounds], [f"{t}/clipped"])[0] if t else "" for t in (q, k, v))
        if layer.q_norm is not None:
            q, k = qk_norm(q, layer.q_norm, f"{p}/q_norm"), qk_norm(k, layer.k_norm, f"{p}/k_norm")
        cos_cache, sin_cache = tables[rotary[i]]
        attention = node(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "/mask/seqlens_k",
             "/mask/total_sequence_length", cos_cache, sin_cache][:9 if cos_cache else 7],
            [f"{p}/attention/output", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
            num_heads=heads, kv_num_heads=kv_heads, scale=layout.attention_scale, do_rotary=int(bool(cos_cache)),
            rotary_interleaved=0, local_window_size=layout.windows[i], **softcap)[0]
        x = scaled(layer.o, attention, f"{p}/o/output", f"{p}/src", layout.residual_scale)
        if layer.attention_output_norm is not None:  # Gemma 2 / 3: normed before the residual add
            weight = init(f"{p}/attention_output_norm", layer.attention_output_norm)
            x = node("SimplifiedLayerNormalization", [x, weight], [f"{p}/attention_output_norm/output"], axis=-1,
                     epsilon=eps, stash_type=1)[0]
        if layout.parallel:  # Phi: the MLP reads the input norm's output too; both join the residual below
            attended = x
        elif layer.post_norm is None:  # OLMo 2: the MLP reads the residual stream as it is
            residual = node("Add", [residual, x], [f"{p}/post_attention/sum"])[0]
            normed = residual
        else:
            normed, residual = skip_norm(residual, x, layer.post_norm, layer.post_norm_bias, f"{p}/post_norm")
        if layer.gate is None:  # Nemotron, Phi: down(act(up(x)))
            gated = activate(project(layer.up, normed, f"{p}/up/output", f"{p}/src"), p)
        else:
            gate = project(layer.gate, normed, f"{p}/gate/output", f"{p}/src")
            up = project(layer.up, normed, f"{p}/up/output", f"{p}/src")
            gated = node("Mul", [activate(gate, p), up], [f"{p}/mlp/gated"])[0]
        x = scaled(layer.down, gated, f"{p}/down/output", f"{p}/src", layout.residual_scale)
        if layer.mlp_output_norm is not None:
            weight = init(f"{p}/mlp_output_norm", layer.mlp_output_norm)
            x = node("SimplifiedLayerNormalization", [x, weight], [f"{p}/mlp_output_norm/output"], axis=-1,
                     epsilon=eps, stash_type=1)[0]
        if layout.parallel:
            x = node("Add", [attended, x], [f"{p}/parallel/sum"])[0]
    normed = skip_norm(residual, x, weights.norm, weights.norm_bias, "/norm", keep_sum=False)[0]
    if layout.logits_softcap:  # c * tanh(logits / c), as transformers' final_logit_softcapping
        logits = scaled(weights.lm_head, normed, "/lm_head/output", "/lm_head/src", layout.logits_scale)
        cap = init("/lm_head/softcap", np.array(layout.logits_softcap, np.float32))
        capped = node("Tanh", [node("Div", [logits, cap], ["/lm_head/softcap/div"])[0]], ["/lm_head/softcap/tanh"])[0]
        node("Mul", [capped, cap], ["logits"])
    else:
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
