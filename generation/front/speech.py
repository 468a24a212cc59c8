"""Whisper through the front: a clip's transcription as rows of the continuous batch.

The clip is prepared as `generation.tasks.speech_to_text` prepares it (on a worker thread: its
features, the first window through the encoder, the prompt) and decoded beside every other
request: one row, or with timestamps (or a clip longer than a window) a row per window, the
windows following Whisper's seek loop (`generation.families.whisper.windows.seek`, the loop the
engine's own task runs too).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .errors import Refused, speech_field
from .request import between, check_fields, checked


@dataclass(frozen=True)
class SpeechRequest:
    """A transcription: language (code or name; None: detected), task (transcribe or translate),
    timestamps (segments with times), temperature (0: greedy; a list: the fallback's
    temperatures, as transformers' generate(temperature=(...))), a prompt (earlier text the
    transcription continues: transformers' prompt_ids), Whisper's long-form options (None: the
    model's generation_config.json), a seed and generation settings. It is also the handle API's
    request (deployments.schema.TranscriptionRequest is this class), refused by field when made."""

    language: str | None = None
    task: str = "transcribe"
    timestamps: bool = False
    temperature: float | list[float] = 0.0
    prompt: str | None = None
    compression_ratio_threshold: float | None = None
    logprob_threshold: float | None = None
    no_speech_threshold: float | None = None
    condition_on_prev_tokens: bool | None = None
    seed: int | None = None
    settings: dict = field(default_factory=dict)

    def __post_init__(self):
        check_fields(self, SPEECH_RULES, ("task", "timestamps", "temperature", "settings"))

    @classmethod
    def checked(cls, values: dict) -> "SpeechRequest":
        """From a caller's dict (a handle's): a field it does not have is refused by name."""
        return checked(cls, values)


def _number(low: float, high: float):
    return lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and low <= v <= high


def _temperatures(value) -> bool:
    values = value if isinstance(value, list) else [value]
    return 1 <= len(values) <= 16 and all(_number(0, 2)(t) for t in values)


SPEECH_RULES = {
    "language": (lambda v: isinstance(v, str) and len(v) <= 64, "a string of at most 64 characters"),
    "task": (lambda v: v in ("transcribe", "translate"), "transcribe or translate"),
    "timestamps": (lambda v: isinstance(v, bool), "true or false"),
    "temperature": (_temperatures, "a number from 0 to 2, or a list of 1 to 16 of them"),
    "prompt": (lambda v: isinstance(v, str) and len(v) <= 4096, "a string of at most 4096 characters"),
    "compression_ratio_threshold": (_number(0, 1e6), "a number from 0 to 1e6"),
    "logprob_threshold": (_number(-1e6, 0), "a number from -1e6 to 0"),
    "no_speech_threshold": (_number(0, 1), "a number from 0 to 1"),
    "condition_on_prev_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "seed": (between(0, 2**63 - 1), "an integer from 0 to 2**63 - 1"),
    "settings": (lambda v: isinstance(v, dict), "an object of generation settings"),
}


@dataclass
class SpeechResult:
    """The transcription: its text, tokens, segments (windows.Segment: start, end, tokens,
    text; None without timestamps), the clip's seconds and its language (a name where known)."""

    text: str
    tokens: list[int]
    segments: list | None
    duration: float
    language: str | None
    queued: list[float]  # seconds each of its rows (a window, a fallback's retry) waited for a slot


async def transcribe(front, samples, request: SpeechRequest, encode, aencode=None) -> SpeechResult:
    """Whisper over one clip (16 kHz samples) through `front` (an EngineFront of a Whisper model);
    `encode` runs the encoder over log-mel windows [n, n_mels, frames] (a server's encoder
    deployment): on a worker thread for the first window (language detection needs it before
    the prompt); `aencode`, a coroutine function of the same, for the later windows where given
    (no thread waits on a reply per window). Bad input raises Refused naming the transcription
    request's field."""
    import generation
    from generation.families.whisper.audio import HOP_LENGTH, SAMPLING_RATE
    from generation.families.whisper.languages import LANGUAGES
    from generation.families.whisper.windows import window_frames
    from generation.families.whisper.prompt import detected_language

    if front.family != "whisper":
        raise Refused(f"this model does not take audio (a {front.family} model)", "model")
    settings = {**front.defaults, **(request.settings or {})}
    fallback = isinstance(request.temperature, list)
    if request.temperature and not fallback:
        settings.update(do_sample=True, temperature=request.temperature)
    try:
        ctx = generation.context(front.batcher.ctx.model, **settings)
        long_form = len(samples) > window_frames(ctx) * HOP_LENGTH  # needs timestamps, whatever the format
        timestamps = request.timestamps or long_form or bool(ctx.model.generation_config.get("return_timestamps"))
        speech = await asyncio.to_thread(_prepared, front, ctx, samples, request, fallback, timestamps, encode)
        if speech.windowed:
            result = await _windowed(front, ctx, speech, settings, aencode)
        else:
            completion = (await front.decoded(speech.prompts[0], speech.seeds[0], settings, speech.encoder)).result(5)
            tokens = completion.tokens
            result = _Result(front.tokenizer.decode(tokens, skip_special_tokens=True), tokens, None,
                             [completion.queued_seconds])
    except Refused:
        raise
    except ValueError as e:  # the engine's words, naming the transcription's field
        raise Refused(str(e), speech_field(getattr(e, "setting", None)), message=str(e)) from None
    code = detected_language(ctx.model.generation_config, speech.prompts[0])
    return SpeechResult(result.text, result.tokens, result.segments, len(samples) / SAMPLING_RATE,
                        LANGUAGES.get(code, code) if code else request.language, result.queued)


@dataclass
class _Result:
    text: str
    tokens: list[int]
    segments: list | None
    queued: list[float]


def _prepared(front, ctx, samples, request: SpeechRequest, fallback: bool, timestamps: bool, encode):
    """The clip prepared (generation.families.whisper.speech.prepare_speech), on a worker thread."""
    from generation.params.checks import SettingError
    from generation.families.whisper.prompt import prompt_ids
    from generation.families.whisper.speech import prepare_speech

    options = dict(compression_ratio_threshold=request.compression_ratio_threshold,
                   logprob_threshold=request.logprob_threshold, no_speech_threshold=request.no_speech_threshold,
                   condition_on_prev_tokens=request.condition_on_prev_tokens,
                   temperature=tuple(request.temperature) if fallback else None)
    if request.prompt is not None:
        options["prompt_ids"] = prompt_ids(ctx.model, request.prompt)
    speech = prepare_speech(ctx, [samples], language=request.language, task=request.task, seeds=[request.seed or 0],
                            return_timestamps=bool(timestamps), encode=encode, **options)
    if speech.options.logprob_threshold is not None and not front.batcher.ctx.token_logprobs:
        raise SettingError("logprob_threshold", "logprob_threshold: this server runs without log-probabilities "
                                                "(max_logprobs -1), which the fallback rates windows by")
    return speech


async def _windowed(front, ctx, speech, settings: dict, aencode=None) -> _Result:
    """Timestamps, or a clip longer than a window: each window a row of the batch beside every
    other request, driven by Whisper's seek loop."""
    from generation.families.whisper.windows import EncodeWindow, check_decoder_length, checked_outputs, seek, transcript

    clip = speech.windows(ctx)[0]
    rated = speech.options.logprob_threshold is not None
    loop, queued = seek(clip, ctx.model), []
    try:
        ask = next(loop)
        while True:
            if isinstance(ask, EncodeWindow) and aencode is not None:
                windows = clip.inputs()[None]
                answer = clip.reused_encoder(speech.encoder) or checked_outputs(await aencode(windows), windows)
            elif isinstance(ask, EncodeWindow):
                answer = await asyncio.to_thread(clip.next_encoder, speech.encode, speech.encoder)
            else:
                attempt = {**settings, **clip.setting_changes()}
                check_decoder_length(ctx, len(ask.prompt), ctx.with_settings(**attempt))
                handle = await front.decoded(ask.prompt, clip.window_seed, attempt, ask.encoder, speech.timestamps,
                                             rated)
                answer = handle.job
                queued.append(handle.result(timeout=5).queued_seconds)
            ask = loop.send(answer)
    except StopIteration:
        pass
    text, tokens, _ = transcript(ctx, clip.segments)
    return _Result(text, tokens, clip.segments if speech.timestamps else None, queued)
