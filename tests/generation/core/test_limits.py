"""Every setting is bounded when settings are built (generation/params/settings.py, generation/params/limits.py).

Invariants: a setting past its bound (2**64, the bound + 1, inf, nan, a list one entry too long)
raises SettingError whose `setting` names it and whose message gives the allowed range; at its
bound it is accepted, and a request with it runs in the batcher beside a plain one whose tokens
are those it gets alone; validation raises nothing but SettingError on any JSON-like value, and
settings it accepts never make admission raise. The processors whose work grows with a setting
(n-grams, multi-token biases and bad words, prompt lookup, exponential decay) still equal
transformers 4.57 at the caps.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings as hyp_settings, strategies as st
from transformers.generation import logits_process as lp

import generation
from generation.engine.batching import ContinuousBatcher
from generation.params import limits
from generation.logits import row_settings as R
from generation.logits import selection as S
from generation.assisted.prompt_lookup import lookup
from generation.params.settings import Settings, make_settings
from generation.params.checks import SettingError

BIG = 2**64
VOCAB, CONTEXT = 1000, 256  # the tiny test models


@pytest.fixture(scope="module")
def model(test_models, load_model):
    model = load_model(test_models["llama-genai"])
    assert (model.vocab_size, model.max_context) == (VOCAB, CONTEXT)
    return model


@pytest.fixture(scope="module")
def ctx(model):
    return generation.context(model, max_new_tokens=12)


@pytest.fixture(scope="module")
def batcher(ctx):
    batcher = ContinuousBatcher(ctx, slots=limits.MAX_BEAMS, capacity=CONTEXT)
    yield batcher
    batcher.close()


def refused(ctx, name: str, **settings) -> SettingError:
    with pytest.raises(SettingError) as info:
        ctx.with_settings(**settings)
    assert info.value.setting == name, (info.value.setting, str(info.value))
    return info.value


ids = lambda count, length, start=3: [[start + (i * length + j) % (VOCAB - start) for j in range(length)]  # noqa: E731
                                      for i in range(count)]
STOPS = ["".join("abcdefghij"[(i + j) % 10] for j in range(limits.MAX_STOP_LENGTH)) for i in range(limits.MAX_STOP_STRINGS)]

# (setting, largest value allowed, the other settings it needs, the range in the message)
INTEGERS = [
    ("top_k", VOCAB, dict(do_sample=True), "from 0 to 1000 (this model's vocabulary)"),
    ("no_repeat_ngram_size", limits.MAX_NGRAM_SIZE, {}, "from 0 to 32"),
    ("encoder_no_repeat_ngram_size", limits.MAX_NGRAM_SIZE, {}, "from 0 to 32"),
    ("min_length", CONTEXT, {}, "from 0 to 256 (this model's context)"),
    ("min_new_tokens", CONTEXT, {}, "from 0 to 256 (this model's context)"),
    ("max_new_tokens", CONTEXT, {}, "from 0 to 256 (this model's context)"),
    ("max_length", CONTEXT, {}, "from 0 to 256 (this model's context)"),
    ("prompt_lookup_num_tokens", limits.MAX_LOOKUP_TOKENS, {}, "from 1 to 32"),
    ("max_matching_ngram_size", limits.MAX_MATCHING_NGRAM_SIZE, dict(prompt_lookup_num_tokens=4), "from 1 to 32"),
    ("num_assistant_tokens", limits.MAX_LOOKUP_TOKENS, {}, "from 1 to 32"),
    ("num_beams", limits.MAX_BEAMS, {}, "from 1 to 16"),
]
TOKEN_IDS = ["forced_bos_token_id", "pad_token_id", "eos_token_id", "forced_eos_token_id", "suppress_tokens",
             "begin_suppress_tokens"]
# (setting, a value at its bound, the same one step past it, what the message says)
LISTS = [
    ("eos_token_id", list(range(3, 3 + limits.MAX_TOKEN_IDS)), list(range(3, 4 + limits.MAX_TOKEN_IDS)), "at most 256"),
    ("forced_eos_token_id", list(range(3, 3 + limits.MAX_TOKEN_IDS)), list(range(3, 4 + limits.MAX_TOKEN_IDS)),
     "at most 256"),
    ("suppress_tokens", list(range(VOCAB)), list(range(VOCAB)) + [5], "at most 1000"),
    ("begin_suppress_tokens", list(range(VOCAB)), list(range(VOCAB)) + [5], "at most 1000"),
    ("bad_words_ids", ids(limits.MAX_SEQUENCES, 2), ids(limits.MAX_SEQUENCES + 1, 2), "at most 256"),
    ("bad_words_ids", ids(1, limits.MAX_SEQUENCE_LENGTH), ids(1, limits.MAX_SEQUENCE_LENGTH + 1), "at most 32"),
    ("sequence_bias", [[s, 1.0] for s in ids(limits.MAX_SEQUENCES, 2)],
     [[s, 1.0] for s in ids(limits.MAX_SEQUENCES + 1, 2)], "at most 256"),
    ("sequence_bias", [[ids(1, limits.MAX_SEQUENCE_LENGTH)[0], 1.0]], [[ids(1, limits.MAX_SEQUENCE_LENGTH + 1)[0], 1.0]],
     "at most 32"),
    ("sequence_bias", [[[5], limits.MAX_BIAS], [[6, 7], -limits.MAX_BIAS]], [[[5], 100.5]], r"in [-100, 100]"),
    ("stop_strings", STOPS, STOPS + ["x"], "at most 16"),
    ("stop_strings", ["y" * limits.MAX_STOP_LENGTH], ["y" * (limits.MAX_STOP_LENGTH + 1)], "at most 256"),
    ("exponential_decay_length_penalty", [CONTEXT, 1.5], [CONTEXT + 1, 1.5], "start_index from 0 to 256"),
    ("exponential_decay_length_penalty", [2, limits.MAX_FLOAT], [2, limits.MAX_FLOAT + 1], "decay_factor in (0, 10000]"),
]
# (setting, largest value allowed, just past it, other settings, the interval in the message)
FLOATS = [
    ("temperature", limits.MAX_FLOAT, limits.MAX_FLOAT + 1, dict(do_sample=True), "[0, 10000]"),
    ("repetition_penalty", limits.MAX_FLOAT, limits.MAX_FLOAT + 1, {}, "(0, 10000]"),
    ("encoder_repetition_penalty", limits.MAX_FLOAT, limits.MAX_FLOAT + 1, {}, "(0, 10000]"),
    # (at -10000 beam search itself fails, as it does from about -4: generation/search/beam.py's LOST)
    ("length_penalty", limits.MAX_FLOAT, limits.MAX_FLOAT + 1, dict(num_beams=2), "[-10000, 10000]"),
    ("top_p", 1.0, 1.0001, dict(do_sample=True), "(0, 1]"),
    ("typical_p", 1.0, 1.0001, dict(do_sample=True), "(0, 1]"),
    ("min_p", 1.0, 1.0001, dict(do_sample=True), "[0, 1]"),
    ("epsilon_cutoff", 0.999, 1.0, dict(do_sample=True), "[0, 1)"),
    ("eta_cutoff", 0.999, 1.0, dict(do_sample=True), "[0, 1)"),
]


# --- past the bound: refused by name, with the range ---------------------------------------------

@pytest.mark.parametrize("name, bound, extra, message", INTEGERS)
def test_an_integer_past_its_bound_is_refused_with_the_range(ctx, name, bound, extra, message):
    for value in (bound + 1, BIG, -BIG, 10**5000):
        error = refused(ctx, name, **extra, **{name: value})
        assert message in str(error)
    assert "not 18446744073709551616" in str(refused(ctx, name, **extra, **{name: BIG}))
    assert "an integer of about 5001 digits" in str(refused(ctx, name, **extra, **{name: 10**5000}))


@pytest.mark.parametrize("name", TOKEN_IDS)
@pytest.mark.parametrize("value", [VOCAB, BIG])
def test_a_token_id_outside_the_vocabulary_is_refused(ctx, name, value):
    error = refused(ctx, name, **{name: value if name in ("forced_bos_token_id", "pad_token_id") else [5, value]})
    assert f"names token id {value}, outside this model's vocabulary (0 to 999)" in str(error)
    for setting, inside in (("bad_words_ids", [[5, value]]), ("sequence_bias", [[[value], 1.0]])):
        assert "outside this model's vocabulary (0 to 999)" in str(refused(ctx, setting, **{setting: inside}))


@pytest.mark.parametrize("name, bound, over, message", LISTS)
def test_a_list_past_its_bound_is_refused(ctx, name, bound, over, message):
    assert message in str(refused(ctx, name, **{name: over}))


@pytest.mark.parametrize("name, bound, over, extra, interval", FLOATS)
def test_a_float_past_its_bound_or_not_finite_is_refused(ctx, name, bound, over, extra, interval):
    for value in (over, math.inf, -math.inf, math.nan, BIG):
        error = refused(ctx, name, **extra, **{name: value})
        assert interval in str(error) or name == "temperature" and "> 0 when sampling" in str(error), str(error)


@pytest.mark.parametrize("name, value", [
    ("sequence_bias", [[[5], math.inf]]), ("sequence_bias", [[[5], math.nan]]), ("sequence_bias", [[[5, 6], -math.inf]]),
    ("sequence_bias", [[[5], BIG]]), ("exponential_decay_length_penalty", [2, math.inf]),
    ("exponential_decay_length_penalty", [2, math.nan]), ("exponential_decay_length_penalty", [BIG, 1.5]),
    ("exponential_decay_length_penalty", [2, BIG]), ("temperature", math.nan),
])
def test_no_infinite_or_nan_value_anywhere(ctx, name, value):
    refused(ctx, name, **{name: value})


def test_greedy_temperature_must_still_be_finite(ctx):
    """A greedy row ignores temperature (transformers accepts 0), but not inf or nan."""
    assert ctx.with_settings(temperature=0.0).temperature == 0.0
    for value in (math.inf, math.nan, -1.0):
        refused(ctx, "temperature", temperature=value)


def test_the_models_own_long_max_length_comes_down_to_its_context(model):
    """A generation_config.json that asks for more than the context (or a top_k past a small
    vocabulary) still loads: the settings say what the rows get."""
    from generation.params.settings import model_settings

    base = model_settings(model.config, {"max_length": 4096, "max_new_tokens": 10**6}, CONTEXT, VOCAB)
    assert (base["max_length"], base["max_new_tokens"]) == (CONTEXT, CONTEXT)
    assert model_settings(model.config, {}, CONTEXT, 32)["top_k"] == 32  # transformers' default 50, of 32 ids


def test_the_errors_pickle_with_their_setting():
    import pickle

    error = pickle.loads(pickle.dumps(SettingError("top_k", "top_k must be ...")))
    assert (error.setting, str(error)) == ("top_k", "top_k must be ...")


def test_prompts_and_seeds_raise_setting_errors(ctx):
    for prompts in ([[5, BIG]], [[5, [6]]], [[5, "x"]], [[[5, 6], [7]]], [[5.0]], [[True]], [list(range(300))]):
        with pytest.raises(SettingError) as info:
            generation.generate(ctx, prompts)
        assert info.value.setting == "prompt"
    for seeds in ([BIG], [-1], ["1"], [None], 5):
        with pytest.raises(SettingError) as info:
            generation.generate(ctx, [[5, 6]], seeds=seeds)
        assert info.value.setting == "seed"


# --- at the bound: accepted, and a batch runs with it ------------------------------------------

def at_bound_cases():
    cases = [(name, {**extra, name: bound}) for name, bound, extra, _ in INTEGERS]
    cases += [(name, {name: VOCAB - 1 if name in ("forced_bos_token_id", "pad_token_id") else [VOCAB - 1]})
              for name in TOKEN_IDS]
    cases += [(name, {name: bound}) for name, bound, _, _ in LISTS]
    cases += [(name, {**extra, name: bound}) for name, bound, _, extra, _ in FLOATS]
    return cases


WORST = {"do_sample": True, "top_k": 0, "top_p": 0.9, "typical_p": 0.9, "min_p": 0.01, "epsilon_cutoff": 1e-4,
         "eta_cutoff": 1e-4, "temperature": 0.7, "repetition_penalty": limits.MAX_FLOAT,
         "encoder_repetition_penalty": limits.MAX_FLOAT, "no_repeat_ngram_size": limits.MAX_NGRAM_SIZE,
         "encoder_no_repeat_ngram_size": limits.MAX_NGRAM_SIZE,
         "sequence_bias": [[s, limits.MAX_BIAS * (-1) ** i] for i, s in enumerate(ids(limits.MAX_SEQUENCES, 32))],
         "bad_words_ids": ids(limits.MAX_SEQUENCES, limits.MAX_SEQUENCE_LENGTH, start=500), "stop_strings": STOPS,
         "min_new_tokens": CONTEXT, "exponential_decay_length_penalty": [0, limits.MAX_FLOAT],
         "eos_token_id": list(range(3, 3 + limits.MAX_TOKEN_IDS)), "remove_invalid_values": True,
         "prompt_lookup_num_tokens": limits.MAX_LOOKUP_TOKENS, "max_matching_ngram_size": limits.MAX_MATCHING_NGRAM_SIZE,
         "renormalize_logits": True, "max_new_tokens": 40}


@pytest.mark.parametrize("name, settings", at_bound_cases() + [("every costly setting at once", WORST)],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_setting_at_its_bound_runs_beside_a_plain_request(ctx, batcher, name, settings):
    prompt, plain_prompt = [5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]
    at_bound = batcher.submit(prompt, seed=1, settings=settings)
    plain = batcher.submit(plain_prompt, seed=2)
    done = at_bound.result(timeout=120)
    assert done.finish_reason in ("stop", "length"), (done.finish_reason, done.error)
    assert done.status is None
    assert plain.result(timeout=120).tokens == generation.generate(ctx, [plain_prompt], seeds=[2])[0]


# --- any JSON-like value: SettingError or settings that admit -----------------------------------

json_like = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from([BIG, -BIG, 2**63, 10**400, VOCAB, CONTEXT, 32, 33])
    | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)
FIELDS = sorted(Settings.__dataclass_fields__)


@hyp_settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.sampled_from(FIELDS + ["guidance_scale", "frobnicate"]), json_like, min_size=1, max_size=3))
@example(overrides={"adapter": "0"})  # a LoRA adapter the model does not know: refused when validated, not admitted
def test_validation_raises_only_setting_errors_and_what_it_accepts_admits(ctx, overrides):
    try:
        settings = ctx.with_settings(**overrides)
    except SettingError as e:
        assert e.setting in overrides or e.setting in ("eos_token_id", "pad_token_id"), (e.setting, overrides)
        return
    if settings.num_beams > 1:  # beams run through beam_search, not the decode-state verbs
        return
    state = generation.new_state(ctx, 2, CONTEXT)
    state, first = generation.admit(ctx, state, [0, 1], [[5, 6, 7], [8, 9]], [0, 1],
                                    settings=[settings, ctx.settings])
    state, out = generation.step(ctx, state)
    assert not first.failed and not out.failed


@hyp_settings(max_examples=300, deadline=None)
@given(json_like, json_like, json_like)
def test_a_request_of_any_json_is_refused_by_name_or_submitted(batcher, prompt, seed, settings):
    try:
        request = batcher.submit(prompt, seed=seed, settings=settings)
    except SettingError as e:
        assert e.setting in ("prompt", "seed", "settings") or isinstance(settings, dict) and e.setting in settings
        return
    assert request.result(timeout=60).finish_reason in ("stop", "length")


# --- the costly processors at their caps, against transformers ---------------------------------

def ours(scores, history, settings, prompt_length, limit=10**6):
    rows = R.RowSettings(1, scores.shape[-1])
    rows.set_row(0, settings, prompt_length, limit, encoder_ids=history[:prompt_length])
    return R.apply(scores[None], rows, history[None], np.array([len(history)]))[0]


def theirs(processor, scores, history):
    return processor(torch.tensor([history]), torch.from_numpy(scores[None].copy()))[0].numpy()


def looping_history(length: int, period: int, seed: int) -> list[int]:
    """A row in a loop (every n-gram repeats) with a few changes, so some n-grams are new."""
    rng = np.random.default_rng(seed)
    row = (rng.integers(0, 50, period).tolist() * (length // period + 1))[:length]
    for at in rng.integers(0, length, length // 20):
        row[at] = int(rng.integers(0, 50))
    return row


@pytest.mark.parametrize("period", [1, 3, 7])
def test_no_repeat_ngrams_at_the_cap_equal_transformers(period):
    history = looping_history(600, period, period)
    scores = np.random.default_rng(0).standard_normal(64).astype(np.float32)
    for size in (2, 5, limits.MAX_NGRAM_SIZE):
        got = ours(scores, np.array(history), make_settings({}, {"no_repeat_ngram_size": size}), 300)
        np.testing.assert_array_equal(got, theirs(lp.NoRepeatNGramLogitsProcessor(size), scores, history))
        got = ours(scores, np.array(history), make_settings({}, {"encoder_no_repeat_ngram_size": size}), 300)
        expected = theirs(lp.EncoderNoRepeatNGramLogitsProcessor(size, torch.tensor([history[:300]])), scores, history)
        np.testing.assert_array_equal(got, expected)


def test_many_long_biases_and_bad_words_equal_transformers():
    rng = np.random.default_rng(1)
    history = looping_history(400, 5, 2)
    entries = []
    for i in range(limits.MAX_SEQUENCES):
        length = int(rng.integers(1, limits.MAX_SEQUENCE_LENGTH + 1))
        if i % 3 == 0 and length > 1:  # an entry whose prefix the row ends with: it applies
            entries.append(history[len(history) - length + 1:] + [int(rng.integers(0, 64))])
        else:
            entries.append(rng.integers(0, 64, length).tolist())
    biases = [float(np.float32(b)) for b in rng.uniform(-limits.MAX_BIAS, limits.MAX_BIAS, len(entries))]
    scores = rng.standard_normal(64).astype(np.float32)
    got = ours(scores, np.array(history), make_settings({}, {"sequence_bias": [[e, b] for e, b in zip(entries, biases)]}), 10)
    bias = {}
    for e, b in zip(entries, biases):
        bias[tuple(e)] = b
    np.testing.assert_allclose(got, theirs(lp.SequenceBiasLogitsProcessor(bias), scores, history), rtol=1e-6, atol=1e-5)
    got = ours(scores, np.array(history), make_settings({}, {"bad_words_ids": entries, "eos_token_id": [63]}), 10)
    expected = theirs(lp.NoBadWordsLogitsProcessor(entries, 63), scores, history)
    assert np.array_equal(np.isneginf(got), np.isneginf(expected)) and np.isneginf(got).sum() > 5
    np.testing.assert_array_equal(got, expected)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # inf and nan scores, as torch makes them
def test_exponential_decay_with_a_huge_factor_gives_transformers_numbers_and_never_raises():
    """factor ** k within float32: the same scores; past it (torch casts the growth to float32):
    inf, and nan for a score of 0 or -inf, the same; past float64 transformers raises
    OverflowError, and this gives what it gives just below (inf)."""
    scores = np.array([2.0, 0.0, -3.0, -np.inf, 1.0], np.float32)
    for eos in ([0, 1, 2, 3], [4]):
        processor = lp.ExponentialDecayLengthPenalty((0, limits.MAX_FLOAT), eos, 10)
        settings = make_settings({}, {"exponential_decay_length_penalty": [0, limits.MAX_FLOAT], "eos_token_id": eos})
        for k in (1, 5, 20, 76):  # 1e4 ** 76 is within float64, past float32
            history = list(range(10 + k))
            np.testing.assert_array_equal(ours(scores, np.array(history), settings, 10),
                                          theirs(processor, scores, history))
        with pytest.raises(OverflowError):  # transformers itself: 1e4 ** 100 overflows a double
            theirs(processor, scores, list(range(110)))
        beyond = ours(scores, np.array(range(110)), settings, 10)
        np.testing.assert_array_equal(beyond, ours(scores, np.array(range(86)), settings, 10))


def brute_lookup(row: list[int], max_ngram: int, k: int) -> list[int]:
    """Prompt lookup as docs/settings.md says it: the longest n from max_ngram down whose last-n-tokens
    occur earlier with a token after them, the earliest occurrence, then k tokens on (repeating)."""
    for n in range(min(max_ngram, len(row) - 1), 0, -1):
        tail = row[len(row) - n:]
        for start in range(len(row) - n):
            if row[start:start + n] == tail:
                follow = row[start + n:]
                return [follow[i % len(follow)] for i in range(k)]
    return []


@hyp_settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=80), min_size=1, max_size=4),
       st.integers(1, limits.MAX_MATCHING_NGRAM_SIZE), st.integers(1, limits.MAX_LOOKUP_TOKENS))
def test_prompt_lookup_equals_the_brute_force_rule(rows, max_ngram, k):
    width = max(len(r) for r in rows) + 1
    tokens = np.full((len(rows), width), 7, np.int64)
    for i, r in enumerate(rows):
        tokens[i, :len(r)] = r
    got, counts = lookup(tokens, np.array([len(r) for r in rows]), max_ngram, np.full(len(rows), k))
    for i, r in enumerate(rows):
        expected = brute_lookup(r, max_ngram, k) if len(r) >= 2 else []
        assert got[i, :counts[i]].tolist() == expected, (r, max_ngram, k)


# --- the sampling warpers without a permutation to undo, against the sort-everything ones ---------

def _sorted_top_p(scores, p, keep):
    """TopPLogitsWarper as written: a stable argsort, the cumulative cut, the permutation undone."""
    order = np.argsort(scores, axis=1, kind="stable")
    cumulative = np.cumsum(S.softmax(np.take_along_axis(scores, order, axis=1)), axis=1)
    remove = (cumulative <= (1.0 - p)[:, None].astype(cumulative.dtype))
    remove &= np.arange(scores.shape[1]) < scores.shape[1] - keep[:, None]
    out = np.zeros_like(remove)
    np.put_along_axis(out, order, remove, axis=1)
    return np.where(out & (p < 1)[:, None], -np.inf, scores).astype(scores.dtype)


def _sorted_typical_p(scores, mass, keep):
    normalized = S.log_softmax(scores)
    p = np.exp(normalized)
    with np.errstate(invalid="ignore"):
        entropy = -np.nansum(normalized * p, axis=1, keepdims=True)
    shifted = np.abs(-normalized - entropy)
    order = np.argsort(shifted, axis=1, kind="stable")
    sorted_shifted = np.take_along_axis(shifted, order, axis=1)
    cumulative = np.cumsum(S.softmax(np.take_along_axis(scores, order, axis=1)), axis=1)
    last = np.minimum((cumulative < mass[:, None]).sum(axis=1), scores.shape[1] - 1)
    remove = sorted_shifted > sorted_shifted[np.arange(len(scores)), last][:, None]
    remove &= ~(np.arange(scores.shape[1]) < keep[:, None])
    out = np.zeros_like(remove)
    np.put_along_axis(out, order, remove, axis=1)
    return np.where(out & (mass < 1)[:, None], -np.inf, scores).astype(scores.dtype)


SPECIAL = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 1.0, -1.0, 2.0]


@st.composite
def warper_rows(draw):
    n, vocab = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2, 5, 40, 700]))
    seed, kind = draw(st.integers(0, 2**32 - 1)), draw(st.sampled_from(["normal", "ties", "holes", "special"]))
    rng = np.random.default_rng(seed)
    scores = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    if kind == "ties":
        scores = rng.integers(-3, 3, (n, vocab)).astype(np.float32)
    elif kind == "holes":
        scores[rng.random((n, vocab)) < 0.6] = -np.inf
    elif kind == "special":
        scores = np.where(rng.random((n, vocab)) < 0.5, rng.choice(np.array(SPECIAL, np.float32), (n, vocab)), scores)
    p = rng.choice(np.array([0.05, 0.3, 0.9, 0.999, 1.0], np.float32), n)
    return scores, p, rng.integers(1, 4, n)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@hyp_settings(max_examples=600, deadline=None)
@given(warper_rows())
def test_top_p_and_typical_p_cut_the_tokens_the_sorted_versions_cut(rows):
    scores, p, keep = rows
    assert np.array_equal(S.top_p(scores, p, keep), _sorted_top_p(scores, p, keep), equal_nan=True)
    assert np.array_equal(S.typical_p(scores, p, keep), _sorted_typical_p(scores, p, keep), equal_nan=True)
    assert np.array_equal(S._stable_argsort(scores), np.argsort(scores, axis=1, kind="stable"))
