"""Encoder-decoder text-to-text (Marian, T5, BART) against transformers `generate()`.

Invariants: for a batch of sources of different lengths, in every layout (Optimum merged,
transformers.js `onnx/`, unmerged decoder pair), greedy and beam tokens equal transformers'
for each source alone, with the model's own generation config (Marian and BART: the forced eos)
and with processors that read the source (encoder_repetition_penalty,
encoder_no_repeat_ngram_size); log-probabilities equal compute_transition_scores; texts in give
what their token ids give; sampling is seeded and independent of the other sources; bad
sources and a missing encoder say what is wrong.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation import tasks
from generation.families import seq2seq

LAYOUTS = [("marian-optimum", "marian"), ("marian-js", "marian"), ("marian-unmerged", "marian"),
           ("t5-optimum", "t5"), ("bart-optimum", "bart")]


@pytest.fixture(scope="module")
def models(s2s, load_model):
    return lambda key: load_model(s2s[key])


@pytest.fixture(scope="module")
def hf(s2s):
    import torch
    import transformers

    torch.set_num_threads(1)
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = transformers.AutoModelForSeq2SeqLM.from_pretrained(s2s[f"hf/{name}"]).eval()
        return cache[name]
    return get


def sources_of(model, lengths=(5, 9, 2), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 900, n).tolist() + [model.config["eos_token_id"]] for n in lengths]


def transformers_generate(model, source, max_new, **settings):
    """(tokens after the decoder start, without the final eos, transition log-probabilities) for
    one source alone."""
    import torch

    ids = torch.tensor([source])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             output_scores=True, return_dict_in_generate=True, **settings)
        beams = getattr(out, "beam_indices", None)
        scores = model.compute_transition_scores(out.sequences, out.scores, beams, normalize_logits=True)
    steps = len(out.scores) if beams is None else int((beams[0] >= 0).sum())
    tokens, logprobs = out.sequences[0, 1:1 + steps].tolist(), scores[0, :steps].tolist()
    if tokens and tokens[-1] == model.generation_config.eos_token_id:
        tokens, logprobs = tokens[:-1], logprobs[:-1]
    return tokens, logprobs


@pytest.mark.parametrize("key, name", LAYOUTS, ids=[k for k, _ in LAYOUTS])
@pytest.mark.parametrize("settings", [
    dict(), dict(num_beams=3), dict(repetition_penalty=1.3, no_repeat_ngram_size=2),
    dict(encoder_repetition_penalty=1.5, encoder_no_repeat_ngram_size=2),
    dict(encoder_no_repeat_ngram_size=2, num_beams=2),
], ids=["greedy", "beams", "penalties", "encoder-settings", "encoder-ngrams-beams"])
def test_text_to_text_equals_transformers(models, hf, key, name, settings):
    model = models(key)
    ctx = generation.context(model, max_new_tokens=12, token_logprobs=True, **settings)
    sources = sources_of(model)
    got = tasks.text_to_text(ctx, sources)
    tolerance = 1e-3 if name == "t5" else 1e-4  # FIXTURES.md: T5's ONNX logits differ by ~5e-5
    for source, result in zip(sources, got):
        tokens, logprobs = transformers_generate(hf(name), source, 12, do_sample=False, **settings)
        assert result.tokens == tokens, (key, source)
        np.testing.assert_allclose(result.logprobs, logprobs, atol=tolerance)
        assert result.text == generation.text.tokenizer.model_tokenizer(model).decode(tokens, skip_special_tokens=True)


def test_encoder_repetition_penalty_with_beams_penalises_every_beam(models, hf):
    """A deliberate difference: transformers 4.57 passes the encoder input to
    EncoderRepetitionPenaltyLogitsProcessor unexpanded, so under beam search only the first row
    of the flattened batch is penalised (with batch 1: the best beam only). Raymuter penalises
    every beam of the prompt, as the setting means; greedy equals transformers."""
    model = models("marian-optimum")
    source = sources_of(model)[0]
    penalised = generation.context(model, max_new_tokens=12, encoder_repetition_penalty=1.5, num_beams=2)
    plain = generation.context(model, max_new_tokens=12, num_beams=2)
    ours = tasks.text_to_text(penalised, [source])[0].tokens
    theirs, _ = transformers_generate(hf("marian"), source, 12, do_sample=False, encoder_repetition_penalty=1.5, num_beams=2)
    assert ours != tasks.text_to_text(plain, [source])[0].tokens  # the penalty acts
    assert ours != theirs  # and differs from transformers' first-row-only reading (this source shows it)


def test_texts_in_give_what_their_token_ids_give(models):
    model = models("marian-optimum")
    ctx = generation.context(model, max_new_tokens=8)
    texts = ["ka lo mi", "shi an re po stand"]
    ids = [generation.text.tokenizer.model_tokenizer(model).encode(t).ids for t in texts]
    assert [r.tokens for r in tasks.text_to_text(ctx, texts)] == [r.tokens for r in tasks.text_to_text(ctx, ids)]


def test_sampling_is_seeded_and_batch_independent(models):
    model = models("bart-optimum")
    ctx = generation.context(model, max_new_tokens=10, do_sample=True, temperature=1.5, top_k=0)
    sources = sources_of(model, (4, 7, 3, 11))
    first = [r.tokens for r in tasks.text_to_text(ctx, sources, seeds=[1, 2, 3, 4])]
    assert [r.tokens for r in tasks.text_to_text(ctx, sources, seeds=[1, 2, 3, 4])] == first
    assert [r.tokens for r in tasks.text_to_text(ctx, sources[2:3], seeds=[3])] == first[2:3]
    assert [r.tokens for r in tasks.text_to_text(ctx, sources, seeds=[5, 6, 7, 8])] != first


def test_bad_sources_say_what_is_wrong(models):
    model = models("marian-optimum")
    ctx = generation.context(model, max_new_tokens=4)
    limit = model.config["max_position_embeddings"]
    with pytest.raises(ValueError, match=rf"sources\[1\] has {limit + 1} tokens; the encoder takes at most {limit}"):
        tasks.text_to_text(ctx, [[5, 0], [7] * (limit + 1)])
    with pytest.raises(ValueError, match=r"sources\[0\] is empty"):
        tasks.text_to_text(ctx, [[]])
    with pytest.raises(ValueError, match=r"sources\[0\] must be a text or a list of token ids of this model"):
        tasks.text_to_text(ctx, [[5, 5000]])
    with pytest.raises(ValueError, match="an encoder-decoder model needs encoder= outputs"):
        generation.generate(ctx, [[999]])


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3)], ids=["greedy", "beams"])
def test_more_sources_than_slots(models, settings):
    """Sources join as slots free up (greedy) or batch after batch (beams); each source's tokens
    stay those of one run over all of them."""
    model = models("t5-optimum")
    ctx = generation.context(model, max_new_tokens=10, **settings)
    sources = sources_of(model, (5, 9, 2, 14, 3), seed=1)
    want = [r.tokens for r in tasks.text_to_text(ctx, sources)]
    assert [r.tokens for r in tasks.text_to_text(generation.compile(ctx, batch_size=2), sources)] == want


def test_cached_encoding_equals_the_plain_encoder_and_encodes_each_source_once(models):
    """encode_sources_cached (what a server's encoder replica runs) gives what encode_sources
    gives, and a source the cache holds is not encoded again."""
    ctx = generation.context(models("marian-optimum"))
    kept = {}

    def lookup(content):
        return kept.get(repr(content))

    def store(content, value, nbytes):
        assert nbytes == value[0].nbytes
        kept[repr(content)] = value

    plain = seq2seq.encode_sources(ctx, [[5, 6, 7], [8, 9]])
    first, computed = seq2seq.encode_sources_cached(ctx, [[5, 6, 7], [8, 9]], lookup, store)
    assert computed == 2 and len(kept) == 2 and first.source_ids == plain.source_ids
    assert all(np.array_equal(a, b) for a, b in zip(first.hidden, plain.hidden))
    again, computed = seq2seq.encode_sources_cached(ctx, [[8, 9], [4, 5]], lookup, store)
    assert computed == 1 and again.source_ids == [[8, 9], [4, 5]]
    assert np.array_equal(again.hidden[0], plain.hidden[1])
