"""What the engine front refuses, and the one table from an engine error to the request's field.

Every refusal carries its field as data: `Refused.field` names a field of the front's request
(`EngineRequest`: "prompt", "messages.0.content.1", "settings.top_k", "tools", "logprobs") and
`Refused.reason` says what was wrong with it; the message is the field's name, then the reason.
An engine error (generation's SettingError) names the engine's setting; `refused` finds the
request's field for it in SETTING_FIELDS (or by the rules beside it) and speaks of that field,
never by rewriting the message.
"""

from __future__ import annotations


class Refused(ValueError):
    """A request the front refuses (HTTP 400): `field` the request's field to blame (None: none
    is), `reason` what was wrong with it. The message is the field's name, then `predicate`
    (": <reason>" unless the raiser says otherwise), so a layer that names the field otherwise
    (an OpenAI route's "stop" for "settings.stop_strings") puts its name before the predicate.
    A raiser's whole `message` (one that says more than the field) has no predicate and stays."""

    def __init__(self, reason: str, field: str | None, message: str | None = None, predicate: str | None = None):
        spoken = spoken_name(field)
        if message is None and spoken:
            predicate = predicate if predicate is not None else f": {reason}"
            message = spoken + predicate
        super().__init__(message or reason)
        self.field, self.reason, self.predicate = field, reason, predicate if spoken else None

    def __reduce__(self):  # crosses Ray's and multiprocessing's process boundaries intact
        return type(self), (self.reason, self.field, str(self), self.predicate)


class Overloaded(RuntimeError):
    """The engine's queue is full, or its engine process is restarting (HTTP 503 with Retry-After)."""


def spoken_name(field: str | None) -> str | None:
    """How a message names a field: "settings.top_k" as top_k, "messages.0.content" as is."""
    return None if field is None else field.removeprefix("settings.")


# The request field an engine setting comes from, where it is not "settings.<setting>".
SETTING_FIELDS = {"seed": "seed", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}
# The transcription request's fields that are settings of the engine's Whisper task.
SPEECH_FIELDS = {"language": "language", "task": "task", "prompt": "prompt",
                 "compression_ratio_threshold": "compression_ratio_threshold",
                 "logprob_threshold": "logprob_threshold", "no_speech_threshold": "no_speech_threshold",
                 "condition_on_prev_tokens": "condition_on_prev_tokens", "temperature": "temperature",
                 "do_sample": "temperature"}


def request_field(request, setting: str | None) -> str | None:
    """The field of a generation request (EngineRequest) an engine error about `setting` is about."""
    if setting is None:
        return None
    if setting == "prompt":
        return "messages" if request.messages is not None else "prompt"
    if setting == "eos_token_id" and request.stop_token_ids and "eos_token_id" not in request.settings:
        return "stop_token_ids"
    return SETTING_FIELDS.get(setting, f"settings.{setting}")


def speech_field(setting: str | None) -> str:
    """The field of a transcription request an engine error about `setting` is about (else the file)."""
    if setting is None:
        return "file"
    return SPEECH_FIELDS.get(setting, f"settings.{setting}")


def refused(error: ValueError, field: str | None) -> Refused:
    """The Refused of an engine error about `field`. An engine error's sentence has its setting
    as its subject ("temperature must be ...", "top_k: ..."); the request's field takes that
    place where the request names the setting otherwise ("stop_token_ids names token id ..."),
    the rest of the engine's words kept. A message whose subject is not the setting stays whole."""
    setting, message = getattr(error, "setting", None), str(error)
    if field is None or setting is None or not _subject(message, setting):
        return Refused(message, field, message=message)
    predicate = message[len(setting):]
    return Refused(predicate.removeprefix(": ").strip(), field, predicate=predicate)


def _subject(message: str, setting: str) -> bool:
    """Whether `message` begins with the name `setting` as a word ("top_k: ...", "top_k must",
    "structured_outputs.grammar: ..."; not "prompts[0] ...")."""
    rest = message[len(setting):]
    return message.startswith(setting) and (not rest or rest[0] in ":. =[")
