"""Every row's processor settings as arrays (RowSettings, built once as a row enters) and `apply`: the
processors of generation/logits/processors.py in transformers 4.57's `_get_logits_processor` order,
then custom processors and the rows' constraints.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..params.settings import Settings
from ..params.checks import SettingError
from .constraints import RowConstraint, constrain
from .processors import (
    NEG_INF,
    CustomProcessor,
    JoinedRules,
    SequenceRules,
    encoder_no_repeat_ngram,
    encoder_repetition_penalty,
    exponential_decay_length_penalty,
    force_tokens,
    frequency_presence_penalty,
    join_rules,
    min_length,
    no_repeat_ngram,
    remove_invalid_values,
    repetition_penalty,
    sequence_bias,
    suppress,
)


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
