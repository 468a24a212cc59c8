"""Sliding windows, exact everywhere (model_builders.windows: Mistral, every layer local, and
GPT-Neo, a global layer then a local one; window 8, so prompts and answers cross it).

Invariant: a row's window is its own. Every row gets the tokens transformers 4.57 gives its
prompt alone, in every cache mode (append: the Optimum graphs, whose window counts buffer
columns; grow; in_place: GroupQueryAttention's local_window_size), in a batch of prompts of 1 to
20 tokens, whole or in pieces; joining a running batch through the Scheduler; as a beam search
beside rows of other lengths; over a reused prefix; with candidates verified (prompt lookup, a
draft model).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import generation
from generation.assisted.prompt_lookup import PromptLookup
from generation.cache.windowed import WindowedAppendCache
from generation.engine.scheduler import Scheduler
from generation.runtime.model import Model

MAX_NEW = 24
LENGTHS = (1, 5, 11, 3, 20)
# fixture folder, oracle model, cache mode
MODES = [("mistral-optimum", "mistral", "append"), ("gpt_neo-optimum", "gpt_neo", "append"),
         ("mistral-optimum", "mistral", "grow"), ("mistral-genai", "mistral", "in_place")]
JOINING = [m for m in MODES if m[2] != "grow"]
APPEND = [m for m in MODES if m[2] == "append"]


def ids(modes):
    return [f"{folder}-{mode}" for folder, _, mode in modes]


@pytest.fixture(scope="module")
def windows(pytestconfig):
    from model_builders.windows import ensure_window_models

    return ensure_window_models()


@pytest.fixture(scope="module")
def oracle(windows):
    from conftest import Oracle

    return Oracle(windows)


@pytest.fixture(scope="module")
def prompts(prompts_of):
    return prompts_of(LENGTHS, seed=5)


def context(windows, load_model, folder, mode, **settings):
    return generation.context(load_model(windows[folder]), cache_mode=mode, **{"max_new_tokens": MAX_NEW, **settings})


def run_all(scheduler: Scheduler, add_at: dict | None = None) -> None:
    """Steps until every job ended; `add_at`: {step: [jobs]} added at those step boundaries."""
    add_at, step = dict(add_at or {}), 0
    while scheduler.busy or add_at:
        for job in add_at.pop(step, []):
            scheduler.add(job)
        scheduler.step()
        step += 1


def test_the_window_matters(windows, oracle, prompts):
    """Guard: without its window the same weights answer otherwise (the fixtures cross it)."""
    import torch
    import transformers

    widened = {"mistral": dict(sliding_window=None), "gpt_neo": dict(attention_layers=["global", "global"])}
    for name, override in widened.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(windows[f"hf/{name}"], **override).eval()
        ids = torch.tensor([prompts[2]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                                 pad_token_id=0)
        assert out[0, ids.shape[1]:].tolist() != oracle.greedy(name, prompts[2], MAX_NEW), name
        assert len(set(oracle.greedy(name, prompts[2], MAX_NEW))) > 5, name


def test_append_caches_of_windowed_models_keep_rows_where_the_window_looks(windows, test_models, load_model):
    for folder in ("mistral-optimum", "gpt_neo-optimum"):
        state = generation.new_state(generation.context(load_model(windows[folder])), slots=2, capacity=32)
        assert type(state.cache) is WindowedAppendCache, folder
    state = generation.new_state(generation.context(load_model(test_models["llama-optimum"])), slots=2, capacity=32)
    assert type(state.cache) is not WindowedAppendCache


def test_rows_copied_from_slots_of_other_lengths(windows, load_model, oracle, prompts_of):
    """copy_rows takes the first `length` rows of each source wherever they end (a prefix of a
    longer row too): the copies step as their sources, and as transformers."""
    import numpy as np

    long = prompts_of([11], seed=3)[0]
    short = long[:5]
    ctx = context(windows, load_model, "mistral-optimum", "append")
    state = generation.new_state(ctx, slots=4, capacity=32)
    state, _ = generation.admit(ctx, state, [0, 1], [short, long], seeds=[0, 1])
    state.cache.copy_rows([2, 3], [0, 1], 5)
    state.cache.token_input[:] = 9
    logits = state.cache.decode(np.array([5, 11, 5, 5])).copy()
    np.testing.assert_allclose(logits[[2, 3]], logits[[0, 0]], atol=1e-5)
    np.testing.assert_allclose(logits[0], oracle.logits("mistral", short + [9])[-1], atol=1e-4)
    np.testing.assert_allclose(logits[1], oracle.logits("mistral", long + [9])[-1], atol=1e-4)


@pytest.mark.parametrize("config, window", [
    (dict(model_type="mistral", sliding_window=8, max_position_embeddings=256), 8),
    (dict(model_type="mistral", sliding_window=None, max_position_embeddings=256), None),
    (dict(model_type="mistral", sliding_window=4096, max_position_embeddings=4096), None),  # never crossed
    (dict(model_type="qwen2", sliding_window=8, use_sliding_window=False, max_position_embeddings=256), None),
    (dict(model_type="qwen2", sliding_window=8, use_sliding_window=True, max_position_embeddings=256,
          layer_types=["full_attention", "sliding_attention"]), 8),
    (dict(model_type="gemma3_text", sliding_window=8, max_position_embeddings=256,
          layer_types=["sliding_attention", "full_attention"]), 8),
    (dict(model_type="gemma3_text", sliding_window=8, max_position_embeddings=256,
          layer_types=["full_attention", "full_attention"]), None),
    (dict(model_type="gpt_neo", window_size=8, attention_layers=["global", "local"], max_position_embeddings=256), 8),
    (dict(model_type="gpt_neo", window_size=8, attention_layers=["global", "global"], max_position_embeddings=256), None),
    (dict(model_type="llama", max_position_embeddings=256), None),
])
def test_the_window_is_read_from_the_config(config, window):
    model = SimpleNamespace(config=config, max_context=config["max_position_embeddings"])
    assert Model.attention_window.fget(model) == window


@pytest.mark.parametrize("steps", ["whole", "pieces"])
@pytest.mark.parametrize("folder, name, mode", MODES, ids=ids(MODES))
def test_a_batch_of_mixed_lengths_equals_transformers_alone(windows, load_model, oracle, prompts, folder, name, mode,
                                                            steps):
    ctx = context(windows, load_model, folder, mode, prompt_steps=steps)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    assert rows == [oracle.greedy(name, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("folder, name, mode", JOINING, ids=ids(JOINING))
def test_rows_joining_a_running_batch_keep_their_own_window(windows, load_model, oracle, prompts, folder, name, mode):
    """Through the Scheduler: the 11-token row runs alone, a 1-token row joins at step 3 and a
    5-token one at step 9 (the first row is then far past the window), and a fourth row waits for
    a slot that a finished row leaves."""
    ctx = context(windows, load_model, folder, mode)
    scheduler = Scheduler(ctx, slots=3, capacity=64)
    order = [2, 0, 1, 4]
    jobs = [scheduler.job(prompts[i], seed=i, settings=dict(max_new_tokens=MAX_NEW - 6 * k))
            for k, i in enumerate(order)]
    run_all(scheduler, {0: [jobs[0]], 3: [jobs[1]], 9: [jobs[2], jobs[3]]})
    assert [j.tokens for j in jobs] == [oracle.greedy(name, prompts[i], MAX_NEW - 6 * k) for k, i in enumerate(order)]


@pytest.mark.parametrize("folder, name, mode", JOINING, ids=ids(JOINING))
def test_a_beam_search_beside_rows_of_other_lengths(windows, load_model, oracle, prompts, folder, name, mode):
    from test_beam import transformers_beams

    ctx = context(windows, load_model, folder, mode, max_new_tokens=16)
    scheduler = Scheduler(ctx, slots=5, capacity=64)
    beams = scheduler.job(prompts[1], settings=dict(num_beams=3, num_return_sequences=2))
    plain = [scheduler.job(prompts[i], seed=i) for i in (4, 0)]
    run_all(scheduler, {0: [plain[0], beams], 4: [plain[1]]})
    expected = transformers_beams(oracle, name, prompts[1], 16, num_beams=3, num_return_sequences=2)
    assert [h.tokens for h in beams.hypotheses] == [tokens for tokens, _, _ in expected]
    assert [h.score for h in beams.hypotheses] == pytest.approx([score for _, score, _ in expected], rel=1e-4)
    assert [j.tokens for j in plain] == [oracle.greedy(name, prompts[i], 16) for i in (4, 0)]


@pytest.mark.parametrize("folder, name, mode", JOINING, ids=ids(JOINING))
def test_rows_over_a_reused_prefix(windows, load_model, oracle, prompts_of, folder, name, mode):
    """Prompts sharing a 16-token block, interleaved with rows of other lengths: the later ones
    run only their rest over the cached block, and every row is transformers' alone."""
    system = prompts_of([18], seed=7)[0]
    asked = [system + [11, 12, 13], [40], system + [21, 22, 23, 24, 25, 26, 27], system[:17], [50, 51, 52, 53]]
    ctx = context(windows, load_model, folder, mode, max_new_tokens=16)
    scheduler = Scheduler(ctx, slots=3, capacity=64, prefix_cache_bytes=2**20)
    jobs = [scheduler.job(p, seed=i) for i, p in enumerate(asked)]
    run_all(scheduler, {0: jobs[:2], 2: jobs[2:4], 5: jobs[4:]})
    assert [j.cached_tokens for j in jobs] == [0, 0, 16, 16, 0]
    assert [j.tokens for j in jobs] == [oracle.greedy(name, p, 16) for p in asked]


@pytest.mark.parametrize("folder, name, mode", APPEND, ids=ids(APPEND))
def test_prompt_lookup_verifies_inside_each_rows_window(windows, load_model, oracle, prompts_of, folder, name, mode):
    """Prompt lookup candidates, verified for rows of different lengths in one run (some kept,
    some not): the plain greedy tokens of each row alone."""
    base = prompts_of([6, 9], seed=11)
    asked = [base[0] * 3, base[1] * 2 + base[1][:4], [7, 8, 7, 8, 7], [60]]
    ctx = context(windows, load_model, folder, mode)
    scheduler = Scheduler(ctx, slots=4, capacity=96, lookup=PromptLookup())
    verified = []
    verify = scheduler.state.cache.verify
    scheduler.state.cache.verify = lambda *a: verified.append(1) or verify(*a)
    jobs = [scheduler.job(p, seed=i, settings=dict(prompt_lookup_num_tokens=3)) for i, p in enumerate(asked)]
    run_all(scheduler, {0: jobs[:3], 4: jobs[3:]})
    assert verified
    assert [j.tokens for j in jobs] == [oracle.greedy(name, p, MAX_NEW) for p in asked]


def test_a_draft_model_verifies_inside_each_rows_window(windows, load_model, oracle, prompts):
    """GPT-Neo drafts for Mistral (the same tokenizer): the draft's cache cuts its rows back to
    what the target kept, and rows of every length get the target's greedy tokens."""
    ctx = generation.compile(generation.context(load_model(windows["mistral-optimum"]), max_new_tokens=MAX_NEW,
                                                draft=load_model(windows["gpt_neo-optimum"]), num_assistant_tokens=3),
                             batch_size=3)
    rows = generation.generate(ctx, prompts, seeds=list(range(len(prompts))))
    assert rows == [oracle.greedy("mistral", p, MAX_NEW) for p in prompts]
