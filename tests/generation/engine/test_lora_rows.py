"""LoRA adapters per row (generation.runtime.lora) against transformers + PEFT.

Invariant: in every layout (the Optimum export as its fused rewrite and as exported, the merged
decoder, the onnxruntime-genai build; Llama, Qwen2, and Phi-3 with q|k|v and gate|up packed), a
batch mixing rows of three adapters (model_builders.lora: other ranks, targets and scalings) and
rows without one gives each row the greedy tokens, and the log-probabilities within 1e-4, of
PEFT's model on that prompt alone with that adapter (or with adapters disabled). A seeded sampled
row's tokens do not depend on its batch or its neighbours' adapters; a beam search with an
adapter is PEFT's; an adapter loaded into a place another left (the LRU) gives its own tokens;
what cannot run is refused naming the setting.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.params.checks import SettingError
from generation.runtime.errors import ModelError
from generation.runtime.lora.adapter import AdapterError
from generation.runtime.lora.registry import LoraSpec

MAX_NEW = 10
ADAPTERS = ["a1", None, "a2", "a3", "a2", None]
# (fixture folder, oracle, fuse, its cache mode)
LAYOUTS = [("llama-optimum", "llama", True, "in_place"), ("llama-optimum", "llama", False, "append"),
           ("llama-genai", "llama", False, "in_place"), ("llama-merged", "llama", False, "append"),
           ("qwen2-genai", "qwen2", False, "in_place"), ("phi3-optimum", "phi3", True, "in_place"),
           ("phi3-optimum", "phi3", False, "append")]


@pytest.fixture(scope="module")
def folders(test_models):
    from model_builders.families import ensure_family_models

    return {**test_models, **ensure_family_models()}


@pytest.fixture(scope="module")
def adapters(folders, tmp_path_factory):
    from model_builders.lora import PACKED, build_adapters

    root = tmp_path_factory.mktemp("adapters")
    return {kind: build_adapters(folders[f"hf/{kind}"], root / kind, PACKED if kind == "phi3" else None)
            for kind in ("llama", "qwen2", "phi3")}


@pytest.fixture(scope="module")
def peft(folders, adapters):
    from model_builders.lora import peft_model

    return {kind: peft_model(folders[f"hf/{kind}"], found) for kind, found in adapters.items()}


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of((4, 1, 7, 3, 5, 9), seed=11)


def spec_of(found, **kw) -> LoraSpec:
    return LoraSpec(modules=tuple((name, str(path)) for name, path in found.items()), **{"max_lora_rank": 8, **kw})


def peft_greedy(model, prompt, adapter, **kw) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens (no eos) and their log-probabilities, the prompt alone."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
        else:
            model.set_adapter(adapter)
            out = model.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                 pad_token_id=0, output_scores=True, return_dict_in_generate=True, **kw)
    tokens = out.sequences[0, len(prompt):].tolist()
    if kw.get("num_beams", 1) > 1:
        return tokens, []
    scores = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0]
    return tokens, scores.tolist()


def load(folders, layout, found, **kw):
    folder, _, fuse, _ = layout
    return generation.load(folders[folder], threads=1, fuse=fuse, lora=spec_of(found, **kw))


@pytest.mark.parametrize("layout", LAYOUTS, ids=[f"{f}-{m}{'-fused' if fu else ''}" for f, _, fu, m in LAYOUTS])
def test_a_mixed_batch_gives_each_row_peft_alone(folders, adapters, peft, prompts, layout):
    kind = layout[1]
    model = load(folders, layout, adapters[kind])
    assert model.graph.native_mode == layout[3]
    ctx = generation.context(model, max_new_tokens=MAX_NEW, do_sample=False, token_logprobs=True, eos_token_id=None)
    rows = generation.generate(ctx, prompts, adapters=ADAPTERS)
    moved = 0
    for prompt, adapter, row in zip(prompts, ADAPTERS, rows):
        tokens, logprobs = peft_greedy(peft[kind], prompt, adapter)
        assert row.tokens == tokens, (adapter, prompt)
        np.testing.assert_allclose(row.logprobs, logprobs, atol=1e-4)
        moved += adapter is not None and tokens != peft_greedy(peft[kind], prompt, None)[0]
    assert moved >= 3  # the adapters change the tokens: a row given none would fail


def test_a_sampled_row_is_its_own_in_any_batch(folders, adapters, prompts):
    model = load(folders, LAYOUTS[0], adapters["llama"])
    ctx = generation.context(model, max_new_tokens=MAX_NEW, do_sample=True, top_k=0, eos_token_id=None)
    alone = generation.generate(ctx, [prompts[2]], seeds=[7], adapters=["a2"])[0]
    mixed = generation.generate(ctx, prompts, seeds=[1, 2, 7, 4, 5, 6], adapters=["a1", None, "a2", "a3", "a1", "a3"])
    assert mixed[2] == alone
    other = generation.generate(ctx, [prompts[2]], seeds=[7], adapters=["a1"])[0]
    assert other != alone  # the adapter, not only the seed, decides the draws' distribution


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]], ids=["in_place", "append"])
def test_a_beam_search_with_an_adapter_is_pefts(folders, adapters, peft, prompts, layout):
    model = load(folders, layout, adapters["llama"])
    ctx = generation.context(model, max_new_tokens=MAX_NEW, num_beams=3, do_sample=False, eos_token_id=None)
    rows = generation.generate(ctx, prompts[:2], adapters=["a2", "a1"])
    for prompt, adapter, row in zip(prompts, ("a2", "a1"), rows):
        assert row == peft_greedy(peft["llama"], prompt, adapter, num_beams=3)[0]


def test_an_adapter_takes_the_place_the_least_recently_used_one_leaves(folders, adapters, peft, prompts):
    model = load(folders, LAYOUTS[0], adapters["llama"], max_loras=2)
    ctx = generation.context(model, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    for names in (["a1", "a2"], ["a3", None], ["a1", "a3"], ["a2", "a2"]):
        rows = generation.generate(ctx, prompts[:2], adapters=names)
        for prompt, adapter, row in zip(prompts, names, rows):
            assert row == peft_greedy(peft["llama"], prompt, adapter)[0], names
    assert model.lora.loads >= 5 and model.lora.evictions >= 3
    assert len(model.lora.places) == 2


def test_what_cannot_run_is_refused_by_name(folders, adapters, prompts, tmp_path):
    model = load(folders, LAYOUTS[0], adapters["llama"])
    ctx = generation.context(model, max_new_tokens=2)
    with pytest.raises(SettingError) as e:
        generation.generate(ctx, prompts[:1], adapters=["nope"])
    assert e.value.setting == "adapter" and "a1, a2, a3" in str(e.value)
    with pytest.raises(SettingError, match="adapters"):
        generation.generate(ctx, prompts[:2], adapters=["a1"])
    plain = generation.context(generation.load(folders["llama-genai"], threads=1), max_new_tokens=2)
    with pytest.raises(SettingError, match="without LoRA adapters"):
        generation.generate(plain, prompts[:1], adapters=["a1"])
    with pytest.raises(AdapterError, match="^r: .*max_lora_rank 4"):
        load(folders, LAYOUTS[0], adapters["llama"], max_lora_rank=4)
    def later_layer(name, array):
        return name.replace("layers.1.", "layers.7."), array

    def narrower(name, array):
        return name, array[:, :32] if "lora_A" in name else array

    for edit, message in ((later_layer, "^target_modules: .*layers.7.* is not in the base model's graph"),
                          (narrower, "^target_modules: .* maps 32 -> ")):
        folder = edited(adapters["llama"]["a3"], tmp_path / edit.__name__, edit)
        with pytest.raises(AdapterError, match=message):
            generation.load(folders["llama-genai"], lora=spec_of({"bad": folder}))
    with pytest.raises(ModelError, match="precision 'int8'"):
        generation.load(folders["llama-optimum"], precision="int8", lora=spec_of(adapters["llama"]))
    with pytest.raises(ValueError, match="max_loras must be"):
        LoraSpec(max_loras=0)


def edited(folder, out, edit):
    """A copy of adapter `folder` whose tensors went through `edit(name, array) -> (name, array)`."""
    import shutil

    from safetensors.numpy import save_file

    from generation.runtime.lora.adapter import read_safetensors

    shutil.copytree(folder, out)
    tensors = dict(edit(k, v) for k, v in read_safetensors(out / "adapter_model.safetensors").items())
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, out / "adapter_model.safetensors")
    return out
