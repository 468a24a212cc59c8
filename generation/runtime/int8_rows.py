"""Int8 dynamic quantization per batch row.

transformers.js's `_quantized` / `_int8` decoders (onnxruntime's `quantize_dynamic`) compute each
projection as

    y, x_scale, x_zp = DynamicQuantizeLinear(x)            # x: [B, S, H] float
    out = Cast(MatMulInteger(y, W, x_zp, w_zp)) * (x_scale * w_scale)

and DynamicQuantizeLinear takes ONE scale and zero point over the whole tensor: every row of the
batch, padding rows included, so a row's logits depend on the rows beside it. At load,
`rows_apart` rewrites each such DynamicQuantizeLinear so that row b takes the scale and zero
point of its own [1, S, H] slice, exactly as onnxruntime's CPU kernel computes them
(`GetQuantizationParameter`):

    lo, hi = min(0, min(x[b])), max(0, max(x[b]))
    scale[b] = 1 if hi == lo else (hi - lo) / 255
    zp[b] = uint8(round_half_even(clip(0 - lo / scale[b], 0, 255)))
    y[b] = QuantizeLinear(x[b], scale[b], zp[b])            # saturate(round(x / scale) + zp)

onnxruntime's CPU MatMulInteger takes only a scalar a_zero_point, so the MatMulInteger runs
without one and the zero point comes off in int32, where it is exact:

    (y - zp[b]) @ (W - w_zp) = y @ (W - w_zp) - zp[b] * colsum(W - w_zp)

(the column sums are a constant of the weights; onnxruntime folds them at session creation).
x_scale becomes [B, 1, ..., 1]: the graph's own Mul(x_scale, w_scale) and Mul(Cast(...), that)
multiply the same floats in the same order, so each row's output equals the graph run on that
row alone, bit for bit. The scale still spans a row's positions: a prompt's padding positions
would enter it, so such a graph's prompts run in groups of one length (`DecoderGraph.
prompts_by_length`, cache/prefill.py), and its LM head keeps every position (runtime/head.py).

Only that pattern is touched: a DynamicQuantizeLinear whose outputs are read only by
MatMulInteger (y, and x_zp as its a_zero_point) and Mul (x_scale); any other reader leaves the
graph as it is, with the reason. A graph without DynamicQuantizeLinear (fp32, fp16, q4) is
returned untouched.
"""

from __future__ import annotations

from .onnx_graph import default_opset, graphs

QUANTIZE = "DynamicQuantizeLinear"


def rows_apart(model) -> tuple[int, str | None]:
    """Rewrite, in place, every DynamicQuantizeLinear of `model` (an onnx ModelProto; in a merged
    decoder's If branches too) to take its scale and zero point per batch row (axis 0). Returns
    (how many were rewritten, None), or (0, why not) where one is read outside the pattern
    (nothing changed); (0, None) for a graph that has none."""
    opset = default_opset(model)
    found = []
    for graph in graphs(model.graph):
        quantizers = [n for n in graph.node if n.op_type == QUANTIZE and n.domain in ("", "ai.onnx")]
        if quantizers:
            found.append((graph, quantizers, _readers(graph)))
    if not found:
        return 0, None
    if opset < 13:
        return 0, f"its opset {opset} is older than 13 (QuantizeLinear per axis, Clip with inputs)"
    for graph, quantizers, readers in found:
        # a name read inside a nested subgraph is read outside the pattern
        nested = {name for sub in graphs(graph) if sub is not graph for n in sub.node for name in n.input}
        for node in quantizers:
            reason = _pattern_breaks(node, readers, {o.name for o in graph.output} | nested)
            if reason:
                return 0, reason
    count = 0
    for graph, quantizers, readers in found:
        for node in quantizers:
            _rewrite(graph, node, readers, f"/int8_rows{count}", opset)
            count += 1
    return count, None


def _readers(graph) -> dict[str, list]:
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    return readers


def _pattern_breaks(node, readers: dict, outputs: set[str]) -> str | None:
    y, scale, zp = (list(node.output) + ["", "", ""])[:3]
    if {y, scale, zp} & outputs:
        return f"{node.name}: its outputs are graph outputs or read inside a subgraph"
    for reader in readers.get(y, []):
        if reader.op_type != "MatMulInteger" or list(reader.input).index(y) != 0 or \
                len(reader.input) < 3 or reader.input[2] != zp:
            return f"{node.name}: its quantized output is read by {reader.op_type}, not as a MatMulInteger's A"
    for reader in readers.get(zp, []):
        if reader.op_type != "MatMulInteger" or reader.input[0] != y or list(reader.input).index(zp) != 2:
            return f"{node.name}: its zero point is read by {reader.op_type}, not as a MatMulInteger's a_zero_point"
    for reader in readers.get(scale, []):
        if reader.op_type != "Mul":
            return f"{node.name}: its scale is read by {reader.op_type}, not a Mul"
    return None


def _rewrite(graph, node, readers: dict, prefix: str, opset: int) -> None:
    """Replace `node` by its per-row computation (the module's docstring), and shift each
    MatMulInteger that reads it by its rows' zero points."""
    from onnx import TensorProto, helper

    x = node.input[0]
    y, scale, zp = (list(node.output) + ["", "", ""])[:3]
    scale = scale or f"{prefix}/scale"
    zp = zp or f"{prefix}/zp"
    p = prefix

    def const(name, value, dtype=TensorProto.FLOAT, dims=()):
        return helper.make_node("Constant", [], [f"{p}/{name}"], name=f"{p}/{name}",
                                value=helper.make_tensor(f"{p}/{name}_value", dtype, list(dims),
                                                         value if dims else [value]))

    def reduce(op, data, out):
        if opset >= 18:
            return helper.make_node(op, [data, f"{p}/axis1"], [out], name=out, keepdims=1)
        return helper.make_node(op, [data], [out], name=out, axes=[1], keepdims=1)

    nodes = [
        const("zero", 0.0), const("one", 1.0), const("qmax", 255.0),
        const("flat_shape", [0, -1], TensorProto.INT64, [2]), const("flat", [-1], TensorProto.INT64, [1]),
        const("izero", 0, TensorProto.INT64), const("ione", 1, TensorProto.INT64),
        helper.make_node("Reshape", [x, f"{p}/flat_shape"], [f"{p}/rows"], name=f"{p}/rows"),  # [B, S*H]
        reduce("ReduceMin", f"{p}/rows", f"{p}/min"),  # [B, 1]
        reduce("ReduceMax", f"{p}/rows", f"{p}/max"),
        helper.make_node("Min", [f"{p}/min", f"{p}/zero"], [f"{p}/lo"], name=f"{p}/lo"),
        helper.make_node("Max", [f"{p}/max", f"{p}/zero"], [f"{p}/hi"], name=f"{p}/hi"),
        helper.make_node("Sub", [f"{p}/hi", f"{p}/lo"], [f"{p}/range"], name=f"{p}/range"),
        helper.make_node("Div", [f"{p}/range", f"{p}/qmax"], [f"{p}/ratio"], name=f"{p}/ratio"),
        helper.make_node("Equal", [f"{p}/hi", f"{p}/lo"], [f"{p}/flat_row"], name=f"{p}/flat_row"),
        # onnxruntime's kernel: scale 1 where the row is all zeros
        helper.make_node("Where", [f"{p}/flat_row", f"{p}/one", f"{p}/ratio"], [f"{p}/row_scale"],
                         name=f"{p}/row_scale"),  # [B, 1]
        helper.make_node("Div", [f"{p}/lo", f"{p}/row_scale"], [f"{p}/lo_steps"], name=f"{p}/lo_steps"),
        helper.make_node("Sub", [f"{p}/zero", f"{p}/lo_steps"], [f"{p}/zp_float"], name=f"{p}/zp_float"),
        helper.make_node("Clip", [f"{p}/zp_float", f"{p}/zero", f"{p}/qmax"], [f"{p}/zp_clipped"],
                         name=f"{p}/zp_clipped"),
        helper.make_node("Round", [f"{p}/zp_clipped"], [f"{p}/zp_round"], name=f"{p}/zp_round"),  # half to even
        helper.make_node("Cast", [f"{p}/zp_round"], [f"{p}/row_zp"], name=f"{p}/row_zp", to=TensorProto.UINT8),
        helper.make_node("Reshape", [f"{p}/row_scale", f"{p}/flat"], [f"{p}/scale_b"], name=f"{p}/scale_b"),
        helper.make_node("Reshape", [f"{p}/row_zp", f"{p}/flat"], [f"{p}/zp_b"], name=f"{p}/zp_b"),
        helper.make_node("QuantizeLinear", [x, f"{p}/scale_b", f"{p}/zp_b"], [y], name=f"{p}/quantize", axis=0),
        # [B, 1, ..., 1] of x's rank: Where(range(rank) == 0, shape(x), 1)
        helper.make_node("Shape", [x], [f"{p}/x_shape"], name=f"{p}/x_shape"),
        helper.make_node("Size", [f"{p}/x_shape"], [f"{p}/rank"], name=f"{p}/rank"),
        helper.make_node("Range", [f"{p}/izero", f"{p}/rank", f"{p}/ione"], [f"{p}/dims"], name=f"{p}/dims"),
        helper.make_node("Equal", [f"{p}/dims", f"{p}/izero"], [f"{p}/is_batch"], name=f"{p}/is_batch"),
        helper.make_node("Where", [f"{p}/is_batch", f"{p}/x_shape", f"{p}/ione"], [f"{p}/keep_shape"],
                         name=f"{p}/keep_shape"),
        helper.make_node("Reshape", [f"{p}/row_scale", f"{p}/keep_shape"], [scale], name=f"{p}/scale"),
        helper.make_node("Cast", [f"{p}/row_zp"], [f"{p}/zp_i32"], name=f"{p}/zp_i32", to=TensorProto.INT32),
        helper.make_node("Reshape", [f"{p}/zp_i32", f"{p}/keep_shape"], [f"{p}/zp_rows"], name=f"{p}/zp_rows"),
    ]
    if opset >= 18:  # ReduceMin / ReduceMax take their axes as an input
        nodes.insert(0, const("axis1", [1], TensorProto.INT64, [1]))
    at = list(graph.node).index(node)
    graph.node.remove(node)
    for offset, new in enumerate(nodes):
        graph.node.insert(at + offset, new)
    for j, matmul in enumerate(readers.get(y, [])):
        _shift(graph, matmul, f"{p}/zp_rows", f"{p}/mm{j}")


def _shift(graph, matmul, zp_rows: str, p: str) -> None:
    """MatMulInteger(y, W, zp, w_zp) -> MatMulInteger(y, W, '', w_zp) - zp_rows * colsum(W - w_zp),
    in int32 (zp_rows: [B, 1, ..., 1])."""
    from onnx import TensorProto, helper

    weight = matmul.input[1]
    w_zp = matmul.input[3] if len(matmul.input) > 3 and matmul.input[3] else None
    out = matmul.output[0]
    nodes = [helper.make_node("Cast", [weight], [f"{p}/w32"], name=f"{p}/w32", to=TensorProto.INT32)]
    centred = f"{p}/w32"
    if w_zp is not None:
        nodes += [helper.make_node("Cast", [w_zp], [f"{p}/wzp32"], name=f"{p}/wzp32", to=TensorProto.INT32),
                  helper.make_node("Sub", [f"{p}/w32", f"{p}/wzp32"], [f"{p}/centred"], name=f"{p}/centred")]
        centred = f"{p}/centred"
    nodes += [
        helper.make_node("Constant", [], [f"{p}/axis0"], name=f"{p}/axis0",
                         value=helper.make_tensor(f"{p}/axis0_value", TensorProto.INT64, [1], [-2])),
        # ReduceSum takes its axes as an input from opset 13
        helper.make_node("ReduceSum", [centred, f"{p}/axis0"], [f"{p}/colsum"], name=f"{p}/colsum", keepdims=0),
        helper.make_node("Mul", [zp_rows, f"{p}/colsum"], [f"{p}/offset"], name=f"{p}/offset"),
        helper.make_node("Sub", [f"{p}/unshifted", f"{p}/offset"], [out], name=f"{p}/shifted"),
    ]
    matmul.input[2] = ""
    matmul.output[0] = f"{p}/unshifted"
    at = list(graph.node).index(matmul)
    for offset, new in enumerate(nodes):
        graph.node.insert(at + 1 + offset, new)
