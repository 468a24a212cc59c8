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

from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ...core.context import Context
from ...core.rng import derived_seed
from ...runtime.encoders import EncoderOutputs
from .timestamps import TIME_PRECISION, split_segments, timestamp_rule_ids

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


def timestamp_settings(ctx: Context, settings=None):
    """`settings` (default: the context's) with Whisper's timestamp rules on."""
    return replace(settings or ctx.settings, timestamp_rules=timestamp_rule_ids(ctx.model))


@dataclass
class ClipWindows:
    """One clip decoded window after window (the module docstring's loop, for one clip): the
    next window's input frames, and `take`, which applies the seek rule to a decoded window.
    features [n_mels, T]; max_frames: where this clip's decoding ends."""

    features: np.ndarray
    max_frames: int
    window: int
    begin: int  # the first timestamp token
    prompt: list[int]
    seed: int
    index: int = 0  # the clip's row in its batch (of the first windows' encoder outputs)
    seek: int = 0
    count: int = 0  # windows decoded
    segments: list[Segment] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.seek >= self.max_frames

    @property
    def frames(self) -> int:
        """The clip's frames in the next window (the rest is zeros)."""
        return min(self.max_frames - self.seek, self.window)

    @property
    def window_seed(self) -> int:
        """The next window's seed: the clip's k-th window samples from derived_seed(seed, k)."""
        return derived_seed(self.seed, self.count)

    def inputs(self) -> np.ndarray:
        """[n_mels, window] the next window's features, zeros past the clip's end."""
        out = np.zeros((self.features.shape[0], self.window), np.float32)
        part = self.features[:, self.seek:self.seek + self.frames]
        out[:, :part.shape[-1]] = part
        return out

    def next_encoder(self, encode: Callable[[np.ndarray], EncoderOutputs], first: EncoderOutputs | None = None
                     ) -> EncoderOutputs:
        """The encoder's outputs for the next window (one row): `first`'s row when this is the
        clip's first window and a whole one (its frames are those `first` encoded)."""
        if first is not None and self.count == 0 and self.frames == self.window:
            return first.take([self.index])
        return run_encoder(encode, self.inputs()[None])

    def take(self, tokens: list[int], logprobs: list[float] | None = None) -> None:
        """The decoded window's segments; seek moves past them."""
        offset = float(self.seek) * TIME_PRECISION / INPUT_STRIDE  # in float64, in transformers' order
        pieces, advance = split_segments(tokens, self.begin, offset, self.frames, INPUT_STRIDE)
        for p in pieces:
            self.segments.append(Segment(p.start, p.end, tokens[p.lo:p.hi],
                                         None if logprobs is None else logprobs[p.lo:p.hi]))
        self.seek += advance
        self.count += 1


def clip_windows(ctx: Context, features: np.ndarray, num_frames, prompts: list[list[int]],
                 seeds: list[int]) -> list[ClipWindows]:
    """The ClipWindows of a batch of clips (arguments as `decode_windows`)."""
    window, total = window_frames(ctx), features.shape[-1]
    begin = ctx.model.generation_config["no_timestamps_token_id"] + 1
    count = len(prompts)
    # transformers: batched long-form reads each clip's length from the attention mask; one clip,
    # or a batch within one window, runs to the end of the features
    long_batch = count > 1 and total > window
    max_frames = np.asarray(num_frames, np.int64) if long_batch else np.full(count, total, np.int64)
    return [ClipWindows(features[b], int(max_frames[b]), window, begin, list(prompts[b]), int(seeds[b]), b)
            for b in range(count)]


def decode_windows(ctx: Context, features: np.ndarray, num_frames, prompts: list[list[int]],
                   encode: Callable[[np.ndarray], EncoderOutputs], seeds: list[int],
                   first: EncoderOutputs | None = None) -> list[list[Segment]]:
    """Each clip's segments, decoded window after window (see the module docstring). A window
    is a row of one Scheduler: a clip's next window is admitted when its row ends, the seek
    rule applied in between, so the clips' windows interleave.

    features: [B, n_mels, T] log-mel features (T >= one window: `audio.whisper_features`, long
    form when a clip is longer than the window); num_frames: [B] frames of each clip (its
    `attention_mask.sum(-1)`); prompts: each clip's decoder prompt without <|notimestamps|>;
    encode: [n, n_mels, window] features -> EncoderOutputs; seeds: one per clip (a clip's k-th
    window samples from `derived_seed(seed, k)`). first: the encoder's outputs for
    features[..., :window], when already computed (language detection): a clip whose first
    window is those frames reuses them.
    """
    from ...core.scheduler import Job, Scheduler

    clips = clip_windows(ctx, features, num_frames, prompts, seeds)
    settings = timestamp_settings(ctx)
    budget = max(settings.new_tokens_for(len(c.prompt)) for c in clips)
    capacity = max(len(c.prompt) for c in clips) + budget
    if ctx.model.max_context:
        capacity = min(capacity, ctx.model.max_context)
    slots = min(ctx.batch_size or len(clips), len(clips)) * settings.num_beams
    scheduler = Scheduler(ctx, slots, capacity, stream=False)
    ready = [b for b, c in enumerate(clips) if not c.done]
    while ready or scheduler.busy:
        if ready:  # the next windows of the clips whose last one just ended, encoded together
            inputs = np.stack([clips[b].inputs() for b in ready])
            whole = np.array([clips[b].frames == clips[b].window for b in ready])
            reuse = first if first is not None and all(clips[b].count == 0 for b in ready) else None
            encoder = _encode(encode, inputs, np.array(ready), whole, reuse)
            for j, b in enumerate(ready):
                clip = clips[b]
                scheduler.add(Job(clip.prompt, clip.window_seed, settings, settings.new_tokens_for(len(clip.prompt)),
                                  encoder.take([j]), key=b))
            ready = []
        for job in scheduler.step()[1]:
            if job.error is not None:
                raise job.error
            clips[job.key].take(job.tokens, job.logprobs)
            if not clips[job.key].done:
                ready.append(job.key)
    return [c.segments for c in clips]


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
