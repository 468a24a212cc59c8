"""The projections of a decoder graph that a LoRA adapter can change, per layer, in every layout.

A projection is a MatMul by a constant [in, out] weight (an initializer, a Constant, or one seen
through Identity / Transpose / Cast), or a MatMulNBits (4-bit weights, float activations). Read in
node order, each layer's projections come in one of these shapes (h hidden, q = heads * head_dim,
kv = kv_heads * head_dim, i intermediate; packed ones as the onnxruntime-genai builder, the fused
rewrite and Phi-3 write them):

    attention  q (h, q), k (h, kv), v (h, kv)   |  q|k|v packed (h, q + 2 kv)
    then       o (q, h)
    MLP        gate (h, i), up (h, i)   |  gate|up packed (h, 2 i)   |  up (h, i) alone (no gate)
    then       down (i, h)

and the LM head (h, vocab) last. Projections of one shape (k and v; gate and up; every one of
q, k, v, o where heads * head_dim == hidden and kv_heads == heads) are told apart by the order the
model calls them, which exporters keep; where a node's name says which module it is
(`.../q_proj/MatMul`, `.../qkv_proj/MatMul`), the name must agree, or nothing is rewritten.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..onnx_graph import graphs
from .adapter import AdapterError

# a module of transformers' decoder layers -> the parts ("atoms") of the output it computes
MODULES = {"q_proj": ("q",), "k_proj": ("k",), "v_proj": ("v",), "o_proj": ("o",), "qkv_proj": ("q", "k", "v"),
           "gate_proj": ("gate",), "up_proj": ("up",), "down_proj": ("down",), "gate_up_proj": ("gate", "up")}
_NAMED = re.compile(r"(?:^|[/._])(q_proj|k_proj|v_proj|o_proj|qkv_proj|gate_proj|up_proj|down_proj|gate_up_proj)"
                    r"(?:[/._]|$)")
_MODULE_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.[A-Za-z_]+\.([A-Za-z_]+)$")


@dataclass(frozen=True)
class Projection:
    """One projection node's place: its layer, the atoms its output packs (in order), each atom's
    columns, and its input width."""

    layer: int
    atoms: tuple[str, ...]
    sizes: tuple[int, ...]
    in_features: int

    @property
    def key(self) -> str:
        return f"{self.layer}.{'_'.join(self.atoms)}"

    @property
    def out_features(self) -> int:
        return sum(self.sizes)


def module_place(module: str) -> tuple[int, tuple[str, ...]]:
    """(layer, atoms) of a base-model module name (`model.layers.3.self_attn.q_proj`); AdapterError
    naming it where it is not a decoder layer's projection."""
    match = _MODULE_KEY.search(module)
    if match is None or match.group(2) not in MODULES:
        raise AdapterError(f"target_modules: {module} is not a decoder layer's projection ("
                           f"{', '.join(MODULES)}); embeddings, the LM head and other modules are not applied")
    return int(match.group(1)), MODULES[match.group(2)]


def dims(config: dict) -> dict[str, int]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or hidden // heads)
    inner = config.get("intermediate_size")  # an onnxruntime-genai folder's genai_config.json has none
    return {"h": hidden, "q": heads * head_dim, "kv": kv_heads * head_dim, "i": int(inner) if inner else None,
            "layers": int(config["num_hidden_layers"])}


def find_projections(model, config: dict) -> list[tuple[object, list[tuple[object, Projection]]]]:
    """[(graph, [(node, Projection)])] for each graph of `model` (an onnx ModelProto; a merged
    decoder's If branches each) that computes the layers; AdapterError where a graph's projections
    do not read as config.json's layers."""
    d = dims(config)
    shapes = _constant_shapes(model)
    out = []
    for graph in graphs(model.graph):
        found = [(node, shape) for node in graph.node if (shape := _weight_shape(node, shapes)) is not None]
        if len(found) < d["layers"] * 4:  # a merged decoder's outer graph, a subgraph of no layers
            continue
        if d["i"] is None:  # the MLP's down projection: (intermediate, hidden), the one to hidden not from q
            d["i"] = next((i for _, (i, o) in found if o == d["h"] and i != d["q"]), d["q"])
        out.append((graph, _as_layers(found, d)))
    if not out:
        raise AdapterError("the decoder graph has no projections by constant weights (MatMul or MatMulNBits) to "
                           "apply an adapter to")
    return out


def distinct(found: list) -> list[Projection]:
    """find_projections' projections, each once (a merged decoder's branches have the same)."""
    return list({p.key: p for _, nodes in found for _, p in nodes}.values())


def from_inputs(lora_inputs, config: dict) -> list[Projection]:
    """The projections of a graph rewrite.add_lora gave LoRA inputs, read back off those inputs
    (DecoderGraph.lora_inputs: `lora.<layer>.<atoms>.a` [groups, in, K], `.b` [groups, K, out]) and
    config.json (how a packed q|k|v splits its columns): no second read of the graph's file."""
    shapes = dict(lora_inputs)
    d = dims(config)
    out = []
    for name in shapes:
        if not (name.startswith("lora.") and name.endswith(".a")):
            continue
        layer, _, joined = name[len("lora."):-len(".a")].partition(".")
        atoms, columns = tuple(joined.split("_")), shapes[name[:-len(".a")] + ".b"][2]
        sizes = {("q", "k", "v"): (d["q"], d["kv"], d["kv"]), ("gate", "up"): (columns // 2, columns // 2)}.get(
            atoms, (columns,))
        if sum(sizes) != columns:
            raise AdapterError(f"the decoder graph's {joined} projection of layer {layer} gives {columns} columns, "
                               f"where config.json's heads give {sum(sizes)}")
        out.append(Projection(int(layer), atoms, sizes, shapes[name][1]))
    return out


def _as_layers(found: list, d: dict) -> list:
    h, q, kv, i = d["h"], d["q"], d["kv"], d["i"]
    want = {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, i), "up": (h, i), "down": (i, h)}
    # each step's options, each option the projections it takes in order (their atoms)
    steps = [[(("q", "k", "v"),), (("q",), ("k",), ("v",))], [(("o",),)],
             [(("gate", "up"),), (("gate",), ("up",)), (("up",),)], [(("down",),)]]
    out, j = [], 0
    for layer in range(d["layers"]):
        for options in steps:
            for option in options:
                shapes = [(want[atoms[0]][0], sum(want[a][1] for a in atoms)) for atoms in option]
                if [shape for _, shape in found[j:j + len(option)]] == shapes:
                    break
            else:
                got = [shape for _, shape in found[j:j + 3]]
                raise AdapterError(f"the decoder graph's layer {layer} projections read {got} where "
                                   f"{[[(want[a[0]][0], sum(want[x][1] for x in a)) for a in o] for o in options]} "
                                   "was looked for: its layout is not one an adapter is applied to")
            for atoms, (node, shape) in zip(option, found[j:j + len(option)]):
                _check_name(node, atoms, layer)
                out.append((node, Projection(layer, atoms, tuple(want[a][1] for a in atoms), shape[0])))
            j += len(option)
    return out


def _check_name(node, atoms: tuple[str, ...], layer: int) -> None:
    match = _NAMED.search(node.name or "")
    if match and MODULES[match.group(1)] != atoms:
        raise AdapterError(f"the decoder graph's node {node.name!r} is read as layer {layer}'s "
                           f"{'|'.join(atoms)} projection, but its name says {match.group(1)}")


def _constant_shapes(model) -> dict[str, tuple[int, ...]]:
    """Every constant's shape by name: initializers and Constant nodes of every graph, and names
    that only pass one on (Identity, Transpose [1, 0], Cast)."""
    shapes: dict[str, tuple[int, ...]] = {}
    passes = []
    for graph in graphs(model.graph):
        shapes.update({t.name: tuple(t.dims) for t in graph.initializer})
        for node in graph.node:
            if node.op_type == "Constant":
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    shapes[node.output[0]] = tuple(value.dims)
            elif node.op_type in ("Identity", "Transpose", "Cast"):
                passes.append(node)
    for _ in range(3):  # chains of a few: Cast(Transpose(w))
        for node in passes:
            shape = shapes.get(node.input[0])
            if shape is not None and node.output[0] not in shapes:
                shapes[node.output[0]] = shape[::-1] if node.op_type == "Transpose" else shape
    return shapes


def _weight_shape(node, shapes: dict) -> tuple[int, int] | None:
    """(in, out) of a projection node, None for any other node."""
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx"):
        shape = shapes.get(node.input[1])
        return shape if shape is not None and len(shape) == 2 else None
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a.i for a in node.attribute}
        return int(attrs["K"]), int(attrs["N"])
    return None
