"""The support matrix: every decoder-only text architecture optimum-onnx 0.1.0 exports for text
generation, tiny (model_builders.matrix: hidden 64, 2 layers, grouped KV heads where the
architecture has them, a sliding window of 8 where it has one), in the plain Optimum layout (and
Llama's merged decoder), loaded as a server loads it (`generation.load`, the fused rewrite where it
applies).

Invariants: each architecture loads in the cache mode MODES names (a fallback from in_place or
append to grow is a regression, even when its tokens stay right); in one batch of prompts of 1, 5
and 11 tokens, every row gets the 16 tokens transformers 4.57 `generate` gives its prompt alone
(min_new_tokens=16 on both sides: no row ends early, every step is compared); a beam search equals
transformers' on MLA + experts in append, on sinks + experts + a window in the fused graph
(in_place), and on ALiBi by column distance in append with each row's keys at the buffer's end; the
exports without position_ids that run append (BLOOM's and MPT's ALiBi) stay exact as rows join a
running batch, and the one that runs grow unfused (gpt_oss) says why in the log.
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
#: fuse=True: in_place where the fused rewrite takes it, append where the export has position_ids or
#: places tokens by the attention mask or column distances (bloom and mpt: ALiBi; runtime/positions.py);
#: none runs grow (gpt_oss would, unfused: Optimum exports it without position_ids)
MODES = {
    "arcee": "append", "bloom": "append", "codegen": "append", "cohere": "append", "deepseek_v3": "append",
    "falcon": "append", "gemma": "in_place", "gemma2": "in_place", "gemma3_text": "in_place", "glm": "append",
    "gpt2": "append", "gpt_bigcode": "append", "gpt_neo": "append", "gpt_neox": "append", "gpt_oss": "in_place",
    "gptj": "append", "granite": "in_place", "helium": "append", "llama": "in_place", "llama-merged": "in_place",
    "mistral": "in_place", "mpt": "append", "nemotron": "in_place", "olmo": "in_place", "olmo2": "in_place",
    "opt": "append", "phi": "in_place", "phi3": "in_place", "qwen2": "in_place", "qwen3": "in_place",
    "qwen3_moe": "append", "smollm3": "in_place", "stablelm": "append",
}
BEAMS = ("deepseek_v3", "gpt_oss", "mpt")
WITHOUT_POSITIONS = ("bloom", "mpt")  # append without position_ids (runtime/positions.py)
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


def _run_joining(ctx, prompts) -> list:
    """Through the Scheduler, 3 slots: the 11-token row alone, the 1-token row joining at step 3, the
    5-token one at step 9 with two more that wait for the slots finished rows leave."""
    from generation.engine.scheduler import Scheduler
    from test_windows import run_all

    scheduler = Scheduler(ctx, slots=3, capacity=64)
    jobs = [scheduler.job(p, seed=i, settings=dict(max_new_tokens=MAX_NEW - 2 * i, min_new_tokens=MAX_NEW - 2 * i))
            for i, p in enumerate(prompts)]
    run_all(scheduler, {0: jobs[:1], 3: jobs[1:2], 9: jobs[2:]})
    return [j.tokens for j in jobs]


@pytest.fixture(scope="module")
def joining(prompts, prompts_of):
    return [prompts[2], prompts[0], prompts[1]] + prompts_of((3, 9), seed=7)


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("arch", WITHOUT_POSITIONS)
def test_rows_joining_a_running_batch_without_position_ids(matrix, load_model, oracle, joining, arch, steps):
    """BLOOM and MPT in the append mode: rows of other lengths join mid-run, and every row is
    transformers' alone (MPT's keys end at the buffer's width, where its ALiBi reads them)."""
    model = load_model(matrix[arch][0], fuse=True)
    assert model.graph.native_mode == "append" and not model.graph.has_position_ids
    ctx = generation.context(model, prompt_steps=steps)
    expected = [oracle.greedy(arch, p, MAX_NEW - 2 * i, min_new_tokens=MAX_NEW - 2 * i) for i, p in enumerate(joining)]
    assert _run_joining(ctx, joining) == expected


@pytest.mark.parametrize("arch,keys_at_end", [("mpt", False), ("gpt_oss", False), ("gpt_oss", True)])
def test_where_append_would_not_be_exact(matrix, oracle, joining, arch, keys_at_end):
    """Guard: MPT with each row's keys at the buffer's start, and gpt-oss's export (positions from
    the cache's length) in either append layout, answer a joining row otherwise than transformers."""
    import dataclasses

    model = generation.load(matrix[arch][0], threads=1, fuse=False)
    model.graph = dataclasses.replace(model.graph, native_mode="append", keys_at_end=keys_at_end)
    expected = [oracle.greedy(arch, p, MAX_NEW - 2 * i, min_new_tokens=MAX_NEW - 2 * i) for i, p in enumerate(joining)]
    assert _run_joining(generation.context(model), joining) != expected


@pytest.mark.parametrize("arch,mode,logged", [
    ("bloom", "append", "runs in the append cache mode without position_ids: its ALiBi positions are the attention"),
    ("mpt", "append", "runs in the append cache mode without position_ids: its ALiBi bias is the distance between"),
    ("gpt_oss", "grow", "runs in the grow cache mode: model_type 'gpt_oss' takes a token's position from the cache's"),
])
def test_an_export_without_position_ids_says_which_mode_and_why(matrix, caplog, arch, mode, logged):
    """Each export as exported (gpt_oss's fused graph runs in_place: test_fusion_gpt_oss.py)."""
    import logging

    with caplog.at_level(logging.INFO, logger="generation.runtime.model"):
        model = generation.load(matrix[arch][0], threads=1, fuse=False)
    assert model.graph.native_mode == mode and model.graph.keys_at_end == (arch == "mpt")
    assert any(logged in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
