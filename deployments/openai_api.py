"""The OpenAI-compatible request and response shapes, and how a request maps onto the engine.

Pure data, no Ray and no arrays: the ingress validates a body into `CompletionRequest` /
`ChatCompletionRequest` (pydantic), turns it into generation settings with `settings_of`, and
builds the response from the engine's tokens with `completion_response`. Every rejection is an
`ApiError` that renders as OpenAI's error body, naming the field.

OpenAI fields map onto transformers' settings: max_tokens -> max_new_tokens, temperature (0 means
greedy), top_p, seed, stop -> stop_strings, logprobs / top_logprobs. Raymuter's own fields carry
the rest of the generation config (num_beams, length_penalty, repetition_penalty,
no_repeat_ngram_size, min_new_tokens, top_k, min_p, ...). presence_penalty and
frequency_penalty have no transformers processor: a non-zero value is refused, not ignored.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

# Raymuter's own fields: generation_config settings a request may set besides OpenAI's.
EXTRA_SETTINGS = (
    "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size",
    "min_new_tokens", "min_length", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "num_beams", "length_penalty", "early_stopping", "renormalize_logits", "exponential_decay_length_penalty",
    "forced_eos_token_id", "forced_bos_token_id", "remove_invalid_values", "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size", "prompt_lookup_num_tokens", "max_matching_ngram_size",
)


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def __reduce__(self):  # crosses Ray's process boundary intact (handle callers get it)
        return type(self), (self.status, self.message, self.param, self.kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=16)
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # Raymuter's own (see EXTRA_SETTINGS)
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None
    min_new_tokens: int | None = None
    min_length: int | None = None
    bad_words_ids: list[list[int]] | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    sequence_bias: list[tuple[list[int], float]] | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | Literal["never"] | None = None
    renormalize_logits: bool | None = None
    exponential_decay_length_penalty: tuple[int, float] | None = None
    forced_eos_token_id: int | list[int] | None = None
    forced_bos_token_id: int | None = None
    remove_invalid_values: bool | None = None
    encoder_repetition_penalty: float | None = None
    encoder_no_repeat_ngram_size: int | None = None
    prompt_lookup_num_tokens: int | None = None  # prompt lookup decoding: same tokens, fewer model steps
    max_matching_ngram_size: int | None = None
    ignore_eos: bool = False  # vLLM's: generate to max_tokens whatever the eos token

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_additive_penalties(cls, value: float, info) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} has no transformers processor; use repetition_penalty "
                             "(multiplicative, as transformers) or no_repeat_ngram_size")
        return value


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text, or token ids)."""

    prompt: str | list[int]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages, rendered with the model folder's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def parse(kind: type[_Request], body: dict) -> _Request:
    """Validate a JSON body; the first problem becomes an ApiError naming its field."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] == "extra_forbidden":
            message = f"unknown field '{field}'"
        raise ApiError(400, f"{field}: {message}" if field else message, param=field) from None


def settings_of(request: _Request, context_length: int | None = None, prompt_length: int = 0) -> dict:
    """The generation settings a request asks for (validated by the engine when used)."""
    settings: dict = {}
    if getattr(request, "max_completion_tokens", None) is not None:
        request = request.model_copy(update={"max_tokens": request.max_completion_tokens})
    if request.max_tokens is not None:
        if context_length and prompt_length + request.max_tokens > context_length:
            raise ApiError(400, f"max_tokens: {request.max_tokens} new tokens after a prompt of {prompt_length} "
                                f"exceed the model's context of {context_length} tokens", param="max_tokens")
        settings["max_new_tokens"] = request.max_tokens
    if request.temperature is not None:
        if request.temperature == 0:
            settings["do_sample"] = False
        else:
            settings.update(do_sample=True, temperature=request.temperature)
    if request.top_p is not None:
        settings["top_p"] = request.top_p
    if request.stop is not None:
        settings["stop_strings"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.ignore_eos:
        settings["eos_token_id"] = []
    if request.logit_bias:
        try:
            settings["sequence_bias"] = [[[int(token)], float(bias)] for token, bias in request.logit_bias.items()]
        except ValueError:
            raise ApiError(400, "logit_bias: keys must be token ids", param="logit_bias") from None
    for name in EXTRA_SETTINGS:
        value = getattr(request, name)
        if value is not None:
            settings[name] = [list(pair) for pair in value] if name == "sequence_bias" else value
    return settings


def wants_logprobs(request: _Request) -> int | None:
    """None, or how many alternatives each token's log-probability comes with (0: just its own)."""
    if request.logprobs in (None, False):
        if request.top_logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set", param="top_logprobs")
        return None
    if isinstance(request.logprobs, int) and not isinstance(request.logprobs, bool):  # the legacy completions form
        return request.logprobs
    return request.top_logprobs or 0


def completion_response(request_id: str, model: str, text: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, chat: bool = False, logprobs: dict | None = None) -> dict:
    """The body of a finished completion (`chat`: a chat.completion)."""
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
             "total_tokens": prompt_tokens + completion_tokens}
    reason = {"cancelled": "stop", "error": "stop"}.get(finish_reason, finish_reason)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                  "logprobs": logprobs}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model, "choices": [choice],
            "usage": usage}


def generate_request(request: _Request, index: int = 0) -> dict:
    """The decoder's GenerateRequest fields for choice `index` of an OpenAI request (choice i
    of a seeded request with n > 1 takes seed + i)."""
    body: dict = {"settings": settings_of(request), "logprobs": wants_logprobs(request)}
    if request.seed is not None:
        body["seed"] = (request.seed + index) % 2**63
    if isinstance(request, ChatCompletionRequest):
        body["messages"] = [m.model_dump(exclude_none=True) for m in request.messages]
    else:
        body["prompt"] = request.prompt
    return body


def completion_logprobs(tokens: list[dict], chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object from the decoder's TokenLogprob dicts: chat's `content` list, or
    the legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    if not tokens:
        return {"content": []} if chat else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if chat:
        return {"content": [{"token": t["text"], "logprob": t["logprob"], "bytes": list(t["text"].encode()),
                             "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}
                                              for _, text, lp in (t.get("top") or [])]} for t in tokens]}
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t["text"])
    return {"tokens": [t["text"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{text: lp for _, text, lp in (t.get("top") or [])} for t in tokens],
            "text_offset": offsets}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason ("stop" or "length") of the decoder's."""
    return None if reason is None else "length" if reason == "length" else "stop"


def stream_chunk(request_id: str, model: str, created: int, index: int, text: str, reason: str | None,
                 chat: bool, logprobs: dict | None = None, first: bool = False) -> dict:
    """One server-sent event's body."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model, "choices": [choice]}
