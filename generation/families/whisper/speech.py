"""A Whisper request made ready to decode: audio loaded and checked, log-mel features, the first
windows through the encoder, the decoder prompts (language given or detected, task, timestamps)
as transformers 4.57 Whisper generate makes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ...cache.cross import run_first_steps
from ...core.context import Context
from ...params.inputs import check_seeds
from ...params.checks import SettingError
from ...runtime.encoders import EncoderOutputs, encode_audio
from ...runtime.model import preprocessor_config
from .. import Prepared
from ..seq2seq import decoder_start
from . import audio
from .windows import ClipWindows, check_decoder_length, clip_windows, run_encoder, window_frames
from .options import WhisperOptions, whisper_options
from .prompt import init_tokens

OPTION_NAMES = ("temperature", "compression_ratio_threshold", "logprob_threshold", "no_speech_threshold",
                "condition_on_prev_tokens", "prompt_ids", "prompt_condition_type")


def whisper_prompts(ctx: Context, encoder: EncoderOutputs, language=None, task: str | None = None,
                    timestamps: bool = False, is_multilingual: bool | None = None) -> list[list[int]]:
    """Each clip's decoder prompt as transformers 4.57 Whisper builds it (prompt.init_tokens):
    the language given, or detected from the first step's logits over the language tokens. `encoder`:
    the outputs of each clip's first window (what detection reads)."""
    config = ctx.model.generation_config
    start = decoder_start(ctx)

    def detect() -> list[int]:
        logits, _ = run_first_steps(ctx.model, [[start]] * len(encoder), encoder)
        ids = np.array(sorted(int(i) for i in config["lang_to_id"].values()))
        return ids[logits[:, ids].argmax(axis=1)].tolist()

    return init_tokens(config, ctx.model.config, start, len(encoder), language, task, timestamps, is_multilingual,
                       detect)


@dataclass
class Speech(Prepared):
    """Clips ready to decode (the first half of `speech_to_text`): their decoder prompts
    (language given or detected), the encoder's outputs for their first windows (`encoder`),
    their log-mel features and seeds, whether they decode with timestamps, and the `encode` that
    runs the encoder on later windows."""

    features: object  # audio.LogMelFeatures
    seeds: list[int]
    timestamps: bool
    encode: Callable
    options: WhisperOptions = WhisperOptions()

    @property
    def windowed(self) -> bool:
        """Whether the clips decode window after window (timestamps, or options that need it)."""
        return self.timestamps or self.options.windowed

    def windows(self, ctx: Context) -> list[ClipWindows]:
        """Each clip's windows, to decode one after another (`windowed`)."""
        return clip_windows(ctx, self.features.features, self.features.num_frames, self.prompts, self.seeds,
                            self.options, self.timestamps)


def prepare_speech(ctx: Context, audios, sampling_rate: int = 16000, language=None, task: str | None = None,
                   seeds=None, return_timestamps: bool | None = None, encode=None, is_multilingual=None,
                   **options) -> Speech:
    """Everything `speech_to_text` does before decoding (its arguments, checked): the features,
    the first windows through the encoder, the prompts. A server decodes the result in its
    batch (a row per clip, or with timestamps a row per window). options: Whisper's long-form
    options (`options.whisper_options`: temperature, compression_ratio_threshold,
    logprob_threshold, no_speech_threshold, condition_on_prev_tokens, prompt_ids,
    prompt_condition_type)."""
    if not isinstance(audios, (list, tuple)) or not audios:
        raise ValueError("audios must be a non-empty list of arrays or audio files")
    if return_timestamps not in (None, True, False):
        raise ValueError(f"return_timestamps must be true, false or None, not {return_timestamps!r}")
    if ctx.settings.num_return_sequences > 1:
        raise ValueError(f"num_return_sequences={ctx.settings.num_return_sequences}: speech_to_text gives one "
                         "transcription per clip (set it to 1)")
    if encode is not None and not callable(encode):
        raise ValueError(f"encode must be a function of log-mel features, not {encode!r}")
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"prepare_speech got unknown options {sorted(unknown)} (Whisper's: {', '.join(OPTION_NAMES)})")
    chosen = whisper_options(ctx.model.generation_config, ctx.model.vocab_size, **options)
    if chosen.logprob_threshold is not None and ctx.settings.num_beams > 1:
        raise SettingError("logprob_threshold", "logprob_threshold with num_beams > 1 is not implemented "
                                                "(transformers rates a beam search's window by its scores)")
    clips = [audio.load_audio(a) if isinstance(a, (str, bytes)) or hasattr(a, "__fspath__")
             else audio.load_audio(a, sampling_rate) for a in audios]
    seeds = check_seeds(seeds, len(clips))
    window = preprocessor_config(ctx.model).get("chunk_length", audio.CHUNK_SECONDS)
    frames = window_frames(ctx)
    if round(window * audio.SAMPLING_RATE) // audio.HOP_LENGTH != frames:
        raise ValueError(f"{ctx.model.folder}: preprocessor_config.json's chunk_length ({window} s) is not the "
                         f"encoder's window ({frames} frames)")
    long_form = max(len(clip) for clip in clips) > window * audio.SAMPLING_RATE
    timestamps = _timestamps_on(ctx, clips, window, return_timestamps)
    encode = encode or (lambda features: encode_audio(ctx.model, features))
    n_mels = ctx.model.config.get("num_mel_bins", 80)
    features = audio.whisper_features(clips, n_mels=n_mels, long_form=long_form, chunk_seconds=window)
    first = run_encoder(encode, features.features[..., :frames])
    prompts = whisper_prompts(ctx, first, language, task, timestamps=timestamps, is_multilingual=is_multilingual)
    check_decoder_length(ctx, max(len(p) for p in prompts) + len(chosen.prompt_ids or ()))
    return Speech(prompts, first, features, seeds, timestamps, encode, chosen)


def _timestamps_on(ctx: Context, clips, window: float, asked: bool | None) -> bool:
    """Whether the clips decode with timestamps, as transformers decides: `asked`, else the
    generation config's return_timestamps; a clip longer than the window needs them."""
    config = ctx.model.generation_config
    timestamps = config.get("return_timestamps") if asked is None else asked
    longest = int(np.argmax([len(clip) for clip in clips]))
    long_form = len(clips[longest]) > window * 16000
    if long_form and timestamps is False:
        source = "return_timestamps=False" if asked is False else "generation_config.json's return_timestamps is false"
        raise ValueError(f"audios[{longest}] lasts {len(clips[longest]) / 16000:.1f} s, longer than this model's "
                         f"{window} s window: long-form decoding needs timestamps, and {source} "
                         "(pass return_timestamps=True)")
    return bool(timestamps) or long_form
