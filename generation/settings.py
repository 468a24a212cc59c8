"""Generation settings: generation_config.json, config.json and the caller's overrides.

Settings are validated once, when they are built; each error names the field, the value and
the allowed range. Defaults are those of transformers 4.57 `GenerationConfig` (top_k 50 when
sampling, max_length 20, ...), so a model behaves as it does under `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

# Settings that change the output and that this engine does not apply yet: refused rather than
# silently ignored. Value = the setting's no-op default in transformers 4.57.
_NOT_YET = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "min_length": 0, "min_new_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "remove_invalid_values": False,
    "exponential_decay_length_penalty": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "sequence_bias": None, "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
    "renormalize_logits": False, "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "penalty_alpha": None, "guidance_scale": None, "watermarking_config": None,
    "num_return_sequences": 1, "constraints": None, "force_words_ids": None,
    "prefix_allowed_tokens_fn": None, "assistant_model": None, "prompt_lookup_num_tokens": None,
}
_IGNORED = {  # generation_config.json fields with no effect on the tokens
    "transformers_version", "_from_model_config", "bos_token_id", "use_cache", "output_scores",
    "output_logits", "output_attentions", "output_hidden_states", "return_dict_in_generate",
    "decoder_start_token_id", "cache_implementation", "early_stopping", "length_penalty",
    "max_time", "stop_strings", "trust_remote_code", "low_memory", "token_healing",
    "num_assistant_tokens", "num_assistant_tokens_schedule", "max_matching_ngram_size",
    "compile_config", "cache_config", "disable_compile", "is_assistant", "dola_layers",
    "assistant_confidence_threshold", "assistant_early_exit", "assistant_lookbehind",
    "target_lookbehind", "generation_kwargs", "top_h",
}


@dataclass(frozen=True)
class Settings:
    """How the tokens of one row are chosen and when the row stops."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    max_new_tokens: int | None = None
    max_length: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int = 0

    def new_tokens_for(self, prompt_length: int) -> int:
        """How many tokens a prompt of this length may get, by the seed's rule (the pipelines of
        transformers 4): max_new_tokens, else 256 when max_length is unset or 20 (its default),
        else max_length minus the prompt."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None or self.max_length == 20:
            return 256
        return max(0, self.max_length - prompt_length)


_FIELDS = {f.name for f in fields(Settings)}


def _token_ids(name: str, value) -> tuple[int, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ValueError(f"{name} must be a token id or a list of token ids, not {value!r}")
    return tuple(items)


def _check(s: Settings) -> Settings:
    if not isinstance(s.do_sample, bool):
        raise ValueError(f"do_sample must be true or false, not {s.do_sample!r}")
    if not isinstance(s.temperature, (int, float)) or isinstance(s.temperature, bool):
        raise ValueError(f"temperature must be a number, not {s.temperature!r}")
    if s.do_sample and not s.temperature > 0:  # greedy rows never use it, as in transformers
        raise ValueError(f"temperature must be > 0 when sampling, not {s.temperature!r} "
                         "(for greedy decoding set do_sample=False)")
    if not isinstance(s.top_k, int) or isinstance(s.top_k, bool) or s.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 turns it off), not {s.top_k!r}")
    if not isinstance(s.top_p, (int, float)) or isinstance(s.top_p, bool) or not 0.0 <= s.top_p <= 1.0:
        raise ValueError(f"top_p must be a number in [0, 1], not {s.top_p!r}")
    for name in ("max_new_tokens", "max_length"):
        value = getattr(s, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
    if not isinstance(s.pad_token_id, int) or isinstance(s.pad_token_id, bool) or s.pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a token id >= 0, not {s.pad_token_id!r}")
    return replace(s, temperature=float(s.temperature), top_p=float(s.top_p))


def model_settings(config: dict, generation_config: dict) -> dict:
    """The settings a model folder asks for, as transformers reads them: generation_config.json,
    with eos and pad taken from config.json where it is silent."""
    merged = {k: v for k, v in generation_config.items() if k not in _IGNORED}
    for key in ("eos_token_id", "pad_token_id"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    return merged


def make_settings(base: dict, overrides: dict) -> Settings:
    """Settings from a model's `base` dict and the caller's `overrides`; unknown or unsupported
    fields raise ValueError naming them."""
    values = {**base, **overrides}
    for key, value in values.items():
        if key in _NOT_YET:
            if value != _NOT_YET[key] and not (value is None or value == [] or value == {}):
                raise ValueError(f"{key}={value!r} is not supported by this engine yet; "
                                 f"remove it (or set it to {_NOT_YET[key]!r}) to generate")
        elif key not in _FIELDS and key in overrides:
            raise ValueError(f"unknown generation setting '{key}'")
    kwargs = {k: v for k, v in values.items() if k in _FIELDS}
    eos = _token_ids("eos_token_id", kwargs.pop("eos_token_id", None))
    pad = kwargs.pop("pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return _check(Settings(eos_token_id=eos, pad_token_id=pad, **kwargs))
