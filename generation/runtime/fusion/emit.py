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
# the rotary tables GroupQueryAttention reads for each kind of layer (families.py's `rotary`)
_TABLES = {"global": ("cos_cache", "sin_cache"), "local": ("cos_cache_local", "sin_cache_local"), "none": ("", "")}


def fused_graph(weights: DecoderWeights, config: dict, layout: Family):
    """The ModelProto of the fused decoder: inputs input_ids, attention_mask, past_key_values.N.key
    / .value; outputs logits, present.N.key / .value (names as the source graph had them).
    `layout`: families.family(config), what the family adds to Llama's block."""
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    emit = _Emitter(layout, heads, kv_heads, head_dim)
    if layout.name == "nemotron":  # NemotronRotaryEmbedding is 'default' whatever rope_scaling says
        config = {**config, "rope_scaling": None}
    positions = int(config.get("max_position_embeddings") or 4096)
    vocab = weights.embed.shape[0]

    _mask_lengths(emit)
    rotary = layout.rotary or ("global",) * len(weights.layers)
    order = _rotary_tables(emit, config, rotary, positions)
    softcap = {"softcap": layout.attention_softcap} if layout.attention_softcap and weights.scores_softcapped else {}
    if "global" in rotary and order is not None:  # partial rotary GroupQueryAttention cannot rotate as it is
        weights = _reordered(weights, order, heads, kv_heads)

    embed = weights.embed if layout.embed_scale == 1.0 else (weights.embed * np.float32(layout.embed_scale))
    x = emit.node("Gather", [emit.init("embed_tokens.weight", embed.astype(np.float32)), "input_ids"],
                  ["/embed/output"])[0]
    residual = None
    for i, layer in enumerate(weights.layers):
        x, residual = _decoder_layer(emit, layer, i, x, residual, _TABLES[rotary[i]], softcap)
    _logits(emit, weights, residual, x)
    return _model(emit, len(weights.layers), vocab)


class _Emitter:
    """The graph being written (its nodes and initializers, in the order they are made) and the
    node patterns the fused decoder repeats, in the family's kind of norm and activation."""

    def __init__(self, layout: Family, heads: int, kv_heads: int, head_dim: int):
        self.layout, self.eps = layout, layout.eps
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.nodes, self.inits = [], []
        self.produced: set[str] = set()  # names the copied quantized nodes and constants made

    def init(self, name: str, array: np.ndarray) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def node(self, op: str, inputs: list[str], outputs: list[str], domain: str = "", **attrs) -> list[str]:
        from onnx import helper

        self.nodes.append(helper.make_node(op, inputs, outputs, name=outputs[0] + "/node", domain=domain, **attrs))
        return outputs

    def project(self, linear: Linear, x: str, out: str, scope: str) -> str:
        """out = x @ linear (+ its bias): a MatMul, or the source's quantized nodes renamed into
        `scope` (projections of one input in one scope share its quantization node). The result is
        named `out` (a graph output: Phi's biased logits)."""
        product = out if linear.bias is None else f"{out}/product"
        if not linear.quantized:
            self.node("MatMul", [x, self.init(out + ".weight", linear.weight)], [product])
        else:
            self._copy_quantized(linear, x, product, scope)
        if linear.bias is not None:
            return self.node("Add", [product, self.init(out + ".bias", linear.bias)], [out])[0]
        return out

    def _copy_quantized(self, linear: Linear, x: str, product: str, scope: str) -> None:
        """The source's nodes of a quantized projection, reading `x` and giving `product`, their
        other names and constants moved into `scope` (each made once)."""
        from onnx import NodeProto, TensorProto

        rename = {linear.source_input: x, linear.source_output: product, "": ""}

        def renamed(name: str) -> str:
            if name not in rename:
                rename[name] = f"{scope}/{name}"
                if name in linear.constants and rename[name] not in self.produced:
                    copy = TensorProto()
                    copy.CopyFrom(linear.constants[name])
                    copy.name = rename[name]
                    self.inits.append(copy)
                    self.produced.add(copy.name)
            return rename[name]
        for source in linear.nodes:
            outputs = [renamed(name) for name in source.output]
            if outputs[0] in self.produced:
                continue
            copy = NodeProto()
            copy.CopyFrom(source)
            copy.name = outputs[0] + "/node"
            del copy.input[:], copy.output[:]
            copy.input.extend(renamed(name) for name in source.input)
            copy.output.extend(outputs)
            self.nodes.append(copy)
            self.produced.update(outputs)

    def scaled(self, linear: Linear, x: str, out: str, scope: str, factor: float) -> str:
        """project(...) * factor: folded into a float weight, a Mul after a quantized one."""
        if factor == 1.0:
            return self.project(linear, x, out, scope)
        if not linear.quantized:
            bias = None if linear.bias is None else (linear.bias * np.float32(factor)).astype(np.float32)
            return self.project(Linear((linear.weight * np.float32(factor)).astype(np.float32), bias, linear.shape), x,
                                out, scope)
        y = self.project(linear, x, out + "/unscaled", scope)
        return self.node("Mul", [y, self.init(out + ".scale", np.array(factor, np.float32))], [out])[0]

    def rms_norm(self, x: str, weight: np.ndarray, name: str, weight_name: str | None = None) -> str:
        """An RMSNorm of x over its last axis, named `name`/output (its weight `weight_name`, else `name`)."""
        return self.node("SimplifiedLayerNormalization", [x, self.init(weight_name or name, weight)],
                         [f"{name}/output"], axis=-1, epsilon=self.eps, stash_type=1)[0]

    def head_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        """Qwen3's RMSNorm over each head of x [B, S, heads * head_dim]."""
        split = self.node("Reshape", [x, self.init(f"{name}/heads", np.array([0, 0, -1, self.head_dim], np.int64))],
                          [f"{name}/split"])[0]
        normed = self.node("SimplifiedLayerNormalization", [split, self.init(f"{name}/weight", weight)],
                           [f"{name}/normed"], axis=-1, epsilon=self.eps, stash_type=1)[0]
        return self.node("Reshape", [normed, self.init(f"{name}/joined", np.array([0, 0, -1], np.int64))],
                         [f"{name}/output"])[0]

    def qk_norm(self, x: str, weight: np.ndarray, name: str) -> str:
        """q's or k's RMSNorm: over each head (head_norm), or over all heads together (OLMo 2)."""
        if self.layout.qk_norm_span == "head":
            return self.head_norm(x, weight, name)
        return self.rms_norm(x, weight, name, weight_name=f"{name}/weight")

    def first_norm(self, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str) -> str:
        """The first layer's input norm: an RMSNorm, or a LayerNorm with its bias where the family's are."""
        if self.layout.layer_norm:
            beta = bias if bias is not None else np.zeros_like(weight)
            return self.node("LayerNormalization", [x, self.init(name, weight), self.init(f"{name}.bias", beta)],
                             [f"{name}/output"], axis=-1, epsilon=self.eps, stash_type=1)[0]
        return self.rms_norm(x, weight, name)

    def skip_norm(self, residual: str, x: str, weight: np.ndarray, bias: np.ndarray | None, name: str,
                  keep_sum: bool = True) -> tuple[str, str]:
        """(norm(residual + x), residual + x) in one node, as first_norm's kind of norm."""
        sums = [f"{name}/sum"] if keep_sum else []
        if self.layout.layer_norm:
            beta = bias if bias is not None else np.zeros_like(weight)
            inputs = [residual, x, self.init(name, weight), self.init(f"{name}.bias", beta)]
            out = self.node("SkipLayerNormalization", inputs, [f"{name}/output", "", "", *sums], domain="com.microsoft",
                            epsilon=self.eps)
        else:
            out = self.node("SkipSimplifiedLayerNormalization", [residual, x, self.init(name, weight)],
                            [f"{name}/output", "", "", *sums], domain="com.microsoft", epsilon=self.eps)
        return out[0], out[-1]

    def activate(self, g: str, p: str) -> str:
        """The MLP's activation of g."""
        activation = self.layout.activation
        if activation == "gelu_tanh":  # 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), as torch's tanh gelu
            return self.node("FastGelu", [g], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        if activation == "gelu":  # 0.5 g (1 + erf(g / sqrt(2)))
            return self.node("Gelu", [g], [f"{p}/act/gelu"], domain="com.microsoft")[0]
        if activation == "relu2":  # Nemotron's relu(g)^2
            relu = self.node("Relu", [g], [f"{p}/act/relu"])[0]
            return self.node("Mul", [relu, relu], [f"{p}/act/relu2"])[0]
        sigmoid = self.node("Sigmoid", [g], [f"{p}/act/sigmoid"])[0]
        return self.node("Mul", [g, sigmoid], [f"{p}/act/silu"])[0]

    def experts(self, layer, x: str, p: str) -> str:
        """onnxruntime's MoE over x [B, S, hidden]: the router's logits [B * S, experts], the
        experts' weights as it takes them ([experts, out, in]: transformers' transposed)."""
        moe = self.layout.experts
        logits = self.project(layer.router, x, f"{p}/router/output", f"{p}/src")
        logits = self.node("Reshape", [logits, self.init(f"{p}/router/shape", np.array([-1, moe.count], np.int64))],
                           [f"{p}/router/logits"])[0]
        weights = [self.init(f"{p}/gate_up.weight", layer.experts.gate_up.transpose(0, 2, 1)),
                   self.init(f"{p}/gate_up.bias", layer.experts.gate_up_bias),
                   self.init(f"{p}/down.weight", layer.experts.down.transpose(0, 2, 1)),
                   self.init(f"{p}/down.bias", layer.experts.down_bias)]
        limit = {} if moe.limit is None else {"swiglu_limit": moe.limit}  # without it: no clamp
        return self.node("MoE", [x, logits, *weights], [f"{p}/output"], domain="com.microsoft", k=moe.top_k,
                         activation_type="swiglu", swiglu_fusion=1, activation_alpha=moe.alpha, activation_beta=1.0,
                         normalize_routing_weights=1, use_sparse_mixer=0, **limit)[0]


def _mask_lengths(emit: _Emitter) -> None:
    """Each row's valid cache rows - 1 (seqlens_k) and the mask's width, as GroupQueryAttention takes
    them, from the attention mask's values."""
    from onnx import TensorProto

    one = emit.init("/constants/one", np.array([1], np.int64))
    emit.node("ReduceSum", ["attention_mask", one], ["/mask/sum"], keepdims=0)
    emit.node("Sub", ["/mask/sum", one], ["/mask/seqlens"])
    emit.node("Cast", ["/mask/seqlens"], ["/mask/seqlens_k"], to=TensorProto.INT32)
    emit.node("Shape", ["attention_mask"], ["/mask/shape"])
    emit.node("Gather", ["/mask/shape", emit.init("/constants/axis1", np.array(1, np.int64))], ["/mask/width"], axis=0)
    emit.node("Cast", ["/mask/width"], ["/mask/total_sequence_length"], to=TensorProto.INT32)


def _rotary_tables(emit: _Emitter, config: dict, rotary: tuple[str, ...], positions: int) -> np.ndarray | None:
    """The cos / sin tables of each kind of layer `rotary` names, as initializers; gives each head's
    q / k dimensions in the order GroupQueryAttention rotates them (gqa_rotary; None: as they are)."""
    order = None
    for kind in sorted(set(rotary) - {"none"}):
        # Gemma 3's local layers: rope_local_base_freq, unscaled (as its rotary_emb_local)
        source = config if kind == "global" else {**config, "rope_theta": config.get("rope_local_base_freq", 10000.0),
                                                  "rope_scaling": None}
        cos, sin = rope_tables(source, emit.head_dim, positions)
        cos, sin, order = gqa_rotary(cos, sin, emit.head_dim)
        emit.init(_TABLES[kind][0], cos)
        emit.init(_TABLES[kind][1], sin)
    return order


def _decoder_layer(emit: _Emitter, layer, i: int, x: str, residual: str | None, tables: tuple[str, str],
                   softcap: dict) -> tuple[str, str]:
    """Layer i over the previous block's output x and the residual stream (None: the first layer):
    gives this layer's MLP output and the residual stream it is added to next."""
    p = f"/layers.{i}"
    normed, residual = _input_norm(emit, layer, p, x, residual)
    q, k, v = _qkv(emit, layer, p, normed)
    attention = _attention(emit, layer, i, (q, k, v), tables, softcap)
    x = emit.scaled(layer.o, attention, f"{p}/o/output", f"{p}/src", emit.layout.residual_scale)
    if layer.attention_output_norm is not None:  # Gemma 2 / 3: normed before the residual add
        x = emit.rms_norm(x, layer.attention_output_norm, f"{p}/attention_output_norm")
    if emit.layout.parallel:  # Phi: the MLP reads the input norm's output too; both join the residual below
        attended = x
    elif layer.post_norm is None:  # OLMo 2: the MLP reads the residual stream as it is
        residual = emit.node("Add", [residual, x], [f"{p}/post_attention/sum"])[0]
        normed = residual
    else:
        normed, residual = emit.skip_norm(residual, x, layer.post_norm, layer.post_norm_bias, f"{p}/post_norm")
    x = _mlp(emit, layer, p, normed)
    if layer.mlp_output_norm is not None:
        x = emit.rms_norm(x, layer.mlp_output_norm, f"{p}/mlp_output_norm")
    if emit.layout.parallel:
        x = emit.node("Add", [attended, x], [f"{p}/parallel/sum"])[0]
    return x, residual


def _input_norm(emit: _Emitter, layer, p: str, x: str, residual: str | None) -> tuple[str, str]:
    """(what attention reads, the residual stream): the input norm of x, with the previous layer's
    residual add fused in where there is one."""
    if layer.input_norm is None:  # OLMo 2: attention reads the residual stream as it is
        residual = x if residual is None else emit.node("Add", [residual, x], [f"{p}/residual"])[0]
        return residual, residual
    if residual is None:
        return emit.first_norm(x, layer.input_norm, layer.input_norm_bias, f"{p}/input_norm"), x
    return emit.skip_norm(residual, x, layer.input_norm, layer.input_norm_bias, f"{p}/input_norm")


def _qkv(emit: _Emitter, layer, p: str, normed: str) -> tuple[str, str, str]:
    """q, k and v of `normed` as GroupQueryAttention takes them: apart, or packed in q (k and v
    empty), clipped and normed where the family does."""
    if any(x.quantized for x in (layer.q, layer.k, layer.v)):  # GroupQueryAttention takes them apart
        q, k, v = (emit.project(x, normed, f"{p}/{name}/output", f"{p}/src")
                   for x, name in ((layer.q, "q"), (layer.k, "k"), (layer.v, "v")))
    else:  # one packed MatMul, as the genai builder writes it
        qkv = Linear(np.concatenate([x.weight for x in (layer.q, layer.k, layer.v)], axis=1), shape=(0, 0))
        if any(x.bias is not None for x in (layer.q, layer.k, layer.v)):
            qkv.bias = np.concatenate([x.bias if x.bias is not None else np.zeros(x.shape[1], np.float32)
                                       for x in (layer.q, layer.k, layer.v)])
        q, k, v = emit.project(qkv, normed, f"{p}/qkv/output", f"{p}/src"), "", ""
        if layer.q_norm is not None:  # the norms need q and k apart
            q_size, kv_size = emit.heads * emit.head_dim, emit.kv_heads * emit.head_dim
            sizes = emit.init(f"{p}/qkv/sizes", np.array([q_size, kv_size, kv_size], np.int64))
            q, k, v = emit.node("Split", [q, sizes], [f"{p}/q/output", f"{p}/k/output", f"{p}/v/output"], axis=-1)
    clip = emit.layout.clip_qkv
    if clip:  # OLMo's clip_qkv: q, k and v (packed or apart) clamped
        bounds = [emit.init(f"{p}/clip/min", np.array(-clip, np.float32)),
                  emit.init(f"{p}/clip/max", np.array(clip, np.float32))]
        q, k, v = (emit.node("Clip", [t, *bounds], [f"{t}/clipped"])[0] if t else "" for t in (q, k, v))
    if layer.q_norm is not None:
        q, k = emit.qk_norm(q, layer.q_norm, f"{p}/q_norm"), emit.qk_norm(k, layer.k_norm, f"{p}/k_norm")
    return q, k, v


def _attention(emit: _Emitter, layer, i: int, qkv: tuple[str, str, str], tables: tuple[str, str],
               softcap: dict) -> str:
    """Layer i's GroupQueryAttention over q, k, v and its cache (past and present share a buffer),
    rotating q and k by `tables` (empty: no rotary embedding)."""
    p = f"/layers.{i}"
    cos_cache, sin_cache = tables
    # gpt-oss's sinks: head_sink, after position_ids and attention_bias (unused)
    sink = [] if layer.sinks is None else ["", "", emit.init(f"{p}/attention/sinks", layer.sinks)]
    return emit.node(
        "GroupQueryAttention",
        [*qkv, f"past_key_values.{i}.key", f"past_key_values.{i}.value", "/mask/seqlens_k",
         "/mask/total_sequence_length", cos_cache, sin_cache][:9 if cos_cache or sink else 7] + sink,
        [f"{p}/attention/output", f"present.{i}.key", f"present.{i}.value"], domain="com.microsoft",
        num_heads=emit.heads, kv_num_heads=emit.kv_heads, scale=emit.layout.attention_scale,
        do_rotary=int(bool(cos_cache)), rotary_interleaved=0, local_window_size=emit.layout.windows[i], **softcap)[0]


def _mlp(emit: _Emitter, layer, p: str, normed: str) -> str:
    """The MLP of `normed`: gated, ungated, or gpt-oss's experts."""
    if layer.experts is not None:  # gpt-oss: its router's logits pick and weigh the experts
        return emit.experts(layer, normed, f"{p}/moe")
    if layer.gate is None:  # Nemotron, Phi: down(act(up(x)))
        gated = emit.activate(emit.project(layer.up, normed, f"{p}/up/output", f"{p}/src"), p)
    else:
        gate = emit.project(layer.gate, normed, f"{p}/gate/output", f"{p}/src")
        up = emit.project(layer.up, normed, f"{p}/up/output", f"{p}/src")
        gated = emit.node("Mul", [emit.activate(gate, p), up], [f"{p}/mlp/gated"])[0]
    return emit.scaled(layer.down, gated, f"{p}/down/output", f"{p}/src", emit.layout.residual_scale)


def _logits(emit: _Emitter, weights: DecoderWeights, residual: str, x: str) -> None:
    """The final norm of residual + x and the LM head, soft-capped where the family caps its logits."""
    layout = emit.layout
    normed = emit.skip_norm(residual, x, weights.norm, weights.norm_bias, "/norm", keep_sum=False)[0]
    if layout.logits_softcap:  # c * tanh(logits / c), as transformers' final_logit_softcapping
        logits = emit.scaled(weights.lm_head, normed, "/lm_head/output", "/lm_head/src", layout.logits_scale)
        cap = emit.init("/lm_head/softcap", np.array(layout.logits_softcap, np.float32))
        capped = emit.node("Tanh", [emit.node("Div", [logits, cap], ["/lm_head/softcap/div"])[0]],
                           ["/lm_head/softcap/tanh"])[0]
        emit.node("Mul", [capped, cap], ["logits"])
    else:
        emit.scaled(weights.lm_head, normed, "logits", "/lm_head/src", layout.logits_scale)


def _model(emit: _Emitter, layers: int, vocab: int):
    """The ModelProto of the emitted nodes, with the decoder's inputs and outputs (the cache's
    [batch, kv_heads, length, head_dim] past and present of each of `layers` layers)."""
    from onnx import TensorProto, helper

    cache_shape = ["batch_size", emit.kv_heads, "past_sequence_length", emit.head_dim]
    present_shape = ["batch_size", emit.kv_heads, "total_sequence_length", emit.head_dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", vocab])]
    for i in range(layers):
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", TensorProto.FLOAT, cache_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kind}", TensorProto.FLOAT, present_shape))
    graph = helper.make_graph(emit.nodes, "raymuter_fused_decoder", inputs, outputs, emit.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)],
                              producer_name="raymuter.fusion")
    model.ir_version = IR_VERSION
    return model
