"""The LM head only where logits are read.

A prompt's run reads one row of logits per prompt (its last token's), yet a decoder graph
computes the LM head at every position: [n, S, vocab] floats, the largest tensor the run writes
(a 32-token prefill of SmolLM2-135M, vocabulary 49152, takes 0.83-0.85x the time without it). At load,
`head_positions` gives the decoder a `logits_positions` input [n, P]: a GatherND picks those
positions of the hidden states before the LM head, so logits are [n, P, vocab]. Feeding every
position (what `feeds.step_inputs` does unless told) gives the graph's logits unchanged; a
prompt's run feeds its last position, a decode step position 0.

The rewrite is made in memory at each load (the graph without its weights, milliseconds), so
nothing is cached: the session reads the weights from the source's folder.
"""

from __future__ import annotations

from pathlib import Path

POSITIONS = "logits_positions"
# row-wise in their first input: gathering rows first changes nothing (runtime.quantize's int8
# projections take each token's own scale, so they are too)
_HEADS = ("MatMul", "MatMulNBits", "QuantizedMatMul")
#: elementwise after the head, with scalar constants (Gemma 2's soft-cap: Mul(Tanh(Div(logits, c)), c)):
#: gathering rows before the head gives the rows they would have picked
_ELEMENTWISE = ("Tanh", "Div", "Mul", "Add", "Sub")


def head_positions(source: Path | object):
    """(ModelProto with the `logits_positions` input, None), or (None, why not) where the graph's
    logits are not a MatMul of [n, S, hidden] hidden states: at the top of the graph, or in each
    branch of a merged decoder's If (its branches see the input from the outer graph). Refused:
    a quantized head whose activation scale spans every position (DynamicQuantizeLinear), a bias
    or a cast after the MatMul (elementwise operators with scalar constants may follow it: a
    soft-cap). source: the decoder's file, or its ModelProto (without weights; a copy is changed)."""
    import onnx
    from onnx import TensorProto, helper

    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
    else:
        model = onnx.load(str(source), load_external_data=False)
    graph = model.graph
    if not any(o.domain in ("", "ai.onnx") and o.version >= 13 for o in model.opset_import):
        return None, "its opset is older than 13 (Unsqueeze takes its axes as an input from 13)"
    if any(i.name == POSITIONS for i in graph.input):
        return None, f"it already takes {POSITIONS}"
    output = next((o for o in graph.output if o.name == "logits"), None)
    if output is None or len(output.type.tensor_type.shape.dim) != 3:
        return None, "its logits are not [batch, sequence, vocab]"
    reason = _cut(graph, "logits", [0])
    if reason:
        return None, reason
    graph.input.append(helper.make_tensor_value_info(POSITIONS, TensorProto.INT64, ["batch_size", "logits_length"]))
    return model, None


def _cut(graph, name: str, count: list) -> str | None:
    """Put the GatherND before the MatMul that makes `name` in `graph`, or in both branches of
    the If that makes it; the reason where neither. `count`: the cuts made so far (names)."""
    from onnx import TensorProto, helper

    head = next((n for n in graph.node if name in n.output), None)
    tail = _elementwise_input(graph, head)
    if tail is not None:
        return _cut(graph, tail, count)
    if head is not None and head.op_type == "If":
        at = list(head.output).index(name)
        for attribute in head.attribute:
            branch = attribute.g
            reason = _cut(branch, branch.output[at].name, count)
            if reason:
                return f"{reason} (in the If's {attribute.name})"
        return None
    if head is None or head.op_type not in _HEADS or head.domain not in ("", "com.microsoft", "raymuter"):
        return f"its logits come from {head.op_type if head else 'no node'}, not a MatMul"
    if head.input[0] in {w.name for w in graph.initializer}:
        return "its LM head multiplies the weights by the hidden states, not the hidden states by the weights"
    count[0] += 1
    prefix = f"/logits_positions{count[0]}"
    axes = helper.make_tensor(f"{prefix}/axes_value", TensorProto.INT64, [1], [-1])
    nodes = [helper.make_node("Constant", [], [f"{prefix}/axes"], name=f"{prefix}/Constant", value=axes),
             helper.make_node("Unsqueeze", [POSITIONS, f"{prefix}/axes"], [f"{prefix}/index"],
                              name=f"{prefix}/Unsqueeze"),
             helper.make_node("GatherND", [head.input[0], f"{prefix}/index"], [f"{prefix}/hidden"],
                              name=f"{prefix}/GatherND", batch_dims=1)]
    at = list(graph.node).index(head)
    head.input[0] = f"{prefix}/hidden"
    for node in reversed(nodes):
        graph.node.insert(at, node)
    return None


def _elementwise_input(graph, node) -> str | None:
    """The one varying input of `node` where it is elementwise (_ELEMENTWISE) over it and scalar
    constants and nothing else reads that input; else None."""
    if node is None or node.op_type not in _ELEMENTWISE or node.domain not in ("", "ai.onnx"):
        return None
    scalars = {t.name for t in graph.initializer if not list(t.dims) or list(t.dims) == [1]}
    scalars |= {n.output[0] for n in graph.node if n.op_type == "Constant" and n.attribute
                and n.attribute[0].name in ("value", "value_float") and not list(n.attribute[0].t.dims)}
    varying = [name for name in node.input if name not in scalars]
    if len(varying) != 1 or sum(varying[0] in n.input for n in graph.node) != 1:
        return None
    return varying[0]
