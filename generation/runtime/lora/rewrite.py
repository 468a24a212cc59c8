"""Give each projection of a decoder graph a LoRA path whose adapter each batch row picks.

A run's rows are grouped by their adapter's place in the bank (bank.py): group g holds the rows at
place low + g (`lora.rows` [G, n_g], padded to the largest group's count), and `lora.slots` [n, 2]
says where each row is. Nodes run once per run make those per token (`_token_indices`), then per
projection y = x W (projections.py), at load:

    xg = GatherND(x, tokens)                   # [G, n_g T, in]: each group's rows' tokens (once per x)
    d  = MatMul(MatMul(xg, A), B)              # [G, n_g T, out]: A [G, in, K], B [G, K, out]
    y' = y + GatherND(d, token_slots)          # [n, T, out]: each row's tokens' products

so each row multiplies its own adapter's columns only: a batch mixing 4 adapters computes no
row's product with another adapter's weights (a mask over every place's columns would, 4 times the
work; measured: bench/lora.py). K = blocks * max_rank, a block per adapter module that can reach
the projection (a packed q|k|v has three). Place 0 is zeros: rows without an adapter sit there
when others have one (x 0 = 0, so y' = y exactly); a run without adapters feeds K = 0 and one
group of one row (`empty_feeds`: every product is empty and y' = y + 0 = y). A, B, `lora.rows`
and `lora.slots` are graph inputs, so an adapter loads into its place between two runs with no
new session, and a run feeds only the places from its rows' lowest to their highest: views, no copy.

This is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` with the scaling folded into B at load
(a rounding apart, within the log-probabilities' tolerance; greedy tokens equal).
"""

from __future__ import annotations

import numpy as np

from ..onnx_graph import default_opset
from .adapter import AdapterError
from .projections import Projection, distinct, find_projections

ROWS = "lora.rows"  # int64 [G, n_g]: the batch rows of each group (padding: row 0, read by none)
SLOTS = "lora.slots"  # int64 [n, 2]: each row's group and its index in the group
DTYPES = {1: "float32", 10: "float16"}


def input_names(projection: Projection) -> tuple[str, str]:
    """The A and B inputs of a projection."""
    return f"lora.{projection.key}.a", f"lora.{projection.key}.b"


def one_empty_group(rows: int) -> dict[str, np.ndarray]:
    """`lora.rows` and `lora.slots` of a run of `rows` rows none of which has an adapter: one group
    of one row (row 0), which every row reads (its product, with K = 0, is zeros)."""
    return {ROWS: np.zeros((1, 1), np.int64), SLOTS: np.zeros((rows, 2), np.int64)}


def empty_feeds(lora_inputs, rows: int, dtypes: dict) -> dict[str, np.ndarray]:
    """The LoRA inputs of a run of `rows` rows none of which has an adapter, from the graph's
    (lora_inputs: (name, shape; -1 where dynamic); none for a graph without adapters): one empty
    group, A [1, in, 0], B [1, 0, out]."""
    if not lora_inputs:
        return {}
    out = one_empty_group(rows)
    for name, shape in lora_inputs:
        if name not in out:
            out[name] = np.zeros(tuple(1 if i == 0 else max(d, 0) for i, d in enumerate(shape)), dtypes[name])
    return out


def add_lora(model, config: dict) -> tuple[list[Projection], int]:
    """Rewrite `model` (an onnx ModelProto, weights not needed) in place; the projections (one per
    place in the layers, the same in each of a merged decoder's branches) and the onnx element
    type of their inputs. AdapterError where the graph's projections cannot be read."""
    from onnx import TensorProto, helper

    found = find_projections(model, config)
    elem = _element_type(model, found[0][1][0][0])
    top = model.graph
    for graph, nodes in found:
        added, grouped = [], {}
        for node, projection in nodes:
            a, b = input_names(projection)
            p, x = f"lora/{projection.key}", node.input[0]
            extra = []
            if x not in grouped:  # q, k and v (gate and up) read one x: grouped once
                grouped[x] = f"{p}/x"
                extra.append(helper.make_node("GatherND", [x, "lora/tokens"], [grouped[x]], name=f"{p}/x"))
            base = node.output[0]
            node.output[0] = f"{p}/base"
            extra += [helper.make_node("MatMul", [grouped[x], a], [f"{p}/h"], name=f"{p}/a"),
                      helper.make_node("MatMul", [f"{p}/h", b], [f"{p}/d"], name=f"{p}/b"),
                      helper.make_node("GatherND", [f"{p}/d", "lora/token_slots"], [f"{p}/delta"], name=f"{p}/back"),
                      helper.make_node("Add", [f"{p}/base", f"{p}/delta"], [base], name=f"{p}/add")]
            added.append((node, extra))
        _insert_after(graph, added)
    projections = distinct(found)
    for projection in projections:
        a, b = input_names(projection)
        width = f"lora_width_{len(projection.atoms)}"
        top.input.append(helper.make_tensor_value_info(a, elem, ["lora_groups", projection.in_features, width]))
        top.input.append(helper.make_tensor_value_info(b, elem, ["lora_groups", width, projection.out_features]))
    top.input.append(helper.make_tensor_value_info(ROWS, TensorProto.INT64, ["lora_groups", "lora_group_rows"]))
    top.input.append(helper.make_tensor_value_info(SLOTS, TensorProto.INT64, ["batch", 2]))
    front = _token_indices(model)
    for i, node in enumerate(front):
        top.node.insert(i, node)
    return projections, elem


def _token_indices(model) -> list:
    """The nodes, run once per run, that make the rows' indices per token of a run of T tokens:
    `lora/tokens` [G, n_g T, 2] (row, t), what each group reads of x [n, T, in]; `lora/token_slots`
    [n, T, 2] (group, index * T + t), where each row's tokens are in a group's products."""
    from onnx import TensorProto, helper

    names = {i.name for i in model.graph.input}
    source = next((n for n in ("input_ids", "inputs_embeds") if n in names), None)
    if source is None:
        raise AdapterError("the decoder graph has neither input_ids nor inputs_embeds: its run's token count "
                           "cannot be read for the adapters' path")
    opset = default_opset(model, 13)
    const = model.graph.initializer
    for name, values in (("lora/c1", [1]), ("lora/c2", [2]), ("lora/cm1", [-1]), ("lora/pairs", [0, -1, 2]),
                         ("lora/split", [1, 1])):
        const.append(helper.make_tensor(name, TensorProto.INT64, [len(values)], values))
    for name, value in (("lora/s0", 0), ("lora/s1", 1)):
        const.append(helper.make_tensor(name, TensorProto.INT64, [], [value]))

    def unsqueeze(x, out, axis):
        if opset >= 13:
            return helper.make_node("Unsqueeze", [x, {1: "lora/c1", 2: "lora/c2", -1: "lora/cm1"}[axis]], [out])
        return helper.make_node("Unsqueeze", [x], [out], axes=[axis])

    node = helper.make_node
    return [
        node("Shape", [source], ["lora/source_shape"]),
        node("Gather", ["lora/source_shape", "lora/s1"], ["lora/T"]),  # a scalar
        node("Range", ["lora/s0", "lora/T", "lora/s1"], ["lora/t"]),  # [T]
        node("Reshape", ["lora/T", "lora/c1"], ["lora/T1"]),  # [1]
        # tokens: (row, t) for each group's rows
        node("Shape", [ROWS], ["lora/groups"]),
        node("Concat", ["lora/groups", "lora/T1"], ["lora/grid"], axis=0),  # [G, n_g, T]
        unsqueeze(ROWS, "lora/rows3", 2),
        node("Expand", ["lora/rows3", "lora/grid"], ["lora/row_of"]),
        node("Expand", ["lora/t", "lora/grid"], ["lora/t_of"]),
        unsqueeze("lora/row_of", "lora/row_of4", -1),
        unsqueeze("lora/t_of", "lora/t_of4", -1),
        node("Concat", ["lora/row_of4", "lora/t_of4"], ["lora/tokens4"], axis=-1),
        node("Reshape", ["lora/tokens4", "lora/pairs"], ["lora/tokens"]),
        # token_slots: (group, index * T + t) for each row's tokens
        node("Split", [SLOTS], ["lora/g", "lora/j"], axis=1) if opset < 13 else
        node("Split", [SLOTS, "lora/split"], ["lora/g", "lora/j"], axis=1),
        node("Mul", ["lora/j", "lora/T"], ["lora/jT"]),
        node("Add", ["lora/jT", "lora/t"], ["lora/j_of"]),  # [n, T]
        node("Shape", ["lora/j_of"], ["lora/nT"]),
        node("Expand", ["lora/g", "lora/nT"], ["lora/g_of"]),
        unsqueeze("lora/g_of", "lora/g_of3", -1),
        unsqueeze("lora/j_of", "lora/j_of3", -1),
        node("Concat", ["lora/g_of3", "lora/j_of3"], ["lora/token_slots"], axis=-1),
    ]


def _insert_after(graph, added: list) -> None:
    nodes = list(graph.node)
    after = {id(node): extra for node, extra in added}
    del graph.node[:]
    for node in nodes:
        graph.node.append(node)
        graph.node.extend(after.get(id(node), []))


def _element_type(model, node) -> int:
    """The float type of a projection's activations: its weight's (MatMul) or its scales' (MatMulNBits)."""
    from ..onnx_graph import graphs

    name = node.input[1] if node.op_type == "MatMul" else node.input[2]
    for graph in graphs(model.graph):
        for tensor in graph.initializer:
            if tensor.name == name:
                return tensor.data_type if tensor.data_type in DTYPES else 1
    return 1
