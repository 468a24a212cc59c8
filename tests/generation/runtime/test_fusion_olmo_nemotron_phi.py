"""The fused rewrite of OLMo, OLMo 2, Nemotron and Phi (generation.runtime.fusion.families), on
model_builders.families' tiny `olmo_clipped` (weightless LayerNorms, q/k/v clipped at 1.5),
`olmo2` (q/k norms over all heads, a norm after attention and after the MLP, none before),
`nemotron` (LayerNorm1p with biases, relu² MLP without a gate, 16 of 32 dimensions rotary) and
`phi` (attention and MLP side by side, biases everywhere, 16 of 32 rotary), and on the support
matrix's Nemotron and Phi (8 of 16 dimensions rotary: GroupQueryAttention rotates table halves
that are multiples of 8, so the rewrite lays each head's q / k dimensions out for it).

Invariants: each export loads as its fused graph in the in_place mode, with its family's norms,
clip and activation; every row of a batch of mixed lengths (whole or in pieces) gets the tokens
transformers `generate` gives its prompt alone, and the logits are transformers'; the clip changes
the answers (guard); a rewrite that leaves out what the family adds is refused by the probe, and
the export runs as exported; the laid-out rotation is transformers'.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import generation
from generation.runtime import fusion
from generation.runtime.fusion import emit, weights

MAX_NEW = 24
LENGTHS = (1, 5, 11)
FUSED = ["olmo_clipped", "olmo2", "nemotron", "phi"]


@pytest.fixture(scope="module")
def models():
    from model_builders.families import ensure_family_models

    return ensure_family_models()


@pytest.fixture(scope="module")
def matrix():
    from model_builders.matrix import matrix_models

    return matrix_models()


@pytest.fixture(scope="module")
def oracles(models, matrix):
    from conftest import Oracle

    return {"families": Oracle(models), "matrix": Oracle({f"hf/{a}": hf for a, (_, hf) in matrix.items()})}


@pytest.fixture(scope="module")
def fused(models, load_model):
    return {name: load_model(models[f"{name}-optimum"], fuse=True) for name in FUSED}


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


def _graph(model):
    import onnx

    return onnx.load(str(model.decoder_path)).graph


@pytest.mark.parametrize("name,ops", [
    ("olmo_clipped", {"LayerNormalization": 1, "SkipLayerNormalization": 4, "Clip": 2, "Sigmoid": 2}),
    ("olmo2", {"SimplifiedLayerNormalization": 8, "SkipSimplifiedLayerNormalization": 1, "Sigmoid": 2}),
    ("nemotron", {"LayerNormalization": 1, "SkipLayerNormalization": 4, "Relu": 2, "Sigmoid": 0}),
    ("phi", {"LayerNormalization": 1, "SkipLayerNormalization": 2, "FastGelu": 2, "Sigmoid": 0}),
])
def test_each_loads_as_its_fused_graph(fused, models, name, ops):
    model = fused[name]
    assert model.fused_from == models[f"{name}-optimum"] / "model.onnx" and model.graph.native_mode == "in_place"
    graph = _graph(model)
    counts = {op: sum(n.op_type == op for n in graph.node) for op in ops}
    assert counts == ops
    assert sum(n.op_type == "GroupQueryAttention" for n in graph.node) == 2


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("name", FUSED)
def test_rows_of_mixed_lengths_equal_transformers_alone(fused, oracles, prompts, name, steps):
    ctx = generation.context(fused[name], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    expected = [oracles["families"].greedy(name, p, MAX_NEW, min_new_tokens=MAX_NEW) for p in prompts]
    assert rows == expected and len({tuple(r) for r in rows}) == len(prompts)


@pytest.mark.parametrize("source,name", [("families", n) for n in FUSED] + [("matrix", "nemotron"), ("matrix", "phi")])
def test_fused_logits_equal_transformers(models, matrix, load_model, oracles, source, name):
    """A 13-token prompt's logits at every position, then two decodes over the fused graph's own
    cache (the matrix's Nemotron and Phi: 8 of 16 dimensions rotary, laid out for the operator)."""
    path = models[f"{name}-optimum"] if source == "families" else matrix[name][0]
    model = load_model(path, fuse=True)
    assert model.fused_from is not None
    prompt = np.random.default_rng(3).integers(3, 1000, 13)
    prefill, *steps = fusion._run_probe(model.session, model.graph, prompt, steps=2)
    sequence = prompt.tolist() + [int(prefill[-1].argmax()), int(steps[0][-1].argmax())]
    want = oracles[source].logits(name, sequence)
    np.testing.assert_allclose(prefill, want[:len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[0][0], want[len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[1][0], want[len(prompt) + 1], atol=1e-4)


def test_the_clip_changes_the_answers(oracles, prompts):
    """Guard: without clip_qkv the same OLMo weights answer the 11-token prompt otherwise."""
    import torch
    import transformers

    oracle = oracles["families"]
    model = transformers.AutoModelForCausalLM.from_pretrained(oracle.hf_dir("olmo_clipped"), clip_qkv=None).eval()
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, pad_token_id=0)
    assert out[0, ids.shape[1]:].tolist() != oracle.greedy("olmo_clipped", prompts[2], MAX_NEW, min_new_tokens=MAX_NEW)


def _weights_without(change):
    read = weights.read_weights

    def read_changed(*args):
        out = read(*args)
        change(out)
        return out
    return read_changed


def _no_norm_biases(w):
    w.norm_bias = None
    for layer in w.layers:
        layer.input_norm_bias = layer.post_norm_bias = None


def _no_output_norms(w):
    for layer in w.layers:
        layer.attention_output_norm = layer.mlp_output_norm = None


def _no_head_bias(w):
    w.lm_head.bias = None


@pytest.mark.parametrize("source,name,wrong", [
    ("families", "olmo_clipped", "no clip"),
    ("families", "olmo2", "no output norms"),
    ("families", "nemotron", "no norm biases"),
    ("families", "phi", "no lm_head bias"),
    ("matrix", "nemotron", "rotary dimensions as they are"),
    ("matrix", "phi", "rotary dimensions as they are"),
])
def test_a_wrong_rewrite_is_refused(models, matrix, tmp_path, monkeypatch, caplog, source, name, wrong):
    """The probe compares the fused graph's logits with the export's: a rewrite that leaves out
    what the family adds is refused, and the export loads as exported."""
    import dataclasses

    from generation.runtime.fusion import families

    monkeypatch.setenv("RAYMUTER_CACHE", str(tmp_path / "cache"))
    if wrong == "no clip":
        monkeypatch.setattr(fusion, "family", lambda config: dataclasses.replace(families.family(config), clip_qkv=0.0))
    elif wrong == "rotary dimensions as they are":  # the tables padded, the q / k dimensions not laid out
        monkeypatch.setattr(emit, "_reordered", lambda w, *args: w)
    else:
        change = {"no output norms": _no_output_norms, "no norm biases": _no_norm_biases,
                  "no lm_head bias": _no_head_bias}[wrong]
        monkeypatch.setattr(weights, "read_weights", _weights_without(change))
    path = models[f"{name}-optimum"] if source == "families" else matrix[name][0]
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        model = generation.load(path, threads=1, fuse=True)
    assert model.fused_from is None and model.graph.native_mode != "in_place"
    assert any("runs unfused: the fused graph's logits differ" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("head_dim,rotary", [(16, 8), (32, 8), (80, 24), (64, 32), (64, 64)])
def test_the_laid_out_rotation_is_transformers(head_dim, rotary):
    """GroupQueryAttention's rotation (pairs j, j + T over tables of T columns) of the laid-out q and
    k equals transformers' partial rotation (pairs j, j + r over its first 2r dimensions), laid out
    the same way; their products sum over the same pairs."""
    import torch
    from transformers.models.nemotron.modeling_nemotron import apply_rotary_pos_emb

    rng = np.random.default_rng(0)
    positions = 40
    freqs = np.arange(positions, dtype=np.float32)[:, None] * rng.uniform(0.01, 1, rotary // 2).astype(np.float32)
    cos, sin = np.cos(freqs), np.sin(freqs)
    table_cos, table_sin, order = emit.gqa_rotary(cos, sin, head_dim)
    assert table_cos.shape[1] % 8 == 0 and (order is None) == (rotary // 2 % 8 == 0)
    order = np.arange(head_dim) if order is None else order
    assert sorted(order) == list(range(head_dim))
    q, k = (rng.standard_normal((1, 1, positions, head_dim)).astype(np.float32) for _ in range(2))
    full_cos, full_sin = (torch.tensor(np.concatenate([t, t], axis=1))[None] for t in (cos, sin))
    want_q, want_k = (t.numpy()[..., order] for t in apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k),
                                                                          full_cos, full_sin))

    def gqa(x):  # onnxruntime's rotate-half over the first 2T dimensions
        t = table_cos.shape[1]
        a, b, rest = x[..., :t], x[..., t:2 * t], x[..., 2 * t:]
        return np.concatenate([a * table_cos - b * table_sin, b * table_cos + a * table_sin, rest], axis=-1)

    got_q, got_k = gqa(q[..., order]), gqa(k[..., order])
    np.testing.assert_allclose(got_q, want_q, atol=1e-5)
    np.testing.assert_allclose(got_k, want_k, atol=1e-5)
    np.testing.assert_allclose(got_q @ got_k.swapaxes(-1, -2), (want_q @ want_k.swapaxes(-1, -2)), atol=1e-4)


def test_a_rotation_the_heads_cannot_hold_is_named():
    cos = np.ones((4, 12), np.float32)
    with pytest.raises(fusion.FusionError, match="24 rotary dimensions of 24: GroupQueryAttention rotates a multiple"):
        emit.gqa_rotary(cos, cos, 24)


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="olmo2"), None),
    (dict(model_type="olmo", clip_qkv=8.0), None),
    (dict(model_type="phi", qk_layernorm=True), "qk_layernorm is true: Phi's per-head LayerNorms"),
    (dict(model_type="nemotron", hidden_act="silu"), "hidden_act 'silu' is not relu2"),
    (dict(model_type="phi", hidden_act="relu"), "hidden_act 'relu' is not gelu_new or gelu_pytorch_tanh or gelu"),
    (dict(model_type="olmo", attention_bias=True), "attention_bias is true"),
])
def test_what_is_not_rewritten_is_named(config, reason):
    got = fusion.unsupported_config(config, "cpu")
    assert (got is None) if reason is None else (reason in got), got
