"""Whisper (transformers 4.57), a model family: audio in, text (and timestamps) out.

    prompt.py      the decoder prompt from every source transformers reads (language, task, forced ids)
    languages.py   Whisper's language codes and names
    speech.py      a request made ready: audio loaded, log-mel features, the first windows
                   through the encoder, the decoder prompts (`prepare`)
    audio.py       the audio front end: files, bytes or arrays to 16 kHz samples, log-mel features
    timestamps.py  the timestamp rules a window's tokens follow, and segments from its tokens
    windows.py     Whisper windows: a clip decoded window after window, the one seek loop (timestamps, audio longer than a window)

The family's contract (generation.families.contract) is below; its modules are imported when
called, but for timestamps.py, whose rules are the family's hooks: the timestamp rule ids a
timestamped window's rows hold, and the logits processor that applies them (the engine's layers
call both through `model.hooks`, and name no family).
"""

from __future__ import annotations

from ...runtime.hooks import Hooks
from .timestamps import timestamp_processor, timestamp_rule_ids

KIND = "encoder-decoder"
HOOKS = Hooks(timestamp_rules=timestamp_rule_ids, timestamps=timestamp_processor)


def detect(config: dict, files: list[str]) -> bool:
    return config.get("model_type") == "whisper"


def prepare(ctx, audios, **options):
    """Clips ready to decode: a speech.Speech (`speech.prepare_speech`'s options)."""
    from .speech import prepare_speech

    return prepare_speech(ctx, audios, **options)


def encode(model, features):
    """The encoder over log-mel windows [n, n_mels, frames]."""
    from ...runtime.encoders import encode_audio

    return encode_audio(model, features)
