"""The default model that ships with Raymuter (generation/default_model/files/, built by
`python -m generation.default_model.train`; nothing is trained here).

Invariants: the shipped model is trained (its own text is far more likely under it than under a
uniform guess, which an untrained model cannot pass) and ends documents with eos; Raymuter's
greedy tokens on both of its graphs (and the merged export's fused rewrite) equal transformers' on the committed checkpoint; commands run
without `--model` use it and say so; it fits in 20 MB and every file of it ships in the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest

import generation
from generation.default_model import FOLDER, default_model_path
from generation.text.tokenizer import model_tokenizer

REPO = Path(__file__).resolve().parents[3]
PROMPTS = ("The list type", "A context manager", "Exceptions are raised when",
           "user: What does json.dumps do?\nassistant:")
NEW = 50
LAYOUTS = {"genai": (FOLDER / "genai", {}), "merged": (FOLDER, {}), "merged-as-exported": (FOLDER, {"fuse": False})}


@pytest.fixture(scope="module")
def model():
    return generation.load(default_model_path(), threads=2)


@pytest.fixture(scope="module")
def tokenizer(model):
    return model_tokenizer(model)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(p).ids for p in PROMPTS]


def test_default_is_the_genai_build_and_the_folder_the_merged_export():
    assert default_model_path() == FOLDER / "genai"
    assert generation.load(default_model_path(), threads=1).graph.native_mode == "in_place"
    merged = generation.load(FOLDER, threads=1, fuse=False)
    assert merged.decoder_path == FOLDER / "onnx" / "decoder_model_merged.onnx"
    assert merged.graph.has_use_cache_branch
    # loaded by default as its fused rewrite (its weights are float16 behind Casts, in the If's outer graph)
    fused = generation.load(FOLDER, threads=1)
    assert fused.fused_from == merged.decoder_path and fused.graph.native_mode == "in_place"


def test_sampled_text_decodes_ends_and_is_likely(model, tokenizer, prompts):
    """50 new tokens with the shipped sampling settings: every token is a text token that
    decodes, each row ends at eos or the limit, and the mean raw log-probability of the text
    is far above a uniform guess's (-log 4096 = -8.3; an untrained model scores about that)."""
    ctx = generation.context(model, max_new_tokens=NEW, token_logprobs=True, logprobs_of="raw")
    assert ctx.settings.do_sample and ctx.settings.repetition_penalty > 1  # generation_config.json's
    rows = generation.generate(generation.compile(ctx, batch_size=len(prompts)), prompts, seeds=[0, 1, 2, 3])
    special = {0, 1, 2}
    for prompt, row in zip(PROMPTS, rows):
        assert 0 < len(row.tokens) <= NEW, prompt
        assert all(0 <= t < model.vocab_size and t not in special for t in row.tokens), (prompt, row.tokens)
        assert all(tokenizer.id_to_token(t) is not None for t in row.tokens)
        text = tokenizer.decode(row.tokens)
        assert text.strip() and "\ufffd" not in text, (prompt, text)
        mean = float(np.mean(row.logprobs))
        assert mean > -3.5, (prompt, text, mean)  # perplexity under 33, against 4096 for a uniform guess


def test_greedy_reaches_eos(model, prompts):
    """The model learned where documents end: the chat prompt's greedy answer ends with eos
    before the limit (generate leaves the eos token out)."""
    ctx = generation.context(model, max_new_tokens=128, do_sample=False)
    row = generation.generate(ctx, [prompts[-1]], seeds=[0])[0]
    assert len(row) < 128


@pytest.fixture(scope="module")
def reference():
    """transformers on the committed float16 checkpoint, computing in float32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(FOLDER, dtype=torch.float32).eval()


_GREEDY: dict = {}


def reference_greedy(reference, prompt, **settings) -> list[int]:
    """transformers' greedy new tokens for one prompt alone, without the eos (memoised)."""
    import torch

    key = (tuple(prompt), tuple(sorted(settings.items())))
    if key not in _GREEDY:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                     **settings)[0, len(prompt):].tolist()
        _GREEDY[key] = out[:-1] if out and out[-1] == reference.config.eos_token_id else out
    return _GREEDY[key]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("settings", [{}, {"repetition_penalty": 1.0}], ids=["shipped-penalty", "plain"])
def test_greedy_equals_transformers(reference, prompts, layout, settings):
    """Raymuter on either graph gives transformers' greedy tokens on the checkpoint (all prompts
    in one batch; the shipped repetition penalty applies in both unless overridden)."""
    folder, options = LAYOUTS[layout]
    model = generation.load(folder, threads=2, **options)
    ctx = generation.context(model, max_new_tokens=NEW, do_sample=False, **settings)
    rows = generation.generate(generation.compile(ctx, batch_size=len(prompts)), prompts, seeds=[0] * len(prompts))
    for prompt, row in zip(prompts, rows):
        assert row == reference_greedy(reference, prompt, **settings)


def test_graphs_hold_the_checkpoint_weights():
    """The graphs store the checkpoint's matrices as they are, under their names: all of them
    (the merged decoder), all but q/k/v, which the genai builder fuses into one matrix."""
    onnx = pytest.importorskip("onnx")
    from onnx import numpy_helper
    from safetensors.numpy import load_file

    matrices = {k: v for k, v in load_file(str(FOLDER / "model.safetensors")).items() if v.size >= 1024}
    for path, fused in ((FOLDER / "onnx" / "decoder_model_merged.onnx", ()),
                        (FOLDER / "genai" / "model.onnx", ("q_proj", "k_proj", "v_proj"))):
        stored = {i.name: i for i in onnx.load(str(path)).graph.initializer}
        for key, tensor in matrices.items():
            if not any(f".{f}." in key for f in fused):
                assert f"weights/{key}/fp16" in stored, (path.name, key)
                np.testing.assert_array_equal(numpy_helper.to_array(stored[f"weights/{key}/fp16"]), tensor)


def test_cli_without_model_uses_the_default_and_says_so(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "deployments.cli", "generate", "The list type", "--max-new-tokens",
                           "12", "--greedy"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no --model given: using the default model" in done.stderr
    assert str(default_model_path()) in done.stderr
    assert done.stdout.strip()


def test_fits_in_20_mb_and_ships_in_the_package():
    """Every file of the model is package data of generation.default_model (its patterns as
    setuptools globs them); tests/test_packaging.py installs the wheel and runs it."""
    files = {f for f in FOLDER.rglob("*") if f.is_file()}
    assert sum(f.stat().st_size for f in files) <= 20_000_000
    package = REPO / "generation" / "default_model"
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "generation.default_model"]
    shipped = {f for pattern in patterns for f in package.glob(pattern) if f.is_file()}
    assert not files - shipped, sorted(files - shipped)
    assert (FOLDER / "README.md").is_file() and (FOLDER / "loss_curves.png").is_file()
