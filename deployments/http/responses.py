"""OpenAI's Responses API, its protocol: the request (ResponseRequest) and the stored response's
shapes. Beside it, each a job of its own, pure data, no Ray:

    responses_conversion.py  a request as the chat request it is (input items as messages,
                             options as a chat body, a chat error's field by its Responses name)
    responses_events.py      the response object, its ending and its typed stream events
    response_runs.py         runs: the decoder called, the store kept, background tasks

A next turn (`previous_response_id`) is the stored conversation plus the new input, rendered
with the chat template as the chat request with those messages is: its tokens are that chat's.
Instructions are not carried from turn to turn (OpenAI's rule); reasoning items given back as
input are left out, as chat templates leave a past turn's thinking out.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from generation.front import limits

from .openai import INT_MAX

# Fields of a chat request the Responses API names otherwise (a request that gives the chat's
# name is told the Responses name).
CHAT_ONLY = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
             "response_format": "text.format", "logprobs": "top_logprobs", "n": None, "stream_options": None,
             "echo": None, "add_generation_prompt": None, "functions": "tools", "function_call": "tool_choice"}
# A chat field's Responses name, for errors the chat validation or the decoder gives.
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # accepted, no effect
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the reasoning comes whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseRequest(BaseModel):
    """POST /v1/responses. Settings beyond OpenAI's (seed, top_k, repetition_penalty, stop,
    chat_template_kwargs, ...) are the chat route's, under the same names."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(max_length=512)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=limits.MAX_MESSAGES)]  # a text: any length
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    max_output_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    include: list[Literal[INCLUDES]] | None = Field(default=None, max_length=len(INCLUDES))
    store: bool = True
    background: bool = False
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=1024)
    # accepted, with no effect on the output
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _no_chat_fields(cls, body):
        """A chat request's field is named with the Responses field it takes (before `input`,
        which a chat body lacks, is missed)."""
        for name, instead in CHAT_ONLY.items():
            if isinstance(body, dict) and name in body:
                raise ValueError(f"{name}: not a field of /v1/responses" + (f"; it takes {instead}" if instead else ""))
        return body


# -- the OpenAPI document's shapes (the routes build them as dicts) ---------------------------------------
class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: from the decoder replica's prefix cache
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    previous_response_id: str | None
    store: bool
    background: bool


class ResponseItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"
