"""The front's request: what a client asks of the engine, in the engine's own words.

It is also the handle API's request (deployments.schema.GenerateRequest is this class): it
crosses the Ray hop as it is, and checks its own fields when made, so a bad one is refused by
name wherever it was built ("seed", "messages.0.role"). A refusal's field names one of these
fields ("prompt", "messages.0.content.1", "settings.top_k").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from .errors import Refused

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_LOGPROBS, MAX_PRIORITY, MAX_AFFINITY = 20, 1_000_000, 128


@dataclass(frozen=True)
class EngineRequest:
    """One generation: a prompt (text or token ids) or chat messages (dicts, rendered with the
    model's chat template), generation settings (any generation_config.json field), a seed
    (None: the front picks one), log-probabilities on request (None: none; k: each token's and
    the k most likely of each step). `stop_token_ids` end the generation as eos tokens do;
    `tools` (OpenAI's) go to the template, and `tool_choice` other than "auto" holds the output
    to calls by a grammar; `echo` gives the prompt back first (with `prompt_logprobs`).
    `affinity`: the serving replica it would rather run on (a stored response's, whose prefix
    cache holds the conversation); `priority`: the scheduler's order, lower first (vLLM's), 0
    interactive, batch rows above it. `adapter_path`: where the LoRA adapter its `adapter` setting
    names lives (a server's ingress sets it from the names every replica shares: a decoder replica
    that does not know the adapter, or knows another one by that name, loads it from there first)."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None
    add_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    chat_template_kwargs: dict[str, Any] | None = None  # messages: more of the chat template's variables
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    echo: bool = False
    prompt_logprobs: int | None = None
    request_id: str | None = None
    affinity: str | None = None
    priority: int = 0
    adapter_path: str | None = None

    def __post_init__(self):
        check_fields(self, RULES, NOT_NONE)
        check_messages(self)

    @classmethod
    def checked(cls, values: dict) -> "EngineRequest":
        """From a caller's dict (a handle's): a field it does not have is refused by name."""
        return checked(cls, values)

    @property
    def calls_tools(self) -> bool:
        """Its messages come with tools the model may call (tool_choice not "none")."""
        return bool(self.messages is not None and self.tools and self.tool_choice != "none")

    @property
    def stop_strings(self) -> list[str]:
        stops = self.settings.get("stop_strings") or []
        return [stops] if isinstance(stops, str) else list(stops)


def own_fields(kind, values: dict) -> dict:
    """The items of `values` that are fields of the dataclass `kind`."""
    names = {f.name for f in fields(kind)}
    return {k: v for k, v in values.items() if k in names}


def checked(kind, values: dict):
    """The dataclass `kind` made from a caller's dict; a key that is not one of its fields is
    refused by name (a keyword argument's TypeError would not name it as a request's field)."""
    extra = sorted(set(values) - {f.name for f in fields(kind)})
    if extra:
        raise Refused("not a field of the request", extra[0])
    return kind(**values)


def check_fields(request, rules: dict, not_none) -> None:
    """Refuse a malformed field by name (what a typed schema would say, without one): `rules`
    maps a field to (is it well formed, what it must be); a field in `not_none` may not be None."""
    for name, (well_formed, must_be) in rules.items():
        value = getattr(request, name)
        if (value is None and name in not_none) or (value is not None and not well_formed(value)):
            raise Refused(f"must be {must_be}", name)


def integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _ints(value) -> bool:
    return isinstance(value, list) and all(integer(v) for v in value)


def between(low: int, high: int):
    return lambda v: integer(v) and low <= v <= high


# field -> (is it well formed (None aside, where None is allowed), what it must be)
RULES = {
    "prompt": (lambda v: isinstance(v, str) or _ints(v), "a string or a list of token ids"),
    "messages": (lambda v: isinstance(v, list), "a list of messages"),
    "settings": (lambda v: isinstance(v, dict), "an object of generation settings"),
    "seed": (between(0, 2**63 - 1), "an integer from 0 to 2**63 - 1"),
    "logprobs": (between(0, MAX_LOGPROBS), f"an integer from 0 to {MAX_LOGPROBS}"),
    "prompt_logprobs": (between(0, MAX_LOGPROBS), f"an integer from 0 to {MAX_LOGPROBS}"),
    "add_special_tokens": (lambda v: isinstance(v, bool), "true or false"),
    "add_generation_prompt": (lambda v: isinstance(v, bool), "true or false"),
    "parallel_tool_calls": (lambda v: isinstance(v, bool), "true or false"),
    "echo": (lambda v: isinstance(v, bool), "true or false"),
    "stop_token_ids": (_ints, "a list of token ids"),
    "chat_template_kwargs": (lambda v: isinstance(v, dict), "an object"),
    "tools": (lambda v: isinstance(v, list) and all(isinstance(t, dict) for t in v), "a list of tools"),
    "tool_choice": (lambda v: isinstance(v, (str, dict)), 'a string ("auto", "none", "required") or a named function'),
    "request_id": (lambda v: isinstance(v, str), "a string"),
    "affinity": (lambda v: isinstance(v, str) and len(v) <= MAX_AFFINITY, f"a string of at most {MAX_AFFINITY} characters"),
    "priority": (between(0, MAX_PRIORITY), f"an integer from 0 to {MAX_PRIORITY}"),
    "adapter_path": (lambda v: isinstance(v, str) and 0 < len(v) <= 4096, "a path or hub id of at most 4096 characters"),
}
NOT_NONE = {"settings", "add_special_tokens", "add_generation_prompt", "parallel_tool_calls", "echo", "priority"}


def check_messages(request: EngineRequest) -> None:
    """Refuse a request without exactly one input, or a malformed message, by its field."""
    if (request.prompt is None) == (request.messages is None):
        raise Refused("give exactly one of prompt and messages", None)
    for i, message in enumerate(request.messages or []):
        if not isinstance(message, dict):
            raise Refused("must be an object with a role and content", f"messages.{i}")
        if message.get("role") not in ROLES:
            raise Refused(f"must be one of {', '.join(ROLES)}", f"messages.{i}.role")
        if not isinstance(message.get("content"), (str, list, type(None))):
            raise Refused("must be a string, a list of parts or null", f"messages.{i}.content")
