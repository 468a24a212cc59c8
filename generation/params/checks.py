"""Each generation setting checked: its range, type and shape (CHECKS, field by field), lists
normalized, and SettingError naming the setting when it is wrong. generation/params/settings.py
builds Settings through `check_settings`, which takes and gives a Settings (unnamed here: this module
sits below settings.py, which imports it).
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import replace

from . import limits

ANY_TOKEN_ID = 2**31 - 1  # the bounds when no model is given (make_settings without vocab, context)


ANY_LENGTH = 2**30  # as Context.max_position for a model whose config gives no context


class SettingError(ValueError):
    """A generation setting (or a request's prompt or seed) outside its allowed range. `setting`
    is the engine's name for it ("top_k", "stop_strings", "prompt", "seed", ...), so serving
    code maps it to the request's field without reading the message."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting

    def __reduce__(self):  # Ray pickles errors between processes
        return SettingError, (self.setting, str(self))


class _Short(reprlib.Repr):
    """repr with long values cut short; never raises on a JSON-like value (an integer of
    100000 digits has no repr in Python 3.11; a list nested 10000 deep overflows repr)."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxlist, self.maxtuple, self.maxdict, self.maxset = 3, 8, 8, 4, 4
        self.maxstring, self.maxother, self.maxlong = 80, 80, 40

    def repr_int(self, x, level):
        if x.bit_length() > 128:
            return f"{'-' if x < 0 else ''}an integer of about {int(x.bit_length() * 0.30103) + 1} digits"
        return super().repr_int(x, level)


_short = _Short()


def shown(value) -> str:
    """`value` as an error message shows it: its repr, shortened when long."""
    try:
        return _short.repr(value)
    except Exception:  # noqa: BLE001 - a message must never fail
        return f"a {type(value).__name__}"


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    """An int or a finite float (not a bool)."""
    return is_integer(value) or isinstance(value, float) and math.isfinite(value)


def _text(x: float) -> str:
    return f"{x:g}"


def check_integer(name: str, value, low: int, high: int, note: str = "", null: bool = False) -> None:
    """SettingError unless `value` is an integer in [low, high] (or None, with `null`)."""
    if null and value is None:
        return
    if not is_integer(value) or not low <= value <= high:
        raise SettingError(name, f"{name} must be an integer from {low} to {high}{note}"
                                 f"{', or null' if null else ''}, not {shown(value)}")


def check_number(name: str, value, low: float, high: float, *, open_low: bool = False, open_high: bool = False,
                 note: str = "") -> None:
    """SettingError unless `value` is a finite number in the interval (open at either end)."""
    ok = _number(value) and (low < value if open_low else low <= value)
    ok = ok and (value < high if open_high else value <= high)
    if not ok:
        interval = f"{'(' if open_low else '['}{_text(low)}, {_text(high)}{')' if open_high else ']'}"
        raise SettingError(name, f"{name} must be a number in {interval}{note}, not {shown(value)}")


def token_ids(name: str, value, most: int = limits.MAX_TOKEN_IDS) -> tuple[int, ...]:
    if value is None:
        return ()
    items = [value] if is_integer(value) else value
    if isinstance(items, (list, tuple)) and len(items) > most:
        raise SettingError(name, f"{name} holds {len(items)} token ids; at most {most} are allowed")
    if not isinstance(items, (list, tuple)) or not all(is_integer(v) and v >= 0 for v in items):
        raise SettingError(name, f"{name} must be a token id or a list of token ids, not {shown(value)}")
    return tuple(items)


def _sequences(name: str, value, with_bias: bool):
    """bad_words_ids ([[ids], ...]) or sequence_bias ([[ids, bias], ...] or {(ids): bias}) as
    tuples; a repeated sequence_bias entry keeps its first place and its last bias, as the dict
    transformers builds. At most MAX_SEQUENCES entries of MAX_SEQUENCE_LENGTH tokens, biases
    within +-MAX_BIAS."""
    if value is None:
        return None
    if with_bias and isinstance(value, dict):
        value = [[list(k) if isinstance(k, (tuple, list)) else k, v] for k, v in value.items()]
    form = "[[token ids], bias] pairs" if with_bias else "lists of token ids"
    if not isinstance(value, (list, tuple)) or not value:
        raise SettingError(name, f"{name} must be a non-empty list of {form}, not {shown(value)}")
    if len(value) > limits.MAX_SEQUENCES:
        raise SettingError(name, f"{name} holds {len(value)} entries; at most {limits.MAX_SEQUENCES} are allowed")
    out: dict = {}
    for j, entry in enumerate(value):
        ids, bias = (entry[0], entry[1]) if with_bias and isinstance(entry, (list, tuple)) and len(entry) == 2 else (entry, 0.0)
        if isinstance(ids, (list, tuple)) and len(ids) > limits.MAX_SEQUENCE_LENGTH:
            raise SettingError(name, f"{name}[{j}] holds {len(ids)} token ids; at most "
                                     f"{limits.MAX_SEQUENCE_LENGTH} are allowed")
        if (not isinstance(ids, (list, tuple)) or not ids or not all(is_integer(t) and t >= 0 for t in ids)
                or not (is_integer(bias) or isinstance(bias, float))):
            raise SettingError(name, f"{name}[{j}] = {shown(entry)} is not one of {form} (token ids >= 0)")
        if with_bias and not (_number(bias) and abs(bias) <= limits.MAX_BIAS):
            raise SettingError(name, f"{name}[{j}] has bias {shown(bias)}; a bias must be a number in "
                                     f"[-{_text(limits.MAX_BIAS)}, {_text(limits.MAX_BIAS)}]")
        out[tuple(ids)] = float(bias)
    return tuple(out.items()) if with_bias else tuple(out)


def _id_list(name: str, value, most: int = limits.MAX_TOKEN_IDS):
    return None if value is None else token_ids(name, value, most)


def _stop_strings(value):
    if value is None:
        return None
    items = [value] if isinstance(value, str) else value
    if isinstance(items, (list, tuple)) and len(items) > limits.MAX_STOP_STRINGS:
        raise SettingError("stop_strings", f"stop_strings holds {len(items)} strings; at most "
                                           f"{limits.MAX_STOP_STRINGS} are allowed")
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v for v in items):
        raise SettingError("stop_strings", f"stop_strings must be a string or a list of non-empty strings, "
                                           f"not {shown(value)}")
    for j, stop in enumerate(items):
        if len(stop) > limits.MAX_STOP_LENGTH:
            raise SettingError("stop_strings", f"stop_strings[{j}] has {len(stop)} characters; at most "
                                               f"{limits.MAX_STOP_LENGTH} are allowed")
    return tuple(items) or None


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _structured(value) -> tuple[str, str] | None:
    """structured_outputs as (kind, text): a JSON schema serialized compactly, a regex, the
    choices as a JSON list, a grammar ("" for json_object); None stays None."""
    name = "structured_outputs"
    if value is None:
        return None
    if isinstance(value, tuple) and len(value) == 2 and value[0] in STRUCTURED_KINDS and isinstance(value[1], str):
        return value
    if not isinstance(value, dict) or len(value) != 1 or next(iter(value)) not in STRUCTURED_KINDS:
        raise SettingError(name, f"{name} must be one of {{\"json\": schema}}, {{\"json_object\": true}}, "
                                 f"{{\"regex\": pattern}}, {{\"choice\": [strings]}} or {{\"grammar\": text}}, "
                                 f"not {shown(value)}")
    kind, given = next(iter(value.items()))
    if kind == "json":
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as e:
                raise SettingError(name, f"{name}.json is not valid JSON: {e}") from None
        if not isinstance(given, (dict, bool)):
            raise SettingError(name, f"{name}.json must be a JSON schema (an object), not {shown(given)}")
        text = json.dumps(given, separators=(",", ":"))  # keys in the schema's order: the properties' order
    elif kind == "json_object":
        if given is not True:
            raise SettingError(name, f"{name}.json_object must be true, not {shown(given)}")
        text = ""
    elif kind == "choice":
        most = limits.MAX_CONSTRAINT_CHOICES
        if (not isinstance(given, (list, tuple)) or not given or len(given) > most
                or not all(isinstance(c, str) and c for c in given)):
            raise SettingError(name, f"{name}.choice must be a list of 1 to {most} non-empty strings, "
                                     f"not {shown(given)}")
        text = json.dumps(list(given))
    else:
        if not isinstance(given, str) or not given:
            raise SettingError(name, f"{name}.{kind} must be a non-empty string, not {shown(given)}")
        text = given
    if len(text) > limits.MAX_GRAMMAR_LENGTH:
        raise SettingError(name, f"{name}.{kind} has {len(text)} characters; at most "
                                 f"{limits.MAX_GRAMMAR_LENGTH} are allowed")
    return kind, text


def _decay(value, context: int, where: str):
    if value is None:
        return None
    ok = (isinstance(value, (list, tuple)) and len(value) == 2 and is_integer(value[0]) and 0 <= value[0] <= context
          and _number(value[1]) and 0 < value[1] <= limits.MAX_FLOAT)
    if not ok:
        raise SettingError("exponential_decay_length_penalty",
                           f"exponential_decay_length_penalty must be [start_index from 0 to {context}{where}, "
                           f"decay_factor in (0, {_text(limits.MAX_FLOAT)}]], not {shown(value)}")
    return int(value[0]), float(value[1])


def _normalize(s, context: int, where: str, vocab: int):
    """List-valued settings as tuples (settings are frozen and hashable), in one spelling."""
    return replace(
        s, exponential_decay_length_penalty=_decay(s.exponential_decay_length_penalty, context, where),
        sequence_bias=_sequences("sequence_bias", s.sequence_bias, True),
        bad_words_ids=_sequences("bad_words_ids", s.bad_words_ids, False),
        forced_eos_token_id=_id_list("forced_eos_token_id", s.forced_eos_token_id) or None,
        suppress_tokens=_id_list("suppress_tokens", s.suppress_tokens, vocab) or None,
        begin_suppress_tokens=_id_list("begin_suppress_tokens", s.begin_suppress_tokens, vocab) or None,
        stop_strings=_stop_strings(s.stop_strings), structured_outputs=_structured(s.structured_outputs))


def check_vocabulary(s, vocab: int | None) -> None:
    """SettingError naming the setting whose token id is outside the vocabulary [0, vocab)
    (any id below 2**31 when no vocabulary is given)."""
    top, what = (vocab - 1, "this model's vocabulary") if vocab else (ANY_TOKEN_ID, "the token ids")
    for name, ids in s.token_ids().items():
        bad = [t for t in ids if not 0 <= t <= top]
        if bad:
            raise SettingError(name, f"{name} names token id {shown(bad[0])}, outside {what} (0 to {top})")


VOCAB, CONTEXT = "vocab", "context"  # a bound that is the model's: its vocabulary size, its context


def _boolean(name: str, value, bounds: dict) -> None:
    if not isinstance(value, bool):
        raise SettingError(name, f"{name} must be true or false, not {shown(value)}")


def _adapter(name: str, value, bounds: dict) -> None:
    if value is not None and not (isinstance(value, str) and 0 < len(value) <= 256):
        raise SettingError(name, f"{name} must be an adapter's name (a string of 1 to 256 characters) or null, "
                                 f"not {shown(value)}")


def _integer_in(low, high, note: str = "", null: bool = False):
    """The check of an integer in [low, high] (a bound VOCAB or CONTEXT: the model's, its note
    added), or None with `null`."""
    def check(name: str, value, bounds: dict) -> None:
        top, extra = bounds.get(high, (high, ""))
        check_integer(name, value, low, top, extra + note, null=null)
    return check


def _number_in(low: float, high: float, note: str = "", open_low: bool = False, open_high: bool = False,
               null: bool = False):
    """The check of a finite number in the interval (open at either end), or None with `null`."""
    def check(name: str, value, bounds: dict) -> None:
        if not (null and value is None):
            check_number(name, value, low, high, open_low=open_low, open_high=open_high, note=note)
    return check


def _token_id(null: bool = False):
    """The check of a token id >= 0 (its bound is the vocabulary: check_vocabulary), or None with `null`."""
    def check(name: str, value, bounds: dict) -> None:
        if not (null and value is None) and (not is_integer(value) or value < 0):
            raise SettingError(name, f"{name} must be a token id >= 0, not {shown(value)}")
    return check


def _one_of(*choices: str):
    def check(name: str, value, bounds: dict) -> None:
        if value not in choices:
            spelled = " or ".join(f"\"{c}\"" for c in choices)
            raise SettingError(name, f"{name} must be {spelled}, not {shown(value)}")
    return check


def _sampling_temperature(name: str, value, bounds: dict) -> None:
    """> 0 when sampling (greedy rows never use it, as transformers), and finite in any case."""
    if bounds["do_sample"] and not (_number(value) and value > 0):
        raise SettingError(name, f"temperature must be > 0 when sampling, not {shown(value)} "
                                 "(for greedy decoding set do_sample=False)")
    check_number(name, value, 0, limits.MAX_FLOAT, note=" (> 0 when sampling)")


def _beams(name: str, value, bounds: dict) -> None:
    if not is_integer(value) or value < 1:
        raise SettingError(name, f"num_beams must be an integer >= 1, not {shown(value)} (from 1 to {limits.MAX_BEAMS})")
    check_integer(name, value, 1, limits.MAX_BEAMS)


def _return_sequences(name: str, value, bounds: dict) -> None:
    beams = bounds["num_beams"]
    if not is_integer(value) or not 1 <= value <= beams:
        raise SettingError(name, f"num_return_sequences must be an integer from 1 to num_beams ({beams}), "
                                 f"not {shown(value)} (for several samples of one prompt, send it with several seeds)")


def _early_stopping(name: str, value, bounds: dict) -> None:
    if value not in (True, False, "never") or value in (0, 1) and not isinstance(value, bool):
        raise SettingError(name, f"early_stopping must be true, false or \"never\", not {shown(value)}")


def _stop_strings_with_beams(name: str, value, bounds: dict) -> None:
    if bounds["num_beams"] > 1 and value:
        raise SettingError(name, "stop_strings with num_beams > 1 is not supported yet; use eos_token_id or one beam")


_TURNS_OFF_1, _TURNS_OFF_0 = " (1 turns it off)", " (0 turns it off)"
# Each field's check, in the order they run (the first failure raises, naming its field). A bound
# VOCAB or CONTEXT is the model's (with its note), or ANY_TOKEN_ID / ANY_LENGTH when none is given.
# List-valued fields are checked as they are normalized (_normalize); token ids against the
# vocabulary by check_vocabulary.
CHECKS = (
    ("do_sample", _boolean),
    ("temperature", _sampling_temperature),
    ("top_k", _integer_in(0, VOCAB)),
    ("top_p", _number_in(0, 1, _TURNS_OFF_1, open_low=True)),
    ("repetition_penalty", _number_in(0, limits.MAX_FLOAT, _TURNS_OFF_1, open_low=True)),
    ("encoder_repetition_penalty", _number_in(0, limits.MAX_FLOAT, _TURNS_OFF_1, open_low=True)),
    ("frequency_penalty", _number_in(-limits.MAX_ADDITIVE_PENALTY, limits.MAX_ADDITIVE_PENALTY, _TURNS_OFF_0)),
    ("presence_penalty", _number_in(-limits.MAX_ADDITIVE_PENALTY, limits.MAX_ADDITIVE_PENALTY, _TURNS_OFF_0)),
    ("no_repeat_ngram_size", _integer_in(0, limits.MAX_NGRAM_SIZE, _TURNS_OFF_0)),
    ("encoder_no_repeat_ngram_size", _integer_in(0, limits.MAX_NGRAM_SIZE, _TURNS_OFF_0)),
    ("min_length", _integer_in(0, CONTEXT)),
    ("min_new_tokens", _integer_in(0, CONTEXT, null=True)),
    ("min_p", _number_in(0, 1, null=True)),
    ("typical_p", _number_in(0, 1, _TURNS_OFF_1, open_low=True)),
    ("epsilon_cutoff", _number_in(0, 1, _TURNS_OFF_0, open_high=True)),
    ("eta_cutoff", _number_in(0, 1, _TURNS_OFF_0, open_high=True)),
    ("remove_invalid_values", _boolean),
    ("renormalize_logits", _boolean),
    ("num_beams", _beams),
    ("num_return_sequences", _return_sequences),
    ("length_penalty", _number_in(-limits.MAX_FLOAT, limits.MAX_FLOAT)),
    ("early_stopping", _early_stopping),
    ("stop_strings", _stop_strings_with_beams),
    ("num_assistant_tokens", _integer_in(1, limits.MAX_LOOKUP_TOKENS)),
    ("num_assistant_tokens_schedule", _one_of("constant", "heuristic")),
    ("prompt_lookup_num_tokens", _integer_in(1, limits.MAX_LOOKUP_TOKENS, " (null: off)", null=True)),
    ("max_matching_ngram_size", _integer_in(1, limits.MAX_MATCHING_NGRAM_SIZE, null=True)),
    ("forced_bos_token_id", _token_id(null=True)),
    ("max_new_tokens", _integer_in(0, CONTEXT, null=True)),
    ("max_length", _integer_in(0, CONTEXT, null=True)),
    ("pad_token_id", _token_id()),  # ids above the vocabulary: check_vocabulary
    ("adapter", _adapter),
)


def check_settings(s, vocab: int | None = None, context: int | None = None):
    """`s` checked field by field (CHECKS), its lists normalized and its floats as floats."""
    length, where = (context, " (this model's context)") if context else (ANY_LENGTH, "")
    bounds = {VOCAB: (vocab or ANY_TOKEN_ID, " (this model's vocabulary)" if vocab else ""), CONTEXT: (length, where),
              "do_sample": s.do_sample, "num_beams": s.num_beams}
    for name, check in CHECKS:
        check(name, getattr(s, name), bounds)
    s = _normalize(s, length, where, vocab or ANY_TOKEN_ID + 1)
    return replace(s, temperature=float(s.temperature), top_p=float(s.top_p),
                   repetition_penalty=float(s.repetition_penalty),
                   encoder_repetition_penalty=float(s.encoder_repetition_penalty),
                   frequency_penalty=float(s.frequency_penalty), presence_penalty=float(s.presence_penalty),
                   min_p=None if s.min_p is None else float(s.min_p), typical_p=float(s.typical_p),
                   length_penalty=float(s.length_penalty),
                   epsilon_cutoff=float(s.epsilon_cutoff), eta_cutoff=float(s.eta_cutoff))
