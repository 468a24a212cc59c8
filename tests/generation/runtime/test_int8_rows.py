"""Int8 dynamic quantization per batch row (generation.runtime.int8_rows).

Invariants: after `rows_apart`, each row of a batch through DynamicQuantizeLinear -> MatMulInteger ->
Cast -> Mul(x_scale * w_scale) gives, bit for bit, what the graph as written gives that row alone
(one token per row, as a decode step, and several), where the graph as written gives the rows of
the same batch other values; a graph without DynamicQuantizeLinear (fp32 MatMul, q4 MatMulNBits) is
left as it was, and so is one whose DynamicQuantizeLinear is read outside that pattern (the reason
said). Served end to end, a mixed batch equals each prompt alone: test_support_layouts.py and
test_the_merged_int8_variants_rows_do_not_depend_on_the_batch below.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import generation
from generation.runtime.int8_rows import rows_apart

H, N = 16, 8


def _int8_graph(opset: int, extra_reader: bool = False):
    """Two projections of x [B, S, H] sharing one DynamicQuantizeLinear, as quantize_dynamic writes
    them: a weight zero point of 3 and a per-tensor weight scale, a zero point of 0 and per-column
    weight scales."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.integers(-128, 128, (H, N)).astype(np.int8), "W1"),
             numpy_helper.from_array(rng.integers(-128, 128, (H, N)).astype(np.int8), "W2"),
             numpy_helper.from_array(np.array(3, np.int8), "wzp1"),
             numpy_helper.from_array(np.array(0, np.int8), "wzp2"),
             numpy_helper.from_array(np.array(0.02, np.float32), "ws1"),
             numpy_helper.from_array(rng.uniform(0.005, 0.02, N).astype(np.float32), "ws2")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"]),
             helper.make_node("MatMulInteger", ["y", "W1", "z", "wzp1"], ["m1"]),
             helper.make_node("MatMulInteger", ["y", "W2", "z", "wzp2"], ["m2"]),
             helper.make_node("Cast", ["m1"], ["c1"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["m2"], ["c2"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["s", "ws1"], ["p1"]), helper.make_node("Mul", ["s", "ws2"], ["p2"]),
             helper.make_node("Mul", ["c1", "p1"], ["o1"]), helper.make_node("Mul", ["c2", "p2"], ["o2"])]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["B", "S", N]) for o in ("o1", "o2")]
    if extra_reader:  # the quantized activations read by something else than a MatMulInteger
        nodes.append(helper.make_node("Cast", ["y"], ["o3"], to=TensorProto.FLOAT))
        outputs.append(helper.make_tensor_value_info("o3", TensorProto.FLOAT, ["B", "S", H]))
    graph = helper.make_graph(nodes, "int8", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _rows(seq: int) -> np.ndarray:
    """[5, seq, H]: rows of very different ranges, one all positive, one all zeros (scale 1)."""
    rng = np.random.default_rng(seq)
    x = rng.normal(size=(5, seq, H)).astype(np.float32) * np.array([1, 40, 0.01, 3, 1], np.float32)[:, None, None]
    x[2] = np.abs(x[2])
    x[4] = 0
    return x


@pytest.mark.parametrize("seq", [1, 6])
@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_each_row_equals_the_graph_on_that_row_alone(opset, seq):
    original = _int8_graph(opset)
    rewritten = _int8_graph(opset)
    assert rows_apart(rewritten) == (1, None)
    assert "DynamicQuantizeLinear" not in {n.op_type for n in rewritten.graph.node}
    x = _rows(seq)
    exported, served = _session(original), _session(rewritten)
    batched = served.run(None, {"x": x})
    together = exported.run(None, {"x": x})
    for b in range(len(x)):
        alone = exported.run(None, {"x": x[b:b + 1]})
        for got, want in zip(batched, alone):
            np.testing.assert_array_equal(got[b:b + 1], want)
    # the graph as written: a row's values depend on the rows beside it
    assert not np.array_equal(together[0][:1], exported.run(None, {"x": x[:1]})[0])


def _fp32_graph():
    w = numpy_helper.from_array(np.ones((H, N), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["o"])], "fp32",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["B", "S", N])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _q4_graph():
    packed = numpy_helper.from_array(np.zeros((N, 1, 8), np.uint8), "Wq")
    scales = numpy_helper.from_array(np.ones(N, np.float32), "Ws")
    node = helper.make_node("MatMulNBits", ["x", "Wq", "Ws"], ["o"], domain="com.microsoft", K=H, N=N, bits=4,
                            block_size=16)
    graph = helper.make_graph([node], "q4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])],
                              [helper.make_tensor_value_info("o", TensorProto.FLOAT, ["B", "S", N])], [packed, scales])
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("make", [_fp32_graph, _q4_graph])
def test_a_graph_without_dynamic_quantization_is_untouched(make):
    model = make()
    before = model.SerializeToString()
    assert rows_apart(model) == (0, None)
    assert model.SerializeToString() == before


def test_dynamic_quantization_read_outside_the_pattern_is_untouched():
    model = _int8_graph(18, extra_reader=True)
    before = model.SerializeToString()
    count, reason = rows_apart(model)
    assert count == 0 and "its quantized output is read by Cast, not as a MatMulInteger's A" in reason
    assert model.SerializeToString() == before


def test_the_q4_and_fp32_decoders_load_as_they_were(test_models, caplog):
    """Through generation.load: only the int8 variant is rewritten (the log says so) and only its
    prompts run by length."""
    import logging

    with caplog.at_level(logging.INFO, logger="generation.runtime.session"):
        fp32 = generation.load(test_models["llama-merged"], threads=1, fuse=False)
        assert "quantizes its activations" not in caplog.text
        int8 = generation.load(test_models["llama-merged"], variant="quantized", threads=1, fuse=False)
    assert "decoder_model_merged_quantized.onnx quantizes its activations per batch row (18 " in caplog.text
    assert not fp32.graph.prompts_by_length and int8.graph.prompts_by_length


@pytest.mark.parametrize("fuse", [True, False])
def test_the_merged_int8_variants_rows_do_not_depend_on_the_batch(test_models, prompts_of, fuse):
    """Llama's merged `_quantized` (its projections in both If branches), as exported and fused:
    a mixed batch of prompts gives each row the tokens of its prompt alone."""
    model = generation.load(test_models["llama-merged"], variant="quantized", threads=1, fuse=fuse)
    prompts = prompts_of((1, 5, 11), seed=5)
    ctx = generation.context(model, max_new_tokens=16, min_new_tokens=16)
    rows = generation.generate(ctx, prompts, seeds=[0, 1, 2])
    assert rows == [generation.generate(ctx, [p], seeds=[0])[0] for p in prompts]
