"""The support matrix: every decoder-only text architecture optimum-onnx 0.1.0 exports for text
generation, tiny (model_builders.matrix: hidden 64, 2 layers, grouped KV heads where the
architecture has them, a sliding window of 8 where it has one), in the plain Optimum layout (and
Llama's merged decoder), loaded as a server loads it (`generation.load`, the fused rewrite where it
applies).

Invariants: each architecture loads in the cache mode MODES names (a fallback from in_place or
append to grow is a regression, even when its tokens stay right); in one batch of prompts of 1, 5
and 11 tokens, every row gets the 16 tokens transformers 4.57 `generate` gives its prompt alone
(min_new_tokens=16 on both sides: no row ends early, every step is compared); a beam search equals
transformers' on an architecture of each cache mode without a fused graph (MLA + experts in append,
sinks + experts + a window in grow).
"""

# Not in the matrix (optimum-onnx 0.1.0 lists them for text-generation-with-past):
#   gemma3         Gemma3ForConditionalGeneration, a vision-language model (its text decoder,
#                  gemma3_text, is in the matrix)
#   internlm2      remote code only (no transformers 4.57 class): nothing to build without the hub
#   bart, mbart, marian, pegasus, blenderbot, blenderbot-small, bigbird_pegasus
#                  the decoder half of encoder-decoders (*ForCausalLM), not decoder-only models
# Configurations the exporter refuses (the architecture is in the matrix in its other form):
#   falcon with new_decoder_architecture and 2 KV heads, phi with 2 KV heads: optimum's dummy past
#   has num_attention_heads heads ("Sizes of tensors must match ... Expected size 2 but got 4")

from __future__ import annotations

import pytest

import generation

MAX_NEW = 16
LENGTHS = (1, 5, 11)
#: architecture (llama-merged: Llama's decoder_model_merged.onnx) -> the cache mode it loads in with
#: fuse=True: in_place where the fused rewrite takes it, append where the export has position_ids,
#: grow where it has none (bloom and mpt: ALiBi; gemma2, gemma3_text, gpt_oss, nemotron: Optimum
#: exports them without position_ids)
MODES = {
    "arcee": "append", "bloom": "grow", "codegen": "append", "cohere": "append", "deepseek_v3": "append",
    "falcon": "append", "gemma": "in_place", "gemma2": "grow", "gemma3_text": "grow", "glm": "append",
    "gpt2": "append", "gpt_bigcode": "append", "gpt_neo": "append", "gpt_neox": "append", "gpt_oss": "grow",
    "gptj": "append", "granite": "in_place", "helium": "append", "llama": "in_place", "llama-merged": "in_place",
    "mistral": "in_place", "mpt": "grow", "nemotron": "grow", "olmo": "append", "olmo2": "append",
    "opt": "append", "phi": "append", "phi3": "in_place", "qwen2": "in_place", "qwen3": "in_place",
    "qwen3_moe": "append", "smollm3": "append", "stablelm": "append",
}
BEAMS = ("deepseek_v3", "gpt_oss")
WINDOWED = ("gemma2", "gemma3_text", "gpt_oss")  # built here with a window (mistral, gpt_neo, qwen2: test_windows)


@pytest.fixture(scope="module")
def matrix():
    from model_builders.matrix import matrix_models

    return matrix_models()


def test_the_matrix_is_every_architecture_built(matrix):
    assert sorted(matrix) == sorted(MODES)


@pytest.fixture(scope="module")
def oracle(matrix):
    from conftest import Oracle

    return Oracle({f"hf/{arch}": hf for arch, (_, hf) in matrix.items()})


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


@pytest.mark.parametrize("arch", sorted(MODES))
def test_each_architecture_loads_in_its_cache_mode(matrix, load_model, arch):
    model = load_model(matrix[arch][0], fuse=True)
    assert model.graph.native_mode == MODES[arch]
    assert (model.fused_from is not None) == (MODES[arch] == "in_place")


@pytest.mark.parametrize("arch", sorted(MODES))
def test_rows_of_mixed_lengths_equal_transformers_alone(matrix, load_model, oracle, prompts, arch):
    ctx = generation.context(load_model(matrix[arch][0], fuse=True), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    expected = [oracle.greedy(arch, p, MAX_NEW, min_new_tokens=MAX_NEW) for p in prompts]
    assert rows == expected
    # the fixture is not degenerate: rows that depend on their prompt, answers that do not repeat one token
    assert len({tuple(r) for r in rows}) == len(prompts) and all(len(set(r)) >= 4 for r in expected)


@pytest.mark.parametrize("arch", BEAMS)
def test_a_beam_search_equals_transformers(matrix, load_model, oracle, prompts, arch):
    from test_beam import transformers_beams

    ctx = generation.context(load_model(matrix[arch][0], fuse=True), max_new_tokens=MAX_NEW)
    settings = ctx.with_settings(num_beams=3, num_return_sequences=2)
    got = generation.beam_search(ctx, prompts[1:], seeds=[0, 1], settings=[settings, settings])
    for prompt, hypotheses in zip(prompts[1:], got):
        expected = transformers_beams(oracle, arch, prompt, MAX_NEW, num_beams=3, num_return_sequences=2)
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _, _ in expected]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score, _ in expected], rel=1e-4)


@pytest.mark.parametrize("arch", WINDOWED)
def test_the_window_matters(matrix, oracle, prompts, arch):
    """Guard: without its window the same weights answer the 11-token prompt otherwise."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(matrix[arch][1], layer_types=["full_attention"] * 2)
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                    min_new_tokens=MAX_NEW, pad_token_id=0)
    assert out[0, ids.shape[1]:].tolist() != oracle.greedy(arch, prompts[2], MAX_NEW, min_new_tokens=MAX_NEW)
