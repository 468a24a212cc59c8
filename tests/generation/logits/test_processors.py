"""The logits processors (processors.py) and sampling warpers (selection.py) against transformers 4.57.

Each free function runs once on a batch whose rows have different settings (always at least one
row with the setting off), and each row must equal the transformers class built with that row's
setting, applied to that row alone: the same -inf positions and values within 1e-6. A row whose
setting is off is unchanged, and no function writes into its caller's arrays.

Logits come from a drawn seed (never drawn floats: ties and specials would make the sort-based
warpers differ legitimately), token ids from a small range so repeats and n-grams occur. Where a
warper's cut falls within float rounding of its threshold the case is skipped (`assume`): both
sides are right, they just round differently.

Also: sequence_bias and bad_words_ids through `RowSettings` + `apply`, the whole pre-warper chain
of `apply` against transformers' own `_get_logits_processor`, `inplace=True` against the copying
call, the warpers that keep the argmax (typical_p may not, as in transformers), and a few
hand-computed examples.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings, strategies as st
from transformers import GenerationConfig
from transformers.generation import logits_process as lp
from transformers.generation.utils import GenerationMixin

from generation.logits import processors as P
from generation.logits import row_settings as R
from generation.logits import selection as S
from generation.params.settings import make_settings

NEG_INF = -np.inf
FAST = settings(max_examples=150, deadline=None)
SLOW = settings(max_examples=100, deadline=None)


# ---------------------------------------------------------------------------------------------
# helpers

def logits(seed: int, n: int, vocab: int, scale: float = 3.0, holes: bool = False) -> np.ndarray:
    """[n, vocab] float32 standard normal * scale; with `holes`, up to half of each row is -inf
    (as after a processor that removed tokens)."""
    rng = np.random.default_rng(seed)
    scores = (rng.standard_normal((n, vocab)) * scale).astype(np.float32)
    if holes:
        for row in scores:
            row[rng.choice(vocab, size=int(rng.integers(0, vocab // 2 + 1)), replace=False)] = NEG_INF
    return scores


def theirs(processor, row: np.ndarray, input_ids) -> np.ndarray:
    """A transformers processor on one row: input_ids [1, L], scores [1, V]."""
    ids = torch.as_tensor(np.asarray(input_ids, np.int64).reshape(1, -1))
    return processor(ids, torch.from_numpy(row.copy()).reshape(1, -1))[0].numpy()


def assert_row(ours: np.ndarray, expected: np.ndarray, row: int) -> None:
    assert np.array_equal(np.isneginf(ours), np.isneginf(expected)), f"row {row}: -inf at {np.isneginf(ours)} " \
                                                                     f"vs {np.isneginf(expected)}"
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-6, err_msg=f"row {row}")


def assert_unchanged(ours: np.ndarray, before: np.ndarray, row: int) -> None:
    assert np.array_equal(ours, before, equal_nan=True), f"row {row} is off but changed"


def pure(fn, *args, **kwargs):
    """fn(*args, **kwargs), checking that it wrote into none of its array arguments."""
    arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
    arrays += [a for x in (*args, *kwargs.values()) if isinstance(x, list) for a in x if isinstance(a, np.ndarray)]
    copies = [a.copy() for a in arrays]
    out = fn(*args, **kwargs)
    for a, c in zip(arrays, copies):
        assert np.array_equal(a, c, equal_nan=a.dtype.kind == "f"), "an argument was changed in place"
    return out


def compare(ours: np.ndarray, scores: np.ndarray, oracle) -> None:
    """Row i of `ours` against `oracle(i)`: a (processor, input_ids) pair, or None for a row whose
    setting is off (it must be unchanged)."""
    assert ours.shape == scores.shape and ours.dtype == np.float32
    for i in range(len(scores)):
        spec = oracle(i)
        if spec is None:
            assert_unchanged(ours[i], scores[i], i)
        else:
            assert_row(ours[i], theirs(spec[0], scores[i], spec[1]), i)


def table(lists, width: int | None = None) -> np.ndarray:
    """Token lists as a -1 padded [n, width] int64 table."""
    width = max([1] + [len(x) for x in lists]) if width is None else width
    out = np.full((len(lists), width), -1, np.int64)
    for i, ids in enumerate(lists):
        out[i, :len(ids)] = ids
    return out


def probs64(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


# ---------------------------------------------------------------------------------------------
# strategies

@st.composite
def per_row(draw, n: int, on, off):
    """n per-row values, each `off` or drawn from `on`, with at least one of each."""
    values = [draw(st.one_of(st.just(off), on)) for _ in range(n)]
    first, second = draw(st.permutations(range(n)))[:2]
    values[first], values[second] = off, draw(on)
    return values


@st.composite
def batches(draw, tokens: int = 4, width: int = 10, min_length: int = 1, vocab=(8, 40), max_n: int = 5):
    """(scores [n, V], history [n, width], length [n]) with history tokens in [0, tokens)."""
    n = draw(st.integers(2, max_n))
    v = draw(st.integers(*vocab))
    scores = logits(draw(st.integers(0, 2**32 - 1)), n, v)
    ids = st.integers(0, min(tokens, v) - 1)
    history = np.array(draw(st.lists(st.lists(ids, min_size=width, max_size=width), min_size=n, max_size=n)), np.int64)
    length = np.array(draw(st.lists(st.integers(min_length, width), min_size=n, max_size=n)), np.int64)
    return scores, history, length


def token_lists(vocab: int, n: int, min_size: int = 0, max_size: int = 3, tokens: int = 6):
    ids = st.integers(0, min(tokens, vocab) - 1)
    return st.lists(st.lists(ids, min_size=min_size, max_size=max_size, unique=True), min_size=n, max_size=n)


@st.composite
def warper_batches(draw, on, off):
    """(scores, per-row values, per-row min_keep) for a sampling warper."""
    n = draw(st.integers(2, 5))
    v = draw(st.integers(8, 64))
    scores = logits(draw(st.integers(0, 2**32 - 1)), n, v, draw(st.sampled_from([0.3, 1.0, 3.0, 10.0])),
                    draw(st.booleans()))
    values = draw(per_row(n, on, off))
    keep = draw(st.lists(st.integers(1, 3), min_size=n, max_size=n))
    return scores, values, np.array(keep, np.int64)


penalties = st.floats(0.2, 5.0).filter(lambda p: abs(p - 1) > 1e-3)
fractions = st.floats(0.01, 0.99)


# ---------------------------------------------------------------------------------------------
# processors, each against its transformers class row by row

@FAST
@given(batches(), st.data())
def test_repetition_penalty(batch, data):
    scores, history, length = batch
    p = data.draw(per_row(len(scores), penalties, 1.0))
    ours = pure(P.repetition_penalty, scores, history, length, np.array(p, np.float32))
    compare(ours, scores, lambda i: None if p[i] == 1.0 else
            (lp.RepetitionPenaltyLogitsProcessor(p[i]), history[i, :length[i]]))


@FAST
@given(batches(), st.data())
def test_encoder_repetition_penalty(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    p = data.draw(per_row(n, penalties, 1.0))
    prompts = [np.array(x, np.int64) for x in data.draw(token_lists(v, n, 1, 6, tokens=8))]
    ours = pure(P.encoder_repetition_penalty, scores, prompts, np.array(p, np.float64))
    compare(ours, scores, lambda i: None if p[i] == 1.0 else
            (lp.EncoderRepetitionPenaltyLogitsProcessor(p[i], torch.from_numpy(prompts[i])[None]),
             history[i, :length[i]]))


@FAST
@given(batches(tokens=3, width=12), st.data())
def test_no_repeat_ngram(batch, data):
    scores, history, length = batch
    size = data.draw(per_row(len(scores), st.integers(1, 4), 0))
    ours = pure(P.no_repeat_ngram, scores, history, length, np.array(size, np.int64))
    compare(ours, scores, lambda i: None if size[i] == 0 else
            (lp.NoRepeatNGramLogitsProcessor(size[i]), history[i, :length[i]]))


@FAST
@given(batches(tokens=3, width=8), st.data())
def test_encoder_no_repeat_ngram(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    size = data.draw(per_row(n, st.integers(1, 4), 0))
    prompts = [np.array(x, np.int64) for x in data.draw(
        st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=10), min_size=n, max_size=n))]
    ours = pure(P.encoder_no_repeat_ngram, scores, history, length, np.array(size, np.int64), prompts)
    compare(ours, scores, lambda i: None if size[i] == 0 else
            (lp.EncoderNoRepeatNGramLogitsProcessor(size[i], torch.from_numpy(prompts[i]).reshape(1, -1)),
             history[i, :length[i]]))


@FAST
@given(batches(width=6), st.data())
def test_min_length(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    minimum = data.draw(per_row(n, st.integers(1, 8), 0))
    eos = data.draw(token_lists(v, n, 1, 3, tokens=v))
    ours = pure(P.min_length, scores, length, np.array(minimum, np.int64), table(eos))
    compare(ours, scores, lambda i: None if minimum[i] == 0 else
            (lp.MinLengthLogitsProcessor(minimum[i], eos[i]), history[i, :length[i]]))


@FAST
@given(batches(width=8), st.data())
def test_min_new_tokens(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    new = data.draw(per_row(n, st.integers(1, 6), 0))
    prompt = [data.draw(st.integers(1, int(x))) for x in length]
    eos = data.draw(token_lists(v, n, 0, 3, tokens=v))  # a row without eos is unchanged
    minimum = np.array([p + m if m else 0 for p, m in zip(prompt, new)], np.int64)
    ours = pure(P.min_length, scores, length, minimum, table(eos))
    compare(ours, scores, lambda i: None if new[i] == 0 or not eos[i] else
            (lp.MinNewTokensLengthLogitsProcessor(prompt[i], new[i], eos[i]), history[i, :length[i]]))


@FAST
@given(batches(width=3), st.data())
def test_forced_bos(batch, data):
    scores, history, length = batch
    bos = data.draw(per_row(len(scores), st.integers(0, scores.shape[1] - 1), -1))
    tokens = np.array(bos, np.int64)[:, None]
    ours = pure(P.force_tokens, scores, (length == 1) & (tokens[:, 0] >= 0), tokens)
    compare(ours, scores, lambda i: None if bos[i] < 0 else
            (lp.ForcedBOSTokenLogitsProcessor(bos[i]), history[i, :length[i]]))


@FAST
@given(batches(width=6), st.data())
def test_forced_eos(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    eos = data.draw(per_row(n, st.lists(st.integers(0, v - 1), min_size=1, max_size=3, unique=True), []))
    limit = np.array([data.draw(st.integers(2, 8)) for _ in range(n)], np.int64)
    tokens = table(eos)
    ours = pure(P.force_tokens, scores, (length == limit - 1) & (tokens[:, 0] >= 0), tokens)
    compare(ours, scores, lambda i: None if not eos[i] else
            (lp.ForcedEOSTokenLogitsProcessor(int(limit[i]), eos[i]), history[i, :length[i]]))


@FAST
@given(batches(), st.data())
def test_remove_invalid_values(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    scores = scores.copy()
    for row in scores:
        row[rng.choice(v, size=int(rng.integers(0, 4)), replace=False)] = np.nan
        row[rng.choice(v, size=int(rng.integers(0, 3)), replace=False)] = rng.choice([np.inf, -np.inf])
    on = data.draw(per_row(n, st.just(True), False))
    ours = pure(P.remove_invalid_values, scores, np.array(on))
    assert np.isfinite(ours[np.array(on)]).all()
    compare(ours, scores, lambda i: (lp.InfNanRemoveLogitsProcessor(), history[i, :length[i]]) if on[i] else None)


@FAST
@given(batches(width=12), st.data())
def test_exponential_decay_length_penalty(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    decay = data.draw(per_row(n, st.tuples(st.integers(0, 6), st.floats(0.5, 2.0)), None))
    prompt = [data.draw(st.integers(1, int(x))) for x in length]
    eos = data.draw(token_lists(v, n, 1, 3, tokens=v))
    start = np.array([-1 if d is None else d[0] + p for d, p in zip(decay, prompt)], np.int64)
    factor = np.array([1.0 if d is None else d[1] for d in decay], np.float64)
    ours = pure(P.exponential_decay_length_penalty, scores, length, start, factor, table(eos))
    compare(ours, scores, lambda i: None if decay[i] is None else
            (lp.ExponentialDecayLengthPenalty(decay[i], eos[i], prompt[i]), history[i, :length[i]]))


@FAST
@given(batches(width=5), st.data())
def test_suppress_tokens(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    suppressed = data.draw(per_row(n, st.lists(st.integers(0, v - 1), min_size=1, max_size=5, unique=True), []))
    mask = np.zeros((n, v), bool)
    for i, ids in enumerate(suppressed):
        mask[i, ids] = True
    ours = pure(P.suppress, scores, mask)
    compare(ours, scores, lambda i: None if not suppressed[i] else
            (lp.SuppressTokensLogitsProcessor(suppressed[i]), history[i, :length[i]]))


@FAST
@given(batches(width=5), st.data())
def test_suppress_tokens_at_begin(batch, data):
    scores, history, length = batch
    n, v = scores.shape
    suppressed = data.draw(per_row(n, st.lists(st.integers(0, v - 1), min_size=1, max_size=5, unique=True), []))
    begin = np.array([data.draw(st.integers(1, 5)) for _ in range(n)], np.int64)
    mask = np.zeros((n, v), bool)
    for i, ids in enumerate(suppressed):
        mask[i, ids] = True
    ours = pure(P.suppress, scores, mask, length == begin)
    compare(ours, scores, lambda i: None if not suppressed[i] else
            (lp.SuppressTokensAtBeginLogitsProcessor(suppressed[i], int(begin[i])), history[i, :length[i]]))


# sequence_bias and bad_words_ids through RowSettings + apply (the rows' tables are built there)

def applied(scores, history, length, row_settings, prompts=None, limits=None):
    n, v = scores.shape
    rows = R.RowSettings(n, v)
    for i, s in enumerate(row_settings):
        rows.set_row(i, s, int(length[i]) if prompts is None else len(prompts[i]),
                     100 if limits is None else int(limits[i]),
                     encoder_ids=None if prompts is None else prompts[i])
    return pure(R.apply, scores, rows, history, length)


sequences = st.lists(st.integers(0, 3), min_size=1, max_size=3)


@FAST
@given(batches(width=8), st.data())
def test_sequence_bias_through_apply(batch, data):
    scores, history, length = batch
    n = len(scores)
    entries = st.lists(st.tuples(sequences, st.floats(-5, 5, width=32)), min_size=1, max_size=6)
    biases = data.draw(per_row(n, entries, None))
    rows = [make_settings({}, {} if b is None else {"sequence_bias": [[ids, bias] for ids, bias in b]})
            for b in biases]
    ours = applied(scores, history, length, rows)
    compare(ours, scores, lambda i: None if biases[i] is None else
            (lp.SequenceBiasLogitsProcessor({tuple(ids): float(bias) for ids, bias in biases[i]}),
             history[i, :length[i]]))


@FAST
@given(batches(width=8), st.data())
def test_bad_words_through_apply(batch, data):
    scores, history, length = batch
    n = len(scores)
    bad = data.draw(per_row(n, st.lists(sequences, min_size=1, max_size=5), None))
    eos = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=2, unique=True), min_size=n, max_size=n))
    rows = [make_settings({}, {"eos_token_id": e, **({} if b is None else {"bad_words_ids": b})})
            for b, e in zip(bad, eos)]
    ours = applied(scores, history, length, rows)
    compare(ours, scores, lambda i: None if bad[i] is None else
            (lp.NoBadWordsLogitsProcessor(bad[i], eos[i] or None), history[i, :length[i]]))


# the whole chain of apply against transformers' _get_logits_processor

class _Generator(GenerationMixin):
    """Just enough of a model for GenerationMixin._get_logits_processor (no guidance, no watermark)."""


@st.composite
def chain_rows(draw, vocab: int):
    """(generation settings, prompt, new tokens, limit) of one row; each setting on half the time."""
    tok = st.integers(0, 3)
    maybe = {
        "sequence_bias": st.lists(st.tuples(sequences, st.floats(-4, 4, width=32)), min_size=1, max_size=4),
        "encoder_repetition_penalty": penalties,
        "repetition_penalty": penalties,
        "no_repeat_ngram_size": st.integers(1, 3),
        "encoder_no_repeat_ngram_size": st.integers(1, 3),
        "bad_words_ids": st.lists(sequences, min_size=1, max_size=3),
        "min_length": st.integers(1, 10),
        "min_new_tokens": st.integers(1, 4),
        "forced_bos_token_id": tok,
        "forced_eos_token_id": st.lists(tok, min_size=1, max_size=2, unique=True),
        "remove_invalid_values": st.just(True),
        "exponential_decay_length_penalty": st.tuples(st.integers(0, 4), st.floats(0.5, 2.0)),
        "suppress_tokens": st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3, unique=True),
        "begin_suppress_tokens": st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3, unique=True),
    }
    fields = {k: draw(s) for k, s in maybe.items() if draw(st.booleans())}
    eos = draw(st.lists(tok, max_size=2, unique=True))
    if not eos:  # transformers' ExponentialDecayLengthPenalty fails without an eos token
        fields.pop("exponential_decay_length_penalty", None)
    prompt = draw(st.lists(tok, min_size=1, max_size=5))
    new = draw(st.lists(tok, max_size=5))
    limit = len(prompt) + len(new) + draw(st.integers(1, 3))
    return fields, eos, prompt, new, limit


def transformers_chain(fields: dict, eos, prompt, limit: int):
    """The processors generate() builds for one row (do_sample=False: no warpers)."""
    config = dict(fields)
    if "sequence_bias" in config:
        config["sequence_bias"] = {tuple(ids): float(b) for ids, b in config["sequence_bias"]}
    gc = GenerationConfig(**config)
    gc._eos_token_tensor = torch.tensor(eos) if eos else None
    gc.max_length = limit
    if gc.min_new_tokens is not None:  # as generate's _prepare_generated_length
        gc.min_length = gc.min_new_tokens + len(prompt)
    return _Generator.__new__(_Generator)._get_logits_processor(
        gc, input_ids_seq_length=len(prompt), encoder_input_ids=torch.tensor([prompt]))


@SLOW
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan, inf and float32 max scores, as in torch
@given(st.integers(8, 24).flatmap(lambda v: st.tuples(st.just(v), st.lists(chain_rows(v), min_size=2, max_size=4))),
       st.integers(0, 2**32 - 1), st.booleans())
def test_apply_equals_the_transformers_chain(drawn, seed, invalid):
    vocab, rows = drawn
    rows[0] = ({}, *rows[0][1:])  # one row with every processor off
    n = len(rows)
    scores = logits(seed, n, vocab)
    if invalid:
        scores[:, 1], scores[:, 2] = np.nan, np.inf
    full = [prompt + new for _, _, prompt, new, _ in rows]
    history, length = table(full, 12), np.array([len(x) for x in full], np.int64)
    settings_ = [make_settings({}, {**fields, "eos_token_id": eos}) for fields, eos, *_ in rows]
    ours = applied(scores, history, length, settings_, prompts=[r[2] for r in rows], limits=[r[4] for r in rows])
    for i, (fields, eos, prompt, new, limit) in enumerate(rows):
        expected = transformers_chain(fields, eos, prompt, limit)(torch.tensor([full[i]]),
                                                                  torch.from_numpy(scores[i:i + 1].copy()))[0].numpy()
        assert_row(ours[i], expected, i)


def test_min_new_tokens_zero_overrides_min_length_as_generate_does():
    fields, eos, prompt, limit = {"min_length": 6, "min_new_tokens": 0}, [1], [0, 2], 20
    scores = logits(0, 1, 8)
    ours = applied(scores, table([prompt]), np.array([2]), [make_settings({}, {**fields, "eos_token_id": eos})],
                   prompts=[prompt], limits=[limit])
    expected = transformers_chain(fields, eos, prompt, limit)(torch.tensor([prompt]), torch.from_numpy(scores.copy()))
    assert_row(ours[0], expected[0].numpy(), 0)


@FAST
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # nan, inf and float32 max scores, as in torch
@given(batches(tokens=3), st.data())
def test_inplace_writes_the_same_scores_into_the_array(batch, data):
    """`inplace=True` (what apply uses, ignoring the return value) writes what the copying call returns."""
    scores, history, length = batch
    scores[0, 1], scores[1, 2] = np.nan, np.inf
    n, v = scores.shape
    eos = table(data.draw(token_lists(v, n, 1, 2, tokens=v)))
    prompts = [np.array(x, np.int64) for x in data.draw(token_lists(v, n, 1, 3, tokens=3))]
    rows = R.RowSettings(n, v)
    for i in range(n):
        rows.set_row(i, make_settings({}, {"sequence_bias": [[[1], -1.5], [[0, 2], 2.0], [[1, 1], 0.5]],
                                           "bad_words_ids": [[2], [1, 0]]} if i % 2 else {}), 1, 100)
    mask = np.zeros((n, v), bool)
    mask[0, :3] = True
    on = lambda strategy, off, dtype: np.array(data.draw(per_row(n, strategy, off)), dtype)
    calls = {
        "repetition_penalty": (history, length, on(penalties, 1.0, np.float32)),
        "encoder_repetition_penalty": (prompts, on(penalties, 1.0, np.float32)),
        "no_repeat_ngram": (history, length, on(st.integers(1, 3), 0, np.int64)),
        "encoder_no_repeat_ngram": (history, length, on(st.integers(1, 3), 0, np.int64), prompts),
        "sequence_bias": (history, length, rows.one_token_bias, rows.bias_rules),
        "min_length": (length, on(st.integers(1, 12), 0, np.int64), eos),
        "force_tokens": (on(st.just(True), False, bool), eos),
        "remove_invalid_values": (on(st.just(True), False, bool),),
        "exponential_decay_length_penalty": (length, on(st.integers(0, 5), -1, np.int64),
                                             on(st.floats(0.5, 2.0), 1.0, np.float64), eos),
        "suppress": (mask, on(st.just(True), False, bool)),
    }
    for name, args in calls.items():
        expected = getattr(P, name)(scores, *args)
        work = scores.copy()
        getattr(P, name)(work, *args, inplace=True)
        assert np.array_equal(work, expected, equal_nan=True), name


# ---------------------------------------------------------------------------------------------
# warpers (selection.py), each against its transformers class row by row

def check_warper(scores, ours, values, off, make, clear=None):
    """ours: our warper's output on the batch; make(value, i) builds row i's transformers warper;
    clear(row, value) says whether the row's cut is clear of float rounding."""
    if clear is not None:
        assume(all(values[i] == off or clear(scores[i], values[i]) for i in range(len(scores))))
    compare(ours, scores, lambda i: None if values[i] == off else (make(values[i], i), np.zeros(1)))


@FAST
@given(warper_batches(st.floats(0.05, 5.0).filter(lambda t: abs(t - 1) > 1e-3), 1.0))
def test_temperature(batch):
    scores, t, _ = batch
    ours = pure(S.temperature, scores, np.array(t, np.float32))
    check_warper(scores, ours, t, 1.0, lambda t, i: lp.TemperatureLogitsWarper(t))


@FAST
@given(warper_batches(st.integers(1, 70), 0))
def test_top_k(batch):
    scores, k, keep = batch
    ours = pure(S.top_k, scores, np.array(k, np.int64), keep)
    check_warper(scores, ours, k, 0, lambda k, i: lp.TopKLogitsWarper(k, min_tokens_to_keep=int(keep[i])))


def top_p_clear(row, p):
    return np.abs(np.cumsum(np.sort(probs64(row))) - (1 - p)).min() > 1e-5


@FAST
@given(warper_batches(fractions, 1.0))
def test_top_p(batch):
    scores, p, keep = batch
    ours = pure(S.top_p, scores, np.array(p, np.float32), keep)
    check_warper(scores, ours, p, 1.0, lambda p, i: lp.TopPLogitsWarper(p, min_tokens_to_keep=int(keep[i])),
                 top_p_clear)


def min_p_clear(row, p):
    ratio = probs64(row) / probs64(row).max()
    return np.abs(np.delete(ratio, ratio.argmax()) - p).min() > 1e-5


@FAST
@given(warper_batches(st.floats(0.01, 1.0), 0.0))
def test_min_p(batch):
    scores, p, keep = batch
    ours = pure(S.min_p, scores, np.array(p, np.float32), keep)
    check_warper(scores, ours, p, 0.0, lambda p, i: lp.MinPLogitsWarper(p, min_tokens_to_keep=int(keep[i])),
                 min_p_clear)


def typical_clear(row, mass):
    probs = probs64(row)
    with np.errstate(divide="ignore", invalid="ignore"):
        logp = np.log(probs)
        entropy = -np.sum(np.where(probs > 0, probs * logp, 0.0))
    shifted = np.abs(-logp - entropy)
    order = np.argsort(shifted, kind="stable")
    finite = shifted[order][np.isfinite(shifted[order])]
    gaps_clear = len(finite) < 2 or np.diff(finite).min() > 1e-4
    return gaps_clear and np.abs(np.cumsum(probs[order]) - mass).min() > 1e-5


@FAST
@given(warper_batches(fractions, 1.0))
def test_typical_p(batch):
    scores, mass, keep = batch
    ours = pure(S.typical_p, scores, np.array(mass, np.float32), keep)
    check_warper(scores, ours, mass, 1.0, lambda m, i: lp.TypicalLogitsWarper(m, min_tokens_to_keep=int(keep[i])),
                 typical_clear)


cutoffs = st.floats(-4, -0.5).map(lambda x: 10.0 ** x)


@FAST
@given(warper_batches(cutoffs, 0.0))
def test_epsilon_cutoff(batch):
    scores, eps, keep = batch
    ours = pure(S.epsilon_cutoff, scores, np.array(eps, np.float32), keep)
    check_warper(scores, ours, eps, 0.0, lambda e, i: lp.EpsilonLogitsWarper(e, min_tokens_to_keep=int(keep[i])),
                 lambda row, e: np.abs(probs64(row) / e - 1).min() > 1e-5)


def eta_clear(row, eta):
    probs = probs64(row)
    entropy = -np.sum(np.where(probs > 0, probs * np.log(np.where(probs > 0, probs, 1)), 0.0))
    threshold = min(eta, np.sqrt(eta) * np.exp(-entropy))
    return np.abs(probs / threshold - 1).min() > 1e-4


@FAST
@given(warper_batches(cutoffs, 0.0))
def test_eta_cutoff(batch):
    scores, eta, keep = batch
    ours = pure(S.eta_cutoff, scores, np.array(eta, np.float32), keep)
    check_warper(scores, ours, eta, 0.0, lambda e, i: lp.EtaLogitsWarper(e, min_tokens_to_keep=int(keep[i])),
                 eta_clear)


@FAST
@given(warper_batches(st.just(True), False))
def test_log_softmax(batch):
    scores, _, _ = batch
    ours = pure(S.log_softmax, scores)
    compare(ours, scores, lambda i: (lp.LogitNormalization(), np.zeros(1)))


# ---------------------------------------------------------------------------------------------
# properties

KEEPS_ARGMAX = {  # min_keep 1 (typical_p is not here: it keeps the tokens nearest the entropy)
    "temperature": lambda s, v: S.temperature(s, v * 4.9 + 0.1),
    "top_k": lambda s, v: S.top_k(s, (v * s.shape[1]).astype(np.int64), np.ones(len(s), np.int64)),
    "top_p": lambda s, v: S.top_p(s, v, np.ones(len(s), np.int64)),
    "min_p": lambda s, v: S.min_p(s, v, np.ones(len(s), np.int64)),
    "epsilon_cutoff": lambda s, v: S.epsilon_cutoff(s, v * 0.5, np.ones(len(s), np.int64)),
    "eta_cutoff": lambda s, v: S.eta_cutoff(s, v * 0.5, np.ones(len(s), np.int64)),
    "log_softmax": lambda s, v: S.log_softmax(s),
}


@pytest.mark.parametrize("name", KEEPS_ARGMAX)
@settings(max_examples=60, deadline=None)
@given(warper_batches(fractions, 0.999))
def test_warpers_keep_the_argmax(name, batch):
    scores, values, _ = batch
    ours = pure(KEEPS_ARGMAX[name], scores, np.array(values, np.float32))
    assert (ours.argmax(axis=1) == scores.argmax(axis=1)).all()
    assert np.isfinite(ours[np.arange(len(scores)), scores.argmax(axis=1)]).all()


def test_typical_p_may_remove_the_argmax_as_transformers_does():
    # one token at p = 0.3 and many at 0.001: the entropy (5.2 nats) is near the small tokens'
    # surprise (6.9), far from the big one's (1.2), so mass 0.5 keeps only small tokens
    scores = np.log(np.array([[0.3] + [0.001] * 700, [0.3] + [0.001] * 700], np.float32))
    ours = S.typical_p(scores, np.array([0.5, 1.0], np.float32), np.ones(2, np.int64))
    expected = theirs(lp.TypicalLogitsWarper(0.5), scores[0], np.zeros(1))
    assert np.isneginf(ours[0, 0]) and np.isneginf(expected[0])
    assert_row(ours[0], expected, 0)
    assert_unchanged(ours[1], scores[1], 1)


# ---------------------------------------------------------------------------------------------
# hand-computed examples

def test_no_repeat_ngram_by_hand():
    scores = np.zeros((1, 6), np.float32)
    # bigrams of 1 2 3 1 2: after the last token (2) came 3 once: 3 is banned
    out = P.no_repeat_ngram(scores, np.array([[1, 2, 3, 1, 2]]), np.array([5]), np.array([2]))
    assert out.tolist() == [[0, 0, 0, NEG_INF, 0, 0]]
    history = np.array([[1, 2, 3, 1, 2, 0], [1, 2, 1, 2, 1, 0], [1, 1, 1, 1, 1, 1], [3, 5, 3, 0, 0, 0], [4, 4, 0, 0, 0, 0]])
    out = P.no_repeat_ngram(np.zeros((5, 6), np.float32), history, np.array([5, 5, 6, 3, 2]), np.array([2, 3, 0, 1, 3]))
    assert out.tolist() == [[0, 0, 0, NEG_INF, 0, 0],  # as above
                            [0, 0, NEG_INF, 0, 0, 0],  # trigrams 121 212 121; after 2 1 came 2
                            [0, 0, 0, 0, 0, 0],  # size 0: off
                            [0, 0, 0, NEG_INF, 0, NEG_INF],  # size 1: every token held is banned
                            [0, 0, 0, 0, 0, 0]]  # 2 tokens: no trigram yet


def test_repetition_penalty_by_hand():
    scores = np.array([[2.0, -2.0, 1.0, 0.5]], np.float32)
    out = P.repetition_penalty(scores, np.array([[0, 1, 0]]), np.array([3]), np.array([2.0], np.float32))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # positive / 2, negative * 2, once per token
    batch = np.repeat(scores, 3, axis=0)
    history = np.array([[0, 1, 0], [0, 1, 2], [2, 3, 0]])
    out = P.repetition_penalty(batch, history, np.array([3, 3, 2]), np.array([2.0, 1.0, 0.5], np.float32))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.5], [2.0, -2.0, 1.0, 0.5], [2.0, -2.0, 2.0, 1.0]]
    assert batch.tolist() == np.repeat(scores, 3, axis=0).tolist()


def test_min_length_by_hand():
    scores = np.ones((1, 4), np.float32)
    out = P.min_length(scores, np.array([3]), np.array([4]), np.array([[3]]))
    assert out.tolist() == [[1, 1, 1, NEG_INF]]  # 3 tokens < 4: eos removed
    batch = np.ones((4, 4), np.float32)
    eos = np.array([[3, -1], [3, -1], [0, 2], [1, -1]])
    out = P.min_length(batch, np.array([3, 4, 1, 1]), np.array([4, 4, 5, 0]), eos)
    assert out.tolist() == [[1, 1, 1, NEG_INF], [1, 1, 1, 1], [NEG_INF, 1, NEG_INF, 1], [1, 1, 1, 1]]
