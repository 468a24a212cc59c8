"""Read the nodes of an ONNX file without the `onnx` package.

The cache mode depends on how the graph uses its attention mask, which onnxruntime's session
does not expose. An ONNX file is a protobuf `ModelProto`; this module walks just the fields it
needs (graph -> nodes -> op type, domain, inputs, outputs, subgraph attributes) and skips
everything else by length, so a 500 MB file with embedded weights is scanned without reading
its weights.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass, field
from pathlib import Path

# Field numbers of onnx.proto3 that we read.
_MODEL_GRAPH = 7
_GRAPH_NODE = 1
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP_TYPE, _NODE_ATTRIBUTE, _NODE_DOMAIN = 1, 2, 4, 5, 7
_ATTR_G, _ATTR_GRAPHS = 6, 11


@dataclass
class Node:
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[str]
    subgraph_nodes: list["Node"] = field(default_factory=list)


def _varint(buf, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _fields(buf, start: int, end: int):
    """Yield (field_number, start, end) of the length-delimited fields in buf[start:end]."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield number, pos, pos + length
            pos += length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")


def _graph_nodes(buf, start: int, end: int) -> list[Node]:
    return [_node(buf, s, e) for n, s, e in _fields(buf, start, end) if n == _GRAPH_NODE]


def _node(buf, start: int, end: int) -> Node:
    node = Node("", "", [], [])
    for number, s, e in _fields(buf, start, end):
        if number == _NODE_INPUT:
            node.inputs.append(bytes(buf[s:e]).decode())
        elif number == _NODE_OUTPUT:
            node.outputs.append(bytes(buf[s:e]).decode())
        elif number == _NODE_OP_TYPE:
            node.op_type = bytes(buf[s:e]).decode()
        elif number == _NODE_DOMAIN:
            node.domain = bytes(buf[s:e]).decode()
        elif number == _NODE_ATTRIBUTE:
            for a, gs, ge in _fields(buf, s, e):
                if a in (_ATTR_G, _ATTR_GRAPHS):
                    node.subgraph_nodes.extend(_graph_nodes(buf, gs, ge))
    return node


def read_nodes(path: str | Path) -> list[Node]:
    """All nodes of the model's main graph, each with the nodes of its subgraphs (If, Loop)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for number, start, end in _fields(buf, 0, len(buf)):
            if number == _MODEL_GRAPH:
                return _graph_nodes(buf, start, end)
    raise ValueError(f"{path}: no graph in this ONNX file")


def flatten(nodes: list[Node]) -> list[Node]:
    """The nodes and, recursively, the nodes of their subgraphs, in one list."""
    out: list[Node] = []
    for node in nodes:
        out.append(node)
        out.extend(flatten(node.subgraph_nodes))
    return out


_GRAPH_OUTPUT, _VALUE_INFO_NAME = 12, 1


def read_output_names(path: str | Path) -> list[str]:
    """The names of the main graph's outputs (what a task can read from it), without its weights."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for number, start, end in _fields(buf, 0, len(buf)):
            if number == _MODEL_GRAPH:
                return [bytes(buf[s:e]).decode() for n, gs, ge in _fields(buf, start, end) if n == _GRAPH_OUTPUT
                        for m, s, e in _fields(buf, gs, ge) if m == _VALUE_INFO_NAME]
    raise ValueError(f"{path}: no graph in this ONNX file")


def graphs(graph):
    """An onnx GraphProto and every subgraph in it (If branches, Loop bodies), depth first: what a
    rewrite of a loaded ModelProto walks (runtime.int8_rows, runtime.quantize)."""
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            for sub in ([attribute.g] if attribute.type == attribute.GRAPH else list(attribute.graphs)):
                yield from graphs(sub)


def default_opset(model, missing: int = 0) -> int:
    """The version of the default (ai.onnx) domain an onnx ModelProto imports; `missing` where it
    imports none (runtime.int8_rows, runtime.quantize, runtime.lora.rewrite)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), missing)
