"""The front's request: what a client asks of the engine, in the engine's own words.

A serving layer fills one from its own request shape (deployments' GenerateRequest has the same
field names) and hands it to `EngineFront.stream`; a refusal's field names one of these fields
("prompt", "messages.0.content.1", "settings.top_k").
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class EngineRequest:
    """One generation: a prompt (text or token ids) or chat messages (dicts, rendered with the
    model's chat template), generation settings (any generation_config.json field), a seed
    (None: the front picks one), log-probabilities on request (None: none; k: each token's and
    the k most likely of each step). `stop_token_ids` end the generation as eos tokens do;
    `tools` (OpenAI's) go to the template, and `tool_choice` other than "auto" holds the output
    to calls by a grammar; `echo` gives the prompt back first (with `prompt_logprobs`)."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    seed: int | None = None
    logprobs: int | None = None
    add_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    echo: bool = False
    prompt_logprobs: int | None = None
    request_id: str | None = None
    priority: int = 0  # lower first (engine/scheduler.py): 0 interactive; batch rows above

    @classmethod
    def of(cls, values: dict) -> "EngineRequest":
        """From a dict of these fields (others ignored: a serving shape may carry more)."""
        return cls(**own_fields(cls, values))

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
