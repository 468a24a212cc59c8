"""Give each projection of a decoder graph a LoRA path whose adapter each batch row picks.

Per projection y = x W (projections.py), at load:

    h = FusedMatMul(x, A, transB=1)     # A [R, in]: the places' lora_A rows, one after the other
    y' = y + MatMul(h * mask, B)        # B [R, out]: their lora_B, times each module's scaling
                                        # mask [n, 1, R]: 1 on the rows' own place's columns

A, B and mask are graph inputs (bank.py feeds them), so an adapter loads into its place between
two runs with no new session, and a run feeds only the range of places its rows use (R = 0 for a
run without adapters: every product is empty and y' = y + 0 = y). A place's columns hold one
`max_rank` block per adapter module that can reach the projection (a packed q|k|v has three), so
the mask is one input per such count: `lora.mask.1`, `.2`, `.3`.

This is PEFT's `base(x) + lora_B(lora_A(x)) * scaling` with the scaling folded into B at load
(a rounding apart, within the log-probabilities' tolerance; greedy tokens equal).
"""

from __future__ import annotations

from .projections import Projection, distinct, find_projections

MASK = "lora.mask.{}"  # [n, R]: R = places fed * blocks * max_rank
DTYPES = {1: "float32", 10: "float16"}


def input_names(projection: Projection) -> tuple[str, str]:
    """The A and B inputs of a projection."""
    return f"lora.{projection.key}.a", f"lora.{projection.key}.b"


def add_lora(model, config: dict) -> tuple[list[Projection], int]:
    """Rewrite `model` (an onnx ModelProto, weights not needed) in place; the projections (one per
    place in the layers, the same in each of a merged decoder's branches) and the onnx element
    type of their inputs. AdapterError where the graph's projections cannot be read."""
    from onnx import TensorProto, helper

    found = find_projections(model, config)
    elem = _element_type(model, found[0][1][0][0])
    masks: set[int] = set()
    for graph, nodes in found:
        added = []
        for node, projection in nodes:
            a, b = input_names(projection)
            blocks = len(projection.atoms)
            masks.add(blocks)
            p = f"lora/{projection.key}"
            base = node.output[0]
            node.output[0] = f"{p}/base"
            added.append((node, [
                helper.make_node("FusedMatMul", [node.input[0], a], [f"{p}/h"], name=f"{p}/a", domain="com.microsoft",
                                 transB=1),
                helper.make_node("Mul", [f"{p}/h", f"lora/mask{blocks}/rows"], [f"{p}/masked"], name=f"{p}/mask"),
                helper.make_node("MatMul", [f"{p}/masked", b], [f"{p}/delta"], name=f"{p}/b"),
                helper.make_node("Add", [f"{p}/base", f"{p}/delta"], [base], name=f"{p}/add")]))
        _insert_after(graph, added)
    projections = distinct(found)
    top = model.graph
    for projection in projections:
        a, b = input_names(projection)
        top.input.append(helper.make_tensor_value_info(a, elem, [f"lora_rows_{len(projection.atoms)}",
                                                                 projection.in_features]))
        top.input.append(helper.make_tensor_value_info(b, elem, [f"lora_rows_{len(projection.atoms)}",
                                                                 projection.out_features]))
    unsqueeze = _unsqueeze_takes_axes_input(model)
    front = []
    for blocks in sorted(masks):
        top.input.append(helper.make_tensor_value_info(MASK.format(blocks), elem, ["batch", f"lora_rows_{blocks}"]))
        if unsqueeze:
            axes = f"lora/mask{blocks}/axes"
            top.initializer.append(helper.make_tensor(axes, TensorProto.INT64, [1], [1]))
            front.append(helper.make_node("Unsqueeze", [MASK.format(blocks), axes], [f"lora/mask{blocks}/rows"]))
        else:
            front.append(helper.make_node("Unsqueeze", [MASK.format(blocks)], [f"lora/mask{blocks}/rows"], axes=[1]))
    for i, node in enumerate(front):
        top.node.insert(i, node)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return projections, elem


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


def _unsqueeze_takes_axes_input(model) -> bool:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 13) >= 13
