"""The fused rewrite of Gemma 2, Gemma 3 and SmolLM3 (generation.runtime.fusion.families), on
model_builders.families' tiny `gemma2_capped` (scores capped at 1 and logits at 2, exported from
eager attention, the one transformers 4.57 caps scores in; scores scaled by 32 ** -0.5),
`gemma3_scaled` (local layer: rotary base 100; global layer: base 1e6 with linear scaling 8;
logits capped at 3) and `smollm3_window` (layer 1 without rotary embedding, windowed); window 8.
Their plain Optimum exports (sdpa: scores uncapped) are in the support matrix
(families/test_support_matrix.py).

Invariants: each export loads as its fused graph in the in_place mode, each layer with its window,
rotary table and cap on the scores; every row of a batch of mixed lengths (whole or in pieces)
gets the tokens transformers `generate` gives its prompt alone, and the logits are transformers'
(eager attention for gemma2_capped); the caps and the rotary tables change the answers (guards);
a rewrite that leaves one of them out is refused by the probe, and the export runs as exported.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

import generation
from generation.runtime import fusion
from generation.runtime.fusion import families, weights

MAX_NEW = 24
LENGTHS = (1, 5, 11)
# fixture folder, oracle model
FUSED = [("gemma2_capped-optimum", "gemma2_capped"), ("gemma3_scaled-optimum", "gemma3_scaled"),
         ("smollm3_window-optimum", "smollm3_window")]
EAGER = ("gemma2_capped",)


@pytest.fixture(scope="module")
def models():
    from model_builders.families import ensure_family_models

    return ensure_family_models()


@pytest.fixture(scope="module")
def oracle(models):
    from conftest import Oracle

    return Oracle(models, eager=EAGER)


@pytest.fixture(scope="module")
def fused(models, load_model):
    return {folder: load_model(models[folder], fuse=True) for folder, _ in FUSED}


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


def _attention_nodes(model):
    import onnx

    return [n for n in onnx.load(str(model.decoder_path), load_external_data=False).graph.node
            if n.op_type == "GroupQueryAttention"]


@pytest.mark.parametrize("folder,windows,softcaps,tables", [
    ("gemma2_capped-optimum", [8, -1], [1.0, 1.0], ["cos_cache", "cos_cache"]),
    ("gemma3_scaled-optimum", [8, -1], [0.0, 0.0], ["cos_cache_local", "cos_cache"]),
    ("smollm3_window-optimum", [-1, 8], [0.0, 0.0], ["cos_cache", None]),
])
def test_each_loads_as_its_fused_graph(fused, models, folder, windows, softcaps, tables):
    from onnx import helper

    model = fused[folder]
    assert model.fused_from == models[folder] / "model.onnx" and model.graph.native_mode == "in_place"
    assert model.graph.has_logits_positions  # the LM head cut before the logits' cap too (runtime.head)
    nodes = _attention_nodes(model)
    attrs = [{a.name: helper.get_attribute_value(a) for a in n.attribute} for n in nodes]
    assert [a["local_window_size"] for a in attrs] == windows
    assert [a.get("softcap", 0.0) for a in attrs] == softcaps
    assert [n.input[7] if len(n.input) > 7 else None for n in nodes] == tables
    assert [a["do_rotary"] for a in attrs] == [int(t is not None) for t in tables]


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("folder,name", FUSED, ids=[n for _, n in FUSED])
def test_rows_of_mixed_lengths_equal_transformers_alone(fused, oracle, prompts, folder, name, steps):
    ctx = generation.context(fused[folder], max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    expected = [oracle.greedy(name, p, MAX_NEW, min_new_tokens=MAX_NEW) for p in prompts]
    assert rows == expected and len({tuple(r) for r in rows}) == len(prompts)


@pytest.mark.parametrize("folder,name,cap", [("gemma2_capped-optimum", "gemma2_capped", 2.0),
                                             ("gemma3_scaled-optimum", "gemma3_scaled", 3.0),
                                             ("smollm3_window-optimum", "smollm3_window", None)])
def test_fused_logits_equal_transformers(fused, oracle, folder, name, cap):
    """A 13-token prompt's logits at every position (past the window), then two decodes over the
    fused graph's own cache; the capped ones within their cap."""
    prompt = np.random.default_rng(3).integers(3, 1000, 13)
    model = fused[folder]
    prefill, *steps = fusion._run_probe(model.session, model.graph, prompt, steps=2)
    sequence = prompt.tolist() + [int(prefill[-1].argmax()), int(steps[0][-1].argmax())]
    want = oracle.logits(name, sequence)
    np.testing.assert_allclose(prefill, want[:len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[0][0], want[len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[1][0], want[len(prompt) + 1], atol=1e-4)
    if cap is not None:
        assert np.abs(prefill).max() <= cap


@pytest.mark.parametrize("fuse", [True, False])
def test_a_capped_head_computes_the_positions_read(models, load_model, fuse):
    """runtime.head cuts the LM head before the cap's Div, Tanh and Mul (the fused graph's and
    the export's): fed some positions, the logits are those rows of every position's."""
    model = load_model(models["gemma2_capped-optimum"], fuse=fuse)
    assert model.graph.has_logits_positions
    prompt = np.random.default_rng(1).integers(3, 1000, 9)
    every = fusion._run_probe(model.session, model.graph, prompt, steps=0)[0]
    names = {i.name for i in model.session.get_inputs()}
    feeds = {"input_ids": prompt[None, :], "attention_mask": np.ones((1, 9), np.int64),
             "logits_positions": np.array([[8, 3]])}
    if "position_ids" in names:
        feeds["position_ids"] = np.arange(9)[None, :]
    for entry in model.graph.cache:
        feeds[entry.past] = np.zeros((1, entry.heads, 0, entry.head_dim), np.float32)
    picked = model.session.run(["logits"], {k: v for k, v in feeds.items() if k in names})[0]
    np.testing.assert_allclose(picked[0], every[[8, 3]], atol=1e-5)


def _transformers_greedy(hf_dir, prompt, **overrides) -> list[int]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, **overrides).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             min_new_tokens=MAX_NEW, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name,overrides", [
    ("gemma2_capped", dict(attn_implementation="sdpa")),  # sdpa ignores the cap on the scores
    ("gemma2_capped", dict(attn_implementation="eager", attn_logit_softcapping=None)),
    ("gemma3_scaled", dict(rope_local_base_freq=1e6)),  # the local layer on the global base
    ("gemma3_scaled", dict(rope_scaling=None)),  # the global layer unscaled
    ("smollm3_window", dict(no_rope_layers=[1, 1])),  # rotary on every layer
    ("smollm3_window", dict(layer_types=["full_attention"] * 2)),  # no window
])
def test_what_each_family_adds_changes_the_answers(oracle, prompts, name, overrides):
    """Guard: without it the same weights answer the 11-token prompt otherwise."""
    expected = oracle.greedy(name, prompts[2], MAX_NEW, min_new_tokens=MAX_NEW)
    assert _transformers_greedy(oracle.hf_dir(name), prompts[2], **overrides) != expected


def test_the_logits_cap_binds(oracle, prompts):
    """Guard: uncapped, gemma2_capped's logits reach past its cap of 2 (a cap never changes a
    greedy token: the logits test above is what sees it)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        oracle.hf_dir("gemma2_capped"), attn_implementation="eager", final_logit_softcapping=None).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompts[2]])).logits
    assert float(logits.abs().max()) > 4.0


def _wrong_rotary(config):
    return ("global",) * int(config["num_hidden_layers"])


@pytest.mark.parametrize("folder,wrong", [
    ("gemma2_capped-optimum", "scores uncapped"),
    ("gemma2_capped-optimum", "logits uncapped"),
    ("gemma2_capped-optimum", "no output norms"),
    ("gemma3_scaled-optimum", "one rotary table"),
    ("smollm3_window-optimum", "one rotary table"),
])
def test_a_wrong_rewrite_is_refused(models, tmp_path, monkeypatch, caplog, folder, wrong):
    """The probe compares the fused graph's logits with the export's: a rewrite that leaves out
    what the family adds is refused, and the export loads as exported."""
    monkeypatch.setenv("RAYMUTER_CACHE", str(tmp_path / "cache"))
    if wrong == "scores uncapped":
        monkeypatch.setattr(weights, "_capped", lambda *args: 0)
    elif wrong == "logits uncapped":
        monkeypatch.setattr(fusion, "family", lambda config: dataclasses.replace(families.family(config),
                                                                                 logits_softcap=0.0))
    elif wrong == "no output norms":
        read = weights.read_weights

        def without_norms(*args):
            out = read(*args)
            for layer in out.layers:
                layer.attention_output_norm = layer.mlp_output_norm = None
            return out
        monkeypatch.setattr(weights, "read_weights", without_norms)
    else:
        monkeypatch.setattr(families, "layer_rotary", _wrong_rotary)
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        model = generation.load(models[folder], threads=1, fuse=True)
    assert model.fused_from is None and model.graph.native_mode != "in_place"
    assert any("runs unfused: the fused graph's logits differ" in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


@pytest.mark.parametrize("kind,kwargs", [
    ("Gemma2Config", {}),
    ("Gemma3TextConfig", {}),
    ("Gemma3TextConfig", dict(sliding_window_pattern=3)),
    ("SmolLM3Config", dict(use_sliding_window=True)),
    ("SmolLM3Config", dict(use_sliding_window=True, no_rope_layer_interval=3)),
    ("SmolLM3Config", {}),
    ("SmolLM3Config", dict(layer_types=["sliding_attention"] * 7)),  # windows whatever use_sliding_window says
])
def test_each_layers_window_and_rotary_are_read_as_transformers_reads_them(kind, kwargs):
    """From a config.json without `layer_types` (and SmolLM3's `no_rope_layers`), as older ones
    are, transformers fills them in; the rewrite reads the same (and a stored layer_types as it is:
    transformers' masks follow it)."""
    import transformers

    config = getattr(transformers, kind)(num_hidden_layers=7, sliding_window=8, max_position_embeddings=256, **kwargs)
    stored = {k: v for k, v in config.to_dict().items() if k not in ("layer_types", "no_rope_layers")}
    if "sliding_window_pattern" in kwargs:  # as older Gemma 3 config.json files spell it
        stored["sliding_window_pattern"] = kwargs["sliding_window_pattern"]
    if "layer_types" in kwargs:
        stored["layer_types"] = kwargs["layer_types"]
    sliding = [t == "sliding_attention" for t in config.layer_types]
    assert families.layer_windows(stored) == tuple(8 if s else -1 for s in sliding)
    if kind == "Gemma3TextConfig":
        assert families.layer_rotary(stored) == tuple("local" if s else "global" for s in sliding)
    elif kind == "SmolLM3Config":
        assert families.layer_rotary(stored) == tuple("global" if r else "none" for r in config.no_rope_layers)
    else:
        assert families.layer_rotary(stored) == ("global",) * 7
