"""Whisper's long-form options, read as transformers 4.57 `WhisperForConditionalGeneration.generate`
reads them (an argument, else generation_config.json's value), and the two numbers its temperature
fallback rates a window by.

    temperature                 one value or a tuple: a window is decoded at the first, and again
                                at the next while it needs a fallback (0: greedy; > 0: sampling)
    compression_ratio_threshold a window whose tokens compress better than this (zlib) needs one
    logprob_threshold           a window whose mean token log-probability is below this needs one
    no_speech_threshold         a window below logprob_threshold whose <|nospeech|> probability
                                (after <|startoftranscript|>) is above this is skipped as silence
    condition_on_prev_tokens    each window's prompt starts with <|startofprev|> and the clip's
                                tokens so far (the last max_target_positions // 2 - 1), unless the
                                window ended at a temperature of 0.5 or more
    prompt_ids                  <|startofprev|> + a text's tokens before each window's prompt
                                ("first-segment": then part of the previous tokens; "all-segments":
                                in place of <|startofprev|>, needs condition_on_prev_tokens)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

from ...params.checks import SettingError, check_number

CONDITION_TYPES = ("first-segment", "all-segments")


@dataclass(frozen=True)
class WhisperOptions:
    """What the module docstring lists; temperatures None: the context's settings decide."""

    temperatures: tuple[float, ...] | None = None
    compression_ratio_threshold: float | None = None
    logprob_threshold: float | None = None
    no_speech_threshold: float | None = None
    condition_on_prev_tokens: bool = False
    prompt_ids: tuple[int, ...] | None = None
    prompt_condition_type: str = "first-segment"

    @property
    def fallback(self) -> bool:
        """Whether a window is rated after decoding (a threshold is set)."""
        return self.compression_ratio_threshold is not None or self.logprob_threshold is not None

    @property
    def windowed(self) -> bool:
        """Whether a clip without timestamps still needs the window loop (as transformers runs it)."""
        return (self.fallback or self.no_speech_threshold is not None or self.prompt_ids is not None
                or (self.temperatures is not None and len(self.temperatures) > 1))


def whisper_options(generation_config: dict, vocab_size: int, temperature=None, compression_ratio_threshold=None,
                    logprob_threshold=None, no_speech_threshold=None, condition_on_prev_tokens=None,
                    prompt_ids=None, prompt_condition_type=None) -> WhisperOptions:
    """The options of a request, each an argument or else generation_config.json's, checked."""
    def pick(name, value):
        return value if value is not None else generation_config.get(name)

    if temperature is not None:
        values = tuple(temperature) if isinstance(temperature, (list, tuple)) else (temperature,)
        if not values or len(values) > 16:
            raise SettingError("temperature", "temperature: give one temperature or a list of 1 to 16")
        for t in values:
            check_number("temperature", t, 0.0, 100.0)
        temperature = tuple(float(t) for t in values)
    thresholds = {}
    for name, value, low, high in (("compression_ratio_threshold", compression_ratio_threshold, 0.0, 1e6),
                                   ("logprob_threshold", logprob_threshold, -1e6, 0.0),
                                   ("no_speech_threshold", no_speech_threshold, 0.0, 1.0)):
        value = pick(name, value)
        if value is not None:
            check_number(name, value, low, high)
            value = float(value)
        thresholds[name] = value
    if thresholds["no_speech_threshold"] is not None and thresholds["logprob_threshold"] is None:
        raise SettingError("no_speech_threshold", "no_speech_threshold: a window is skipped as silence only when "
                                                  "it is also below logprob_threshold; set logprob_threshold too")
    condition = pick("condition_on_prev_tokens", condition_on_prev_tokens)
    if condition not in (None, True, False):
        raise SettingError("condition_on_prev_tokens", f"condition_on_prev_tokens must be true or false, "
                                                       f"not {condition!r:.40}")
    kind = prompt_condition_type or CONDITION_TYPES[0]
    if kind not in CONDITION_TYPES:
        raise SettingError("prompt_condition_type", f"prompt_condition_type must be one of "
                                                    f"{', '.join(CONDITION_TYPES)}, not {kind!r:.40}")
    if kind == "all-segments" and condition is not True:
        raise SettingError("prompt_condition_type", "prompt_condition_type 'all-segments' needs "
                                                    "condition_on_prev_tokens=True")
    if prompt_ids is not None:
        prompt_ids = tuple(prompt_ids)
        if not prompt_ids or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                     for t in prompt_ids):
            raise SettingError("prompt_ids", f"prompt_ids must be a non-empty list of token ids below {vocab_size}")
    return WhisperOptions(temperature, thresholds["compression_ratio_threshold"], thresholds["logprob_threshold"],
                          thresholds["no_speech_threshold"], bool(condition), prompt_ids, kind)


def compression_ratio(tokens: list[int], vocab_size: int) -> float:
    """The tokens' bytes over their zlib-compressed bytes, as `_retrieve_compression_ratio`."""
    width = int(math.log2(vocab_size) / 8) + 1
    data = b"".join(int(t).to_bytes(width, "little") for t in tokens)
    return len(data) / len(zlib.compress(data))


def needs_fallback(options: WhisperOptions, tokens: list[int], mean_logprob: float | None, no_speech: float | None,
                   vocab_size: int) -> tuple[bool, bool]:
    """(needs a fallback, skip as silence) of a decoded window, as `_need_fallback`. tokens:
    the window's new tokens with its eos; mean_logprob: their mean log-probability (a beam
    search's: its sequence score)."""
    fallback = skip = False
    if options.compression_ratio_threshold is not None:
        fallback = compression_ratio(tokens, vocab_size) > options.compression_ratio_threshold
    if options.logprob_threshold is not None and mean_logprob < options.logprob_threshold:
        fallback = True
        if options.no_speech_threshold is not None and no_speech > options.no_speech_threshold:
            fallback, skip = False, True
    return fallback, skip
