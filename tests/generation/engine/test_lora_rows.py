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


def batcher_of(model, **kw):
    from generation.engine.batching import ContinuousBatcher

    ctx = generation.context(model, do_sample=False, eos_token_id=None)
    return ContinuousBatcher(ctx, **{"slots": 4, "kv_cache_bytes": 0, "prefill_chunk_tokens": 0, **kw})


def test_the_prefix_cache_names_an_adapters_rows_by_the_adapter(folders, adapters, peft, prompts_of):
    """A prompt's blocks computed with an adapter are found again by that adapter's rows only; a
    conversation's next turn with an adapter finds its previous answer too."""
    model = load(folders, LAYOUTS[0], adapters["llama"])
    batcher = batcher_of(model, prefix_cache_bytes=1 << 24)
    try:
        prompt = prompts_of((40,), seed=21)[0]

        def run(adapter, tokens=prompt):
            settings = {"max_new_tokens": MAX_NEW} | ({"adapter": adapter} if adapter else {})
            done = batcher.submit(tokens, settings=settings).result(timeout=60)
            assert done.tokens == peft_greedy(peft["llama"], tokens, adapter)[0], adapter
            return done

        assert [run(a).cached_tokens for a in ("a1", "a1", "a2", None, None, "a2")] == [0, 32, 0, 0, 32, 32]
        first = run("a3")
        turn = prompt + first.tokens + prompts_of((5,), seed=22)[0]
        assert run("a3", turn).cached_tokens >= len(prompt) + MAX_NEW - 16  # its answer's blocks too
        assert run("a1", turn).cached_tokens == 32  # a1's prompt blocks, not a3's answer
    finally:
        batcher.close()


def test_loads_unloads_and_evictions_while_rows_run_leave_their_tokens(folders, adapters, peft, prompts_of):
    model = load(folders, LAYOUTS[0], {"a1": adapters["llama"]["a1"], "a2": adapters["llama"]["a2"]}, max_loras=2)
    batcher = batcher_of(model, prefill_chunk_tokens=2)  # a3's prompt in chunks, between a1's steps
    long = 40
    try:
        prompts = prompts_of((6, 9, 4, 11), seed=31)
        assert batcher.submit(prompts[2], settings={"max_new_tokens": 2, "adapter": "a2"}).result(timeout=60)
        running = [batcher.submit(prompts[0], settings={"max_new_tokens": long, "adapter": "a1"}),
                   batcher.submit(prompts[1], settings={"max_new_tokens": long})]
        next(iter(running[0].events(timeout=60)))  # a1's row is running, at place 2 (a2 has place 1)
        batcher.load_adapter("a3", str(adapters["llama"]["a3"]))
        # a2 is idle: a3 (rank 6) takes its place (rank 8), and a1's rows move while its row runs
        third = batcher.submit(prompts[3], settings={"max_new_tokens": MAX_NEW, "adapter": "a3"}).result(timeout=60)
        assert third.tokens == peft_greedy(peft["llama"], prompts[3], "a3")[0]
        batcher.unload_adapter("a1")  # its running row finishes with it
        with pytest.raises(SettingError, match="adapter 'a1' is not one this model knows"):
            batcher.submit(prompts[3], settings={"adapter": "a1"})
        import torch

        for request, prompt, adapter in zip(running, prompts, ("a1", None)):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                if adapter:
                    peft["llama"].set_adapter(adapter)
                    want = peft["llama"].generate(ids, max_new_tokens=long, do_sample=False, eos_token_id=None,
                                                  pad_token_id=0)
                else:
                    with peft["llama"].disable_adapter():
                        want = peft["llama"].generate(ids, max_new_tokens=long, do_sample=False, eos_token_id=None,
                                                      pad_token_id=0)
            assert request.result(timeout=60).tokens == want[0, len(prompt):].tolist(), adapter
        assert model.lora.evictions == 1 and batcher.adapter_names() == ["a2", "a3"]
        with pytest.raises(AdapterError, match="lora_name 'a2' is loaded already"):
            batcher.load_adapter("a2", str(adapters["llama"]["a2"]))
    finally:
        batcher.close()


@pytest.mark.parametrize("chunk", [4, 0], ids=["in-chunks", "whole"])
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]], ids=["in_place", "append"])
def test_chunked_prompts_and_preempted_rows_keep_their_adapters(folders, adapters, peft, prompts_of, chunk, layout):
    """A prompt run in chunks between the running rows' steps, and a row preempted for an
    interactive one and resumed (in chunks, or whole), each with its adapter, get PEFT's tokens."""
    model = load(folders, layout, adapters["llama"])
    batcher = batcher_of(model, slots=2, prefill_chunk_tokens=chunk, prefix_cache_bytes=1 << 24)
    try:
        prompts = prompts_of((21, 5, 6, 13), seed=41)
        names = ("a2", "a1", "a3", None)
        batch = [batcher.submit(p, settings={"max_new_tokens": 24, "adapter": a} if a else {"max_new_tokens": 24},
                                priority=1) for p, a in zip(prompts[:2], names)]
        next(iter(batch[0].events(timeout=60)))
        urgent = [batcher.submit(p, settings={"max_new_tokens": MAX_NEW} | ({"adapter": a} if a else {}))
                  for p, a in zip(prompts[2:], names[2:])]
        for request, prompt, adapter in zip(urgent, prompts[2:], names[2:]):
            assert request.result(timeout=60).tokens == peft_greedy(peft["llama"], prompt, adapter)[0]
        import torch

        for request, prompt, adapter in zip(batch, prompts, names):
            peft["llama"].set_adapter(adapter)
            with torch.no_grad():
                want = peft["llama"].generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                                              eos_token_id=None, pad_token_id=0)
            assert request.result(timeout=60).tokens == want[0, len(prompt):].tolist(), adapter
        assert batcher.preemptions >= 1
    finally:
        batcher.close()


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1]], ids=["in_place", "append"])
def test_assisted_rows_verify_with_their_adapter(folders, adapters, peft, prompts, layout):
    """Prompt lookup's candidates and a draft model's (the draft runs without adapters) are
    verified by the model with each row's adapter: PEFT's greedy tokens."""
    model = load(folders, layout, adapters["llama"])
    lookup = generation.context(model, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                prompt_lookup_num_tokens=3)
    drafted = generation.context(model, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                 draft=str(folders["llama-optimum"]), num_assistant_tokens=3)
    for ctx in (lookup, drafted):
        repeated = [p + p for p in prompts[:4]]  # something for prompt lookup to find
        rows = generation.generate(ctx, repeated, adapters=ADAPTERS[:4])
        for prompt, adapter, row in zip(repeated, ADAPTERS, rows):
            assert row == peft_greedy(peft["llama"], prompt, adapter)[0], adapter
