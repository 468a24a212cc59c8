"""Read a Llama-like decoder's weights out of any ONNX export of it, by the graph's structure.

Exporters name weights differently (Optimum: `onnx::MatMul_733`; torch dynamo: `val_72`; merged
decoders: each branch its own copy), but every one of them emits the modules in the order the
model calls them. So the weights are the constants the graph reads, in node order:

    Gather(embed_tokens)
    per layer:  Mul(input_layernorm)  MatMul q [+Add bias]  MatMul k [+Add]  MatMul v [+Add]
                MatMul o  Mul(post_attention_layernorm)  MatMul gate  MatMul up  MatMul down
    Mul(norm)  MatMul lm_head (a copy of the table where tied: exporters write it out)

with each family's differences (families.py): Qwen3's Mul(q_norm) after MatMul q and Mul(k_norm)
after MatMul k ([head_dim] weights); Phi-3's one MatMul qkv and one MatMul gate_up, split here;
Gemma 2 / 3's Mul(post_attention_layernorm) after MatMul o and Mul(post_feedforward_layernorm)
after MatMul down (Gemma 3's q/k norms after MatMul v); LayerNormalization(scale, bias) where a
family's norms are LayerNorms (OLMo, Nemotron, Phi; a LayerNorm traced as Mul(scale) then
Add(bias) reads the same); OLMo 2's Mul(q_norm) and Mul(k_norm) over all heads, and no norm before
attention or the MLP; Nemotron's and Phi's MLP without MatMul gate; Phi's biases on every
projection and the LM head; gpt-oss's biases on q, k, v and o, its sinks (a [heads] constant the
graph reshapes or expands to join the scores before their softmax), and in place of the MLP its
router (MatMul or Gemm [+bias]) and its experts: MatMul over [experts, in, out] constants (gate|up,
then down) with an Add of [experts, 1, out] biases, as the export computes every expert at once.

A weight reaches its MatMul as an initializer, a Constant, or through Transpose / Identity / Cast / Gemm
(transB); a quantized one is a MatMulNBits (4-bit: onnx-community `_q4`) or the int8 dynamic
quantization chain (`_quantized`, `_int8`), kept as the source computes it. Counts and shapes are checked against config.json here; the order is checked by the
caller, which runs the rewritten graph against the source and keeps it only when their logits agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class FusionError(ValueError):
    """This graph cannot be rewritten: the reason names what was found."""


@dataclass
class Linear:
    """A projection: a float weight [in, out], or a quantized one as the source computes it:
    the source's nodes from `source_input` to `source_output` (MatMulNBits; int8 dynamic
    quantization's DynamicQuantizeLinear -> MatMulInteger -> Cast -> Mul by the scales), copied
    into the fused graph as they are, with the constants they read."""

    weight: np.ndarray | None  # [in, out], as MatMul reads it; None: quantized
    bias: np.ndarray | None = None  # [out]
    shape: tuple[int, int] = (0, 0)
    nodes: list = field(default_factory=list)
    constants: dict = field(default_factory=dict)  # name -> TensorProto
    source_input: str = ""
    source_output: str = ""

    @property
    def quantized(self) -> bool:
        return self.weight is None


@dataclass
class Experts:
    """A mixture of experts' weights as transformers' GptOssExperts holds them."""

    gate_up: np.ndarray  # [experts, hidden, 2 * inner]: gate and up interleaved along the last axis
    gate_up_bias: np.ndarray  # [experts, 2 * inner]
    down: np.ndarray  # [experts, inner, hidden]
    down_bias: np.ndarray  # [experts, hidden]


@dataclass
class Layer:
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    up: Linear | None = None  # None: gpt-oss, experts in place of the MLP
    down: Linear | None = None
    input_norm: np.ndarray | None = None  # None: OLMo 2, no norm before attention
    post_norm: np.ndarray | None = None  # None: OLMo 2 and Phi, no norm before the MLP
    gate: Linear | None = None  # None: Nemotron and Phi, an MLP without a gate
    input_norm_bias: np.ndarray | None = None  # LayerNorm families' biases
    post_norm_bias: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # [head_dim]: Qwen3's per-head norms; [heads * head_dim]: OLMo 2's
    k_norm: np.ndarray | None = None
    attention_output_norm: np.ndarray | None = None  # [hidden]: Gemma 2 / 3's norm of o's output
    mlp_output_norm: np.ndarray | None = None  # [hidden]: and of down's
    router: Linear | None = None  # [hidden, experts]: gpt-oss's router logits
    experts: Experts | None = None
    sinks: np.ndarray | None = None  # [heads]: gpt-oss's learned logit in each softmax's denominator


@dataclass
class DecoderWeights:
    embed: np.ndarray  # [vocab, hidden]
    layers: list[Layer] = field(default_factory=list)
    norm: np.ndarray | None = None
    lm_head: Linear | None = None  # [hidden, vocab]
    norm_bias: np.ndarray | None = None  # LayerNorm families' final norm bias
    # Gemma 2's scores pass through c * tanh(x / c) in the source: transformers 4.57 caps them in its
    # eager attention only (sdpa, which exporters trace by default, leaves them as they are)
    scores_softcapped: bool = False


def _attr(node, name, default=None):
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _graph_with_past(graph):
    """The graph whose nodes run a decode step: a merged decoder's use_cache_branch=True branch."""
    for node in graph.node:
        if node.op_type == "If" and list(node.input) == ["use_cache_branch"]:
            branch = _attr(node, "then_branch")
            if branch is not None:
                return branch
    return graph


def _constants(graphs) -> dict[str, object]:
    """Names of the constant tensors the graphs hold (initializers, Constant nodes), as protos:
    converted to arrays only when a weight reads them."""
    out = {}
    for graph in graphs:
        for t in graph.initializer:
            out[t.name] = t
        for node in graph.node:
            if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
                out[node.output[0]] = node.attribute[0].t
    return out


def read_weights(model_proto, config: dict, layout) -> DecoderWeights:
    """The weights of `model_proto` (loaded with its external data) laid out as the model's modules:
    `layout` (families.family(config)) names each layer's projections and norms in the order the
    model calls them."""
    source = _Source(model_proto)
    found = _Found(source, config, layout)
    for node in source.graph.node:
        if id(node) not in found.taken:
            found.read(node)
    embed, norms, sinks = _float32(found.embed), [_float32(n) for n in found.norms], [_float32(x) for x in found.sinks]
    norm_biases = {k: _float32(v) for k, v in found.norm_biases.items()}
    for x in found.linears + found.stacked:
        if not x.quantized:
            x.weight, x.bias = _float32(x.weight), _float32(x.bias)
    out = _as_layers(embed, norms, found.linears, config, layout, norm_biases)
    if layout.experts:
        _add_experts(out, found.stacked, sinks, config, layout)
    if layout.attention_softcap:
        capped = _capped(source.graph.node, source.producer, source.const_through, layout.attention_softcap)
        out.scores_softcapped = capped >= len(out.layers)
    return out


class _Source:
    """The graph a decode step runs (a merged decoder's with-past branch) and the constants its
    weights are read from: by name, or through the nodes that only pass them on."""

    def __init__(self, model_proto):
        self.graph = graph = _graph_with_past(model_proto.graph)
        self.protos = _constants([model_proto.graph, graph] if graph is not model_proto.graph else [graph])
        self.arrays: dict[str, np.ndarray] = {}
        self.nodes = ([] if graph is model_proto.graph else list(model_proto.graph.node)) + list(graph.node)
        # a merged decoder's outer graph may cast its weights
        self.producer = {out: n for n in self.nodes for out in n.output}
        self.consumers: dict[str, list] = {}
        for n in graph.node:
            for name in n.input:
                self.consumers.setdefault(name, []).append(n)

    def const(self, name: str) -> np.ndarray | None:
        from onnx import numpy_helper

        if name not in self.arrays and name in self.protos:
            self.arrays[name] = numpy_helper.to_array(self.protos[name])
        return self.arrays.get(name)

    def const_through(self, name: str) -> np.ndarray | None:
        """A constant, or one seen through Identity / Transpose([1, 0]) / Cast to float32 (weights
        stored once and shared, or stored as float16 and cast at load)."""
        from onnx import TensorProto

        value = self.const(name)
        if value is not None:
            return value
        node = self.producer.get(name)
        if node is None:
            return None
        if node.op_type == "Identity":
            return self.const_through(node.input[0])
        if node.op_type == "Transpose" and list(_attr(node, "perm", [1, 0])) == [1, 0]:
            inner = self.const_through(node.input[0])
            return None if inner is None else inner.T
        if node.op_type == "Cast" and _attr(node, "to") == TensorProto.FLOAT:
            inner = self.const_through(node.input[0])
            return None if inner is None or inner.dtype.kind != "f" else inner.astype(np.float32)
        return None

    def cone(self, output: str, source: str) -> list:
        """The nodes computing `output` from `source` and constants, in graph order."""
        seen, todo = {}, [output]
        while todo:
            name = todo.pop()
            if name == source or name in self.protos or name == "":
                continue
            node = self.producer.get(name)
            if node is None:
                raise FusionError(f"the quantized projection {output} reads {name}, not only its input")
            if id(node) not in seen:
                seen[id(node)] = node
                todo.extend(node.input)
        order = {id(n): i for i, n in enumerate(self.nodes)}
        return sorted(seen.values(), key=lambda n: order[id(n)])

    def quantized(self, node) -> Linear:
        """The quantized projection a MatMulNBits or MatMulInteger computes, as the source computes it."""
        if node.op_type == "MatMulNBits":
            source, output = node.input[0], node.output[0]
            shape = (int(_attr(node, "K")), int(_attr(node, "N")))
        else:  # MatMulInteger(DynamicQuantizeLinear(x), W) -> Cast -> Mul(x_scale * w_scale)
            quantize = self.producer.get(node.input[0])
            weight = self.const(node.input[1])
            casts = self.consumers.get(node.output[0], [])
            scaled = self.consumers.get(casts[0].output[0], []) if len(casts) == 1 else []
            if quantize is None or quantize.op_type != "DynamicQuantizeLinear" or weight is None or \
                    casts[0].op_type != "Cast" or len(scaled) != 1 or scaled[0].op_type != "Mul":
                raise FusionError("a MatMulInteger outside the int8 dynamic quantization pattern is not rewritten")
            source, output, shape = quantize.input[0], scaled[0].output[0], weight.shape
        nodes = self.cone(output, source)
        names = {name for n in nodes for name in n.input if name in self.protos}
        return Linear(None, shape=tuple(shape), nodes=nodes, constants={k: self.protos[k] for k in names},
                      source_input=source, source_output=output)


class _Found:
    """The weights met so far in a walk over the source's nodes, in node order: each node's
    (`read`) added to them, still in the source's dtype."""

    def __init__(self, source: _Source, config: dict, layout):
        self.source, self.layout = source, layout
        self.hidden = hidden = int(config["hidden_size"])
        self.heads = heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or hidden // heads)
        self.norm_sizes = {hidden} | ({head_dim} if "q_norm" in layout.norms else set())
        if layout.qk_norm_span == "all":  # OLMo 2's q / k norms: [heads * head_dim], [kv_heads * head_dim]
            self.norm_sizes |= {heads * head_dim, int(config.get("num_key_value_heads") or heads) * head_dim}
        self.embed, self.norms, self.linears = None, [], []
        self.stacked: list[Linear] = []  # experts' projections, [experts, in, out] each (gate|up, down per layer)
        self.sinks: list[np.ndarray] = []
        self.norm_biases: dict[int, np.ndarray] = {}  # a LayerNorm's bias, by its weight's index in norms
        self.norm_outputs: dict[str, int] = {}  # Mul(norm) outputs, where an Add of a bias may follow
        self.by_output: dict[str, Linear] = {}
        self.taken: set[int] = set()  # nodes inside a quantized projection

    def read(self, node) -> None:
        """Add the weight `node` reads, if it reads one."""
        op, layout = node.op_type, self.layout
        if op in ("MatMulNBits", "MatMulInteger"):
            linear = self.source.quantized(node)
            self.taken.update(id(n) for n in linear.nodes)
            self.linears.append(linear)
            self.by_output[linear.source_output] = linear
        elif op in ("QLinearMatMul", "GatherBlockQuantized"):
            raise FusionError(f"quantized weights ({op}) are not rewritten")
        elif op == "Gather" and self.embed is None:
            self._embedding(node)
        elif op == "Mul":
            self._norm_scale(node)
        elif op == "LayerNormalization" and layout.layer_norm:
            self._layer_norm(node)
        elif layout.sinks and op in ("Expand", "Reshape"):
            self._sinks(node)
        elif op in ("MatMul", "Gemm"):
            self._projection(node)
        elif op == "Add":
            self._bias(node)

    def _embedding(self, node) -> None:
        """A Gather over a [vocab, hidden] constant: the embedding table."""
        table = self.source.const_through(node.input[0])
        if table is not None and table.ndim == 2 and table.shape[1] == self.hidden:
            self.embed = _dequantized(table, self.source.consumers.get(node.output[0], []), self.source.const)

    def _norm_scale(self, node) -> None:
        """A Mul by a [norm size] constant: an RMSNorm's weight (or a traced LayerNorm's scale)."""
        for name in node.input:
            value = self.source.const_through(name)
            if value is not None and value.ndim == 1 and value.shape[0] in self.norm_sizes:
                self.norms.append(value)
                self.norm_outputs[node.output[0]] = len(self.norms) - 1

    def _layer_norm(self, node) -> None:
        """A LayerNormalization's scale and bias, where the family's norms are LayerNorms."""
        scale = self.source.const_through(node.input[1])
        bias = self.source.const_through(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if scale is not None and scale.ndim == 1 and scale.shape[0] in self.norm_sizes:
            self.norms.append(scale)
            if bias is not None:
                self.norm_biases[len(self.norms) - 1] = bias

    def _sinks(self, node) -> None:
        """A [heads] float constant reshaped or expanded to join the scores: gpt-oss's sinks."""
        value = self.source.const_through(node.input[0])
        if value is not None and value.dtype.kind == "f" and value.shape in ((self.heads,), (1, self.heads, 1, 1)):
            self.sinks.append(value.reshape(self.heads))

    def _projection(self, node) -> None:
        """A MatMul or Gemm by a constant: a projection ([in, out]), or gpt-oss's experts' stacked
        [experts, in, out] one."""
        op = node.op_type
        weight = self.source.const_through(node.input[1])
        if weight is not None and weight.ndim == 3 and self.layout.experts and op == "MatMul":
            self.stacked.append(Linear(weight, shape=weight.shape))
            self.by_output[node.output[0]] = self.stacked[-1]
            return
        if weight is None or weight.ndim != 2:
            return  # attention's own products (q @ k^T, scores @ v)
        if op == "Gemm":
            if _attr(node, "transA", 0) or _attr(node, "alpha", 1.0) != 1.0 or _attr(node, "beta", 1.0) != 1.0:
                raise FusionError("a Gemm with transA, alpha or beta is not rewritten")
            weight = weight.T if _attr(node, "transB", 0) else weight
        linear = Linear(weight, self.source.const(node.input[2]) if op == "Gemm" and len(node.input) > 2 else None,
                        shape=weight.shape)
        self.linears.append(linear)
        self.by_output[node.output[0]] = linear

    def _bias(self, node) -> None:
        """An Add of a constant to a projection's output (its bias, an expert's broadcast over its
        tokens) or to a traced LayerNorm's scaled output (the norm's bias)."""
        source = [self.by_output[name] for name in node.input if name in self.by_output]
        bias = [self.source.const(name) for name in node.input if name not in self.by_output]
        if source and bias and bias[0] is not None and bias[0].ndim == 1 and source[0].bias is None:
            source[0].bias = bias[0]
        elif source and bias and bias[0] is not None and len(source[0].shape) == 3 and \
                bias[0].shape == (source[0].shape[0], 1, source[0].shape[2]) and source[0].bias is None:
            source[0].bias = bias[0][:, 0, :]  # an expert's bias, broadcast over its tokens
        elif self.layout.layer_norm and any(name in self.norm_outputs for name in node.input):
            index = next(self.norm_outputs[name] for name in node.input if name in self.norm_outputs)
            bias = [self.source.const_through(name) for name in node.input if name not in self.norm_outputs]
            if bias and bias[0] is not None and bias[0].ndim == 1 and index not in self.norm_biases:
                self.norm_biases[index] = bias[0]


def _float32(array: np.ndarray | None) -> np.ndarray | None:
    """A weight as float32: a float16 export's weights are read up (the fused graph is emitted in
    float32, then converted to its precision); other types are not rewritten."""
    if array is None or array.dtype == np.float32:
        return array
    if array.dtype == np.float16:
        return array.astype(np.float32)
    raise FusionError(f"weights of type {array.dtype} are not rewritten (float32 or float16 only)")


def _add_experts(out: DecoderWeights, stacked: list[Linear], sinks: list[np.ndarray], config: dict, layout) -> None:
    """Each layer's experts (two stacked projections with their biases: gate|up, then down) and
    sinks, checked against config.json."""
    layers, hidden = len(out.layers), int(config["hidden_size"])
    count, inner = layout.experts.count, int(config["intermediate_size"])
    if len(sinks) != layers:
        raise FusionError(f"found {len(sinks)} attention sinks, expected {layers} for {layers} layers")
    if len(stacked) != 2 * layers:
        raise FusionError(f"found {len(stacked)} stacked expert projections, expected {2 * layers} for {layers} layers")
    for i, layer in enumerate(out.layers):
        gate_up, down = stacked[2 * i:2 * i + 2]
        for name, x, shape in (("gate_up_proj", gate_up, (count, hidden, 2 * inner)),
                               ("down_proj", down, (count, inner, hidden))):
            if x.shape != shape or x.bias is None:
                found = f"shape {x.shape}" + ("" if x.bias is not None else " and no bias")
                raise FusionError(f"layer {i} experts.{name} has {found}, expected {shape} and a bias")
        layer.experts = Experts(gate_up.weight, gate_up.bias, down.weight, down.bias)
        layer.sinks = sinks[i]


def _capped(nodes, producer, const_through, cap: float) -> int:
    """How many Tanh(x / cap) the graph computes on x that is not a projection's output (the
    logits' cap is: Tanh(Div(MatMul(h, W), c)))."""
    count = 0
    for node in nodes:
        divide = producer.get(node.input[0]) if node.op_type == "Tanh" else None
        if divide is None or divide.op_type != "Div":
            continue
        value = const_through(divide.input[1])
        source = producer.get(divide.input[0])
        projected = source is not None and source.op_type in ("MatMul", "Gemm") and \
            const_through(source.input[1]) is not None
        if value is not None and value.size == 1 and np.isclose(float(value), cap) and not projected:
            count += 1
    return count


def _dequantized(table: np.ndarray, consumers: list, const) -> np.ndarray:
    """An embedding table as float32: an int8 one (quantize_dynamic quantizes Gather too) through
    the DequantizeLinear after it, (q - zero_point) * scale, as onnxruntime computes it."""
    if table.dtype == np.float32 or len(consumers) != 1 or consumers[0].op_type != "DequantizeLinear":
        return table
    scale = const(consumers[0].input[1])
    zero = const(consumers[0].input[2]) if len(consumers[0].input) > 2 and consumers[0].input[2] else 0
    if scale is None or np.ndim(scale) != 0 or np.ndim(zero) != 0:
        raise FusionError("an embedding table quantized per axis is not rewritten")
    return ((table.astype(np.int32) - np.int32(zero)).astype(np.float32) * np.float32(scale)).astype(np.float32)


def _as_layers(embed, norms, linears, config, layout, norm_biases=None) -> DecoderWeights:
    layers = int(config["num_hidden_layers"])
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inner = int(config["intermediate_size"])
    vocab = int(config["vocab_size"])
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    per_norms, per_linears = len(layout.norms), len(layout.linears)
    if embed is None:
        raise FusionError("no embedding table (a Gather over a [vocab, hidden] constant) was found")
    if len(norms) != per_norms * layers + 1:
        raise FusionError(f"found {len(norms)} RMSNorm weights, expected {per_norms * layers + 1} for {layers} layers")
    if len(linears) != per_linears * layers + 1:
        raise FusionError(f"found {len(linears)} MatMul weights, expected {per_linears * layers + 1} "
                          f"for {layers} layers")
    shapes = {"q": (hidden, q_size), "k": (hidden, kv_size), "v": (hidden, kv_size),
              "router": (hidden, layout.experts.count if layout.experts else 0),
              "qkv": (hidden, q_size + 2 * kv_size), "o": (q_size, hidden), "gate": (hidden, inner),
              "up": (hidden, inner), "gate_up": (hidden, 2 * inner), "down": (inner, hidden)}
    norm_shapes = {"input_norm": (hidden,), "post_norm": (hidden,), "q_norm": (head_dim,), "k_norm": (head_dim,),
                   "attention_output_norm": (hidden,), "mlp_output_norm": (hidden,)}
    if layout.qk_norm_span == "all":
        norm_shapes.update(q_norm=(q_size,), k_norm=(kv_size,))
    norm_biases = norm_biases or {}
    out = DecoderWeights(embed=embed, norm=norms[-1], norm_bias=norm_biases.get(len(norms) - 1))
    for i in range(layers):
        parts = dict(zip(layout.linears, linears[per_linears * i:per_linears * (i + 1)]))
        for name, linear in parts.items():
            if linear.shape != shapes[name]:
                raise FusionError(f"layer {i} {name}_proj has shape {linear.shape}, expected {shapes[name]}")
            if linear.bias is not None and name not in layout.biased:
                raise FusionError(f"layer {i} {name}_proj has a bias: not rewritten")
        if "qkv" in parts:
            parts.update(zip("qkv", _split(parts.pop("qkv"), (q_size, kv_size, kv_size), f"layer {i} qkv_proj")))
        if "gate_up" in parts:
            parts.update(zip(("gate", "up"), _split(parts.pop("gate_up"), (inner, inner), f"layer {i} gate_up_proj")))
        named = dict(zip(layout.norms, norms[per_norms * i:per_norms * (i + 1)]))
        for name, weight in named.items():
            if weight.shape != norm_shapes[name]:
                raise FusionError(f"layer {i} {name} has shape {weight.shape}, expected {norm_shapes[name]}")
        for j, name in enumerate(layout.norms):
            bias = norm_biases.get(per_norms * i + j)
            if bias is not None:
                if name not in ("input_norm", "post_norm") or bias.shape != norm_shapes[name]:
                    raise FusionError(f"layer {i} {name} has a bias of shape {bias.shape}: not rewritten")
                named[f"{name}_bias"] = bias
        out.layers.append(Layer(**named, **parts))
    out.lm_head = linears[-1]
    if out.lm_head.shape != (hidden, vocab) or (out.lm_head.bias is not None and "lm_head" not in layout.biased):
        raise FusionError(f"lm_head has shape {out.lm_head.shape}, expected {(hidden, vocab)} and no bias")
    return out


def _split(linear: Linear, sizes: tuple[int, ...], name: str) -> list[Linear]:
    """A packed projection (Phi-3's qkv_proj, gate_up_proj) as its parts, in order along its output."""
    if linear.quantized:
        raise FusionError(f"{name} is packed and quantized: not rewritten")
    ends = np.cumsum((0,) + sizes)
    return [Linear(np.ascontiguousarray(linear.weight[:, a:b]), shape=(linear.weight.shape[0], b - a))
            for a, b in zip(ends[:-1], ends[1:])]
