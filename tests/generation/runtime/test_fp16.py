"""float16 decoders on the CPU, in every float16 layout a GPU node loads: onnxruntime-genai's
`-p fp16 -e cuda` build, an Optimum export in float16, transformers.js' `*_fp16.onnx`, and the
fused rewrite in float16 (what generation.load makes on CUDA, whose GroupQueryAttention takes
float16) from a float32 and from a float16 export; the in_place ones on host and device buffers.

Tolerance, and why: float16 keeps 11 significant bits (a relative spacing of 2^-10), and the
logits pass through every layer's roundings, in another order than transformers' float16 model
takes them; on these models a chosen token's logit sits up to 1.1% of the step's largest |logit|
below transformers' best (transformers' own float16 rows sit up to 0.7% of the whole scale
below its float32 ones). So every token Raymuter chooses, greedy, is checked against
transformers in float16 on the CPU, teacher-forced on Raymuter's own tokens: its logit is within
TOLERANCE (2%) of the step's largest |logit| of the best one. A near tie may go either way and
the rows then part, but a misplaced weight or a wrong cache row moves the logits by O(1), fifty
times more. Whole rows
agree too: at least 30 of 40 rows equal transformers' float16 rows in all 12 tokens (36 measured).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

import generation

TOLERANCE = 0.02
NEW = 12


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of([int(n) for n in np.random.default_rng(1).integers(1, 30, 40)], seed=2)


@pytest.fixture(scope="module")
def torch_fp16(oracle):
    import copy

    import torch

    return copy.deepcopy(oracle.model("llama")).to(torch.float16)  # the oracle's own stays float32


@pytest.fixture(scope="module")
def layouts(test_models, tmp_path_factory):
    """name -> a function loading that float16 layout of the tiny Llama."""
    from model_builders.fp16 import ensure_fp16_models
    from model_builders.text import convert_fp16

    genai = ensure_fp16_models(test_models["hf/llama"])["llama-genai-fp16"]
    optimum = tmp_path_factory.mktemp("optimum-fp16") / "llama"
    shutil.copytree(test_models["llama-optimum"], optimum)
    convert_fp16(test_models["llama-optimum"] / "model.onnx", optimum / "model.onnx")
    merged = test_models["llama-merged"]
    return {
        "genai -p fp16 -e cuda": lambda: generation.load(genai),
        "optimum fp16": lambda: generation.load(optimum, fuse=False),
        "transformers.js fp16": lambda: generation.load(merged, variant="fp16", fuse=False),
        "fused fp16 of the fp32 optimum export": lambda: generation.load(test_models["llama-optimum"], precision="fp16"),
        "fused fp16 of the transformers.js fp16 export": lambda: generation.load(merged, variant="fp16",
                                                                                 precision="fp16"),
    }


def teacher_forced(model, prompt, tokens):
    """transformers' float32 view of its float16 logits at each step that chose `tokens`."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return logits.float().numpy()


def greedy_rows(oracle_model, prompts):
    import torch

    rows = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = oracle_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                                        pad_token_id=oracle_model.config.pad_token_id)
        rows.append(out[0, len(prompt):].tolist())
    return rows


@pytest.fixture(scope="module")
def expected(torch_fp16, prompts):
    return greedy_rows(torch_fp16, prompts)


CASES = [("genai -p fp16 -e cuda", "in_place", "host"), ("genai -p fp16 -e cuda", "in_place", "device"),
         ("optimum fp16", "append", "host"), ("transformers.js fp16", "append", "host"),
         ("fused fp16 of the fp32 optimum export", "in_place", "host"),
         ("fused fp16 of the fp32 optimum export", "in_place", "device"),
         ("fused fp16 of the transformers.js fp16 export", "in_place", "device")]


@pytest.mark.parametrize("name, mode, buffers", CASES, ids=[f"{n}-{b}" for n, _, b in CASES])
def test_float16_rows_equal_transformers_in_float16(layouts, torch_fp16, prompts, expected, name, mode, buffers):
    model = layouts[name]()
    assert np.dtype(model.graph.cache_dtype) == np.float16 and model.graph.native_mode == mode
    assert (model.fused_from is not None) == name.startswith("fused")
    ctx = generation.context(model, buffers=buffers, max_new_tokens=NEW, eos_token_id=[])
    rows = generation.generate(ctx, prompts)
    assert all(len(r) == NEW for r in rows)
    for prompt, row in zip(prompts, rows):
        logits = teacher_forced(torch_fp16, prompt, row)
        chosen = logits[np.arange(NEW), row]
        below = (logits.max(axis=1) - chosen) / np.abs(logits).max(axis=1)
        assert below.max() <= TOLERANCE, (prompt, row, below)
    assert sum(r == e for r, e in zip(rows, expected)) >= 30


def test_a_float16_rewrite_is_refused_on_the_cpu_by_default(test_models, caplog):
    """On the CPU the fused graph is float32: a float16 export runs as exported unless
    precision='fp16' asks for the float16 rewrite."""
    model = generation.load(test_models["llama-merged"], variant="fp16")
    assert model.fused_from is None and model.graph.native_mode == "append"
    with pytest.raises(generation.ModelError, match="precision must be one of auto, fp32, fp16, int8"):
        generation.load(test_models["llama-optimum"], precision="bf16")
