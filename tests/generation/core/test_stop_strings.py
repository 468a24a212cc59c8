"""Stop strings: a row stops at the token that completes one, as transformers' StopStringCriteria.

Invariants: the tokens equal transformers `generate(stop_strings=..., tokenizer=...)` whether the
string lies inside one token, spans tokens, or overhangs the last token's end; rows of one batch
stop at their own strings; the text a caller shows is cut before the string, or keeps it.
"""

from __future__ import annotations

import pytest

import generation
from generation.core.stop_strings import cut_at_stop
from generation.text.tokenizer import model_tokenizer

PROMPT = [40, 41, 42]  # plain greedy on the tiny Llama: 'kathe n ruou repo shiingel anpo stand relo ...'


@pytest.fixture(scope="module")
def model(test_models, load_model):
    return load_model(test_models["llama-optimum"])


@pytest.fixture(scope="module")
def hf_tokenizer(test_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(test_models["hf/llama"])


@pytest.mark.parametrize("stops", [["repo"], ["u re"], ["ngel an"], ["stan"], ["zzz", "lo the"], "9"],
                         ids=["inside", "spans", "spans-more", "overhangs", "second-of-two", "one-string"])
def test_stop_strings_equal_transformers(model, oracle, hf_tokenizer, stops):
    ctx = generation.context(model, max_new_tokens=20, stop_strings=stops)
    got = generation.generate(ctx, [PROMPT])[0]
    want = oracle.greedy("llama", PROMPT, 20, stop_strings=stops, tokenizer=hf_tokenizer)
    assert got == want
    plain = generation.generate(generation.context(model, max_new_tokens=20), [PROMPT])[0]
    assert len(got) < len(plain) and plain[:len(got)] == got  # it stopped, at a token it would have made


def test_rows_stop_at_their_own_strings(model):
    ctx = generation.context(model, max_new_tokens=20)
    plain = generation.generate(ctx, [PROMPT])[0]
    settings = [ctx.with_settings(stop_strings=["repo"]), ctx.with_settings(), ctx.with_settings(stop_strings=["stand"])]
    state = generation.new_state(ctx, slots=3, capacity=32)
    state, first = generation.admit(ctx, state, [0, 1, 2], [PROMPT] * 3, [0, 0, 0], settings=settings)
    ends = {}
    while state.live_rows.size:
        state, out = generation.step(ctx, state)
        for slot in out.finished.nonzero()[0]:
            ends[int(slot)] = int(state.lengths[slot]) + 1 - len(PROMPT)
    assert ends == {0: 4, 2: 7, 1: 20}
    from generation.core.state import row_tokens

    assert row_tokens(state, 0) == plain[:4] and row_tokens(state, 2) == plain[:7]


def test_text_is_cut_before_the_stop_string_or_keeps_it(model):
    ctx = generation.context(model, max_new_tokens=20, stop_strings=["u re"])
    tokens = generation.generate(ctx, [PROMPT])[0]
    text = model_tokenizer(model).decode(tokens)
    assert text.endswith("ruou repo")  # the token that completed the string is kept, as in transformers
    assert cut_at_stop(text, ctx.settings.stop_strings) == "kathe n ruo"
    assert cut_at_stop(text, ctx.settings.stop_strings, include=True) == "kathe n ruou re"


def test_stop_strings_need_a_tokenizer(model, tmp_path):
    import os

    for f in model.folder.iterdir():
        if f.name != "tokenizer.json":
            os.symlink(f, tmp_path / f.name)
    bare = generation.load(tmp_path, threads=1)
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        generation.generate(generation.context(bare, max_new_tokens=4, stop_strings=["a"]), [PROMPT])
