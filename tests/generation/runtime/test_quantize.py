"""Int8 matrix products made at load (generation.runtime.quantize) and the precision choice
(generation.runtime.precision).

Invariants: a QuantizedMatMul's token rows depend on nothing but their own hidden state, so a
batch's rows equal each row alone bit for bit, whatever the rows beside it, the padding or the
chunking; through generation.load(precision='int8'), in every layout (onnxruntime-genai, the
fused rewrite, an Optimum export as exported, a transformers.js merged decoder with If branches),
a mixed batch gives each prompt the tokens it gets alone, greedy, seeded sampling and beams, and
chunked prompts give what whole prompts give. Against transformers in float32 the int8 rows stay
within int8's error: every token chosen greedy is within TOLERANCE of the best logit of
transformers teacher-forced on the row (a misplaced weight moves logits by O(1)).
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import generation
from generation.engine.scheduler import Scheduler
from generation.runtime.onnx_graph import graphs
from generation.runtime.precision import MIN_INT8_BYTES, choose
from generation.runtime.quantize import DOMAIN, FUNCTION, quantize_graph, quantize_weight, smoothing

H, N = 24, 40
# int8 on the tiny random Llama (its logits close together: 31 of the 40 rows below part from
# float32's somewhere in 12 tokens): a chosen token's logit sits up to 14.5% of the step's largest
# |logit| below transformers' float32 best (90% of rows within 8.6%; 7.3% unsmoothed: random
# weights have no outlier channels for SmoothQuant to move); 25%, against the O(1) of a misplaced
# weight or scale
TOLERANCE = 0.25
NEW = 12
LAYOUTS = {"genai": ("llama-genai", True), "fused": ("llama-optimum", True), "optimum": ("llama-optimum", False),
           "merged": ("llama-merged", False)}


def _projections(opset: int = 21):
    """x [B, S, H] -> two projections sharing one weight, and a third of its own, plus a MatMul of
    two activations (left as it is)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(H, N)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.normal(size=(N, H)).astype(np.float32) * 0.1, "V")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("MatMul", ["x", "W"], ["b"]),
             helper.make_node("Add", ["a", "b"], ["c"]), helper.make_node("MatMul", ["c", "V"], ["y"]),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["x", "xt"], ["gram"])]
    graph = helper.make_graph(nodes, "proj", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", H])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", H]),
                               helper.make_tensor_value_info("gram", TensorProto.FLOAT, ["B", "S", "S"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _session(model):
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def test_a_weight_quantizes_per_column_within_half_a_step():
    rng = np.random.default_rng(1)
    weight = rng.normal(size=(64, 9)).astype(np.float32) * np.linspace(0.01, 30, 9, dtype=np.float32)
    weight[:, 4] = 0
    w, scale = quantize_weight(weight)
    assert w.dtype == np.int8 and scale.shape == (9,) and scale[4] == 1 and np.abs(w).max() == 127
    assert (np.abs(weight - w * scale) <= scale / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("opset", [13, 17, 18, 21])
def test_each_token_row_equals_that_row_alone_and_stays_near_float32(opset):
    model = _projections(opset)
    exact = _session(model)
    assert quantize_graph(model) == 3
    assert [n.op_type for n in model.graph.node].count(FUNCTION) == 3
    assert "W" not in {t.name for t in model.graph.initializer}  # read only by the rewritten MatMuls
    assert "MatMul" in {n.op_type for n in model.graph.node}  # x @ x^T: no weight, left as it was
    served = _session(model)
    rng = np.random.default_rng(opset)
    x = rng.normal(size=(5, 7, H)).astype(np.float32) * np.array([1, 40, 0.01, 3, 1], np.float32)[:, None, None]
    x[4] = 0  # an all-zero row (padding): scale from the floor, output 0
    y = served.run(["y"], {"x": x})[0]
    for b in range(5):
        for s in (0, 3, 6):  # a token alone: another batch, another length, another position
            alone = served.run(["y"], {"x": x[b:b + 1, s:s + 1]})[0]
            np.testing.assert_array_equal(y[b:b + 1, s:s + 1], alone)
    want = exact.run(["y"], {"x": x})[0]
    scale = np.abs(want).max(axis=-1, keepdims=True) + 1e-30
    assert (np.abs(y - want) / scale).max() < 0.03
    assert not y[4].any()


def _normed(gamma_readers: int = 0):
    """h [B, S, H] -> x = h * gamma (an RMS norm's last step, as an Optimum export writes it) ->
    two projections of x; `gamma_readers` more readers of x than projections (a Transpose)."""
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(rng.uniform(0.5, 1.5, H).astype(np.float32), "gamma"),
             numpy_helper.from_array(rng.normal(size=(H, N)).astype(np.float32), "Wq"),
             numpy_helper.from_array(rng.normal(size=(H, N)).astype(np.float32) * 3, "Wk")]
    nodes = [helper.make_node("Mul", ["h", "gamma"], ["x"]), helper.make_node("MatMul", ["x", "Wq"], ["q"]),
             helper.make_node("MatMul", ["x", "Wk"], ["k"])]
    outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, ["B", "S", N]) for o in ("q", "k")]
    if gamma_readers:
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 2, 1]))
        outputs.append(helper.make_tensor_value_info("xt", TensorProto.FLOAT, ["B", H, "S"]))
    graph = helper.make_graph(nodes, "normed", [helper.make_tensor_value_info("h", TensorProto.FLOAT, ["B", "S", H])],
                              outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def test_smoothing_moves_outlier_channels_into_the_weights_and_keeps_the_product():
    """SmoothQuant: with the input's channel ranges, (x / s) @ (s W) is x @ W, folded into the norm's
    scale; int8 per token then loses less where a few channels of x are 50x the rest."""
    rng = np.random.default_rng(3)
    h = rng.normal(size=(5, 7, H)).astype(np.float32)
    h[..., [2, 11]] *= 50  # outlier channels, as LLMs' activations have
    exact_model = _normed()
    gamma = numpy_helper.to_array(exact_model.graph.initializer[0])
    ranges = {"x": np.abs((h * gamma).reshape(-1, H)).max(axis=0)}
    weights = [numpy_helper.to_array(t) for t in exact_model.graph.initializer[1:]]
    s = smoothing(ranges["x"], np.max([np.abs(w).max(axis=1) for w in weights], axis=0))
    assert s.shape == (H,) and s[2] > 3 * np.median(s) and s[11] > 3 * np.median(s)
    exact = _session(exact_model).run(["q", "k"], {"h": h})
    errors = {}
    for smoothed in (False, True):
        model = _normed()
        assert quantize_graph(model, ranges if smoothed else None) == 2
        said = next(p.value for p in model.metadata_props if p.key == "raymuter.int8")
        assert said == f"2 projections, {int(smoothed)} inputs smoothed (alpha 0.5)"
        folded = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "gamma"))
        np.testing.assert_allclose(folded, gamma / s if smoothed else gamma, rtol=1e-6)
        served = _session(model)
        got = served.run(["q", "k"], {"h": h})
        for b in range(5):  # still one token at a time
            alone = served.run(["q", "k"], {"h": h[b:b + 1, 2:3]})
            for y, y1 in zip(got, alone):
                np.testing.assert_array_equal(y[b:b + 1, 2:3], y1)
        errors[smoothed] = float(np.mean([np.abs(y - e).mean() / np.abs(e).mean() for y, e in zip(got, exact)]))
    assert errors[True] < 0.5 * errors[False], errors


def test_an_input_read_by_more_than_projections_is_not_smoothed():
    model = _normed(gamma_readers=1)
    assert quantize_graph(model, {"x": np.full(H, 3, np.float32)}) == 2
    assert next(p.value for p in model.metadata_props if p.key == "raymuter.int8").startswith("2 projections, 0 inputs")


def test_a_graph_without_float32_weights_is_not_rewritten():
    model = _projections()
    for t in model.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    before = model.SerializeToString()
    assert quantize_graph(model) == 0
    assert model.SerializeToString() == before


@pytest.fixture(scope="module")
def int8_models(test_models, tmp_path_factory):
    """name -> the tiny Llama of that layout at int8 (built into this module's own cache)."""
    import os

    cache = tmp_path_factory.mktemp("raymuter-cache")
    before = os.environ.get("RAYMUTER_CACHE")
    os.environ["RAYMUTER_CACHE"] = str(cache)
    try:
        models = {name: generation.load(test_models[folder], threads=1, fuse=fuse, precision="int8")
                  for name, (folder, fuse) in LAYOUTS.items()}
    finally:
        if before is None:
            os.environ.pop("RAYMUTER_CACHE")
        else:
            os.environ["RAYMUTER_CACHE"] = before
    return models


def test_every_layout_loads_its_int8_rewrite(int8_models):
    for name, model in int8_models.items():
        assert model.precision == "int8" and model.precision_reason == "asked for"
        assert model.decoder_path.parent.parent.name == "quantized"
        graph = onnx.load(str(model.decoder_path), load_external_data=False)
        assert any(f.domain == DOMAIN and f.name == FUNCTION for f in graph.functions)
        assert (model.fused_from is not None) == (name == "fused")
        kinds = {n.op_type for g in graphs(graph.graph) for n in g.node if n.domain == DOMAIN}
        assert kinds == {FUNCTION}, (name, kinds)
        said = next(p.value for p in graph.metadata_props if p.key == "raymuter.int8")
        # calibrated and smoothed where the projections sit in the top graph and an RMS norm makes
        # their input (genai and fused: q/k/v, gate/up and the LM head's, 2 a layer + 1; the Optimum
        # export's decomposed norms: where its last Mul reads the scale); a merged decoder's If
        # branches are not read by the calibration run, so they quantize unsmoothed
        smoothed = int(said.split(", ")[1].split()[0])
        want = {"genai": 2 * model.config["num_hidden_layers"] + 1, "fused": 2 * model.config["num_hidden_layers"] + 1,
                "merged": 0}
        assert smoothed == want[name] if name in want else smoothed > 0, said
        assert model.graph.has_logits_positions  # runtime.head gathers before the int8 LM head too
    assert int8_models["genai"].graph.native_mode == "in_place" and int8_models["fused"].graph.native_mode == "in_place"
    assert int8_models["optimum"].graph.native_mode == "append"


def test_a_second_load_reads_the_cache(test_models, int8_models, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RAYMUTER_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="generation.runtime.quantize"):
        first = generation.load(test_models["llama-genai"], threads=1, precision="int8")
        assert "quantizing" in caplog.text
        caplog.clear()
        again = generation.load(test_models["llama-genai"], threads=1, precision="int8")
    assert "quantizing" not in caplog.text and "runs as its int8 rewrite" in caplog.text
    assert again.decoder_path == first.decoder_path


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_mixed_batch_gives_each_prompt_its_tokens_alone(int8_models, prompts_of, name):
    model = int8_models[name]
    prompts = prompts_of((1, 5, 11, 3), seed=5)
    for settings in (dict(do_sample=False), dict(do_sample=True, temperature=1.3, top_k=0)):
        ctx = generation.context(model, max_new_tokens=10, min_new_tokens=10, **settings)
        rows = generation.generate(ctx, prompts, seeds=[0, 1, 2, 3])
        assert rows == [generation.generate(ctx, [p], seeds=[s])[0] for s, p in enumerate(prompts)], settings


def test_beams_of_a_mixed_batch_equal_each_prompt_alone(int8_models, prompts_of):
    ctx = generation.context(int8_models["genai"], max_new_tokens=8, num_beams=3, eos_token_id=[])
    prompts = prompts_of((2, 9), seed=6)
    assert generation.generate(ctx, prompts) == [generation.generate(ctx, [p])[0] for p in prompts]


@pytest.mark.parametrize("name", ["genai", "optimum"])
def test_prompts_in_chunks_give_what_whole_prompts_give(int8_models, prompts_of, name):
    ctx = generation.context(int8_models[name], max_new_tokens=6, eos_token_id=[])
    prompts = prompts_of((23, 4, 17), seed=7)
    whole = generation.generate(ctx, prompts)
    scheduler = Scheduler(ctx, 3, 64, prefill_chunk_tokens=5)
    jobs = [scheduler.job(p) for p in prompts]
    for job in jobs:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    assert [job.tokens for job in jobs] == whole


def test_int8_rows_stay_within_int8_error_of_transformers(int8_models, oracle, prompts_of):
    import torch

    hf = oracle.model("llama")
    prompts = prompts_of([int(n) for n in np.random.default_rng(1).integers(1, 30, 40)], seed=2)
    ctx = generation.context(int8_models["genai"], max_new_tokens=NEW, eos_token_id=[])
    rows = generation.generate(ctx, prompts)
    for prompt, row in zip(prompts, rows):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + row[:-1]])).logits[0, len(prompt) - 1:].numpy()
        chosen = logits[np.arange(NEW), row]
        below = (logits.max(axis=1) - chosen) / np.abs(logits).max(axis=1)
        assert below.max() <= TOLERANCE, (prompt, row, below)


def test_int8_is_refused_where_it_does_not_apply(test_models):
    with pytest.raises(generation.ModelError, match="no MatMul with a float32 weight"):
        generation.load(test_models["llama-merged"], variant="quantized", fuse=False, precision="int8")
    with pytest.raises(generation.ModelError, match="precision must be one of auto, fp32, fp16, int8, not 'bf16'"):
        generation.load(test_models["llama-genai"], precision="bf16")


VNNI = frozenset({"avx2", "avx512f", "avx512_vnni"})


@pytest.mark.parametrize("flags, weights, provider, want, said", [
    (VNNI, MIN_INT8_BYTES, "cpu", "int8", "this CPU has avx512_vnni"),
    (frozenset({"avx2", "avx_vnni"}), 2 * MIN_INT8_BYTES, "cpu", "int8", "this CPU has avx_vnni"),
    (frozenset({"amx_int8", "avx512_vnni"}), 2 * MIN_INT8_BYTES, "cpu", "int8", "this CPU has amx_int8"),
    (frozenset({"avx2", "fma"}), 2 * MIN_INT8_BYTES, "cpu", "fp32", "no int8 dot-product instructions"),
    (VNNI, MIN_INT8_BYTES - 1, "cpu", "fp32", "below the 64 MiB"),
    (VNNI, 0, "cpu", None, "no float32 MatMul weights"),
    (VNNI, 2 * MIN_INT8_BYTES, "cuda", None, "on CUDA"),
])
def test_auto_picks_int8_where_the_cpu_has_int8_dot_products_and_the_weights_are_large(flags, weights, provider,
                                                                                       want, said):
    choice = choose("auto", provider, None, flags=flags, weight_bytes=weights)
    assert choice.precision == want and said in choice.reason


def test_an_asked_precision_is_kept_and_a_wrong_one_named():
    assert choose("fp32", "cpu", None, flags=VNNI, weight_bytes=2 * MIN_INT8_BYTES).precision == "fp32"
    assert choose(None, "cpu", None).precision is None
    with pytest.raises(ValueError, match="precision: one of auto, fp32, fp16, int8, not 'int4'"):
        choose("int4", "cpu", None)


def test_auto_counts_the_matmul_weights_of_the_file(test_models):
    tiny = choose("auto", "cpu", test_models["llama-genai"] / "model.onnx", flags=VNNI)
    assert tiny.precision == "fp32" and "MiB, below the 64 MiB" in tiny.reason


def test_slots_and_the_prefix_cache_change_no_token(int8_models, prompts_of):
    """Jobs joining running rows in free slots, with the prefix store on (a shared system prompt),
    give each job what it gets alone: greedy, seeded sampling and beams, log-probabilities too."""
    system = prompts_of([40], seed=8)[0]
    prompts = [system + [11, 12, 13], system + [21, 22], system[:20], [7, 8, 9], system + [11, 12, 13]]
    kinds = [dict(), dict(do_sample=True, temperature=0.9), dict(num_beams=3)]
    ctx = generation.context(int8_models["genai"], max_new_tokens=8, token_logprobs=True)
    scheduler = Scheduler(ctx, 6, 128, prefix_cache_bytes=2**24)
    jobs = [scheduler.job(p, seed=i, settings=kinds[i % 3]) for i, p in enumerate(prompts)]
    for job in jobs:
        scheduler.add(job)
        scheduler.step()
    while scheduler.busy:
        scheduler.step()
    assert sum(job.cached_tokens for job in jobs) > 0
    for i, (job, prompt) in enumerate(zip(jobs, prompts)):
        only = Scheduler(ctx, 3, 128)
        alone = only.job(prompt, seed=i, settings=kinds[i % 3])
        only.add(alone)
        while only.busy:
            only.step()
        assert job.tokens == alone.tokens, i
        np.testing.assert_allclose(job.logprobs, alone.logprobs, atol=1e-4)
