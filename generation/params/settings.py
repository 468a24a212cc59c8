"""Generation settings: generation_config.json, config.json and the caller's overrides.

Settings are validated once, when they are built (`make_settings`, which `Context.with_settings`
and `generation.context` call): each field by its entry in CHECKS (checks.py), in order, each error a
`SettingError` naming the field, the value and the allowed range. Every setting is bounded (token
ids by the model's vocabulary, lengths by its context, the rest by limits.py; floats finite), so
no request can make the engine overflow a numpy array or a row's per-step work grow past the
model's step. This package (generation.params) imports nothing else of the engine: every layer
reads it.
Defaults are those of transformers 4.57 `GenerationConfig` (top_k 50 when sampling, max_length
20, ...), so a model behaves as it does under `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from .checks import SettingError, check_settings, check_vocabulary, is_integer, shown, token_ids

# Settings that change the output and that this engine does not apply: refused rather than
# silently ignored. Value = the setting's no-op default in transformers 4.57.
_UNSUPPORTED = {
    "guidance_scale": None, "watermarking_config": None, "prefix_allowed_tokens_fn": None,
    "num_beam_groups": 1, "diversity_penalty": 0.0, "penalty_alpha": None, "constraints": None,
    "force_words_ids": None,
}
_NOT_YET = {  # built by later work: assisted decoding with a draft model
    "assistant_model": None,
}
_IGNORED = {  # generation_config.json fields with no effect on the tokens
    "transformers_version", "_from_model_config", "bos_token_id", "use_cache", "output_scores",
    "output_logits", "output_attentions", "output_hidden_states", "return_dict_in_generate",
    "decoder_start_token_id", "cache_implementation",
    "max_time", "trust_remote_code", "low_memory", "token_healing",
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
    # the logits processors, in transformers' order (generation.logits.processors); each default is off
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] | None = None
    encoder_repetition_penalty: float = 1.0
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties, beside repetition_penalty as vLLM applies them (no transformers
    # processor): each token's score less frequency x its count in the row's new tokens, less
    # presence where it is among them
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    no_repeat_ngram_size: int = 0
    encoder_no_repeat_ngram_size: int = 0
    bad_words_ids: tuple[tuple[int, ...], ...] | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    forced_bos_token_id: int | None = None
    forced_eos_token_id: tuple[int, ...] | None = None
    remove_invalid_values: bool = False
    exponential_decay_length_penalty: tuple[int, float] | None = None
    suppress_tokens: tuple[int, ...] | None = None
    begin_suppress_tokens: tuple[int, ...] | None = None
    # the sampling warpers after temperature, top_k and top_p (generation.logits.selection)
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    renormalize_logits: bool = False
    stop_strings: tuple[str, ...] | None = None
    # a constraint on the output (generation.logits.constraints): vLLM's structured_outputs, one of
    # {"json": schema}, {"json_object": true}, {"regex": ...}, {"choice": [...]}, {"grammar": ...},
    # held as (kind, text)
    structured_outputs: tuple[str, str] | None = None
    # beam search (generation.search.beam)
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # assisted decoding (generation.assisted): prompt lookup proposes up to this many tokens per step
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None  # the longest n-gram it matches (None: 2)
    # a draft model (context(draft=...)) proposes this many tokens per step, under this schedule
    num_assistant_tokens: int = 20
    num_assistant_tokens_schedule: str = "constant"
    # the LoRA adapter the row runs with (generation.runtime.lora: a name the model's adapters know;
    # None: the base model alone)
    adapter: str | None = None
    # the timestamp rules of this row (Whisper's: no_timestamps_token_id, eos, max_initial_timestamp_index
    # or -1), as the model's family gives them (its hooks' timestamp_rules) and its `timestamps` processor
    # applies them: set by the engine for a timestamped window, never by a request
    timestamp_rules: tuple[int, int, int] | None = None
    # a sampled row's log-probabilities of its scores before the temperature (scores x temperature),
    # as Whisper's temperature fallback rates a window (`_retrieve_avg_logprobs`): set by the engine
    untempered_logprobs: bool = False
    # a row whose reader takes no log-probabilities (a served request without `logprobs`): the step
    # computes none for it, where the context computes them for every other row; set by the engine
    no_logprobs: bool = False

    def token_ids(self) -> dict[str, tuple[int, ...]]:
        """Every token id a setting names, by setting (for the check against the vocabulary)."""
        named = {"eos_token_id": self.eos_token_id, "pad_token_id": (self.pad_token_id,),
                 "forced_eos_token_id": self.forced_eos_token_id or (),
                 "forced_bos_token_id": () if self.forced_bos_token_id is None else (self.forced_bos_token_id,),
                 "suppress_tokens": self.suppress_tokens or (), "begin_suppress_tokens": self.begin_suppress_tokens or (),
                 "bad_words_ids": tuple(t for w in self.bad_words_ids or () for t in w),
                 "sequence_bias": tuple(t for ids, _ in self.sequence_bias or () for t in ids)}
        return named

    def new_tokens_for(self, prompt_length: int) -> int:
        """How many tokens a prompt of this length may get, by the seed's rule (the pipelines of
        transformers 4): max_new_tokens, else 256 when max_length is unset or 20 (its default),
        else max_length minus the prompt."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        if self.max_length is None or self.max_length == 20:
            return 256
        return max(0, self.max_length - prompt_length)


_FIELDS = {f.name for f in fields(Settings)} - {"timestamp_rules", "untempered_logprobs", "no_logprobs"}  # what config and requests may set


def model_settings(config: dict, generation_config: dict, context: int | None = None,
                   vocab: int | None = None) -> dict:
    """The settings a model folder asks for, as transformers reads them: generation_config.json,
    with eos and pad taken from config.json where it is silent. A max_length or max_new_tokens
    past the `context`, and a top_k (50 by default) past the `vocab`, come down to them: a row
    never outgrows the context, and a top_k of the whole vocabulary keeps it all (transformers
    takes min(top_k, vocab)), so this changes no token, and such a folder still loads."""
    merged = {k: v for k, v in generation_config.items() if k not in _IGNORED}
    for key in ("eos_token_id", "pad_token_id"):
        if merged.get(key) is None and config.get(key) is not None:
            merged[key] = config[key]
    for key, most in (("max_length", context), ("max_new_tokens", context), ("top_k", vocab)):
        value = merged.get(key, Settings.top_k if key == "top_k" else None)
        if most and is_integer(value) and value > most:
            merged[key] = most
    return merged


def make_settings(base: dict, overrides: dict, vocab: int | None = None, context: int | None = None) -> Settings:
    """Settings from a model's `base` dict and the caller's `overrides`, for a model of `vocab`
    token ids and a context of `context` tokens (None: unknown, then ids below 2**31 and lengths
    up to 2**30); unknown, unsupported or out-of-range fields raise SettingError naming them."""
    values = {**base, **overrides}
    for key, value in values.items():
        off = value is None or value == [] or value == {}
        if key in _UNSUPPORTED:
            if value != _UNSUPPORTED[key] and not off:
                raise SettingError(key, f"{key}={shown(value)} is not supported by raymuter (see docs/settings.md); "
                                        f"remove it (or set it to {_UNSUPPORTED[key]!r}) to generate")
        elif key in _NOT_YET:
            if value != _NOT_YET[key] and not off:
                raise SettingError(key, f"{key}={shown(value)} is not supported by this engine yet; "
                                        f"remove it (or set it to {_NOT_YET[key]!r}) to generate")
        elif key not in _FIELDS and key in overrides:
            raise SettingError(str(key), f"unknown generation setting {shown(key)}")
    kwargs = {k: v for k, v in values.items() if k in _FIELDS}
    eos = token_ids("eos_token_id", kwargs.pop("eos_token_id", None))
    pad = kwargs.pop("pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    settings = check_settings(Settings(eos_token_id=eos, pad_token_id=pad, **kwargs), vocab, context)
    check_vocabulary(settings, vocab)
    return settings
