"""generation.front.output's TokenTexts: the log-probabilities every route, stream, batch line and
the handle give. Invariant: each is a JSON number, finite and at least -9999.0 (vLLM's floor), and
an alternative the sampling filters removed (-inf, or the engine's id -1 past a top_k's
candidates) is left out; what was finite above the floor stays as it was. Hand-built tokens."""

from __future__ import annotations

import math

from generation.engine.batching import Token
from generation.front.output import LOGPROB_FLOOR, TokenTexts
from generation.logits.prompt_logprobs import from_lists

INF, NAN = math.inf, math.nan


class Letters:
    """A tokenizer of one letter a token: id 0 is "a"."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def test_a_tokens_alternatives_are_json_numbers_and_the_filtered_ones_left_out():
    token = Token(0, -0.25, [(0, -0.25), (1, -1e5), (2, -INF), (-1, -INF), (3, NAN), (4, -2.0)])
    out = TokenTexts(Letters()).of(token, 6)
    assert (out.id, out.text, out.logprob) == (0, "a", -0.25)
    assert out.top == [(0, "a", -0.25), (1, "b", LOGPROB_FLOOR), (4, "e", -2.0)]
    assert TokenTexts(Letters()).of(token, 2).top == [(0, "a", -0.25), (1, "b", LOGPROB_FLOOR)]  # the first 2 asked
    for own in (-INF, NAN, -12345.0):  # a token's own: clamped, never left out
        assert TokenTexts(Letters()).of(Token(1, own, [(-1, -INF)]), 1).logprob == LOGPROB_FLOOR
    assert TokenTexts(Letters()).of(Token(1, -0.5, [(-1, -INF)]), 3).top == []  # every alternative filtered


def test_the_prompts_log_probabilities_the_same():
    found = from_lists([-INF, -0.5], [[0, 1], [2, -1]], [[-0.125, -INF], [-0.5, -INF]])
    out = TokenTexts(Letters()).of_prompt([3, 0, 2], found, 2)
    assert [(t.text, t.logprob, t.top) for t in out] == [
        ("d", None, None), ("a", LOGPROB_FLOOR, [(0, "a", -0.125)]), ("c", -0.5, [(2, "c", -0.5)])]
