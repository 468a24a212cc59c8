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
from ...logits.rng import derived_seed
from ...runtime.encoders import EncoderOutputs
from .options import WhisperOptions, needs_fallback
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
    """One clip decoded window after window (the module docstring's loop, for one clip, with
    the options of `options.WhisperOptions`): the next window's input frames, decoder prompt,
    settings and seed, and `take`, which rates a decoded window (temperature fallback, silence)
    and applies the seek rule. features [n_mels, T]; max_frames: where this clip's decoding ends."""

    features: np.ndarray
    max_frames: int
    window: int
    begin: int  # the first timestamp token
    prompt: list[int]  # the window's own prompt (init tokens): decoder_start, language, task, ...
    seed: int
    index: int = 0  # the clip's row in its batch (of the first windows' encoder outputs)
    options: WhisperOptions = field(default_factory=WhisperOptions)
    timestamps: bool = True
    previous_start: int | None = None  # <|startofprev|>
    cut_off: int = 223  # previous tokens kept: max_target_positions // 2 - 1
    seek: int = 0
    count: int = 0  # windows decoded
    tries: int = 0  # decodes of all windows (a fallback decodes a window again)
    attempt: int = 0  # the next decode's place in the temperatures
    condition: bool = False  # the next window starts with the previous tokens
    segments: list[Segment] = field(default_factory=list)
    no_speech: float | None = None  # the window's <|nospeech|> probability (no_speech_threshold)

    def __post_init__(self):
        self.condition = self.options.condition_on_prev_tokens
        self._window_prompt: list[int] | None = None
        self.context: list[list[int]] = []  # the segments' tokens the next prompts condition on
        ids = self.options.prompt_ids
        if ids is not None and self.options.prompt_condition_type == "first-segment":
            self.context.append(list(ids[1:] if ids[0] == self.previous_start else ids))

    @property
    def done(self) -> bool:
        return self.seek >= self.max_frames

    @property
    def frames(self) -> int:
        """The clip's frames in the next window (the rest is zeros)."""
        return min(self.max_frames - self.seek, self.window)

    @property
    def window_seed(self) -> int:
        """The next decode's seed: the clip's k-th decode samples from derived_seed(seed, k)."""
        return derived_seed(self.seed, self.tries)

    @property
    def temperature(self) -> float | None:
        """The next decode's temperature (None: the context's settings)."""
        temperatures = self.options.temperatures
        return None if temperatures is None else temperatures[self.attempt]

    def decoder_prompt(self) -> list[int]:
        """The next window's decoder input, as transformers' `_prepare_decoder_input_ids` for
        this clip: the previous tokens (conditioning) or prompt_ids, then the window's prompt.
        A fallback decodes the window again from the same input."""
        if self.attempt == 0 or self._window_prompt is None:
            self._window_prompt = self._decoder_prompt()
        return list(self._window_prompt)

    def _decoder_prompt(self) -> list[int]:
        ids = self.options.prompt_ids
        if self.condition and self.context:
            kept = [t[:-1] if len(t) > 2 and t[-2] >= self.begin else t for t in self.context]
            previous = [t for tokens in kept for t in tokens][-self.cut_off:]
            if ids is not None and self.options.prompt_condition_type == "all-segments":
                head = list(ids)
            else:
                head = [] if self.previous_start is None else [self.previous_start]
            return head + previous + self.prompt
        if ids is not None:
            return list(ids) + self.prompt
        return list(self.prompt)

    def settings(self, settings):
        """`settings` (timestamp_settings' where the window has timestamps) for the next decode: the temperature of this attempt
        (0: greedy; > 0: sampling with one beam) as transformers' `generate_with_fallback` sets
        it; log-probabilities before the temperature where the window is rated by them."""
        changes = self.setting_changes()
        if self.options.logprob_threshold is not None:
            changes["untempered_logprobs"] = True
        return replace(settings, **changes)

    def setting_changes(self) -> dict:
        """The generation settings the next decode's temperature sets (none without temperatures)."""
        t = self.temperature
        if t is None:
            return {}
        return dict(do_sample=True, temperature=t, num_beams=1) if t > 0 else dict(do_sample=False, temperature=1.0)

    def take_job(self, job, vocab_size: int) -> bool:
        """`take` of a scheduler Job that decoded the window (its eos, eos log-probability and,
        for a beam search, its score)."""
        eos = job.settings.eos_token_id or ()
        ended = job.reason == "stop" and job.hypotheses is None and bool(eos)
        score = job.hypotheses[0].score if job.hypotheses else None
        return self.take(job.tokens, job.logprobs, min(eos) if ended else None, job.eos_logprob, score, vocab_size)

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
        return self.reused_encoder(first) or run_encoder(encode, self.inputs()[None])

    def reused_encoder(self, first: EncoderOutputs | None) -> EncoderOutputs | None:
        """`first`'s row for this clip when the next window is the clip's first and a whole one
        (its frames are those `first` encoded), else None: the window needs the encoder."""
        if first is not None and self.count == 0 and self.frames == self.window:
            return first.take([self.index])
        return None

    def rate_silence(self, model, encoder: EncoderOutputs) -> None:
        """The window's <|nospeech|> probability, as WhisperNoSpeechDetection: the softmax of
        the raw logits after <|startoftranscript|> (with the previous tokens before it)."""
        if self.options.no_speech_threshold is None:
            return
        from ...cache.cross import run_first_steps
        from ...logits.selection import softmax

        prompt = self.decoder_prompt()
        start = len(prompt) - len(self.prompt)
        logits, _ = run_first_steps(model, [prompt[:start + 1]], encoder)
        self.no_speech = float(softmax(logits.astype(np.float32))[0, self.begin - 2])

    def take(self, tokens: list[int], logprobs: list[float] | None = None, eos: int | None = None,
             eos_logprob: float | None = None, score: float | None = None, vocab_size: int = 0) -> bool:
        """A decoded window: True when it is settled (its segments kept, or skipped as silence,
        and seek moved on), False when it needs a fallback at the next temperature. eos: the eos
        token where the window ended at it (with its log-probability); score: a beam search's
        sequence score."""
        self.tries += 1
        options = self.options
        t = self.temperature  # a window that ends at 0.5 or more stops the next one's conditioning
        self.condition = options.condition_on_prev_tokens and (t is None or t < 0.5)
        skip = False
        if options.fallback:
            rated = tokens + ([eos] if eos is not None else [])
            mean = score
            if score is None and options.logprob_threshold is not None:
                values = np.asarray(list(logprobs) + ([eos_logprob] if eos is not None else []), np.float32)
                total = np.float32(0)
                for value in values:  # one after another in float32, as transformers' sum of tensors
                    total = np.float32(total + value)
                mean = float(total / np.float32(max(len(values), 1)))
            fallback, skip = needs_fallback(options, rated, mean, self.no_speech, vocab_size)
            if fallback and self.attempt + 1 < len(options.temperatures or (None,)):
                self.attempt += 1
                return False
        self.attempt = 0
        self.count += 1
        if skip:
            self.seek += self.frames
            return True
        offset = float(self.seek) * TIME_PRECISION / INPUT_STRIDE  # in float64, in transformers' order
        pieces, advance = split_segments(tokens, self.begin, offset, self.frames, INPUT_STRIDE)
        for p in pieces:
            self.segments.append(Segment(p.start, p.end, tokens[p.lo:p.hi],
                                         None if logprobs is None else logprobs[p.lo:p.hi]))
            self.context.append(tokens[p.lo:p.hi])
        self.seek += advance
        return True


def clip_windows(ctx: Context, features: np.ndarray, num_frames, prompts: list[list[int]],
                 seeds: list[int], options: WhisperOptions | None = None, timestamps: bool = True
                 ) -> list[ClipWindows]:
    """The ClipWindows of a batch of clips (arguments as `decode_windows`)."""
    window, total = window_frames(ctx), features.shape[-1]
    config = ctx.model.generation_config
    begin = config["no_timestamps_token_id"] + 1
    previous_start = config.get("prev_sot_token_id")
    if previous_start is None and len(config.get("suppress_tokens") or ()) >= 2:
        previous_start = config["suppress_tokens"][-2]
    cut_off = ctx.model.config.get("max_target_positions", 448) // 2 - 1
    count = len(prompts)
    # transformers: batched long-form reads each clip's length from the attention mask; one clip,
    # or a batch within one window, runs to the end of the features
    long_batch = count > 1 and total > window
    max_frames = np.asarray(num_frames, np.int64) if long_batch else np.full(count, total, np.int64)
    return [ClipWindows(features[b], int(max_frames[b]), window, begin, list(prompts[b]), int(seeds[b]), b,
                        options or WhisperOptions(), timestamps, previous_start, cut_off)
            for b in range(count)]


def decode_windows(ctx: Context, features: np.ndarray, num_frames, prompts: list[list[int]],
                   encode: Callable[[np.ndarray], EncoderOutputs], seeds: list[int],
                   first: EncoderOutputs | None = None, options: WhisperOptions | None = None,
                   timestamps: bool = True) -> list[list[Segment]]:
    """Each clip's segments, decoded window after window (see the module docstring). A window
    is a row of one Scheduler: a clip's next window is admitted when its row ends, the seek
    rule applied in between, so the clips' windows interleave; a window that needs a fallback
    (options) is admitted again at the next temperature.

    features: [B, n_mels, T] log-mel features (T >= one window: `audio.whisper_features`, long
    form when a clip is longer than the window); num_frames: [B] frames of each clip (its
    `attention_mask.sum(-1)`); prompts: each clip's decoder prompt (init tokens); encode: [n,
    n_mels, window] features -> EncoderOutputs; seeds: one per clip (a clip's k-th decode
    samples from `derived_seed(seed, k)`). first: the encoder's outputs for
    features[..., :window], when already computed (language detection): a clip whose first
    window is those frames reuses them. timestamps False: windows without the timestamp rules
    (a short clip with options that need the loop).
    """
    from ...engine.jobs import Job
    from ...engine.scheduler import Scheduler

    clips = clip_windows(ctx, features, num_frames, prompts, seeds, options, timestamps)
    rated = (options or WhisperOptions()).logprob_threshold is not None
    run_ctx = replace(ctx, token_logprobs=True, logprobs_of="processed") if rated and not (
        ctx.token_logprobs and ctx.logprobs_of == "processed") else ctx
    base = timestamp_settings(ctx) if timestamps else ctx.settings
    budget = max(base.new_tokens_for(len(c.decoder_prompt())) for c in clips)
    capacity = max(len(c.decoder_prompt()) for c in clips) + budget
    if clips[0].condition:  # the previous tokens grow the prompt up to cut_off
        capacity += clips[0].cut_off + 1
    if ctx.model.max_context:
        capacity = min(capacity, ctx.model.max_context)
    slots = min(ctx.batch_size or len(clips), len(clips)) * base.num_beams
    scheduler = Scheduler(run_ctx, slots, capacity, stream=False)
    loops = {b: seek(clip, ctx.model) for b, clip in enumerate(clips) if not clip.done}
    asks = {b: next(loop) for b, loop in loops.items()}

    def answer(b: int, value) -> None:  # the clip's loop goes on to its next ask, or ends
        try:
            asks[b] = loops[b].send(value)
        except StopIteration:
            return
        if isinstance(asks[b], DecodeWindow):
            decode(b)

    def decode(b: int) -> None:
        ask, settings = asks.pop(b), clips[b].settings(base)
        check_decoder_length(ctx, len(ask.prompt), settings)
        scheduler.add(Job(ask.prompt, clips[b].window_seed, settings, settings.new_tokens_for(len(ask.prompt)),
                          ask.encoder, key=b))

    while asks or scheduler.busy:
        ready = sorted(asks)  # the next windows of the clips whose last one just ended, encoded together
        if ready:
            inputs = np.stack([clips[b].inputs() for b in ready])
            whole = np.array([clips[b].frames == clips[b].window for b in ready])
            reuse = first if first is not None and all(clips[b].count == 0 for b in ready) else None
            encoder = _encode(encode, inputs, np.array(ready), whole, reuse)
            for j, b in enumerate(ready):
                answer(b, encoder.take([j]))
        for job in scheduler.step()[1]:
            if job.error is not None:
                raise job.error
            answer(job.key, job)
    return [c.segments for c in clips]


@dataclass
class EncodeWindow:
    """A clip's seek loop asks for its next window's encoder outputs (one row)."""

    clip: ClipWindows


@dataclass
class DecodeWindow:
    """A clip's seek loop asks for its window decoded from `prompt` (the clip's `settings` or
    `setting_changes` for this attempt, its `window_seed`), and a Job-like answer back."""

    clip: ClipWindows
    prompt: list[int]
    encoder: EncoderOutputs


def seek(clip: ClipWindows, model):
    """The seek loop of one clip, the one both drivers run (`decode_windows` over a Scheduler for
    a batch of clips; a server's transcription over its continuous batch, window by window):
    a generator that yields an EncodeWindow (send it the window's EncoderOutputs) and then
    DecodeWindows (send each the Job that decoded it: tokens, logprobs, eos, score) until the
    window is settled (a fallback decodes it again at the next temperature); the seek rule moves
    the clip on between windows, and the loop ends with the clip."""
    while not clip.done:
        encoder = yield EncodeWindow(clip)
        clip.rate_silence(model, encoder)
        settled = False
        while not settled:
            job = yield DecodeWindow(clip, clip.decoder_prompt(), encoder)
            settled = clip.take_job(job, model.vocab_size)


def transcript(ctx: Context, segments: list[Segment]) -> tuple[str, list[int], list[float] | None]:
    """A clip's text (without timestamps), its tokens one after another and their
    log-probabilities (where the context has them), each segment's text set on the way."""
    from ...text.tokenizer import model_tokenizer

    begin = ctx.model.generation_config["no_timestamps_token_id"] + 1
    tokenizer = model_tokenizer(ctx.model) if ctx.model.tokenizer_path else None

    def text(tokens):
        return tokenizer.decode([t for t in tokens if t < begin], skip_special_tokens=True) if tokenizer else ""
    for segment in segments:
        segment.text = text(segment.tokens)
    tokens = [t for s in segments for t in s.tokens]
    logprobs = None if not ctx.token_logprobs else [p for s in segments for p in s.logprobs]
    return text(tokens), tokens, logprobs


def check_decoder_length(ctx: Context, prompt: int, settings=None) -> None:
    """As transformers' Whisper generate (`_set_max_new_tokens_and_length`, each window): a
    decoder prompt of `prompt` tokens (previous tokens included) and max_new_tokens (of
    `settings`, default the context's) within the decoder's positions."""
    from ...params.checks import SettingError

    limit, new = ctx.model.config.get("max_target_positions"), (settings or ctx.settings).max_new_tokens
    if isinstance(limit, int) and new is not None and new + prompt > limit:
        raise SettingError("max_new_tokens", f"max_new_tokens={new} and the {prompt}-token decoder prompt exceed "
                                             f"the decoder's {limit} positions: max_new_tokens can be at most "
                                             f"{limit - prompt}")


def run_encoder(encode: Callable[[np.ndarray], EncoderOutputs], windows: np.ndarray) -> EncoderOutputs:
    """encode(windows) [n, n_mels, frames], checked to give one row per window."""
    return checked_outputs(encode(windows), windows)


def checked_outputs(out, windows: np.ndarray) -> EncoderOutputs:
    """An encoder's reply for `windows`, checked to be EncoderOutputs of one row per window."""
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
