"""The fused rewrite of gpt-oss (generation.runtime.fusion.families), on the support matrix's tiny
`gpt_oss` (model_builders.matrix: 4 experts, 2 per token, sinks, layer 0 windowed at 8, layer 1
global, YaRN factor 32) in its plain Optimum export (no position_ids: unfused it runs grow).

Invariants: the export loads as its fused graph in the in_place mode, each layer a
GroupQueryAttention with its window and the export's sinks (head_sink) and onnxruntime's MoE with
transformers' SwiGLU (alpha 1.702, clamp 7, up + 1, gate|up interleaved, top-2 softmax); the logits
are transformers' at every position of a prompt that crosses the window and after it; every row of
a batch of mixed lengths (whole or in pieces) gets the tokens transformers `generate` gives its
prompt alone; the sinks and the clamp change the answers (guards); a rewrite that drops the sinks,
the clamp or YaRN's attention factor, or windows the wrong layer, is refused by the probe and the
export runs as exported; the YaRN tables are transformers'; configs it cannot rewrite are named.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

import generation
from generation.runtime import fusion
from generation.runtime.fusion import families, rotary, weights

MAX_NEW = 24
LENGTHS = (1, 5, 11)
WINDOW = 8


@pytest.fixture(scope="module")
def paths():
    from model_builders.matrix import matrix_models

    return matrix_models()["gpt_oss"]  # (its Optimum export, its torch model)


@pytest.fixture(scope="module")
def oracle(paths):
    from conftest import Oracle

    return Oracle({"hf/gpt_oss": paths[1]})


@pytest.fixture(scope="module")
def fused(paths, load_model):
    return load_model(paths[0], fuse=True)


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


def _attrs(node) -> dict:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def test_it_loads_as_its_fused_graph(fused, paths):
    import onnx
    from onnx import numpy_helper

    assert fused.fused_from == paths[0] / "model.onnx" and fused.graph.native_mode == "in_place"
    graph = onnx.load(str(fused.decoder_path)).graph
    counts = {op: sum(n.op_type == op for n in graph.node) for op in (
        "GroupQueryAttention", "MoE", "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "TopK",
        "Softmax", "Clip", "Sigmoid")}
    assert counts == {"GroupQueryAttention": 2, "MoE": 2, "SimplifiedLayerNormalization": 1,
                      "SkipSimplifiedLayerNormalization": 4, "TopK": 0, "Softmax": 0, "Clip": 0, "Sigmoid": 0}
    assert len(graph.node) <= 32  # the export: 546 operators besides its constants
    inits = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    attention = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert [_attrs(n)["local_window_size"] for n in attention] == [WINDOW, -1]
    source = onnx.load(str(paths[0] / "model.onnx")).graph
    sinks = [numpy_helper.to_array(t).ravel() for t in source.initializer if list(t.dims) == [1, 4, 1, 1]]
    assert len(sinks) == 2 and all(len(n.input) == 12 for n in attention)
    for node, want in zip(attention, sinks):
        np.testing.assert_array_equal(inits[node.input[11]], want)  # head_sink
    for node in (n for n in graph.node if n.op_type == "MoE"):
        assert _attrs(node) == {"k": 2, "activation_type": b"swiglu", "swiglu_fusion": 1, "swiglu_limit": 7.0,
                                "activation_alpha": pytest.approx(1.702), "activation_beta": 1.0,
                                "normalize_routing_weights": 1, "use_sparse_mixer": 0}
        assert inits[node.input[2]].shape == (4, 256, 64) and inits[node.input[4]].shape == (4, 64, 128)
    assert inits["cos_cache"][0, 0] == pytest.approx(0.1 * np.log(32) + 1)  # YaRN's attention factor


def test_fused_logits_equal_transformers(fused, oracle):
    """A 13-token prompt's logits at every position (past the window of 8), then two decodes over
    the fused graph's own cache."""
    assert fused.fused_from is not None
    prompt = np.random.default_rng(3).integers(3, 1000, 13)
    prefill, *steps = fusion._run_probe(fused.session, fused.graph, prompt, steps=2)
    sequence = prompt.tolist() + [int(prefill[-1].argmax()), int(steps[0][-1].argmax())]
    want = oracle.logits("gpt_oss", sequence)
    np.testing.assert_allclose(prefill, want[:len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[0][0], want[len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[1][0], want[len(prompt) + 1], atol=1e-4)


@pytest.mark.parametrize("steps", ["whole", "pieces"])
def test_rows_of_mixed_lengths_equal_transformers_alone(fused, oracle, prompts, steps):
    assert fused.graph.native_mode == "in_place"  # rows of every length in one run
    ctx = generation.context(fused, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    expected = [oracle.greedy("gpt_oss", p, MAX_NEW, min_new_tokens=MAX_NEW) for p in prompts]
    assert rows == expected and len({tuple(r) for r in rows}) == len(prompts)


def _answer(oracle, prompt, change) -> list[int]:
    """transformers' greedy answer to `prompt` with `change(model)` applied to its modules."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(oracle.hf_dir("gpt_oss")).eval()
    change(model)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def _without_sinks(model):
    import torch

    for layer in model.model.layers:
        layer.self_attn.sinks.data.fill_(-torch.inf)


def _without_clamp(model):
    for layer in model.model.layers:
        layer.mlp.experts.limit = float("inf")


@pytest.mark.parametrize("change", [_without_sinks, _without_clamp])
def test_the_sinks_and_the_clamp_change_the_answers(oracle, prompts, change):
    """Guard: without its sinks, or without its experts' clamp, the same weights answer the
    11-token prompt otherwise."""
    assert _answer(oracle, prompts[2], change) != oracle.greedy("gpt_oss", prompts[2], MAX_NEW, min_new_tokens=MAX_NEW)


def _family_with(**changes):
    def changed(config):
        layout = families.family(config)
        if "limit" in changes:
            return dataclasses.replace(layout, experts=dataclasses.replace(layout.experts, limit=changes["limit"]))
        return dataclasses.replace(layout, **changes)
    return changed


@pytest.mark.parametrize("wrong", ["sinks dropped", "clamp dropped", "window on the global layer",
                                   "yarn's attention factor dropped"])
def test_a_wrong_rewrite_is_refused(paths, tmp_path, monkeypatch, caplog, wrong):
    """The probe compares the fused graph's logits with the export's: a rewrite that leaves out
    what gpt-oss adds is refused, and the export loads as exported (grow)."""
    monkeypatch.setenv("RAYMUTER_CACHE", str(tmp_path / "cache"))
    if wrong == "sinks dropped":
        read = weights.read_weights
        monkeypatch.setattr(weights, "read_weights", lambda *args: _dropped_sinks(read(*args)))
    elif wrong == "clamp dropped":
        monkeypatch.setattr(fusion, "family", _family_with(limit=None))
    elif wrong == "window on the global layer":
        monkeypatch.setattr(fusion, "family", _family_with(windows=(-1, WINDOW)))
    else:
        yarn = rotary._yarn
        monkeypatch.setattr(rotary, "_yarn", lambda *args: (yarn(*args)[0], 1.0))
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        model = generation.load(paths[0], threads=1, fuse=True)
    assert model.fused_from is None and model.graph.native_mode == "grow"
    assert any("runs unfused: the fused graph's logits differ" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def _dropped_sinks(read: weights.DecoderWeights) -> weights.DecoderWeights:
    for layer in read.layers:
        layer.sinks = None
    return read


@pytest.mark.parametrize("scaling", [
    dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
         original_max_position_embeddings=4096),  # gpt-oss's released config
    dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=64),  # truncated, default betas
    dict(rope_type="yarn", factor=4.0, mscale=1.0, mscale_all_dim=0.5, original_max_position_embeddings=128),
    dict(rope_type="yarn", factor=4.0, attention_factor=0.9),
])
def test_the_yarn_tables_are_transformers(scaling):
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = GptOssConfig(hidden_size=64, num_attention_heads=4, head_dim=64, max_position_embeddings=512,
                          rope_theta=150000.0, rope_scaling=scaling)
    positions = 300
    cos, sin = GptOssRotaryEmbedding(config)(torch.zeros(1), torch.arange(positions)[None])
    got_cos, got_sin = rotary.rope_tables(config.to_dict(), 64, positions)
    np.testing.assert_allclose(got_cos, cos[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(got_sin, sin[0].numpy(), atol=2e-5)


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=2), None),
    (dict(model_type="gpt_oss", hidden_act="gelu", attention_bias=True), None),  # GptOssExperts reads neither
    (dict(model_type="gpt_oss", num_local_experts=4, num_experts_per_tok=5),
     "num_experts_per_tok 5 is not an integer from 1 to num_local_experts (4)"),
    (dict(model_type="gpt_oss", num_local_experts=0), "num_local_experts 0 is not a positive integer"),
    (dict(model_type="phimoe"), "a mixture of experts routed by sparsemixer"),
])
def test_what_is_not_rewritten_is_named(config, reason):
    got = fusion.unsupported_config(config, "cpu")
    assert (got is None) if reason is None else (reason in got), got


@pytest.mark.parametrize("config,windows", [
    (dict(model_type="gpt_oss", num_hidden_layers=4, sliding_window=8), (8, -1, 8, -1)),  # GptOssConfig's filling
    (dict(model_type="gpt_oss", num_hidden_layers=2, sliding_window=8,
          layer_types=["full_attention", "sliding_attention"]), (-1, 8)),
    (dict(model_type="gpt_oss", num_hidden_layers=2, sliding_window=None), (-1, -1)),
])
def test_each_layer_gets_its_window(config, windows):
    assert families.layer_windows(config) == windows
