"""The fused rewrite of Optimum and transformers.js decoders (generation.runtime.fusion).

Invariants: a Llama or Qwen2 export, plain or merged, loads by default as a GroupQueryAttention
graph in the in_place cache mode whose logits are transformers' (its greedy tokens and beams are
checked with every other graph's: core/test_greedy_oracle.py, search/test_beam.py); a graph that
cannot be rewritten (another family, quantized or fp16 weights, weights that do not map) loads
as exported with the reason in the log, remembered by the hash of its files; the rotary tables
are transformers' for each rope type the rewrite accepts. (The other families, windows among
them: test_fusion_families.py.)
"""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest

import generation
from generation.runtime import fusion
from generation.runtime.fusion import rotary, weights

FUSED = [("llama-optimum", "llama"), ("qwen2-optimum", "qwen2"), ("llama-merged", "llama")]


@pytest.fixture(scope="module")
def fused(test_models, load_model):
    return {folder: load_model(test_models[folder], fuse=True) for folder, _ in FUSED}


@pytest.mark.parametrize("folder", [f for f, _ in FUSED])
def test_exports_load_as_the_fused_graph(fused, test_models, folder):
    model = fused[folder]
    assert model.fused_from is not None and test_models[folder] in model.fused_from.parents
    assert model.decoder_path != model.fused_from and model.graph.native_mode == "in_place"
    assert model.graph.has_group_query_attention and not model.graph.has_position_ids
    assert model.graph.modes == ("in_place", "grow")


@pytest.mark.parametrize("folder,name", FUSED, ids=[f for f, _ in FUSED])
def test_fused_logits_equal_transformers(fused, oracle, folder, name):
    """A prompt's logits at every position, then two decodes over the fused graph's own cache."""
    prompt = np.random.default_rng(3).integers(3, 1000, 23)
    model = fused[folder]
    prefill, *steps = fusion._run_probe(model.session, model.graph, prompt, steps=2)
    sequence = prompt.tolist() + [int(prefill[-1].argmax()), int(steps[0][-1].argmax())]
    want = oracle.logits(name, sequence)  # [S, V], every position
    np.testing.assert_allclose(prefill, want[:len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[0][0], want[len(prompt)], atol=1e-4)
    np.testing.assert_allclose(steps[1][0], want[len(prompt) + 1], atol=1e-4)


def test_fuse_false_runs_the_export(test_models):
    model = generation.load(test_models["llama-optimum"], threads=1, fuse=False)
    assert model.fused_from is None and model.graph.native_mode == "append"
    with pytest.raises(generation.ModelError, match="fuse must be true or false, not 'yes'"):
        generation.load(test_models["llama-optimum"], fuse="yes")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RAYMUTER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fused"


@pytest.mark.parametrize("folder,variant,reason", [
    ("gpt2-optimum", None, "model_type 'gpt2' is not one of llama, mistral, qwen2, qwen3, granite, phi3, gemma"),
    ("llama-merged", "fp16", "its cache or logits are not float32"),
    ("llama-genai", None, None),  # already fused: not a candidate, nothing logged as a refusal
])
def test_what_cannot_be_rewritten_loads_as_exported(test_models, cache, caplog, folder, variant, reason):
    with caplog.at_level(logging.INFO, logger="generation.runtime.fusion"):
        model = generation.load(test_models[folder], variant=variant, threads=1)
    assert model.fused_from is None
    assert model.graph.native_mode == ("in_place" if folder == "llama-genai" else "append")
    if reason:
        assert any(__import__("re").search(reason, r.getMessage()) and "runs unfused" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_weights_that_do_not_map_are_refused_once(test_models, cache, caplog, monkeypatch):
    """gate and up swapped (the shapes still fit): the probe catches it, the export runs as
    exported, and the refusal is remembered: the next load neither rebuilds nor rechecks."""
    read = weights.read_weights

    def swapped(model_proto, config, layout):
        out = read(model_proto, config, layout)
        for layer in out.layers:
            layer.gate, layer.up = layer.up, layer.gate
        return out
    monkeypatch.setattr(weights, "read_weights", swapped)
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        model = generation.load(test_models["llama-optimum"], threads=1)
    assert model.fused_from is None and model.graph.native_mode == "append"
    assert any("logits differ from the source's" in r.getMessage() for r in caplog.records)
    (refused,) = cache.glob("*/refused.json")
    assert "differ" in json.loads(refused.read_text())["reason"]
    assert not list(cache.glob("*/model.onnx")) and not list(cache.glob(".building-*"))

    monkeypatch.setattr(fusion, "_build", lambda *a: pytest.fail("a remembered refusal was rebuilt"))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        assert generation.load(test_models["llama-optimum"], threads=1).fused_from is None
    assert any("logits differ" in r.getMessage() for r in caplog.records)


def test_the_cache_is_keyed_by_the_files(test_models, cache, tmp_path, monkeypatch):
    first = generation.load(test_models["llama-optimum"], threads=1)
    copy = tmp_path / "copy"
    shutil.copytree(test_models["llama-optimum"], copy)
    monkeypatch.setattr(fusion, "_build", lambda *a: pytest.fail("a copy of the same files was rebuilt"))
    assert generation.load(copy, threads=1).decoder_path == first.decoder_path
    monkeypatch.undo()
    monkeypatch.setenv("RAYMUTER_CACHE", str(cache.parent))
    config = json.loads((copy / "config.json").read_text())
    config["max_position_embeddings"] *= 2  # a field the rewrite reads (its rotary tables): another graph
    (copy / "config.json").write_text(json.dumps(config))
    longer = generation.load(copy, threads=1)
    assert longer.fused_from is not None and longer.decoder_path != first.decoder_path
    assert len(list(cache.glob("*/model.onnx"))) == 2


def test_a_config_that_disagrees_with_its_graph_is_refused(test_models, cache, tmp_path, caplog):
    """The norms' epsilon is baked into the export; a config.json that says otherwise would make
    the rewrite compute another model: the probe refuses it."""
    copy = tmp_path / "copy"
    shutil.copytree(test_models["llama-optimum"], copy)
    config = json.loads((copy / "config.json").read_text())
    config["rms_norm_eps"] = 1e-2
    (copy / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="generation.runtime.fusion"):
        assert generation.load(copy, threads=1).fused_from is None
    assert any("logits differ from the source's" in r.getMessage() for r in caplog.records)


def test_weights_stored_once_and_shared_are_read(test_models, cache, tmp_path):
    """An untrained model's norms are all ones: torch's exporter stores such equal weights once
    and gives each norm an Identity of it (the ~125M bench model was refused for it: "found 1
    RMSNorm weights"). Here every norm reads one shared ones vector that way: the copy still
    loads fused, and its greedy tokens are the export's own."""
    import onnx
    from onnx import numpy_helper

    copy = tmp_path / "copy"
    shutil.copytree(test_models["llama-optimum"], copy)
    path = copy / "model.onnx"
    model = onnx.load(str(path))
    hidden = json.loads((copy / "config.json").read_text())["hidden_size"]
    graph, shared = model.graph, "norm.weight.shared"
    norms = {t.name for t in graph.initializer if list(t.dims) == [hidden]}
    muls = [n for n in graph.node if n.op_type == "Mul" and any(i in norms for i in n.input)]
    assert len(muls) == 2 * json.loads((copy / "config.json").read_text())["num_hidden_layers"] + 1
    for t in [t for t in graph.initializer if t.name in norms]:
        graph.initializer.remove(t)
    graph.initializer.append(numpy_helper.from_array(np.ones(hidden, np.float32), shared))
    for at, name in enumerate(sorted(norms)):
        graph.node.append(onnx.helper.make_node("Identity", [shared], [name], name=f"Identity_{at}"))
    onnx.save_model(model, str(path))
    fused, exported = generation.load(copy, threads=1), generation.load(copy, threads=1, fuse=False)
    assert fused.fused_from == path and exported.fused_from is None
    prompts = [np.random.default_rng(5).integers(3, 1000, n).tolist() for n in (9, 4)]
    rows = [generation.generate(generation.context(m, max_new_tokens=12, do_sample=False), prompts, seeds=[0, 0])
            for m in (fused, exported)]
    assert rows[0] == rows[1]


def test_other_families_are_not_candidates():
    llama = {"model_type": "llama", "hidden_act": "silu"}
    assert fusion.unsupported_config(llama, "cpu") is None
    assert fusion.unsupported_config(llama, "cuda") is None  # CUDA takes the float16 rewrite (test_fp16.py)
    assert fusion.precision_for("cuda", None) == "fp16" and fusion.precision_for("cpu", None) == "fp32"
    assert "gelu" in fusion.unsupported_config({**llama, "hidden_act": "gelu"}, "cpu")
    mistral = {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768}
    assert fusion.unsupported_config(mistral, "cpu") is None  # its window: local_window_size (test_fusion_families)
    qwen2 = {"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False, "max_position_embeddings": 32768}
    assert fusion.unsupported_config(qwen2, "cpu") is None


@pytest.mark.parametrize("rope_scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
])
def test_rope_tables_are_transformers(rope_scaling):
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_theta=50000.0,
                         rope_scaling=rope_scaling)
    embedding = LlamaRotaryEmbedding(config)
    positions = torch.arange(512)[None, :]
    cos, sin = embedding(torch.zeros(1, 512, 16), positions)
    ours_cos, ours_sin = rotary.rope_tables(config.to_dict(), 16, 512)
    # (float32 angles up to 511 rad: one ulp of the angle is 3e-5)
    np.testing.assert_allclose(ours_cos, cos[0, :, :8].numpy(), atol=3e-5)
    np.testing.assert_allclose(ours_sin, sin[0, :, :8].numpy(), atol=3e-5)
    if rope_scaling:  # the scaling changes the tables: the test can tell
        plain, _ = rotary.rope_tables({**config.to_dict(), "rope_scaling": None}, 16, 512)
        assert np.abs(plain - ours_cos).max() > 0.1


def test_rope_types_not_rewritten_are_named():
    with pytest.raises(weights.FusionError, match="rope_scaling of type 'dynamic' is not rewritten"):
        rotary.rope_tables({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, 16, 32)


def test_a_mode_only_the_export_has_names_fuse(fused):
    with pytest.raises(generation.SettingError, match=r"runs as in_place or grow, the fused rewrite of model.onnx: "
                                                      r"load it with fuse=False"):
        generation.context(fused["llama-optimum"], cache_mode="append")


@pytest.fixture(scope="module")
def quantized(test_models, tmp_path_factory):
    """{variant: (fused, as exported)} of the merged decoder's int8 and 4-bit variants (the 4-bit
    one quantized here as transformers.js does: model_builders.text.quantize_q4)."""
    from model_builders.text import quantize_q4

    folder = tmp_path_factory.mktemp("q4") / "llama-merged"
    shutil.copytree(test_models["llama-merged"], folder, ignore=shutil.ignore_patterns("*_fp16.onnx"))
    quantize_q4(folder / "onnx" / "decoder_model_merged.onnx", folder / "onnx" / "decoder_model_merged_q4.onnx")
    return {v: (generation.load(folder, variant=v, threads=1), generation.load(folder, variant=v, threads=1, fuse=False))
            for v in ("quantized", "q4")}


@pytest.mark.parametrize("variant, op", [("quantized", "MatMulInteger"), ("q4", "MatMulNBits")])
def test_quantized_variants_run_fused_as_exported(quantized, variant, op):
    """The oracle for weights transformers cannot hold: the same quantized graph as exported,
    run by onnxruntime. Greedy rows of a mixed batch and beams are its own, token for token."""
    import onnx

    fused, exported = quantized[variant]
    assert fused.fused_from == exported.decoder_path and fused.graph.native_mode == "in_place"
    ops = {n.op_type for n in onnx.load(str(fused.decoder_path), load_external_data=False).graph.node}
    assert {op, "GroupQueryAttention"} <= ops
    prompts = [np.random.default_rng(i).integers(3, 1000, n).tolist() for i, n in enumerate([0, 1, 5, 12, 23, 31])]
    rows = {}
    for name, model in (("fused", fused), ("exported", exported)):
        ctx = generation.context(model, max_new_tokens=24)
        rows[name] = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    assert rows["fused"] == rows["exported"] and len({tuple(r) for r in rows["fused"]}) == len(prompts)
    beams = {}
    for name, model in (("fused", fused), ("exported", exported)):
        ctx = generation.context(model, max_new_tokens=10, num_beams=3, num_return_sequences=2, token_logprobs=True)
        beams[name] = generation.beam_search(ctx, prompts[1:4], [0] * 3)
    for ours, theirs in zip(beams["fused"], beams["exported"]):
        assert [h.tokens for h in ours] == [h.tokens for h in theirs]
        np.testing.assert_allclose([h.score for h in ours], [h.score for h in theirs], atol=1e-4)


def test_the_server_passes_fuse_through(test_models):
    from deployments import cli
    from deployments.cli import serve as serving
    from deployments.app import AppConfig

    assert serving.app_config(cli.parser().parse_args(["serve", "--no-fuse"]))["fuse"] is False
    assert serving.app_config(cli.parser().parse_args(["serve"]))["fuse"] is True
    assert AppConfig().fuse is True
    from deployments.services.generator import TextGenerator

    exported = TextGenerator.from_model(test_models["llama-optimum"], threads=1, fuse=False)
    fused = TextGenerator.from_model(test_models["llama-optimum"], threads=1)
    try:
        assert exported.batcher.ctx.cache_mode == "append" and fused.batcher.ctx.cache_mode == "in_place"
    finally:
        for generator in (exported, fused):
            generator.close()


def test_processes_starting_together_build_it_once(test_models, tmp_path):
    """Replicas of one node load the same export at once: one rewrites it, the others wait for
    it (a lock beside the cache entry) and load the same file."""
    import os
    import subprocess
    import sys

    code = ("import logging, sys, generation; logging.basicConfig(level=logging.INFO, stream=sys.stderr); "
            f"print(generation.load({str(test_models['qwen2-optimum'])!r}, threads=1).decoder_path)")
    env = {**os.environ, "RAYMUTER_CACHE": str(tmp_path / "cache")}
    runs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=env) for _ in range(3)]
    outs = [run.communicate(timeout=120) for run in runs]
    assert all(run.returncode == 0 for run in runs), [err[-2000:] for _, err in outs]
    assert len({out.strip() for out, _ in outs}) == 1 and outs[0][0].strip().endswith("model.onnx")
    assert sum(err.count("rewriting") for _, err in outs) == 1, [err for _, err in outs]
