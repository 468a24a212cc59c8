"""Whisper's sequential decoding over windows: timestamps, and audio longer than one window.

As transformers 4.57 `WhisperForConditionalGeneration.generate` when timestamps are on (asked
for, or forced by a clip longer than the window), with its defaults (one temperature, no
condition_on_prev_tokens, no thresholds, no prompt_ids):

    seek = 0 for every clip; max_frames = each clip's frames (one clip, or a batch that fits in
        one window: the batch's frame count)
    while some clip has seek < max_frames:
        each such clip's next window: features[seek : seek + window], zeros after the clip's end
        encode those windows (`encode`: a separate callable, a server's encoder deployment)
        decode them together from the clip's prompt [sot, lang, task], the timestamp rules on
        split each window at its timestamp pairs (whisper.split_segments), times offset by
            seek * 0.01 s; seek += the frames up to the last pair (or the whole window)

A clip's tokens are its segments' tokens one after another (timestamps included), as
transformers' returned sequences.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from .context import Context
from .generate import Generated, generate
from .rng import derived_seed
from .seq2seq import EncoderOutputs
from .whisper import TIME_PRECISION, split_segments, timestamp_processor

INPUT_STRIDE = 2  # log-mel frames per encoder position (Whisper's second convolution has stride 2)


@dataclass
class Segment:
    """A stretch of a clip between two timestamps: start and end in seconds from the clip's
    start, its tokens (the timestamps at both ends included) and their log-probabilities when
    the context has token_logprobs, and its text (the text tokens decoded)."""

    start: float
    end: float
    tokens: list[int]
    logprobs: list[float] | None = None
    text: str = ""


def window_frames(ctx: Context) -> int:
    """Log-mel frames in one window: the encoder's positions times its stride (3000 for 30 s)."""
    positions = ctx.model.config.get("max_source_positions")
    if not isinstance(positions, int) or positions < 1:
        raise ValueError(f"{ctx.model.folder}: config.json gives no max_source_positions (a Whisper encoder's length)")
    return INPUT_STRIDE * positions


def timestamp_context(ctx: Context) -> Context:
    """`ctx` with Whisper's timestamp rules as the first custom processor: after the suppress
    processors and before the user's, where Whisper's generate puts them."""
    config = ctx.model.generation_config
    no_timestamps, eos = config.get("no_timestamps_token_id"), config.get("eos_token_id", config.get("bos_token_id"))
    if not isinstance(no_timestamps, int):
        raise ValueError(f"{ctx.model.folder}: generation_config.json has no no_timestamps_token_id; "
                         "timestamps need it (return_timestamps)")
    if not isinstance(eos, int):
        raise ValueError(f"{ctx.model.folder}: timestamps need a single eos_token_id, not {eos!r}")
    rules = timestamp_processor(no_timestamps, eos, config.get("max_initial_timestamp_index"))
    return replace(ctx, processors=(rules,) + tuple(ctx.processors), spare_states=[])


def decode_windows(ctx: Context, features: np.ndarray, num_frames, prompts: list[list[int]],
                   encode: Callable[[np.ndarray], EncoderOutputs], seeds: list[int],
                   first: EncoderOutputs | None = None) -> list[list[Segment]]:
    """Each clip's segments, decoded window after window (see the module docstring).

    features: [B, n_mels, T] log-mel features (T >= one window: `audio.whisper_features`, long
    form when a clip is longer than the window); num_frames: [B] frames of each clip (its
    `attention_mask.sum(-1)`); prompts: each clip's decoder prompt without <|notimestamps|>;
    encode: [n, n_mels, window] features -> EncoderOutputs; seeds: one per clip (a clip's k-th
    window samples from `derived_seed(seed, k)`). first: the encoder's outputs for
    features[..., :window], when already computed (language detection): a clip whose first
    window is those frames reuses them.
    """
    window, total = window_frames(ctx), features.shape[-1]
    begin = ctx.model.generation_config["no_timestamps_token_id"] + 1
    decoding = timestamp_context(ctx)
    count = len(prompts)
    # transformers: batched long-form reads each clip's length from the attention mask; one clip,
    # or a batch within one window, runs to the end of the features
    long_batch = count > 1 and total > window
    max_frames = np.asarray(num_frames, np.int64) if long_batch else np.full(count, total, np.int64)
    seek = np.zeros(count, np.int64)
    windows = np.zeros(count, np.int64)
    segments: list[list[Segment]] = [[] for _ in range(count)]
    while (seek < max_frames).any():
        active = np.flatnonzero(seek < max_frames)
        frames = np.minimum(max_frames - seek, window)[active]
        inputs = np.zeros((len(active), features.shape[1], window), np.float32)  # zeros past a clip's end
        for j, b in enumerate(active):
            part = features[b, :, seek[b]:seek[b] + frames[j]]
            inputs[j, :, :part.shape[-1]] = part
        encoder = _encode(encode, inputs, active, frames == window, None if windows.any() else first)
        rows = generate(decoding, [prompts[b] for b in active],
                        seeds=[derived_seed(seeds[b], int(windows[b])) for b in active], encoder=encoder)
        for j, b in enumerate(active):
            tokens, logprobs = (rows[j].tokens, rows[j].logprobs) if isinstance(rows[j], Generated) else (rows[j], None)
            offset = float(seek[b]) * TIME_PRECISION / INPUT_STRIDE  # in float64, in transformers' order
            pieces, advance = split_segments(tokens, begin, offset, int(frames[j]), INPUT_STRIDE)
            for p in pieces:
                segments[b].append(Segment(p.start, p.end, tokens[p.lo:p.hi],
                                           None if logprobs is None else logprobs[p.lo:p.hi]))
            seek[b] += advance
        windows[active] += 1
    return segments


def run_encoder(encode: Callable[[np.ndarray], EncoderOutputs], windows: np.ndarray) -> EncoderOutputs:
    """encode(windows) [n, n_mels, frames], checked to give one row per window."""
    out = encode(windows)
    if not isinstance(out, EncoderOutputs) or len(out) != len(windows):
        rows = len(out) if isinstance(out, EncoderOutputs) else type(out).__name__
        raise ValueError(f"encode returned {rows} rows for {len(windows)} windows (it must return EncoderOutputs)")
    return out


def _encode(encode, inputs: np.ndarray, active: np.ndarray, whole: np.ndarray,
            first: EncoderOutputs | None) -> EncoderOutputs:
    """The encoder's outputs for this step's windows; rows whose window is the first window of
    the features unpadded take them from `first`."""
    reuse = whole if first is not None else np.zeros(len(active), bool)
    hidden: list = [None] * len(active)
    if (~reuse).any():
        for j, h in zip(np.flatnonzero(~reuse), run_encoder(encode, inputs[~reuse]).hidden):
            hidden[j] = h
    for j in np.flatnonzero(reuse):
        hidden[j] = first.hidden[active[j]]
    return EncoderOutputs(hidden)
