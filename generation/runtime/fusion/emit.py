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
and MLP on one norm's output, summed (Add) into the next norm's residual, partial rotary
dimensions laid out for GroupQueryAttention where it cannot rotate them as they are (gqa_rotary),
and gpt-oss's sinks (GroupQueryAttention's head_sink), YaRN tables and experts: its router (MatMul,
Add, Reshape to [tokens, experts]) and onnxruntime's MoE operator (the interleaved SwiGLU with its
alpha, clamp and +1, the top-k logits softmaxed: normalize_routing_weights), as the genai builder
writes them for the CPU.
"""

from __future__ import annotations

import numpy as np

from .families import Family
from .rotary import _reordered, gqa_rotary, rope_tables
from .weights import DecoderWeights, Linear

IR_VERSION, OPSET = 10, 21  # what onnxruntime 1.20+ reads, as the genai builder writes


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

    def experts(layer, x: str, p: str) -> str:
        """onnxruntime's MoE over x [B, S, hidden]: the router's logits [B * S, experts], the
        experts' weights as it takes them ([experts, out, in]: transformers' transposed)."""
        moe = layout.experts
        logits = project(layer.router, x, f"{p}/router/output", f"{p}/src")
        logits = node("Reshape", [logits, init(f"{p}/router/shape", np.array([-1, moe.count], np.int64))],
                      [f"{p}/router/logits"])[0]
        weights = [init(f"{p}/gate_up.weight", layer.experts.gate_up.transpose(0, 2, 1)),
                   init(f"{p}/gate_up.bias", layer.experts.gate_up_bias),
                   init(f"{p}/down.weight", layer.experts.down.transpose(0, 2, 1)),
                   init(f"{p}/down.bias", layer.experts.down_bias)]
        limit = {} if moe.limit is None else {"swiglu_limit": moe.limit}  # without it: no clamp
        return node("MoE", [x, logits, *weights], [f"{p}/output"], domain="com.microsoft", k=moe.top_k,
                    activation_type="swiglu", swiglu_fusion=1, activation_alpha=moe.alpha, activation_beta=1.0,
                    normalize_routing_weights=1, use_sparse_mixer=0, **limit)[0]

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
        # gpt-oss's sinks: head_sink, after position_ids and attention_bias (unused)
        sink = [] if layer.sinks is None else ["", "", init(f"{p}/attention/sinks", layer.sinks)]
        attention = node(
            "GroupQueryAttention",
            [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "/mask/seqlens_k",
             "/mask/total_sequence_length", cos_cache, sin_cache][:9 if cos_cache or sink else 7] + sink,
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
        if layer.experts is not None:  # gpt-oss: its router's logits pick and weigh the experts
            x = experts(layer, normed, f"{p}/moe")
        else:
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
