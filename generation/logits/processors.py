"""The logits processors of transformers 4.57 `_get_logits_processor`, over a whole batch.

Each processor is a free function over `scores` [n, V] float32 and per-row arrays, so one call
serves rows with different settings (a row whose setting is off is left as it is). A processor
returns a new array and never writes into the caller's, unless told `inplace=True` (what `apply`
does on its own copy, so a step copies the scores once, not once per processor). The row's tokens so far are
`history[i, :length[i]]`: its prompt and its new tokens, as transformers counts the columns of
`input_ids` (`length` is transformers' `cur_len`).

`RowSettings` (row_settings.py) holds every row's settings as arrays, with the masks that do not
change between steps (one-token bad words and biases, `suppress_tokens`) built once when the row
enters, and its `apply` runs these processors in transformers' order. The sampling warpers are in `selection.py`.

Beyond transformers: OpenAI's frequency_penalty and presence_penalty (`frequency_presence_penalty`,
as vLLM applies them, over the row's new tokens `history[i, prompt_length[i]:length[i]]`), right
after the repetition penalty, as vLLM's `apply_penalties` orders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


NEG_INF = np.float32(-np.inf)

# A user's processor (the seed's "Processors"): `state(row) -> array` of one shape for every
# row and step, where row = {"prompt": [ids], "generated": [ids, last first], "vocab": V};
# `process(scores [n, V], states [n, ...]) -> scores [n, V]` over the rows at once.
CustomProcessor = tuple[Callable[[dict], np.ndarray], Callable[[np.ndarray, np.ndarray], np.ndarray]]


def _gather_history(history: np.ndarray, length: np.ndarray) -> np.ndarray:
    """history [n, W] with each row's entries past its length replaced by its first token, so a
    gather over the whole width sees only the row's own tokens (repeats change nothing)."""
    width = int(length.max())
    tokens = history[:, :width]
    return np.where(np.arange(width) < length[:, None], tokens, tokens[:, :1])


def repetition_penalty(scores: np.ndarray, history: np.ndarray, length: np.ndarray,
                       penalty: np.ndarray, inplace: bool = False) -> np.ndarray:
    """RepetitionPenaltyLogitsProcessor: every token the row holds gets its score multiplied by
    the penalty when negative, divided by it otherwise; penalty 1 is off.

    >>> repetition_penalty(np.array([[2., -2., 1.]], np.float32), np.array([[0, 1]]), np.array([2]),
    ...                    np.array([2.], np.float32))
    array([[ 1., -4.,  1.]], dtype=float32)
    """
    out = scores if inplace else scores.copy()
    rows = np.flatnonzero(penalty != 1)
    if rows.size and length[rows].max() > 0:
        flat = _gather_history(history[rows], length[rows]) + (rows * scores.shape[1])[:, None]
        p = penalty[rows, None].astype(np.float32)
        got = out.take(flat)
        np.put(out, flat, np.where(got < 0, got * p, got / p))
    return out


def frequency_presence_penalty(scores: np.ndarray, history: np.ndarray, length: np.ndarray, start: np.ndarray,
                               frequency: np.ndarray, presence: np.ndarray, inplace: bool = False) -> np.ndarray:
    """OpenAI's frequency_penalty and presence_penalty, as vLLM's `apply_penalties` applies them
    (no transformers processor): every token among the row's new tokens `history[i, start[i]:
    length[i]]` (not its prompt: vLLM's output_token_ids) gets `frequency x count` subtracted,
    then `presence`; both 0 is off. In float32, one subtraction each, as vLLM's
    `logits -= frequency * counts; logits -= presence * mask` (tokens not among them keep
    their scores exactly).

    >>> frequency_presence_penalty(np.array([[2., 2., 2., 2.]], np.float32), np.array([[3, 1, 1, 2]]),
    ...                            np.array([4]), np.array([1]), np.array([.5], np.float32),
    ...                            np.array([.25], np.float32))
    array([[2.  , 0.75, 1.25, 2.  ]], dtype=float32)

    (token 3 is the prompt's: untouched; token 1 came twice: 2 - 0.5 x 2 - 0.25.)
    """
    out = scores if inplace else scores.copy()
    rows = np.flatnonzero((frequency != 0) | (presence != 0))
    if not rows.size:
        return out
    begin, end = start[rows], length[rows]
    width = int((end - begin).max())
    if width <= 0:
        return out
    at = begin[:, None] + np.arange(width)  # [R, W] each row's new tokens' indices
    held = at < end[:, None]
    tokens = history[rows[:, None], np.minimum(at, history.shape[1] - 1)]
    vocab = scores.shape[1]
    keys, counts = np.unique((rows[:, None] * vocab + tokens)[held], return_counts=True)
    r, t = keys // vocab, keys % vocab
    got = out[r, t] - frequency[r].astype(np.float32) * counts.astype(np.float32)
    out[r, t] = got - presence[r].astype(np.float32)
    return out


def encoder_repetition_penalty(scores: np.ndarray, encoder_ids: Sequence[np.ndarray],
                               penalty: np.ndarray, inplace: bool = False) -> np.ndarray:
    """EncoderRepetitionPenaltyLogitsProcessor: the tokens of the row's encoder input (the prompt
    of a decoder-only model, as transformers passes it) are favoured by 1 / penalty."""
    out = scores if inplace else scores.copy()
    for i in np.flatnonzero(penalty != 1):
        ids = np.asarray(encoder_ids[i], np.int64)
        if ids.size:
            p = np.float32(1 / penalty[i])
            got = out[i, ids]
            out[i, ids] = np.where(got < 0, got * p, got / p)
    return out


def ngram_bans(source: np.ndarray, tail: np.ndarray, size: int, complete: int) -> np.ndarray:
    """The tokens that follow `tail` (size - 1 tokens) in the size-grams of `source[:complete +
    size - 1]` that are whole: the `complete` n-grams starting at 0..complete-1. The starts that
    match the tail's first token are narrowed one token at a time, so a step costs about one
    pass over the row, not size passes (the tokens of transformers' dict of n-grams).

    >>> ngram_bans(np.array([1, 2, 3, 1, 2]), np.array([1]), 2, 4).tolist()
    [2, 2]
    """
    if complete <= 0:
        return np.zeros(0, np.int64)
    if size == 1:
        return source[:complete]
    starts = np.flatnonzero(source[:complete] == tail[0])
    for k in range(1, size - 1):
        if not starts.size:
            break
        starts = starts[source[starts + k] == tail[k]]
    return source[starts + size - 1]


def no_repeat_ngram(scores: np.ndarray, history: np.ndarray, length: np.ndarray, size: np.ndarray,
                    inplace: bool = False) -> np.ndarray:
    """NoRepeatNGramLogitsProcessor: a token that would repeat an n-gram of the row is removed."""
    out = scores if inplace else scores.copy()
    for i in np.flatnonzero(size > 0):
        n, cur = int(size[i]), int(length[i])
        if cur + 1 < n:
            continue
        tokens = history[i, :cur]
        out[i, ngram_bans(tokens, tokens[cur - n + 1:], n, cur - n + 1)] = NEG_INF
    return out


def encoder_no_repeat_ngram(scores: np.ndarray, history: np.ndarray, length: np.ndarray, size: np.ndarray,
                            encoder_ids: Sequence[np.ndarray], inplace: bool = False) -> np.ndarray:
    """EncoderNoRepeatNGramLogitsProcessor: a token that would complete an n-gram of the row's
    encoder input (its prompt, for a decoder-only model) is removed."""
    out = scores if inplace else scores.copy()
    for i in np.flatnonzero(size > 0):
        n, cur = int(size[i]), int(length[i])
        source = np.asarray(encoder_ids[i], np.int64)
        if cur < n - 1 or len(source) < n:
            continue
        out[i, ngram_bans(source, history[i, cur - n + 1:cur], n, len(source) - n + 1)] = NEG_INF
    return out


@dataclass(frozen=True)
class SequenceRules:
    """The multi-token sequence_bias (or bad word) entries of one row, in their order: when the
    row's last tokens are the last `size[r]` of `prefix[r]`, `bias[r]` is added to `token[r]`.
    prefix [R, P] is right-aligned (-1 on the left), so all the row's entries are checked at once."""

    prefix: np.ndarray  # [R, P] int64
    size: np.ndarray  # [R] int64, >= 1
    token: np.ndarray  # [R] int64
    bias: np.ndarray  # [R] float32

    @classmethod
    def of(cls, entries: Sequence[tuple[Sequence[int], float]]) -> "SequenceRules | None":
        """From (token ids, bias) entries of two or more tokens; None when there are none."""
        entries = [(ids, bias) for ids, bias in entries if len(ids) > 1]
        if not entries:
            return None
        width = max(len(ids) - 1 for ids, _ in entries)
        prefix = np.full((len(entries), width), -1, np.int64)
        for r, (ids, _) in enumerate(entries):
            prefix[r, width - len(ids) + 1:] = ids[:-1]
        return cls(prefix, np.array([len(ids) - 1 for ids, _ in entries], np.int64),
                   np.array([ids[-1] for ids, _ in entries], np.int64), np.array([b for _, b in entries], np.float32))


@dataclass(frozen=True)
class JoinedRules:
    """The SequenceRules of a batch's rows in one table: `row` [R] says whose each rule is."""

    row: np.ndarray  # [R] int64
    prefix: np.ndarray  # [R, P] int64, right-aligned, -1 on the left
    size: np.ndarray  # [R]
    token: np.ndarray  # [R]
    bias: np.ndarray  # [R] float32


def join_rules(rules: Sequence[SequenceRules | None]) -> JoinedRules | None:
    """rules[i] (row i's, or None) as one JoinedRules; None when no row has any."""
    held = [(i, t) for i, t in enumerate(rules) if t is not None]
    if not held:
        return None
    width = max(t.prefix.shape[1] for _, t in held)
    prefix = np.full((sum(len(t.size) for _, t in held), width), -1, np.int64)
    at = 0
    for _, t in held:
        prefix[at:at + len(t.size), width - t.prefix.shape[1]:] = t.prefix
        at += len(t.size)
    row = np.concatenate([np.full(len(t.size), i, np.int64) for i, t in held])
    size, token, bias = (np.concatenate([getattr(t, f) for _, t in held]) for f in ("size", "token", "bias"))
    return JoinedRules(row, prefix, size, token, bias)


def _matched_rules(history: np.ndarray, length: np.ndarray, rules: JoinedRules):
    """(rows, tokens, biases) of the rules whose prefix the row ends with, in each row's order."""
    width = rules.prefix.shape[1]
    cur = length[rules.row]
    at = cur[:, None] - width + np.arange(width)  # the last `width` token indices of each rule's row
    got = history[rules.row[:, None], np.maximum(at, 0)]
    unused = np.arange(width) < (width - rules.size)[:, None]
    # a sequence longer than the row never applies
    match = ((got == rules.prefix) | unused).all(axis=1) & (rules.size < cur)
    return rules.row[match], rules.token[match], rules.bias[match]


def sequence_bias(scores: np.ndarray, history: np.ndarray, length: np.ndarray,
                  one_token: np.ndarray | None, rules: "Sequence[SequenceRules | None] | JoinedRules | None",
                  inplace: bool = False) -> np.ndarray:
    """SequenceBiasLogitsProcessor (and NoBadWordsLogitsProcessor, whose bias is -inf):
    `one_token` [n, V] float32 is the bias of the one-token sequences (or None), `rules[i]` the
    longer sequences of row i (or None; or all rows' at once, `join_rules`); a sequence longer than
    the row never applies.
    As transformers, a token's biases are summed first (in float32, in the entries' order), then
    added to its score."""
    out = scores if inplace else scores.copy()
    joined = rules if rules is None or isinstance(rules, JoinedRules) else join_rules(rules)
    matched = None if joined is None else _matched_rules(history, length, joined)
    if matched is None or not matched[0].size:
        if one_token is not None:
            out += one_token
        return out
    row, token, bias = matched
    vocab = scores.shape[1]
    keys, where = np.unique(row * vocab + token, return_inverse=True)
    r, t = keys // vocab, keys % vocab
    summed = np.zeros(len(keys), np.float32) if one_token is None else one_token[r, t].astype(np.float32)
    np.add.at(summed, where.reshape(-1), bias)  # in order, one float32 addition at a time
    before = out[r, t]
    if one_token is not None:
        out += one_token
    out[r, t] = before + summed
    return out


def min_length(scores: np.ndarray, length: np.ndarray, minimum: np.ndarray, eos: np.ndarray,
               inplace: bool = False) -> np.ndarray:
    """MinLengthLogitsProcessor (and MinNewTokensLengthLogitsProcessor, as minimum = prompt +
    min_new_tokens): the row's eos tokens ([n, E], -1 padded) are removed while it holds fewer
    than `minimum` tokens."""
    out = scores if inplace else scores.copy()
    rows, cols = np.nonzero((eos >= 0) & (length < minimum)[:, None])
    out[rows, eos[rows, cols]] = NEG_INF
    return out


def force_tokens(scores: np.ndarray, when: np.ndarray, tokens: np.ndarray, inplace: bool = False) -> np.ndarray:
    """ForcedBOSTokenLogitsProcessor / ForcedEOSTokenLogitsProcessor: rows where `when` get
    -inf everywhere but 0 at their tokens ([n, F], -1 padded)."""
    out = scores if inplace else scores.copy()
    rows = np.flatnonzero(when)
    if rows.size:
        out[rows] = NEG_INF
        r, c = np.nonzero(tokens[rows] >= 0)
        out[rows[r], tokens[rows][r, c]] = 0
    return out


def remove_invalid_values(scores: np.ndarray, on: np.ndarray, inplace: bool = False) -> np.ndarray:
    """InfNanRemoveLogitsProcessor: nan to 0, +-inf to the largest finite float32."""
    out = scores if inplace else scores.copy()
    rows = np.flatnonzero(on)
    if rows.size:
        info = np.finfo(np.float32)
        block = out[rows]
        block = np.where(block != block, np.float32(0), block)
        block = np.where(block == np.inf, info.max, block)
        out[rows] = np.where(block == -np.inf, info.min, block)
    return out


def exponential_decay_length_penalty(scores: np.ndarray, length: np.ndarray, start: np.ndarray,
                                     factor: np.ndarray, eos: np.ndarray, inplace: bool = False) -> np.ndarray:
    """ExponentialDecayLengthPenalty: past `start` tokens (the prompt plus the setting's start
    index; -1 = off), the eos scores grow by |score| * (factor ** (length - start) - 1).

    As transformers, the power is a double and the growth is cast to float32 (torch's scalar):
    past float32's range it is inf, so a score of 0 becomes nan and -inf stays nan, as there.
    Where the double itself overflows (transformers raises OverflowError), it is inf as well."""
    out = scores if inplace else scores.copy()
    for i in np.flatnonzero((start >= 0) & (length > start)):
        ids = eos[i][eos[i] >= 0]
        try:
            grow = pow(float(factor[i]), int(length[i] - start[i])) - 1
        except OverflowError:
            grow = np.inf
        with np.errstate(over="ignore", invalid="ignore"):
            grow = np.float32(grow)
            out[i, ids] = out[i, ids] + np.abs(out[i, ids]) * grow
    return out


def suppress(scores: np.ndarray, mask: np.ndarray, when: np.ndarray | None = None, inplace: bool = False) -> np.ndarray:
    """SuppressTokensLogitsProcessor (mask [n, V]), and SuppressTokensAtBeginLogitsProcessor
    (only rows where `when`)."""
    out = scores if inplace else scores.copy()
    if when is None:
        np.putmask(out, mask, NEG_INF)
    elif when.any():
        rows = np.flatnonzero(when)
        block = out[rows]
        np.putmask(block, mask[rows], NEG_INF)
        out[rows] = block
    return out
