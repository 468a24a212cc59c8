"""Prefix caching in the engine (generation.cache.prefix, Scheduler(prefix_cache_bytes=...)).

Invariants: with the cache, every job's tokens and log-probabilities equal those without it,
in every cache mode, for prefixes cut anywhere (inside a block, a prompt seen whole, a prompt
that is a prefix of another, a cached prefix longer than the new prompt), for greedy, sampled
and beam jobs, interleaved through one scheduler; the store finds what it should (its hit
count is the blocks shared) and keeps within its byte budget, the least recently used leaving
first.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation.cache.prefix import BLOCK, PrefixStore
from generation.engine.scheduler import Scheduler

MODES = [("llama-optimum", "append"), ("llama-genai", "in_place"), ("gpt2-grow", "grow")]
SYSTEM = [int(t) for t in np.random.default_rng(0).integers(3, 900, 40)]  # 2.5 blocks
PROMPTS = [
    SYSTEM + [11, 12, 13],               # a system prompt and a question
    SYSTEM + [21, 22, 23, 24, 25],       # the same system prompt, another question
    SYSTEM + [11, 12, 13],               # the first prompt again, whole
    SYSTEM[:20],                         # a prefix of the others, cut inside a block
    SYSTEM[:16],                         # exactly one block: its last block cannot be reused
    SYSTEM + [11, 12, 13] + SYSTEM[:30],  # longer than anything cached
    [7, 8, 9],                           # shorter than a block
]
JOBS = [dict(), dict(do_sample=True, temperature=0.9), dict(num_beams=3, num_return_sequences=2)]


def run(ctx, jobs, prefix_cache_bytes=0, together=False):
    """Each (prompt, seed, settings) job's (tokens, logprobs, hypotheses), through one scheduler:
    one after another (each prompt sees the ones before it cached), or all added at once."""
    scheduler = Scheduler(ctx, slots=6, capacity=160, isolate=False, prefix_cache_bytes=prefix_cache_bytes)
    made = [scheduler.job(p, seed=s, settings=settings) for p, s, settings in jobs]
    for job in made:
        scheduler.add(job)
        if not together:
            while scheduler.busy:
                scheduler.step()
    while scheduler.busy:
        scheduler.step()
    out = [(j.tokens, j.logprobs, [(h.tokens, h.score) for h in j.hypotheses or []]) for j in made]
    return out, scheduler.prefix, [j.cached_tokens for j in made]


def same(a, b):
    for (tokens, logprobs, hypotheses), (tokens2, logprobs2, hypotheses2) in zip(a, b):
        assert tokens == tokens2
        if logprobs is not None:
            np.testing.assert_allclose(logprobs, logprobs2, atol=1e-4)
        assert [h for h, _ in hypotheses] == [h for h, _ in hypotheses2]
        np.testing.assert_allclose([s for _, s in hypotheses], [s for _, s in hypotheses2], atol=1e-4)


@pytest.mark.parametrize("folder, mode", MODES, ids=[m[1] for m in MODES])
@pytest.mark.parametrize("together", [False, True], ids=["one after another", "interleaved"])
def test_the_cache_changes_no_token_and_no_logprob(test_models, load_model, folder, mode, together):
    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=8, token_logprobs=True)
    jobs = [(p, i, JOBS[i % len(JOBS)]) for i, p in enumerate(PROMPTS)]
    plain, _, none_cached = run(ctx, jobs)
    cached, store, reused = run(ctx, jobs, prefix_cache_bytes=64 * 2**20, together=together)
    same(plain, cached)
    assert none_cached == [0] * len(PROMPTS)
    assert sum(reused) == store.hits  # each job's own share (its usage.prompt_tokens_details.cached_tokens)
    if not together:  # each prompt found what the ones before it left: the system prompt's two blocks
        assert reused == [0, 2 * BLOCK, 2 * BLOCK, BLOCK, 0, 2 * BLOCK, 0]  # prompts 1, 2 and 5 two blocks, 3 one
        assert store.hits == 3 * 2 * BLOCK + BLOCK
        assert store.queries == sum(len(p) for p in PROMPTS)


@pytest.mark.parametrize("folder, mode", MODES, ids=[m[1] for m in MODES])
def test_a_conversations_next_turn_finds_the_answer_before_it_cached(test_models, load_model, folder, mode):
    """Four turns, each prompt the one before, its answer and a new message: every turn after the
    first finds the previous prompt and answer cached but the last token (it was never fed) cut to
    blocks, and its tokens and log-probabilities are a cold scheduler's; a prompt's own entry
    leaves once its row's answer is kept (the longer entry holds it whole)."""
    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=21, eos_token_id=[],
                             token_logprobs=True)
    messages = [SYSTEM + [11, 12, 13], [31, 32, 33, 34, 35], [41, 42], [51, 52, 53, 54, 55, 56, 57]]

    def converse(prefix_cache_bytes):
        scheduler = Scheduler(ctx, slots=4, capacity=200, isolate=False, prefix_cache_bytes=prefix_cache_bytes)
        prompt, turns = [], []
        for i, message in enumerate(messages):
            prompt = prompt + (turns[-1][0].tokens if turns else []) + message
            job = scheduler.job(prompt, seed=i, settings=dict(do_sample=i % 2 == 1, temperature=0.8))
            scheduler.add(job)
            while scheduler.busy:
                scheduler.step()
            turns.append((job, prompt))
        return turns, scheduler.prefix

    cold, _ = converse(0)
    warm, store = converse(64 * 2**20)
    for (job, prompt), (cold_job, _) in zip(warm, cold):
        assert job.tokens == cold_job.tokens
        np.testing.assert_allclose(job.logprobs, cold_job.logprobs, atol=1e-4)
    for (job, prompt), (before, before_prompt) in zip(warm[1:], warm):
        assert job.cached_tokens == (len(before_prompt) + len(before.tokens) - 1) // BLOCK * BLOCK
    assert len(store.entries) == 1  # the last turn's: it holds every earlier prompt and answer


@pytest.mark.parametrize("folder", ["llama-genai", "llama-optimum"])
def test_under_int8_a_next_turn_finds_its_answer_recomputed_bit_for_bit(test_models, folder):
    """Quantized activations (precision int8): a finished row's answer waits for the idle engine
    (`tidy`), which runs it again as a prompt's rest, a piece at a time; the next turn then finds
    the previous prompt and answer cached and its tokens and log-probabilities are a cold
    scheduler's bit for bit. An answer not yet recomputed is not cached: only the prompt's blocks."""
    from generation.engine import answers

    model = generation.load(test_models[folder], threads=1, precision="int8")
    assert model.graph.quantized_activations
    ctx = generation.context(model, max_new_tokens=40, eos_token_id=[], token_logprobs=True)
    messages = [SYSTEM + [11, 12, 13], [31, 32, 33, 34, 35], [41, 42]]

    def converse(prefix_cache_bytes, tidy):
        scheduler = Scheduler(ctx, slots=4, capacity=200, isolate=False, prefix_cache_bytes=prefix_cache_bytes)
        prompt, turns = [], []
        for i, message in enumerate(messages):
            prompt = prompt + (turns[-1][0].tokens if turns else []) + message
            job = scheduler.job(prompt, seed=i, settings=dict(do_sample=i == 1, temperature=0.8))
            scheduler.add(job)
            while scheduler.busy:
                scheduler.step()
            if prefix_cache_bytes:
                assert len(scheduler.answers) == (1 if tidy else i + 1)  # waiting for an idle engine
            pieces = 0
            while tidy and scheduler.tidy():
                pieces += 1
            new_blocks = (len(prompt) + 39) // BLOCK * BLOCK - len(prompt) // BLOCK * BLOCK  # past the prompt's
            assert pieces == (-(-new_blocks // 32) if tidy else 0)  # 32 tokens a piece
            turns.append((job, prompt))
        return turns

    answers.RECOMPUTE_TOKENS, kept = 32, answers.RECOMPUTE_TOKENS  # several pieces an answer
    try:
        cold, warm, untidy = converse(0, False), converse(64 * 2**20, True), converse(64 * 2**20, False)
    finally:
        answers.RECOMPUTE_TOKENS = kept
    for (job, prompt), (cold_job, cold_prompt) in zip(warm, cold):
        assert prompt == cold_prompt and job.tokens == cold_job.tokens
        np.testing.assert_array_equal(job.logprobs, cold_job.logprobs)
    for (job, _), (before, before_prompt) in zip(warm[1:], warm):
        assert job.cached_tokens == (len(before_prompt) + len(before.tokens) - 1) // BLOCK * BLOCK
    for (job, _), (_, before_prompt) in zip(untidy[1:], untidy):
        assert job.cached_tokens == len(before_prompt) // BLOCK * BLOCK  # the prompt's blocks only


def test_the_store_finds_prefixes_by_blocks_and_keeps_its_budget():
    rows = lambda n: {"k": np.arange(2 * n * 4, dtype=np.float32).reshape(2, n, 4)}  # noqa: E731 - [heads, n, dim]
    store = PrefixStore(max_bytes=2 * 48 * 4 * 4 + 10)  # room for 48 + a few rows, not 96
    a = list(range(100, 148))  # 3 blocks
    store.store(a, rows(48))
    assert store.lookup(a + [1])[0] == 48 and store.lookup(a)[0] == 32  # whole: its last token must run
    assert store.lookup(a[:40])[0] == 32 and store.lookup(a[:17])[0] == 16 and store.lookup(a[:16])[0] == 0
    length, found = store.lookup(a[:20] + [999] * 20)
    assert length == 16 and np.array_equal(found["k"], rows(48)["k"][:, :16])
    assert store.lookup([5] + a)[0] == 0  # a block is named by what comes before it too
    b = list(range(500, 548))
    store.store(b, rows(48))  # over the budget: the least recently used (a) leaves
    assert store.lookup(a + [1])[0] == 0 and store.lookup(b + [1])[0] == 48
    assert store.bytes <= store.max_bytes and len(store.entries) == 1
    store.store(b[:32], rows(32))  # held already (a prefix of b): nothing added
    assert len(store.entries) == 1
    with pytest.raises(ValueError, match="prefix cache bytes"):
        PrefixStore(-1)


@pytest.mark.parametrize("folder, mode", MODES, ids=[m[1] for m in MODES])
def test_a_prompt_only_job_warms_the_cache_for_the_prompts_that_follow(test_models, load_model, folder, mode):
    """max_new_tokens 0: no slot, no token, the prompt's log-probabilities if asked (as alone),
    and its blocks kept, so a later prompt that starts with it finds them; its tokens are the
    ones it gets without the cache."""
    from generation.logits.prompt_logprobs import prompt_logprobs

    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=8, token_logprobs=True)
    scheduler = Scheduler(ctx, slots=2, capacity=160, isolate=False, prefix_cache_bytes=64 * 2**20)
    warm = [scheduler.job(SYSTEM, settings={"max_new_tokens": 0}, prompt_logprobs=2),
            scheduler.job(SYSTEM[:20] + [5, 6], settings={"max_new_tokens": 0})]
    for job in warm:
        scheduler.add(job)
    _, ended = scheduler.step()
    assert {id(j) for j in ended} == {id(j) for j in warm} and scheduler.state.free_slots().size == 2
    assert [(j.reason, j.tokens) for j in warm] == [("length", []), ("length", [])]
    np.testing.assert_allclose(warm[0].prompt_logprobs.logprob, prompt_logprobs(ctx, SYSTEM, 2).logprob, atol=1e-5)
    assert warm[1].prompt_logprobs is None and scheduler.prefix.hits == 0
    later = [(SYSTEM + [11, 12, 13], 1, dict()), (SYSTEM + [21, 22], 2, dict(do_sample=True))]
    plain, _, _ = run(ctx, later)  # no cache
    follow = [scheduler.job(p, seed=s, settings=settings) for p, s, settings in later]
    for job in follow:
        scheduler.add(job)
    while scheduler.busy:
        scheduler.step()
    same(plain, [(j.tokens, j.logprobs, []) for j in follow])
    assert [j.cached_tokens for j in follow] == [2 * BLOCK, 2 * BLOCK]  # the warmed system prompt's blocks


@pytest.mark.parametrize("folder", ["qwen2vl-onnx", "idefics3-onnx"])
def test_a_vision_language_prefix_is_named_by_its_images_too(vision_paths, load_model, folder):
    """Prompts with images (Qwen2-VL: M-RoPE positions and deltas): one that repeats an earlier
    prompt's text and image finds it cached through the image; the same text with another image
    finds only the blocks before the image; the tokens and log-probabilities equal those without
    the cache, interleaved or one after another."""
    from generation.families.vl_prompts import prepare_parts

    rng = np.random.default_rng(3)
    image, other = (rng.integers(0, 256, (20, 28, 3), dtype=np.uint8) for _ in range(2))
    lead = "a long opening that every prompt shares before its image " * 2
    parts = [[lead, image, " what is it?"], [lead, image, " and its colour?"], [lead, other, " what is it?"],
             [lead + " no image here"]]
    ctx = generation.context(load_model(vision_paths[folder]), max_new_tokens=6, token_logprobs=True)
    prepared = prepare_parts(ctx, parts)
    jobs = [(p, i, JOBS[i % 2]) for i, p in enumerate(prepared.prompts)]

    def run_images(prefix_cache_bytes, together):
        scheduler = Scheduler(ctx, slots=4, capacity=400, isolate=False, prefix_cache_bytes=prefix_cache_bytes)
        made = [scheduler.job(p, seed=s, settings=settings, encoder=prepared.encoder.take([i]))
                for i, (p, s, settings) in enumerate(jobs)]
        for job in made:
            scheduler.add(job)
            while not together and scheduler.busy:
                scheduler.step()
        while scheduler.busy:
            scheduler.step()
        return [(j.tokens, j.logprobs, []) for j in made], [j.cached_tokens for j in made]

    plain, _ = run_images(0, False)
    for together in (False, True):
        cached, reused = run_images(64 * 2**20, together)
        same(plain, cached)
    _, reused = run_images(64 * 2**20, False)
    image_at = prepared.prompts[0].index(prepared.encoder.image_token_id)
    assert reused[1] >= (len(prepared.prompts[0]) - 8) // BLOCK * BLOCK - BLOCK  # through the image
    assert 0 < reused[2] <= image_at // BLOCK * BLOCK  # another image: only what comes before it
    assert reused[3] >= BLOCK


@pytest.mark.parametrize("folder", ["marian-optimum", "whisper-optimum"])
def test_an_encoder_decoders_repeated_source_skips_its_first_step(s2s, load_model, folder):
    """An encoder-decoder's store keeps each row's first step by its hidden states and decoder
    prompt: a source seen before takes it (its decoder prompt counted as cached), another source
    runs; greedy, sampled and beam jobs give what they give without the store."""
    from generation.cache.cross import FirstStepStore
    from generation.runtime.encoders import EncoderOutputs

    model = load_model(s2s[folder])
    ctx = generation.context(model, max_new_tokens=6, token_logprobs=True)
    rng = np.random.default_rng(5)
    width = model.config.get("d_model") or model.config["hidden_size"]
    sources = [rng.normal(size=(n, width)).astype(np.float32) for n in (8, 8)]  # one length: only their values tell them apart
    start = [int(model.config.get("decoder_start_token_id") or 0)]
    order = [0, 1, 0, 0, 1]  # the sources' repeats, each with other settings
    jobs = [(start, i, JOBS[i % len(JOBS)]) for i in range(len(order))]

    def run_sources(prefix_cache_bytes):
        scheduler = Scheduler(ctx, slots=6, capacity=40, isolate=False, prefix_cache_bytes=prefix_cache_bytes)
        made = [scheduler.job(p, seed=s, settings=settings, encoder=EncoderOutputs([sources[k]]))
                for (p, s, settings), k in zip(jobs, order)]
        for job in made:
            scheduler.add(job)
            while scheduler.busy:
                scheduler.step()
        out = [(j.tokens, j.logprobs, [(h.tokens, h.score) for h in j.hypotheses or []]) for j in made]
        return out, scheduler.prefix, [j.cached_tokens for j in made]

    plain, _, _ = run_sources(0)
    cached, store, reused = run_sources(64 * 2**20)
    same(plain, cached)
    assert isinstance(store, FirstStepStore) and store.bytes > 0
    assert reused == [0, 0, 1, 1, 1] and store.hits == 3


@pytest.mark.parametrize("folder, mode", MODES, ids=[m[1] for m in MODES])
def test_assisted_rows_take_cached_prefixes_and_keep_their_tokens(test_models, load_model, folder, mode):
    """Prompt lookup decoding (a candidate generator verified in the batch) over cached
    prefixes: the tokens and log-probabilities it gives without the cache."""
    from generation.assisted.prompt_lookup import PromptLookup

    ctx = generation.context(load_model(test_models[folder]), cache_mode=mode, max_new_tokens=10, token_logprobs=True)
    repeat = SYSTEM[:24] * 2  # something for the lookup to find
    jobs = [(repeat + [11, 12], i, dict(prompt_lookup_num_tokens=3)) for i in range(3)]

    def run_lookup(prefix_cache_bytes):
        scheduler = Scheduler(ctx, slots=3, capacity=160, lookup=PromptLookup(), isolate=False,
                              prefix_cache_bytes=prefix_cache_bytes)
        made = [scheduler.job(p, seed=s, settings=settings) for p, s, settings in jobs]
        for job in made:
            scheduler.add(job)
            while scheduler.busy:
                scheduler.step()
        return [(j.tokens, j.logprobs, []) for j in made], [j.cached_tokens for j in made]

    plain, _ = run_lookup(0)
    cached, reused = run_lookup(64 * 2**20)
    same(plain, cached)
    assert reused == [0, 3 * BLOCK, 3 * BLOCK]
