"""The ONNX graphs of the moves runtime.device.Device runs on a session's device: a fresh
buffer, a relayout, rows moved, a row written, mask rows set by length, a step's mask entries, a
run's columns moved to each row's length, rows gathered or concatenated, a copy. Each is built
over one dtype and rank with symbolic dims, so one session serves every shape.
"""

from __future__ import annotations

import numpy as np


def move_graph(op: str, dtype: np.dtype, rank: int):
    """The ONNX graph of a move, over tensors of `dtype` and `rank` (the moved buffer's) with
    symbolic dims (one session serves every shape)."""
    from onnx import helper

    parts = _Parts(dtype)
    move = _MOVES.get(op)
    if move is None:
        raise ValueError(f"no device move named {op!r}")
    nodes, inputs, outputs, inits = move(parts, rank)
    graph = helper.make_graph(nodes, op, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


class _Parts:
    """What the moves' graphs are made of, for tensors of one dtype: its element type, the
    constants they share, and value infos with symbolic dims."""

    def __init__(self, dtype: np.dtype):
        from onnx import TensorProto, helper
        from onnx.helper import np_dtype_to_tensor_dtype

        self.element = np_dtype_to_tensor_dtype(dtype)
        self.i64 = i64 = TensorProto.INT64
        self.one = helper.make_tensor("one", self.element, [], [1] if dtype != np.bool_ else [True])
        self.zero_i = helper.make_tensor("zero_i", i64, [], [0])
        self.one_i = helper.make_tensor("one_i", i64, [], [1])
        self.axis1 = helper.make_tensor("axis1", i64, [1], [1])
        self.axis0 = helper.make_tensor("axis0", i64, [1], [0])

    def values(self, name: str, rank: int):
        """A graph input or output of the moved dtype."""
        return _value_info(name, self.element, rank)

    def indices(self, name: str, rank: int = 1):
        """One of int64 (rows, lengths, shapes, pads)."""
        return _value_info(name, self.i64, rank)


def _value_info(name: str, kind: int, rank: int):
    """`name` of `kind` with `rank` symbolic dims (d<name>0, d<name>1, ...)."""
    from onnx import helper

    return helper.make_tensor_value_info(name, kind, [f"d{name}{i}" for i in range(rank)])


# Each move's graph: (nodes, inputs, outputs, initializers) for tensors of `rank`.

def _zeros(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["y"],
                              value=helper.make_tensor("zero", parts.element, [1], [0]))]
    return nodes, [parts.indices("shape")], [parts.values("y", rank)], []


def _relayout(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Shape", ["ends"], ["rank"]),
             helper.make_node("ConstantOfShape", ["rank"], ["starts"],
                              value=helper.make_tensor("z", parts.i64, [1], [0])),
             helper.make_node("Slice", ["x", "starts", "ends"], ["kept"]),
             helper.make_node("Pad", ["kept", "pads"], ["y"])]
    inputs = [parts.values("x", rank), parts.indices("ends"), parts.indices("pads")]
    return nodes, inputs, [parts.values("y", rank)], []


def _move_rows(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Gather", ["x", "src"], ["moved"], axis=0),
             helper.make_node("Unsqueeze", ["dst", "axis1"], ["where"]),
             helper.make_node("ScatterND", ["x", "where", "moved"], ["y"])]
    inputs = [parts.values("x", rank), parts.indices("dst"), parts.indices("src")]
    return nodes, inputs, [parts.values("y", rank)], [parts.axis1]


def _write_row(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Pad", ["values", "pads"], ["padded"]),
             helper.make_node("Unsqueeze", ["row", "axis1"], ["where"]),
             helper.make_node("ScatterND", ["x", "where", "padded"], ["y"])]
    inputs = [parts.values("x", 4), parts.indices("row"), parts.values("values", 4), parts.indices("pads")]
    return nodes, inputs, [parts.values("y", 4)], [parts.axis1]


def _set_lengths(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Gather", ["shape", "one_i"], ["width"], axis=0),
             helper.make_node("Range", ["zero_i", "width", "one_i"], ["columns"]),
             helper.make_node("Max", ["lengths", "one_i"], ["counted"]),
             helper.make_node("Unsqueeze", ["counted", "axis1"], ["counted2"]),
             helper.make_node("Unsqueeze", ["columns", "axis0"], ["columns2"]),
             helper.make_node("Less", ["columns2", "counted2"], ["ones"]),
             helper.make_node("Cast", ["ones"], ["values"], to=parts.element),
             helper.make_node("Unsqueeze", ["rows", "axis1"], ["where"]),
             helper.make_node("ScatterND", ["x", "where", "values"], ["y"])]
    inputs = [parts.values("x", 2), parts.indices("rows"), parts.indices("lengths")]
    return nodes, inputs, [parts.values("y", 2)], [parts.zero_i, parts.one_i, parts.axis0, parts.axis1]


def _mark(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Shape", ["entries"], ["shape"]),
             helper.make_node("Slice", ["shape", "axis0", "axis1"], ["count"]),
             helper.make_node("Expand", ["one", "count"], ["values"]),
             helper.make_node("ScatterND", ["x", "entries", "values"], ["y"])]
    inputs = [parts.values("x", 2), parts.indices("entries", 2)]
    return nodes, inputs, [parts.values("y", 2)], [parts.one, parts.axis0, parts.axis1]


def _move_columns(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axis2"], ["moved"]),
             helper.make_node("Sub", ["ends", "starts"], ["count1"]),
             helper.make_node("Squeeze", ["count1"], ["count"]),
             helper.make_node("Range", ["zero_i", "count", "one_i"], ["steps"]),
             helper.make_node("Unsqueeze", ["lengths", "axes123"], ["rows4"]),
             helper.make_node("Unsqueeze", ["steps", "axes013"], ["steps4"]),
             helper.make_node("Add", ["rows4", "steps4"], ["columns"]),
             helper.make_node("Shape", ["moved"], ["moved_shape"]),
             helper.make_node("Expand", ["columns", "moved_shape"], ["where"]),
             helper.make_node("ScatterElements", ["x", "where", "moved"], ["y"], axis=2)]
    inputs = [parts.values("x", 4), parts.indices("lengths"), parts.indices("starts"), parts.indices("ends")]
    inits = [helper.make_tensor("axis2", parts.i64, [1], [2]), parts.zero_i, parts.one_i,
             helper.make_tensor("axes123", parts.i64, [3], [1, 2, 3]),
             helper.make_tensor("axes013", parts.i64, [3], [0, 1, 3])]
    return nodes, inputs, [parts.values("y", 4)], inits


def _valid_mask(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Squeeze", ["total"], ["total0"]),
             helper.make_node("Range", ["zero_i", "total0", "one_i"], ["columns"]),
             helper.make_node("Unsqueeze", ["columns", "axis0"], ["columns2"]),
             helper.make_node("Unsqueeze", ["lengths", "axis1"], ["lengths2"]),
             helper.make_node("Less", ["columns2", "lengths2"], ["valid"]),
             helper.make_node("GreaterOrEqual", ["columns2", "width"], ["new"]),
             helper.make_node("Or", ["valid", "new"], ["seen"]),
             helper.make_node("Cast", ["seen"], ["y"], to=parts.element)]
    inputs = [parts.indices("lengths"), parts.indices("width"), parts.indices("total")]
    return nodes, inputs, [parts.values("y", 2)], [parts.zero_i, parts.one_i, parts.axis0, parts.axis1]


def _gather(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Gather", ["x", "rows"], ["y"], axis=0)]
    return nodes, [parts.values("x", rank), parts.indices("rows")], [parts.values("y", rank)], []


def _concat(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Concat", ["a", "b"], ["y"], axis=0)]
    return nodes, [parts.values("a", rank), parts.values("b", rank)], [parts.values("y", rank)], []


def _identity(parts: _Parts, rank: int):
    from onnx import helper

    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    return nodes, [parts.values("x", rank)], [parts.values("y", rank)], []


_MOVES = {"zeros": _zeros, "relayout": _relayout, "move_rows": _move_rows, "write_row": _write_row,
          "set_lengths": _set_lengths, "mark": _mark, "move_columns": _move_columns, "valid_mask": _valid_mask,
          "gather": _gather, "concat": _concat, "identity": _identity}
