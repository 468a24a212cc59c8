"""Whisper's timestamps (transformers 4.57): the rules a decoded window follows, and how the
window splits into segments.

Timestamp tokens (<|0.00|>, <|0.02|>, ...) start right after <|notimestamps|>. They come in
pairs (end of one segment, start of the next) and never go back in time; the first new token is
a timestamp no later than `max_initial_timestamp_index`; and when the timestamps together are
more likely than any text token, a timestamp must come (`timestamp_rules`, as
`WhisperTimeStampLogitsProcessor`). A decoded window then splits at each pair into segments of
[start, text..., end] (`split_segments`, as `WhisperGenerationMixin._retrieve_segment`), and the
next window starts at the last pair's time, or at the window's end when the window closed
with a lone timestamp (no speech after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...logits.selection import log_softmax

NEG_INF = np.float32(-np.inf)
TIME_PRECISION = 0.02  # seconds per timestamp token (one encoder position)
FRAME_PRECISION = 0.01  # seconds per log-mel frame


def timestamp_history(generated: list[int], begin: int) -> np.ndarray:
    """What the rules read of a row's new tokens (oldest first): [count, last, penultimate, last
    timestamp], -1 where there is none (what `timestamp_processor` reads per row)."""
    stamps = [t for t in generated if t >= begin]
    return np.array([len(generated), generated[-1] if generated else -1,
                     generated[-2] if len(generated) > 1 else -1, stamps[-1] if stamps else -1], np.int64)


def timestamp_rules(scores: np.ndarray, generated: list[list[int]], no_timestamps: int, eos: int,
                    max_initial: int | None = None, from_logprob: bool = True) -> np.ndarray:
    """scores [n, V] with Whisper's timestamp rules applied; generated[i]: row i's new tokens
    (after the decoder prompt), oldest first. Returns a new array.

    >>> s = np.zeros((1, 6), np.float32)  # 0..2 text (eos 2), 3 <|notimestamps|>, 4..5 timestamps
    >>> timestamp_rules(s, [[]], no_timestamps=3, eos=2)[0].tolist()  # the first token is a timestamp
    [-inf, -inf, -inf, -inf, 0.0, 0.0]
    """
    history = np.stack([timestamp_history(seq, no_timestamps + 1) for seq in generated]).reshape(-1, 4)
    return apply_timestamp_rules(scores, history, no_timestamps, eos, max_initial, from_logprob)


def apply_timestamp_rules(scores: np.ndarray, history: np.ndarray, no_timestamps: int, eos: int,
                          max_initial: int | None = None, from_logprob: bool = True) -> np.ndarray:
    """`timestamp_rules` over the rows' `timestamp_history` [n, 4], the whole batch at once."""
    out = scores.astype(np.float32, copy=True)
    begin = no_timestamps + 1
    count, last, penultimate, stamp = history.T
    cols = np.arange(out.shape[1])
    last_was = (count >= 1) & (last >= begin)
    penultimate_was = (count < 2) | (penultimate >= begin)
    closed = (last_was & penultimate_was)[:, None] & (cols >= begin)  # a pair just closed: text next
    lone = (last_was & ~penultimate_was)[:, None] & (cols < eos)  # a lone timestamp: its partner (or eos)
    # time never goes back; a lone timestamp may repeat as its own partner, others may not
    floor = np.where(last_was & ~penultimate_was, stamp, stamp + 1)
    back = ((stamp >= 0)[:, None]) & (cols >= begin) & (cols < floor[:, None])
    late = begin + max_initial + 1 if max_initial is not None else out.shape[1]
    first = (count == 0)[:, None] & ((cols < begin) | (cols >= late))  # the first new token: an early timestamp
    out[closed | lone | back | first] = NEG_INF
    out[:, no_timestamps] = NEG_INF
    if from_logprob:
        logp = log_softmax(out)
        top = logp[:, begin:].max(axis=1, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            stamp_logp = (np.log(np.exp(logp[:, begin:] - np.where(np.isfinite(top), top, 0)).sum(axis=1))
                          + np.where(np.isfinite(top[:, 0]), top[:, 0], -np.inf))
        text_best = logp[:, :begin].max(axis=1)
        out[stamp_logp > text_best, :begin] = NEG_INF
    return out


def timestamp_processor(scores: np.ndarray, rules: np.ndarray, history: np.ndarray, length: np.ndarray,
                        prompt_length: np.ndarray) -> np.ndarray:
    """WhisperTimeStampLogitsProcessor, in place on `scores` [n, V], on the rows whose `rules` [n, 3]
    (no_timestamps_token_id, eos, max_initial_timestamp_index or -1) are on (first entry >= 0; one
    model's, so alike); each row's new tokens are history[i, prompt_length[i]:length[i]]. The
    family's `timestamps` hook: row_settings.apply runs it where Whisper's generate puts it."""
    on = np.flatnonzero(rules[:, 0] >= 0)
    no_timestamps, eos, max_initial = rules[on[0]].tolist()
    states = np.stack([timestamp_history(history[i, prompt_length[i]:length[i]].tolist(), no_timestamps + 1)
                       for i in on.tolist()])
    scores[on] = apply_timestamp_rules(scores[on], states, no_timestamps, eos, None if max_initial < 0 else max_initial)
    return scores


def timestamp_rule_ids(model) -> tuple[int, int, int]:
    """The model's (no_timestamps_token_id, eos, max_initial_timestamp_index or -1): what a
    timestamped row's `Settings.timestamp_rules` holds (`timestamp_processor` applies them). The
    family's `timestamp_rules` hook."""
    config = model.generation_config
    no_timestamps, eos = config.get("no_timestamps_token_id"), config.get("eos_token_id", config.get("bos_token_id"))
    if not isinstance(no_timestamps, int):
        raise ValueError(f"{model.folder}: generation_config.json has no no_timestamps_token_id; "
                         "timestamps need it (return_timestamps)")
    if not isinstance(eos, int):
        raise ValueError(f"{model.folder}: timestamps need a single eos_token_id, not {eos!r}")
    max_initial = config.get("max_initial_timestamp_index")
    return no_timestamps, eos, max_initial if isinstance(max_initial, int) else -1


@dataclass(frozen=True)
class Piece:
    """One segment of a decoded window: tokens[lo:hi] of the window, from `start` to `end` s."""

    start: float
    end: float
    lo: int
    hi: int


def split_segments(tokens, begin: int, time_offset: float, window_frames: int,
                   input_stride: int = 2) -> tuple[list[Piece], int]:
    """A window's new tokens (no prompt, no eos) as segments, and how many log-mel frames the
    next window starts after this one's start; as transformers 4.57 `_retrieve_segment`.

    time_offset: the window's start in seconds; window_frames: the frames it held of the clip.
    Each pair of timestamps ends a segment and starts the next, which begins at the pair's second
    timestamp. A window ending in a lone timestamp is all speech it had: the next window starts
    after it. Otherwise the tokens after the last pair are dropped and the next window starts at
    the pair's time. Without a pair, the whole window is one segment ending at its last
    timestamp (none, or <|0.00|>: the window's end).

    >>> split_segments([5, 1, 7, 7, 2, 9], begin=5, time_offset=1.0, window_frames=200)
    ([Piece(start=1.0, end=1.04, lo=0, hi=3), Piece(start=1.04, end=1.08, lo=3, hi=6)], 200)
    >>> split_segments([5, 1, 7, 7, 2, 9, 9, 3], begin=5, time_offset=0.0, window_frames=200)[1]  # seek to <|0.08|>
    8
    """
    tokens = np.asarray(tokens, np.int64)
    stamp = tokens >= begin
    single_ending = stamp[-2:].tolist() == [False, True]
    pairs = (np.flatnonzero(stamp[:-1] & stamp[1:]) + 1).tolist()
    if not pairs:
        stamps = tokens[stamp]
        # transformers computes this bound in float32 (a frame count times 0.01 / 0.02), then truncates
        end = int(np.float32(window_frames) * np.float32(FRAME_PRECISION) / np.float32(TIME_PRECISION))
        if stamps.size and stamps[-1] != begin:
            end = float(stamps[-1] - begin)
        return [Piece(time_offset, time_offset + end * TIME_PRECISION, 0, len(tokens))], window_frames
    cuts = pairs + [len(tokens)] if single_ending else pairs[:-1] + [pairs[-1] + 1]
    pieces, lo = [], 0
    for i, hi in enumerate(cuts):
        last = i == len(cuts) - 1
        end_at = hi - 1 if not last or single_ending else hi - 2
        pieces.append(Piece(time_offset + float(tokens[lo] - begin) * TIME_PRECISION,
                            time_offset + float(tokens[end_at] - begin) * TIME_PRECISION, lo, hi))
        lo = hi
    advance = window_frames if single_ending else int(tokens[lo - 2] - begin) * input_stride
    return pieces, advance
