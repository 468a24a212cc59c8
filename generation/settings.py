"""Generation settings: generation_config.json, config.json and the caller's overrides.

Settings are validated once, when they are built; each error names the field, the value and
the allowed range. Defaults are those of transformers 4.57 `GenerationConfig` (top_k 50 when
sampling, max_length 20, ...), so a model behaves as it does under `generate()`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

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
    # the logits processors, in transformers' order (processors.py); each default is off
    sequence_bias: tuple[tuple[tuple[int, ...], float], ...] | None = None
    encoder_repetition_penalty: float = 1.0
    repetition_penalty: float = 1.0
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
    # the sampling warpers after temperature, top_k and top_p (selection.py)
    min_p: float | None = None
    typical_p: float = 1.0
    epsilon_cutoff: float = 0.0
    eta_cutoff: float = 0.0
    renormalize_logits: bool = False
    stop_strings: tuple[str, ...] | None = None
    # beam search (beam.py)
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # assisted decoding (assisted.py): prompt lookup proposes up to this many tokens per step
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None  # the longest n-gram it matches (None: 2)
    # a draft model (context(draft=...)) proposes this many tokens per step, under this schedule
    num_assistant_tokens: int = 20
    num_assistant_tokens_schedule: str = "constant"

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


_FIELDS = {f.name for f in fields(Settings)}


def _token_ids(name: str, value) -> tuple[int, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, int) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ValueError(f"{name} must be a token id or a list of token ids, not {value!r}")
    return tuple(items)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sequences(name: str, value, with_bias: bool):
    """bad_words_ids ([[ids], ...]) or sequence_bias ([[ids, bias], ...] or {(ids): bias}) as
    tuples; a repeated sequence_bias entry keeps its first place and its last bias, as the dict
    transformers builds."""
    if value is None:
        return None
    if with_bias and isinstance(value, dict):
        value = [[list(k) if isinstance(k, (tuple, list)) else k, v] for k, v in value.items()]
    form = "[[token ids], bias] pairs" if with_bias else "lists of token ids"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{name} must be a non-empty list of {form}, not {value!r}")
    out: dict = {}
    for j, entry in enumerate(value):
        ids, bias = (entry[0], entry[1]) if with_bias and isinstance(entry, (list, tuple)) and len(entry) == 2 else (entry, 0.0)
        if (not isinstance(ids, (list, tuple)) or not ids or not all(_integer(t) and t >= 0 for t in ids)
                or not _number(bias)):
            raise ValueError(f"{name}[{j}] = {entry!r} is not one of {form} (token ids >= 0)")
        out[tuple(ids)] = float(bias)
    return tuple(out.items()) if with_bias else tuple(out)


def _id_list(name: str, value):
    return None if value is None else _token_ids(name, value)


def _normalize(s: Settings) -> Settings:
    """List-valued settings as tuples (settings are frozen and hashable), in one spelling."""
    decay = s.exponential_decay_length_penalty
    if decay is not None:
        if (not isinstance(decay, (list, tuple)) or len(decay) != 2 or not _integer(decay[0]) or decay[0] < 0
                or not _number(decay[1]) or not decay[1] > 0):
            raise ValueError("exponential_decay_length_penalty must be [start_index >= 0, decay_factor > 0], "
                             f"not {decay!r}")
        decay = (int(decay[0]), float(decay[1]))
    forced_eos = s.forced_eos_token_id
    return replace(
        s, exponential_decay_length_penalty=decay,
        sequence_bias=_sequences("sequence_bias", s.sequence_bias, True),
        bad_words_ids=_sequences("bad_words_ids", s.bad_words_ids, False),
        forced_eos_token_id=_id_list("forced_eos_token_id", forced_eos) or None,
        suppress_tokens=_id_list("suppress_tokens", s.suppress_tokens) or None,
        begin_suppress_tokens=_id_list("begin_suppress_tokens", s.begin_suppress_tokens) or None,
        stop_strings=_stop_strings(s.stop_strings))


def _stop_strings(value):
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v for v in items):
        raise ValueError(f"stop_strings must be a string or a list of non-empty strings, not {value!r}")
    return tuple(items) or None


def check_vocabulary(s: Settings, vocab: int) -> None:
    """ValueError naming the setting whose token id is outside the vocabulary [0, vocab)."""
    for name, ids in s.token_ids().items():
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad and name != "pad_token_id":
            raise ValueError(f"{name} names token id {bad[0]}, outside this model's vocabulary (0 to {vocab - 1})")


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
    if not _number(s.top_p) or not 0.0 < s.top_p <= 1.0:
        raise ValueError(f"top_p must be a number in (0, 1] (1 turns it off), not {s.top_p!r}")
    for name in ("repetition_penalty", "encoder_repetition_penalty"):
        if not _number(getattr(s, name)) or not getattr(s, name) > 0:
            raise ValueError(f"{name} must be a number > 0 (1 turns it off), not {getattr(s, name)!r}")
    for name in ("no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "min_length"):
        if not _integer(getattr(s, name)) or getattr(s, name) < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 turns it off), not {getattr(s, name)!r}")
    if s.min_new_tokens is not None and (not _integer(s.min_new_tokens) or s.min_new_tokens < 0):
        raise ValueError(f"min_new_tokens must be an integer >= 0, not {s.min_new_tokens!r}")
    if s.min_p is not None and (not _number(s.min_p) or not 0.0 <= s.min_p <= 1.0):
        raise ValueError(f"min_p must be a number in [0, 1], not {s.min_p!r}")
    if not _number(s.typical_p) or not 0.0 < s.typical_p <= 1.0:
        raise ValueError(f"typical_p must be a number in (0, 1] (1 turns it off), not {s.typical_p!r}")
    for name in ("epsilon_cutoff", "eta_cutoff"):
        if not _number(getattr(s, name)) or not 0.0 <= getattr(s, name) < 1.0:
            raise ValueError(f"{name} must be a number in [0, 1) (0 turns it off), not {getattr(s, name)!r}")
    for name in ("remove_invalid_values", "renormalize_logits"):
        if not isinstance(getattr(s, name), bool):
            raise ValueError(f"{name} must be true or false, not {getattr(s, name)!r}")
    if not _integer(s.num_beams) or s.num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, not {s.num_beams!r}")
    if not _integer(s.num_return_sequences) or not 1 <= s.num_return_sequences <= s.num_beams:
        raise ValueError(f"num_return_sequences must be an integer from 1 to num_beams ({s.num_beams}), "
                         f"not {s.num_return_sequences!r} (for several samples of one prompt, send it with "
                         "several seeds)")
    if not _number(s.length_penalty):
        raise ValueError(f"length_penalty must be a number, not {s.length_penalty!r}")
    if s.early_stopping not in (True, False, "never") or s.early_stopping in (0, 1) and not isinstance(s.early_stopping, bool):
        raise ValueError(f"early_stopping must be true, false or \"never\", not {s.early_stopping!r}")
    if s.num_beams > 1 and s.stop_strings:
        raise ValueError("stop_strings with num_beams > 1 is not supported yet; use eos_token_id or one beam")
    if not _integer(s.num_assistant_tokens) or s.num_assistant_tokens < 1:
        raise ValueError(f"num_assistant_tokens must be an integer >= 1, not {s.num_assistant_tokens!r}")
    if s.num_assistant_tokens_schedule not in ("constant", "heuristic"):
        raise ValueError("num_assistant_tokens_schedule must be \"constant\" or \"heuristic\", "
                         f"not {s.num_assistant_tokens_schedule!r}")
    for name in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
        value = getattr(s, name)
        if value is not None and (not _integer(value) or value < 1):
            raise ValueError(f"{name} must be an integer >= 1 (or null: off), not {value!r}")
    if s.forced_bos_token_id is not None and (not _integer(s.forced_bos_token_id) or s.forced_bos_token_id < 0):
        raise ValueError(f"forced_bos_token_id must be a token id >= 0, not {s.forced_bos_token_id!r}")
    for name in ("max_new_tokens", "max_length"):
        value = getattr(s, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be an integer >= 0, not {value!r}")
    if not isinstance(s.pad_token_id, int) or isinstance(s.pad_token_id, bool) or s.pad_token_id < 0:
        raise ValueError(f"pad_token_id must be a token id >= 0, not {s.pad_token_id!r}")
    s = _normalize(s)
    return replace(s, temperature=float(s.temperature), top_p=float(s.top_p),
                   repetition_penalty=float(s.repetition_penalty),
                   encoder_repetition_penalty=float(s.encoder_repetition_penalty),
                   min_p=None if s.min_p is None else float(s.min_p), typical_p=float(s.typical_p),
                   length_penalty=float(s.length_penalty),
                   epsilon_cutoff=float(s.epsilon_cutoff), eta_cutoff=float(s.eta_cutoff))


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
        off = value is None or value == [] or value == {}
        if key in _UNSUPPORTED:
            if value != _UNSUPPORTED[key] and not off:
                raise ValueError(f"{key}={value!r} is not supported by raymuter (see README, 'Settings'); "
                                 f"remove it (or set it to {_UNSUPPORTED[key]!r}) to generate")
        elif key in _NOT_YET:
            if value != _NOT_YET[key] and not off:
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
