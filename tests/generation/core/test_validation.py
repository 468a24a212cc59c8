"""Bad input: each mistake raises ValueError naming the field (and the value) at fault, when the
context or the request is built, and leaves nothing broken behind it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import generation


@pytest.fixture(scope="module")
def optimum(test_models, load_model):
    return load_model(test_models["llama-optimum"])


@pytest.fixture(scope="module")
def grow(test_models, load_model):
    return load_model(test_models["gpt2-grow"])


@pytest.fixture(scope="module")
def genai(test_models, load_model):
    return load_model(test_models["llama-genai"])


@pytest.fixture(scope="module")
def ctx(optimum):
    return generation.context(optimum, max_new_tokens=4)


# --- prompts and seeds ------------------------------------------------------------------------

@pytest.mark.parametrize("bad, message", [
    (1000, r"prompts\[1\]\[2\] = 1000 is not a token id of this model \(0 to 999\)"),
    (-1, r"prompts\[1\]\[2\] = -1 is not a token id"),
    (3.0, r"prompts\[1\]\[2\] = 3.0 is not a token id"),
    (True, r"prompts\[1\]\[2\] = True is not a token id"),
])
def test_bad_token_names_its_position(ctx, bad, message):
    with pytest.raises(ValueError, match=message):
        generation.generate(ctx, [[5, 6, 7], [5, 6, bad, 8]])


def test_numpy_tokens_are_token_ids(ctx):
    as_lists = generation.generate(ctx, [[5, 6, 7], [8, 9]], seeds=[0, 1])
    as_arrays = generation.generate(ctx, [np.array([5, 6, 7]), np.array([8, 9], np.int32)],
                                    seeds=np.array([0, 1]))
    assert as_arrays == as_lists


def test_prompt_as_long_as_the_context(ctx):
    with pytest.raises(ValueError, match=r"prompts\[1\] has 256 tokens; the model's context is 256"):
        generation.generate(ctx, [[5], [7] * 256])


def test_prompt_one_short_of_the_context_gets_one_token(ctx):
    """The longest prompt allowed leaves room for exactly one new token, whatever max_new_tokens."""
    rows = generation.generate(ctx, [[7] * 255, [5, 6]])
    assert [len(r) for r in rows] == [1, 4]


@pytest.mark.parametrize("prompts, message", [
    ("5 6 7", "prompts must be a list of token id lists, not str"),
    ([5, 6, 7], r"prompts\[0\] must be a list of token ids, not int"),
])
def test_prompts_must_be_lists_of_lists(ctx, prompts, message):
    with pytest.raises(ValueError, match=message):
        generation.generate(ctx, prompts)


@pytest.mark.parametrize("seeds, message", [
    ([1, 2, 3], "seeds must give one seed per prompt: got 3 for 2 prompts"),
    ([1], "seeds must give one seed per prompt: got 1 for 2 prompts"),
    (7, "seeds must give one seed per prompt: got int for 2 prompts"),
    ([1, -2], r"seeds\[1\] = -2 must be an integer from 0 to 2\*\*64 - 1"),
    ([2**64, 1], r"seeds\[0\] = 18446744073709551616 must be an integer"),
    ([1, 2.5], r"seeds\[1\] = 2.5 must be an integer"),
])
def test_bad_seeds(ctx, seeds, message):
    with pytest.raises(ValueError, match=message):
        generation.generate(ctx, [[5, 6], [7]], seeds=seeds)


def test_largest_seed_is_accepted(ctx):
    rows = generation.generate(ctx, [[5, 6], [7]], seeds=[2**64 - 1, 0])
    assert [len(r) for r in rows] == [4, 4]


# --- settings -----------------------------------------------------------------------------------

@pytest.mark.parametrize("settings, message", [
    (dict(max_new_tokens=-1), r"max_new_tokens must be an integer from 0 to 256 \(this model's context\), or null, not -1"),
    (dict(max_new_tokens=2.5), r"max_new_tokens must be an integer from 0 to 256 .*not 2.5"),
    (dict(max_length=-3), r"max_length must be an integer from 0 to 256 \(this model's context\), or null, not -3"),
    (dict(do_sample=True, temperature=0), "temperature must be > 0 when sampling, not 0"),
    (dict(do_sample=True, temperature=-0.5), r"temperature must be > 0 when sampling, not -0.5"),
    (dict(do_sample=True, top_p=1.5), r"top_p must be a number in \(0, 1\] \(1 turns it off\), not 1.5"),
    (dict(do_sample=True, top_p=-0.1), r"top_p must be a number in \(0, 1\] .*not -0.1"),
    (dict(do_sample=True, top_p=0), r"top_p must be a number in \(0, 1\] .*not 0"),
    (dict(repetition_penalty=-1.0), r"repetition_penalty must be a number in \(0, 10000\] \(1 turns it off\), not -1.0"),
    (dict(repetition_penalty=0), r"repetition_penalty must be a number in \(0, 10000\] .*not 0"),
    (dict(encoder_repetition_penalty="x"), r"encoder_repetition_penalty must be a number in \(0, 10000\] .*not 'x'"),
    (dict(no_repeat_ngram_size=-2), r"no_repeat_ngram_size must be an integer from 0 to 32 \(0 turns it off\), not -2"),
    (dict(encoder_no_repeat_ngram_size=1.5), r"encoder_no_repeat_ngram_size must be an integer from 0 to 32 .*not 1.5"),
    (dict(min_length=-1), r"min_length must be an integer from 0 to 256 \(this model's context\), not -1"),
    (dict(min_new_tokens=-4), r"min_new_tokens must be an integer from 0 to 256 \(this model's context\), or null, not -4"),
    (dict(min_p=1.5), r"min_p must be a number in \[0, 1\], not 1.5"),
    (dict(typical_p=0.0), r"typical_p must be a number in \(0, 1\] .*not 0.0"),
    (dict(epsilon_cutoff=1.0), r"epsilon_cutoff must be a number in \[0, 1\) .*not 1.0"),
    (dict(eta_cutoff=-0.1), r"eta_cutoff must be a number in \[0, 1\) .*not -0.1"),
    (dict(renormalize_logits="yes"), r"renormalize_logits must be true or false, not 'yes'"),
    (dict(bad_words_ids=[[5], []]), r"bad_words_ids\[1\] = \[\] is not one of lists of token ids"),
    (dict(bad_words_ids=[[5, -2]]), r"bad_words_ids\[0\] = \[5, -2\] is not one of lists of token ids"),
    (dict(bad_words_ids=[[5, 100000]]), r"bad_words_ids names token id 100000, outside this model's vocabulary \(0 to 999\)"),
    (dict(suppress_tokens=[3, 5000]), r"suppress_tokens names token id 5000, outside this model's vocabulary"),
    (dict(forced_bos_token_id=1000), r"forced_bos_token_id names token id 1000, outside this model's vocabulary"),
    (dict(sequence_bias=[[[5], "big"]]), r"sequence_bias\[0\] = \[\[5\], 'big'\] is not one of \[\[token ids\], bias\] pairs"),
    (dict(exponential_decay_length_penalty=[5]),
     r"exponential_decay_length_penalty must be \[start_index from 0 to 256 \(this model's context\), decay_factor in "
     r"\(0, 10000\]\], not \[5\]"),
    (dict(stop_strings=["ok", ""]), r"stop_strings must be a string or a list of non-empty strings"),
    (dict(do_sample=True, top_k=-1), r"top_k must be an integer from 0 to 1000 \(this model's vocabulary\), not -1"),
    (dict(do_sample="yes"), "do_sample must be true or false, not 'yes'"),
    (dict(eos_token_id=-3), "eos_token_id must be a token id or a list of token ids, not -3"),
    (dict(eos_token_id=[2, "x"]), r"eos_token_id must be a token id or a list of token ids, not \[2, 'x'\]"),
    (dict(pad_token_id=-1), "pad_token_id must be a token id >= 0, not -1"),
    (dict(max_new_tokens_=5), "unknown generation setting 'max_new_tokens_'"),
    (dict(temprature=0.7), "unknown generation setting 'temprature'"),
])
def test_bad_setting_names_the_field(optimum, settings, message):
    with pytest.raises(ValueError, match=message):
        generation.context(optimum, **settings)


@pytest.mark.parametrize("settings, message", [
    (dict(assistant_model="draft"), "assistant_model='draft' is not supported by this engine yet"),
    (dict(guidance_scale=1.5), "guidance_scale=1.5 is not supported by raymuter"),
    (dict(watermarking_config={"bias": 2.0}), "watermarking_config=.* is not supported by raymuter"),
    (dict(prefix_allowed_tokens_fn="f"), "prefix_allowed_tokens_fn='f' is not supported by raymuter"),
])
def test_setting_not_supported_is_refused_by_name(optimum, settings, message):
    with pytest.raises(ValueError, match=message):
        generation.context(optimum, **settings)


def test_unsupported_setting_at_its_no_op_value_is_accepted(optimum, ctx):
    quiet = generation.context(optimum, max_new_tokens=4, guidance_scale=None, num_beams=1, repetition_penalty=1.0)
    prompts = [[5, 6, 7], [8, 9]]
    assert generation.generate(quiet, prompts) == generation.generate(ctx, prompts)


def test_greedy_ignores_temperature_zero_as_transformers_does(optimum, ctx):
    """transformers 4.57 accepts temperature=0 with do_sample=False (a warning: the flag is only
    used when sampling) and decodes greedily; generation_config.json files say so."""
    zero = generation.context(optimum, max_new_tokens=4, do_sample=False, temperature=0.0)
    prompts = [[5, 6, 7], [8, 9]]
    assert generation.generate(zero, prompts) == generation.generate(ctx, prompts)


def test_request_overrides_are_validated(ctx):
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\] .*not 3"):
        ctx.with_settings(top_p=3)
    assert ctx.with_settings(top_k=7).top_k == 7
    assert ctx.settings.top_k == 50  # the context's own settings are untouched


# --- cache modes, prompt steps, batch size ------------------------------------------------------

@pytest.mark.parametrize("model, mode, message", [
    ("optimum", "in_place", r"cache_mode 'in_place' does not fit this graph \(model.onnx runs as append or grow\)"),
    ("grow", "append", r"cache_mode 'append' does not fit this graph \(model.onnx runs as grow\)"),
    ("grow", "in_place", "cache_mode 'in_place' does not fit this graph"),
    ("genai", "append", r"cache_mode 'append' does not fit this graph \(model.onnx runs as in_place or grow\)"),
    ("optimum", "paged", "cache_mode must be one of in_place, append, grow, not 'paged'"),
])
def test_cache_mode_the_graph_cannot_run(request, model, mode, message):
    with pytest.raises(ValueError, match=message):
        generation.context(request.getfixturevalue(model), cache_mode=mode)


def test_unknown_prompt_steps(optimum):
    with pytest.raises(ValueError, match="prompt_steps must be one of whole, pieces, not 'halves'"):
        generation.context(optimum, prompt_steps="halves")


@pytest.mark.parametrize("batch_size", [0, -2, 2.0, True, None])
def test_compile_needs_a_positive_integer_batch_size(ctx, batch_size):
    with pytest.raises(ValueError, match=f"batch_size must be an integer >= 1, not {batch_size!r}"):
        generation.compile(ctx, batch_size)


# --- an error leaves nothing broken -------------------------------------------------------------

class Boom(RuntimeError):
    pass


@pytest.mark.parametrize("model", ["optimum", "genai", "grow"])
def test_generation_after_an_error_still_works(request, model):
    ctx = generation.compile(generation.context(request.getfixturevalue(model), max_new_tokens=6), 2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    seeds = [0, 1, 2]
    expected = generation.generate(ctx, prompts, seeds=seeds)
    assert [len(r) for r in expected] == [6, 6, 6]

    with pytest.raises(ValueError, match=r"prompts\[2\]\[1\]"):
        generation.generate(ctx, [[5, 6, 7], [8, 9], [10, 5000]], seeds=seeds)
    with pytest.raises(ValueError, match="seeds"):
        generation.generate(ctx, prompts, seeds=[0, 1])

    steps = []

    def explode(event):  # a client callback that fails mid-generation
        steps.append(event.token.copy())
        if len(steps) == 3:
            raise Boom("client went away")

    with pytest.raises(Boom):
        generation.generate(ctx, prompts, seeds=seeds, on_token=explode)
    assert len(steps) == 3

    assert generation.generate(ctx, prompts, seeds=seeds) == expected
    assert generation.generate(ctx, prompts[::-1], seeds=seeds[::-1]) == expected[::-1]


# --- the cache contract -----------------------------------------------------------------------

def test_assisted_decoding_needs_a_cache_that_verifies(s2s, load_model):
    """An encoder-decoder model's cache has no verify or rewind: prompt lookup is refused when
    the context is made, naming the setting and what the cache lacks."""
    with pytest.raises(ValueError, match=r"prompt_lookup_num_tokens: assisted decoding verifies candidates through "
                                         r"the cache's verify and rewind; cache_mode 'seq2seq' \(Seq2SeqCache\) "
                                         r"has no verify, rewind") as caught:
        generation.context(load_model(s2s["marian-optimum"]), prompt_lookup_num_tokens=3)
    assert caught.value.setting == "prompt_lookup_num_tokens"


def test_a_cache_mode_missing_a_verb_is_refused_when_made(ctx, monkeypatch):
    from generation import cache

    class NoCopies(cache.AppendCache):
        copy_rows = None  # a mode that cannot move rows (beam search, slots)

    monkeypatch.setitem(cache.CACHES, "append", NoCopies)
    with pytest.raises(TypeError, match=r"cache mode 'append' \(NoCopies\) does not implement copy_rows: every mode "
                                        r"implements prefill, insert, decode, decode_steps, copy_rows, release"):
        generation.new_state(replace(ctx, buffers="host"), slots=2, capacity=8)  # (the host mode's class)


def test_every_cache_mode_prefills_through_the_contract(test_models, monkeypatch):
    """admit runs prompts through the cache's own prefill, whatever the mode (no mode is asked
    whether it has one): a mode's prefill is what admission calls."""
    from generation import cache

    calls = []
    for mode, folder in (("append", "llama-optimum"), ("grow", "gpt2-optimum"), ("in_place", "llama-genai")):
        ctx = generation.context(generation.load(test_models[folder], fuse=False), cache_mode=mode, max_new_tokens=3)
        original = cache.CACHES[mode].prefill

        def counted(self, slots, *args, original=original, mode=mode):
            calls.append((mode, list(slots)))
            return original(self, slots, *args)

        monkeypatch.setattr(cache.CACHES[mode], "prefill", counted)
        state = generation.new_state(ctx, slots=2, capacity=16)
        state, first = generation.admit(ctx, state, [1], [[3, 4, 5]], seeds=[0])
        alone = generation.generate(ctx, [[3, 4, 5]])[0]
        assert first.token[0] == alone[0]
    assert [c for c in calls if c[1] == [1]] == [("append", [1]), ("grow", [1]), ("in_place", [1])]
