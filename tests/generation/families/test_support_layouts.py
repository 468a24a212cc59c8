"""The support matrix in its other layouts (model_builders.layouts, from the matrix's tiny Hugging Face
folders): onnxruntime-genai builds of every architecture its builder takes, the transformers.js /
onnx-community `onnx/model.onnx` folder with its quantized and fp16 variants, and the merged decoder
(`onnx/decoder_model_merged.onnx`, `use_cache_branch`), each loaded as a server loads it
(`generation.load`, the fused rewrite where it applies), in the batch of test_support_matrix.py
(prompts of 1, 5 and 11 tokens, 16 new tokens, a window of 8 where the architecture has one).

Invariants: onnxruntime-genai 0.15's builder takes exactly GENAI of the matrix's architectures; a
genai build where the builder is exact gives every row the tokens transformers 4.57 gives its prompt
alone; where the builder departs from transformers (DEPARTS, with the reason, which its graph shows),
every row is onnxruntime-genai's own generator's on that prompt alone, and transformers' differs; the
onnx/ folder and the merged decoder are exact against transformers in the cache mode the Optimum
export loads in (MODES), the merged one as exported too (its If branches); a q4 or fp16 variant's
batch is its own graph's, each prompt alone as exported, and so is an int8 one's (its activations
quantized per row at load: runtime.int8_rows); a beam search equals transformers' in each layout kind.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from test_support_matrix import LENGTHS, MAX_NEW, MODES

#: architecture -> why onnxruntime-genai's build gives other tokens than transformers (the builder's
#: graph: its own generator gives the same other tokens)
DEPARTS = {
    "gemma2": "the builder windows the odd layers where transformers windows the even ones, and caps the attention "
              "scores (attn_logit_softcapping), which transformers 4.57 does in eager attention only, not in the "
              "sdpa attention generate runs by default",
    "gemma3_text": "the builder windows every layer but each sixth ((i + 1) % 6, the released checkpoints' pattern), "
                   "whatever layer_types says: the tiny model's global layer 1 gets the window",
    "olmo": "the builder normalizes with SimplifiedLayerNormalization (RMS, no mean subtracted) where OLMo's "
            "weightless LayerNorm subtracts the mean",
    "qwen2": "the builder puts the window on every layer; transformers windows the layers from max_window_layers on",
}
#: transformers' windowed layers and the genai graph's (local_window_size > 0), for the departures by window
WINDOWED_LAYERS = {"gemma2": ((True, False), (False, True)), "gemma3_text": ((True, False), (True, True)),
                   "qwen2": ((False, True), (True, True))}
#: the genai builds exact against transformers (gpt_oss with swiglu_limit in its config, as released; nemotron
#: and phi of configs whose heads rotate 16 of 32 dimensions, families.py's)
EXACT = ("gemma", "gpt_oss", "granite", "llama", "mistral", "nemotron", "phi", "phi3", "qwen3")
ONNX_FOLDER_ARCHS = ("gemma2", "gpt_neox", "qwen3")
MERGED_ARCHS = ("bloom", "gpt_neox", "phi3")
EOS = 2


@pytest.fixture(scope="module")
def layouts():
    from model_builders.layouts import layout_models

    return layout_models()


@pytest.fixture(scope="module")
def oracle(layouts):
    from conftest import Oracle

    return Oracle({f"hf/{name}": path for name, path in layouts["hf"].items()})


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


def _hf_name(build: str) -> str:
    """The Hugging Face folder a genai build was made from (Nemotron and Phi: families.py's)."""
    from model_builders.layouts import FROM_FAMILIES

    return f"{build}-rotary16" if build in FROM_FAMILIES else build


def _rows(model, prompts) -> list:
    ctx = generation.context(model, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
    return generation.generate(ctx, prompts, seeds=list(range(len(prompts))))


def _transformers(oracle, name, prompts) -> list:
    return [oracle.greedy(name, p, MAX_NEW, min_new_tokens=MAX_NEW) for p in prompts]


def og_greedy(folder, batch: list[list[int]]) -> list[list[int]]:
    """onnxruntime-genai's generator, greedy, `batch` in one run (left-padded with pad id 0 where the
    lengths differ, as its examples do), MAX_NEW tokens each without a final eos."""
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    width = max(len(p) for p in batch)
    params.set_search_options(do_sample=False, batch_size=len(batch), max_length=width + MAX_NEW,
                              min_length=width + MAX_NEW)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([[0] * (width - len(p)) + p for p in batch], np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    rows = [[int(t) for t in generator.get_sequence(i)][width:] for i in range(len(batch))]
    return [r[:-1] if r and r[-1] == EOS else r for r in rows]


# ------------------------------------------------------------------------------------------------
# onnxruntime-genai builds
# ------------------------------------------------------------------------------------------------
def test_the_genai_builder_takes_these_architectures(layouts):
    """What the builder refuses is recorded at build time: a builder that takes one more family (or
    stops failing on SmolLM3's NoPE layers) fails here until the family joins EXACT or DEPARTS."""
    from model_builders.layouts import GENAI, REFUSED_BY_ORT

    built = sorted(set(layouts["genai"]) - set(REFUSED_BY_ORT))
    assert built == sorted(set(GENAI) - {"smollm3"}) == sorted(set(EXACT) | set(DEPARTS))
    assert layouts["refused"]["smollm3"] == "KeyError: 'position_ids'"
    assert all(m.startswith("NotImplementedError") for a, m in layouts["refused"].items() if a != "smollm3")
    assert set(layouts["refused"]) | set(built) == set(MODES) - {"llama-merged"}


@pytest.mark.parametrize("build", EXACT)
def test_genai_builds_equal_transformers(layouts, load_model, oracle, prompts, build):
    model = load_model(layouts["genai"][build])
    assert model.graph.native_mode == "in_place" and model.graph.has_group_query_attention
    rows = _rows(model, prompts)
    assert rows == _transformers(oracle, _hf_name(build), prompts)
    assert len({tuple(r) for r in rows}) == len(prompts) and all(len(set(r)) >= 4 for r in rows)


@pytest.mark.parametrize("build", sorted(DEPARTS))
def test_genai_builds_that_depart_equal_their_own_generator(layouts, load_model, oracle, prompts, prompts_of, build):
    """Every row of the mixed batch is onnxruntime-genai's generator's on its prompt alone; its batch of
    prompts of one length is its rows alone too (ours the same); transformers gives other tokens."""
    folder = layouts["genai"][build]
    model = load_model(folder)
    assert model.graph.native_mode == "in_place"
    rows = _rows(model, prompts)
    assert rows == [og_greedy(folder, [p])[0] for p in prompts] and all(len(r) == MAX_NEW for r in rows)
    assert rows != _transformers(oracle, build, prompts), f"{build} equals transformers: {DEPARTS[build]}?"
    same_length = prompts_of((11, 11), seed=9)
    alone = [og_greedy(folder, [p])[0] for p in same_length]
    assert og_greedy(folder, same_length) == alone == _rows(model, same_length)


@pytest.mark.parametrize("build", sorted(DEPARTS))
def test_where_the_genai_builder_departs_its_graph_says_why(layouts, oracle, build):
    import onnx

    graph = onnx.load(str(layouts["genai"][build] / "model.onnx"), load_external_data=False).graph
    ops = {n.op_type for n in graph.node}
    if build == "olmo":
        assert "SimplifiedLayerNormalization" in ops and "LayerNormalization" not in ops
        return
    windows = tuple(onnx.helper.get_attribute_value(a) > 0 for n in graph.node if n.op_type == "GroupQueryAttention"
                    for a in n.attribute if a.name == "local_window_size")
    theirs = tuple(t == "sliding_attention" for t in oracle.config(build).layer_types)
    assert (theirs, windows) == WINDOWED_LAYERS[build]


def test_a_genai_graph_onnxruntime_refuses_is_refused_by_its_own_generator_too(layouts):
    """The matrix's Nemotron and Phi rotate 8 of 16 dimensions: the builder writes a cos_cache 4 wide,
    which GroupQueryAttention refuses (at least 8, in multiples of 8), in onnxruntime-genai as here."""
    from model_builders.layouts import REFUSED_BY_ORT

    for build in REFUSED_BY_ORT:
        with pytest.raises(Exception, match="cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8"):
            og_greedy(layouts["genai"][build], [[5, 6, 7]])
        model = generation.load(layouts["genai"][build], threads=1)
        with pytest.raises(Exception, match="cos_cache dimension 1 must be"):
            _rows(model, [[5, 6, 7]])


def test_the_generators_batch_of_mixed_lengths_is_not_a_reference(layouts, prompts):
    """Why the rows above are compared with the generator on each prompt alone: its left-padded batch
    gives the shorter rows other tokens, on an exact family too (GroupQueryAttention on the CPU)."""
    folder = layouts["genai"]["llama"]
    batched, alone = og_greedy(folder, prompts), [og_greedy(folder, [p])[0] for p in prompts]
    assert batched[-1] == alone[-1] and batched[:-1] != alone[:-1]


# ------------------------------------------------------------------------------------------------
# transformers.js / onnx-community layouts
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ONNX_FOLDER_ARCHS)
def test_the_onnx_folder_equals_transformers(layouts, load_model, oracle, prompts, arch):
    folder = layouts["onnx"][arch]
    model = load_model(folder, fuse=True)
    assert (model.fused_from or model.decoder_path) == folder / "onnx" / "model.onnx"
    assert model.graph.native_mode == MODES[arch]
    assert _rows(model, prompts) == _transformers(oracle, arch, prompts)


@pytest.mark.parametrize("variant", ["q4", "fp16"])
@pytest.mark.parametrize("arch", ONNX_FOLDER_ARCHS)
def test_a_variant_runs_its_own_graph(layouts, oracle, prompts, arch, variant):
    """The oracle for weights transformers cannot hold: the variant's graph as exported, each prompt
    alone. As a server loads it (fused where the rewrite takes it), the mixed batch gives those rows."""
    folder = layouts["onnx"][arch]
    served = generation.load(folder, variant=variant, threads=1)
    exported = generation.load(folder, variant=variant, threads=1, fuse=False)
    assert exported.decoder_path == folder / "onnx" / f"model_{variant}.onnx"
    rows = _rows(served, prompts)
    assert rows == [_rows(exported, [p])[0] for p in prompts]
    if variant == "q4":  # not fp32's model (fp16 rounding may or may not flip a token)
        assert rows != _transformers(oracle, arch, prompts)


@pytest.mark.parametrize("arch", ONNX_FOLDER_ARCHS)
def test_the_int8_variant_runs_its_own_graph_row_by_row(layouts, oracle, prompts, arch):
    """model_quantized.onnx, each prompt alone: as a server loads it, the graph's own tokens."""
    folder = layouts["onnx"][arch]
    served = generation.load(folder, variant="quantized", threads=1)
    exported = generation.load(folder, variant="quantized", threads=1, fuse=False)
    assert exported.decoder_path == folder / "onnx" / "model_quantized.onnx"
    rows = [_rows(served, [p])[0] for p in prompts]
    assert rows == [_rows(exported, [p])[0] for p in prompts] != _transformers(oracle, arch, prompts)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("arch", ONNX_FOLDER_ARCHS)
def test_the_int8_variants_rows_do_not_depend_on_the_batch(layouts, prompts, arch, fuse):
    """The mixed batch (padding positions in the shorter prompts, padding rows in the steps) gives
    each row the tokens of its prompt alone, through the same load: each row's activations take
    their own scale (runtime.int8_rows) and prompts run by length (graph.prompts_by_length)."""
    model = generation.load(layouts["onnx"][arch], variant="quantized", threads=1, fuse=fuse)
    assert model.graph.prompts_by_length
    assert _rows(model, prompts) == [_rows(model, [p])[0] for p in prompts]


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("arch", MERGED_ARCHS)
def test_the_merged_decoder_equals_transformers(layouts, load_model, oracle, prompts, arch, fuse):
    """As a server loads it (fused where the rewrite takes it) and as exported (both If branches)."""
    folder = layouts["merged"][arch]
    model = load_model(folder, fuse=fuse)
    merged = folder / "onnx" / "decoder_model_merged.onnx"
    assert (model.fused_from or model.decoder_path) == merged
    assert model.graph.native_mode == (MODES[arch] if fuse else "append")
    assert model.graph.has_use_cache_branch == (model.fused_from is None)
    assert _rows(model, prompts) == _transformers(oracle, arch, prompts)


# ------------------------------------------------------------------------------------------------
# a beam search in each layout kind
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,arch", [("genai", "qwen3"), ("onnx", "gemma2"), ("merged", "bloom")])
def test_a_beam_search_equals_transformers(layouts, load_model, oracle, prompts, kind, arch):
    from test_beam import transformers_beams

    ctx = generation.context(load_model(layouts[kind][arch], fuse=True), max_new_tokens=MAX_NEW)
    settings = ctx.with_settings(num_beams=3, num_return_sequences=2)
    got = generation.beam_search(ctx, prompts[1:], seeds=[0, 1], settings=[settings, settings])
    for prompt, hypotheses in zip(prompts[1:], got):
        expected = transformers_beams(oracle, arch, prompt, MAX_NEW, num_beams=3, num_return_sequences=2)
        assert [h.tokens for h in hypotheses] == [tokens for tokens, _, _ in expected]
        assert [h.score for h in hypotheses] == pytest.approx([score for _, score, _ in expected], rel=1e-4)
