"""The fused rewrite of the families after Llama and Qwen2 (generation.runtime.fusion.families):
Mistral and Qwen2 with sliding windows, Qwen3, Granite, Phi-3, Gemma (model_builders.families and
model_builders.windows; window 8).

Invariant: each family's Optimum export loads as its fused GroupQueryAttention graph, in the
in_place cache mode, and every row of a batch of mixed lengths (1, 5 and 11 tokens, whole or in
pieces; the windowed models' rows and answers crossing the window) gets the tokens transformers
4.57 `generate` gives its prompt alone; a beam search beside a greedy row too. A family the
operator cannot express, or that is not rewritten, is named with the reason.
"""

from __future__ import annotations

import pytest

import generation
from generation.runtime import fusion
from generation.runtime.fusion import families, rotary

MAX_NEW = 24
LENGTHS = (1, 5, 11)
# fixture folder, oracle model
FUSED = [("mistral-optimum", "mistral"), ("qwen2_window-optimum", "qwen2_window"), ("qwen3-optimum", "qwen3"),
         ("granite-optimum", "granite"), ("phi3-optimum", "phi3"), ("gemma-optimum", "gemma")]
# whole prompts for every family; in pieces (32, 8, 4, 1) where a piece's keys cross a window
CASES = [(f, n, "whole") for f, n in FUSED] + [(f, n, "pieces") for f, n in FUSED if n in ("mistral", "qwen2_window")]


@pytest.fixture(scope="module")
def models():
    from model_builders.families import ensure_family_models
    from model_builders.windows import ensure_window_models

    return {**ensure_window_models(), **ensure_family_models()}


@pytest.fixture(scope="module")
def oracle(models):
    from conftest import Oracle

    return Oracle(models)


@pytest.fixture(scope="module")
def fused(models, load_model):
    return {folder: load_model(models[folder], fuse=True) for folder, _ in FUSED}


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


@pytest.mark.parametrize("folder", [f for f, _ in FUSED])
def test_each_family_loads_as_its_fused_graph(fused, models, folder):
    import onnx

    model = fused[folder]
    assert model.fused_from == models[folder] / "model.onnx" and model.graph.native_mode == "in_place"
    assert model.graph.has_group_query_attention and not model.graph.has_position_ids
    windows = [next(a.i for a in n.attribute if a.name == "local_window_size")
               for n in onnx.load(str(model.decoder_path), load_external_data=False).graph.node
               if n.op_type == "GroupQueryAttention"]
    assert windows == {"mistral-optimum": [8, 8], "qwen2_window-optimum": [-1, 8]}.get(folder, [-1, -1])


@pytest.mark.parametrize("folder,name,steps", CASES, ids=[f"{f}-{s}" for f, _, s in CASES])
def test_rows_of_mixed_lengths_equal_transformers_alone(fused, oracle, prompts, folder, name, steps):
    ctx = generation.context(fused[folder], max_new_tokens=MAX_NEW, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    expected = [oracle.greedy(name, p, MAX_NEW) for p in prompts]
    assert rows == expected and len({tuple(r) for r in rows}) == len(prompts)


def test_the_window_matters(oracle, prompts):
    """Guard: the windowed Qwen2 answers otherwise without its window (the prompts cross it)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(oracle.hf_dir("qwen2_window"),
                                                              layer_types=["full_attention"] * 2).eval()
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                             pad_token_id=0)
    assert out[0, ids.shape[1]:].tolist() != oracle.greedy("qwen2_window", prompts[2], MAX_NEW)


def test_a_beam_search_beside_a_greedy_row(fused, oracle, prompts):
    """Qwen2 with its window: beams of the 5-token prompt and a greedy 11-token row in one run."""
    from generation.engine.scheduler import Scheduler
    from test_beam import transformers_beams

    ctx = generation.context(fused["qwen2_window-optimum"], max_new_tokens=16)
    scheduler = Scheduler(ctx, slots=4, capacity=64)
    beams = scheduler.job(prompts[1], settings=dict(num_beams=3, num_return_sequences=2))
    plain = scheduler.job(prompts[2], seed=0)
    scheduler.add(beams)
    scheduler.add(plain)
    while scheduler.busy:
        scheduler.step()
    expected = transformers_beams(oracle, "qwen2_window", prompts[1], 16, num_beams=3, num_return_sequences=2)
    assert [h.tokens for h in beams.hypotheses] == [tokens for tokens, _, _ in expected]
    assert [h.score for h in beams.hypotheses] == pytest.approx([score for _, score, _ in expected], rel=1e-4)
    assert plain.tokens == oracle.greedy("qwen2_window", prompts[2], 16)


@pytest.mark.parametrize("config,reason", [
    (dict(model_type="phimoe"), "model_type 'phimoe': a mixture of experts routed by sparsemixer"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention is true"),
    (dict(model_type="gpt2"), "model_type 'gpt2' is not one of llama, mistral, qwen2, qwen3, granite, phi3, gemma"),
    (dict(model_type="gemma", hidden_act="relu"), "hidden_act 'relu' is not silu or gelu_pytorch_tanh or gelu"),
    (dict(model_type="granite", mlp_bias=True), "mlp_bias is true"),
    (dict(model_type="qwen2", attention_bias=True), None),
])
def test_what_is_not_rewritten_is_named(config, reason):
    got = fusion.unsupported_config(config, "cpu")
    assert (got is None) if reason is None else (reason in got), got


@pytest.mark.parametrize("config,windows", [
    (dict(model_type="mistral", sliding_window=8), (8, 8, 8)),
    (dict(model_type="mistral", sliding_window=None), (-1, -1, -1)),
    (dict(model_type="mistral", sliding_window=4096), (-1, -1, -1)),  # never crossed
    (dict(model_type="phi3", sliding_window=8), (8, 8, 8)),
    (dict(model_type="qwen2", sliding_window=8, use_sliding_window=False), (-1, -1, -1)),
    (dict(model_type="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2), (-1, -1, 8)),
    (dict(model_type="qwen3", sliding_window=8, use_sliding_window=True,
          layer_types=["sliding_attention", "full_attention", "sliding_attention"]), (8, -1, 8)),
    (dict(model_type="llama", sliding_window=8), (-1, -1, -1)),
])
def test_each_layers_window_is_read_as_transformers_reads_it(config, windows):
    assert families.layer_windows({**config, "num_hidden_layers": 3, "max_position_embeddings": 256}) == windows


def test_partial_rotary_tables_are_transformers():
    import numpy as np
    import torch
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    config = Phi3Config(hidden_size=128, num_attention_heads=2, max_position_embeddings=64,
                        original_max_position_embeddings=64, partial_rotary_factor=0.5)
    cos, sin = Phi3RotaryEmbedding(config)(torch.zeros(1, 64, 64), torch.arange(64)[None, :])
    ours_cos, ours_sin = rotary.rope_tables(config.to_dict(), 64, 64)
    assert ours_cos.shape == (64, 16)
    np.testing.assert_allclose(ours_cos, cos[0, :, :16].numpy(), atol=3e-5)
    np.testing.assert_allclose(ours_sin, sin[0, :, :16].numpy(), atol=3e-5)
    assert rotary.rope_tables({"partial_rotary_factor": 0.5}, 16, 64)[0].shape == (64, 4)  # laid out: rotary.gqa_rotary
    with pytest.raises(fusion.FusionError, match="'longrope' is not rewritten"):
        rotary.rope_tables({"rope_scaling": {"rope_type": "longrope"}}, 16, 64)
