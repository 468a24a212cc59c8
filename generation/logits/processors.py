"""The logits processors of transformers 4.57 `_get_logits_processor`, over a whole batch.

Each processor is a free function over `scores` [n, V] float32 and per-row arrays, so one call
serves rows with different settings (a row whose setting is off is left as it is). A processor
returns a new array and never writes into the caller's, unless told `inplace=True` (what `apply`
does on its own copy, so a step copies the scores once, not once per processor). The row's tokens so far are
`history[i, :length[i]]`: its prompt and its new tokens, as transformers counts the columns of
`input_ids` (`length` is transformers' `cur_len`).

`RowSettings` holds every row's settings as arrays, with the masks that do not change between
steps (one-token bad words and biases, `suppress_tokens`) built once when the row enters, and
`apply` runs the processors in transformers' order. The sampling warpers are in `selection.py`.

Beyond transformers: OpenAI's frequency_penalty and presence_penalty (`frequency_presence_penalty`,
as vLLM applies them, over the row's new tokens `history[i, prompt_length[i]:length[i]]`), right
after the repetition penalty, as vLLM's `apply_penalties` orders them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..params.settings import SettingError, Settings
from .constraints import RowConstraint, constrain

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


class RowSettings:
    """The settings of `n` rows as arrays, for `apply` and the warpers of `selection`.

    Rows enter with `set_row` (which builds that row's fixed masks) and are read through
    `take(rows)`; a table is allocated only once some row uses it."""

    def __init__(self, n: int, vocab: int, grammars=None, timestamps=None):
        self.n, self.vocab = n, vocab
        self.grammars = grammars  # constraints.Grammars: the matchers of structured_outputs rows
        # the model family's processor of rows with timestamp_rules (its hooks' `timestamps`:
        # (scores, rules [n, 3], history, length, prompt_length), in place), None: it has none
        self.timestamps = timestamps
        self.version = 0  # counts set_row calls: a view taken before one is stale
        f32, i64 = np.float32, np.int64
        self.do_sample = np.zeros(n, bool)
        self.temperature, self.top_p = np.ones(n, f32), np.ones(n, f32)
        self.top_k = np.zeros(n, i64)
        self.min_p, self.typical_p = np.zeros(n, f32), np.ones(n, f32)
        self.epsilon, self.eta = np.zeros(n, f32), np.zeros(n, f32)
        self.min_keep = np.ones(n, i64)
        self.renormalize = np.zeros(n, bool)
        self.untempered = np.zeros(n, bool)  # Settings.untempered_logprobs
        self.no_logprobs = np.zeros(n, bool)  # Settings.no_logprobs
        self.repetition_penalty = np.ones(n, f32)
        self.frequency_penalty, self.presence_penalty = np.zeros(n, f32), np.zeros(n, f32)
        self.encoder_repetition_penalty = np.ones(n, np.float64)  # transformers rounds 1 / penalty from the double
        self.no_repeat_ngram, self.encoder_no_repeat_ngram = np.zeros(n, i64), np.zeros(n, i64)
        self.minimum = np.zeros(n, i64)  # tokens (prompt included) before eos may come
        self.forced_bos = np.full((n, 1), -1, i64)
        self.forced_eos = np.full((n, 1), -1, i64)
        self.remove_invalid = np.zeros(n, bool)
        self.decay_start, self.decay_factor = np.full(n, -1, i64), np.ones(n, np.float64)
        self.begin_index = np.full(n, -1, i64)
        self.timestamp_rules = np.full((n, 3), -1, i64)  # (no_timestamps, eos, max_initial): Settings'; -1: off
        self.eos = np.full((n, 1), -1, i64)
        self.limit = np.zeros(n, i64)
        self.lookup_tokens = np.zeros(n, i64)  # prompt_lookup_num_tokens (0: off); assisted.py
        self.lookup_ngram = np.full(n, 2, i64)  # max_matching_ngram_size
        self.encoder_ids: list[np.ndarray] = [np.zeros(0, i64)] * n
        self.bias_rules: list[SequenceRules | None] = [None] * n  # multi-token entries, per row
        self.bad_rules: list[SequenceRules | None] = [None] * n
        self.constraints: list[RowConstraint | None] = [None] * n  # structured_outputs, per row
        self.one_token_bias: np.ndarray | None = None  # [n, V] float32
        self.bad_mask: np.ndarray | None = None  # [n, V] bool: one-token bad words
        self.suppress_mask: np.ndarray | None = None  # [n, V] bool
        self.begin_mask: np.ndarray | None = None  # [n, V] bool

    def _table(self, name: str, dtype) -> np.ndarray:
        if getattr(self, name) is None:
            setattr(self, name, np.zeros((self.n, self.vocab), dtype))
        return getattr(self, name)

    def _widen(self, name: str, width: int) -> np.ndarray:
        table = getattr(self, name)
        if table.shape[1] < width:
            table = np.pad(table, ((0, 0), (0, width - table.shape[1])), constant_values=-1)
            setattr(self, name, table)
        return table

    def set_row(self, i: int, s: Settings, prompt_length: int, limit: int,
                encoder_ids: Sequence[int] | None = None) -> None:
        """Row i takes settings `s`, for a prompt of `prompt_length` tokens (decoder-side, with
        decoder_start_token_id for an encoder-decoder model) that stops at `limit` tokens;
        `encoder_ids` is the encoder's input (default: none)."""
        self._bad_bias, self._joined = None, {}
        self.version += 1
        self.do_sample[i], self.temperature[i], self.top_k[i], self.top_p[i] = s.do_sample, s.temperature, s.top_k, s.top_p
        self.min_p[i] = 0 if s.min_p is None else s.min_p
        self.typical_p[i], self.epsilon[i], self.eta[i] = s.typical_p, s.epsilon_cutoff, s.eta_cutoff
        self.renormalize[i] = s.renormalize_logits
        self.min_keep[i] = 1  # a beam search raises its rows' (beam.beam_min_keep)
        self.repetition_penalty[i] = s.repetition_penalty
        self.frequency_penalty[i], self.presence_penalty[i] = s.frequency_penalty, s.presence_penalty
        self.encoder_repetition_penalty[i] = s.encoder_repetition_penalty
        self.no_repeat_ngram[i], self.encoder_no_repeat_ngram[i] = s.no_repeat_ngram_size, s.encoder_no_repeat_ngram_size
        if s.min_new_tokens is not None:  # as generate(): min_new_tokens (even 0) replaces min_length
            self.minimum[i] = prompt_length + s.min_new_tokens
        else:
            self.minimum[i] = s.min_length
        self.forced_bos[i, 0] = -1 if s.forced_bos_token_id is None else s.forced_bos_token_id
        forced_eos = s.forced_eos_token_id or ()
        self._widen("forced_eos", len(forced_eos))[i] = -1
        self.forced_eos[i, :len(forced_eos)] = forced_eos
        self.remove_invalid[i] = s.remove_invalid_values
        if s.exponential_decay_length_penalty is None:
            self.decay_start[i], self.decay_factor[i] = -1, 1.0
        else:
            start, factor = s.exponential_decay_length_penalty
            self.decay_start[i], self.decay_factor[i] = start + prompt_length, factor
        self._widen("eos", len(s.eos_token_id))[i] = -1
        self.eos[i, :len(s.eos_token_id)] = s.eos_token_id
        self.limit[i] = limit
        self.lookup_tokens[i] = s.prompt_lookup_num_tokens or 0
        self.lookup_ngram[i] = s.max_matching_ngram_size or 2
        self.encoder_ids[i] = np.asarray(encoder_ids if encoder_ids is not None else [], np.int64)
        self._set_sequences(i, s)
        self._set_mask("suppress_mask", i, s.suppress_tokens)
        self._set_mask("begin_mask", i, s.begin_suppress_tokens)
        first = prompt_length + (1 if prompt_length == 1 and s.forced_bos_token_id is not None else 0)
        self.begin_index[i] = first if s.begin_suppress_tokens else -1
        if s.timestamp_rules is not None and self.timestamps is None:
            raise SettingError("timestamp_rules", "timestamp_rules: this batch was made without a timestamp "
                                                  "processor (the model's family decodes no timestamps)")
        self.timestamp_rules[i] = s.timestamp_rules or (-1, -1, -1)
        self.untempered[i] = s.untempered_logprobs
        self.no_logprobs[i] = s.no_logprobs
        self.constraints[i] = None
        if s.structured_outputs is not None:
            if self.grammars is None:
                raise SettingError("structured_outputs", "structured_outputs: this batch was made without the "
                                                         "model's grammars (constraints.Grammars)")
            self.constraints[i] = RowConstraint(self.grammars.matcher(s.structured_outputs), prompt_length,
                                                self.grammars.eos_ids)

    def _set_mask(self, name: str, i: int, tokens) -> None:
        if tokens:
            self._table(name, bool)[i] = False
            getattr(self, name)[i, list(tokens)] = True
        elif getattr(self, name) is not None:
            getattr(self, name)[i] = False

    def _set_sequences(self, i: int, s: Settings) -> None:
        if self.one_token_bias is not None:
            self.one_token_bias[i] = 0
        if self.bad_mask is not None:
            self.bad_mask[i] = False
        for ids, bias in s.sequence_bias or ():
            if len(ids) == 1:
                self._table("one_token_bias", np.float32)[i, ids[0]] = bias  # the last entry wins, as a dict
        self.bias_rules[i] = SequenceRules.of(s.sequence_bias or ())
        eos = set(s.eos_token_id)
        for ids in s.bad_words_ids or ():
            if len(ids) == 1 and ids[0] not in eos:  # as NoBadWordsLogitsProcessor: an eos bad word is dropped
                self._table("bad_mask", bool)[i, ids[0]] = True
        self.bad_rules[i] = SequenceRules.of([(ids, -np.inf) for ids in s.bad_words_ids or ()])

    def bad_bias(self) -> np.ndarray:
        """The one-token bad words as a bias table: -inf where banned (built once per take)."""
        if getattr(self, "_bad_bias", None) is None:
            self._bad_bias = np.where(self.bad_mask, NEG_INF, np.float32(0))
        return self._bad_bias

    def joined(self, name: str) -> JoinedRules | None:
        """join_rules of "bias_rules" or "bad_rules", built once for these rows (a taken
        RowSettings lives from one refresh of the state to the next)."""
        cache = self.__dict__.setdefault("_joined", {})
        if name not in cache:
            cache[name] = join_rules(getattr(self, name))
        return cache[name]

    def take(self, rows: np.ndarray) -> "RowSettings":
        """The settings of `rows` (an index array) as a RowSettings of len(rows) rows."""
        out = RowSettings.__new__(RowSettings)
        out.n, out.vocab, out.version = len(rows), self.vocab, 0
        for name, value in vars(self).items():
            if name in ("n", "vocab", "version", "_bad_bias", "_joined"):
                continue
            if isinstance(value, np.ndarray):
                setattr(out, name, value[rows])
            elif isinstance(value, list):
                setattr(out, name, [value[r] for r in rows])
            else:
                setattr(out, name, value)
        return out

    def processes(self) -> bool:
        """Whether any processor before the warpers is on for some row (else the raw logits
        go straight to selection)."""
        return bool((self.repetition_penalty != 1).any() or (self.encoder_repetition_penalty != 1).any()
                    or self.frequency_penalty.any() or self.presence_penalty.any()
                    or self.no_repeat_ngram.any() or self.encoder_no_repeat_ngram.any()
                    or (self.minimum > 0).any() or (self.forced_bos >= 0).any() or (self.forced_eos >= 0).any()
                    or self.remove_invalid.any() or (self.decay_start >= 0).any() or (self.begin_index >= 0).any()
                    or self.one_token_bias is not None or self.bad_mask is not None
                    or self.suppress_mask is not None or any(self.bias_rules) or any(self.bad_rules)
                    or (self.timestamp_rules[:, 0] >= 0).any() or any(self.constraints))


def row_views(history: np.ndarray, length: np.ndarray, prompt_length: np.ndarray, vocab: int) -> list[dict]:
    """The row maps a custom processor's `state` reads: prompt, generated (last first), vocab."""
    return [{"prompt": history[i, :p].tolist(), "generated": history[i, p:int(n)][::-1].tolist(), "vocab": vocab}
            for i, (p, n) in enumerate(zip(prompt_length.tolist(), length.tolist()))]


def apply(scores: np.ndarray, rows: RowSettings, history: np.ndarray, length: np.ndarray,
          custom: Sequence[CustomProcessor] = (), prompt_length: np.ndarray | None = None,
          inplace: bool = False) -> np.ndarray:
    """The processors of transformers' `_get_logits_processor` before the warpers, in its order,
    then the custom processors, then the rows' structured_outputs constraints. scores [n, V]; history [n, W] and length [n] as in the module
    docstring; `prompt_length` [n] (for custom processors and the frequency and presence penalties)
    splits each row's history.
    `inplace`: the caller owns float32 `scores` and lets them be overwritten (saves a copy)."""
    out = scores if inplace and scores.dtype == np.float32 else scores.astype(np.float32, copy=True)
    if rows.one_token_bias is not None or any(rows.bias_rules):
        sequence_bias(out, history, length, rows.one_token_bias, rows.joined("bias_rules"), inplace=True)
    if (rows.encoder_repetition_penalty != 1).any():
        encoder_repetition_penalty(out, rows.encoder_ids, rows.encoder_repetition_penalty, inplace=True)
    if (rows.repetition_penalty != 1).any():
        repetition_penalty(out, history, length, rows.repetition_penalty, inplace=True)
    if rows.frequency_penalty.any() or rows.presence_penalty.any():  # where vLLM puts them: after repetition
        if prompt_length is None:
            raise ValueError("prompt_length: frequency_penalty and presence_penalty count the new tokens only; "
                             "pass each row's prompt length")
        frequency_presence_penalty(out, history, length, prompt_length, rows.frequency_penalty,
                                   rows.presence_penalty, inplace=True)
    if rows.no_repeat_ngram.any():
        no_repeat_ngram(out, history, length, rows.no_repeat_ngram, inplace=True)
    if rows.encoder_no_repeat_ngram.any():
        encoder_no_repeat_ngram(out, history, length, rows.encoder_no_repeat_ngram, rows.encoder_ids, inplace=True)
    if rows.bad_mask is not None or any(rows.bad_rules):
        bad = None if rows.bad_mask is None else rows.bad_bias()
        sequence_bias(out, history, length, bad, rows.joined("bad_rules"), inplace=True)
    if (rows.minimum > 0).any():
        min_length(out, length, rows.minimum, rows.eos, inplace=True)
    if (rows.forced_bos >= 0).any():
        force_tokens(out, (length == 1) & (rows.forced_bos[:, 0] >= 0), rows.forced_bos, inplace=True)
    if (rows.forced_eos >= 0).any():
        force_tokens(out, (length == rows.limit - 1) & (rows.forced_eos[:, 0] >= 0), rows.forced_eos, inplace=True)
    if rows.remove_invalid.any():
        remove_invalid_values(out, rows.remove_invalid, inplace=True)
    if (rows.decay_start >= 0).any():
        exponential_decay_length_penalty(out, length, rows.decay_start, rows.decay_factor, rows.eos, inplace=True)
    if rows.suppress_mask is not None:
        suppress(out, rows.suppress_mask, inplace=True)
    if rows.begin_mask is not None:
        suppress(out, rows.begin_mask, length == rows.begin_index, inplace=True)
    if (rows.timestamp_rules[:, 0] >= 0).any():  # where Whisper's generate puts them: before the user's
        rows.timestamps(out, rows.timestamp_rules, history, length, prompt_length)
    if custom:
        views = row_views(history, length, prompt_length, rows.vocab)
        for state, process in custom:
            states = np.stack([np.asarray(state(v)) for v in views])
            out = np.asarray(process(out, states), np.float32)
            if out.shape != scores.shape:
                raise ValueError(f"a custom processor returned scores of shape {out.shape}, not {scores.shape}")
    if any(rows.constraints):  # as a LogitsProcessor given to generate(): after the others, before the warpers
        constrain(out, rows.constraints, history, length)
    return out
