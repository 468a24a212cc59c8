"""Whisper's timestamp rules (transformers 4.57 `WhisperTimeStampLogitsProcessor`), batched.

Timestamp tokens (<|0.00|>, <|0.02|>, ...) start right after <|notimestamps|>. They come in
pairs (end of one segment, start of the next) and never go back in time; the first new token is
a timestamp no later than `max_initial_timestamp_index`; and when the timestamps together are
more likely than any text token, a timestamp must come.
"""

from __future__ import annotations

import numpy as np

from .selection import log_softmax

NEG_INF = np.float32(-np.inf)


def timestamp_rules(scores: np.ndarray, generated: list[list[int]], no_timestamps: int, eos: int,
                    max_initial: int | None = None, from_logprob: bool = True) -> np.ndarray:
    """scores [n, V] with Whisper's timestamp rules applied; generated[i]: row i's new tokens
    (after the decoder prompt), oldest first. Returns a new array.

    >>> s = np.zeros((1, 6), np.float32)  # 0..2 text (eos 2), 3 <|notimestamps|>, 4..5 timestamps
    >>> timestamp_rules(s, [[]], no_timestamps=3, eos=2)[0].tolist()  # the first token is a timestamp
    [-inf, -inf, -inf, -inf, 0.0, 0.0]
    """
    out = scores.astype(np.float32, copy=True)
    begin = no_timestamps + 1
    out[:, no_timestamps] = NEG_INF
    for k, seq in enumerate(generated):
        last_was = len(seq) >= 1 and seq[-1] >= begin
        penultimate_was = len(seq) < 2 or seq[-2] >= begin
        if last_was:
            if penultimate_was:  # a pair just closed: text next
                out[k, begin:] = NEG_INF
            else:  # a lone timestamp: its partner (or eos) next
                out[k, :eos] = NEG_INF
        stamps = [t for t in seq if t >= begin]
        if stamps:  # time never goes back
            last = stamps[-1] if last_was and not penultimate_was else stamps[-1] + 1
            out[k, begin:last] = NEG_INF
        if not seq:  # the first new token
            out[k, :begin] = NEG_INF
            if max_initial is not None:
                out[k, begin + max_initial + 1:] = NEG_INF
    if from_logprob:
        logp = log_softmax(out)
        top = logp[:, begin:].max(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            stamp = (np.log(np.exp(logp[:, begin:] - np.where(np.isfinite(top), top, 0)).sum(axis=1))
                     + np.where(np.isfinite(top[:, 0]), top[:, 0], -np.inf))
        text_best = logp[:, :begin].max(axis=1)
        out[stamp > text_best, :begin] = NEG_INF
    return out
