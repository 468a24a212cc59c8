"""An OpenAI request as the decoder's GenerateRequest (deployments/schema.py), and a decoder's
refusal as the OpenAI request's own field.

OpenAI fields map onto transformers' settings: max_tokens -> max_new_tokens, temperature (0 means
greedy), top_p, seed, stop -> stop_strings, logit_bias -> sequence_bias, logprobs / top_logprobs;
presence_penalty and frequency_penalty are the engine's own settings of those names (beyond
transformers: generation.logits.processors.frequency_presence_penalty);
vLLM's stop_token_ids join the eos tokens, min_tokens is min_new_tokens, ignore_eos drops the eos
tokens. Raymuter's own fields (EXTRA_SETTINGS) carry the rest of the generation config
(num_beams, length_penalty, repetition_penalty, no_repeat_ngram_size, top_k, min_p, ...). vLLM's
`priority` is the scheduler's order (GenerateRequest.priority: lower first). The output's
constraint (response_format, structured_outputs, guided_*) is the engine's structured_outputs
setting. The engine validates the settings when it uses them; a refusal comes back naming its
setting, and `for_request` names the request's field instead (stop, not stop_strings).
"""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from generation.front import Refused

from ..schema import GenerateRequest
from .edge import request_id
from .openai import ApiError, ChatCompletionRequest, CompletionRequest, constraint_fields

OpenAIRequest = CompletionRequest | ChatCompletionRequest

# Raymuter's own fields: generation_config settings a request may set besides OpenAI's.
EXTRA_SETTINGS = (
    "top_k", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "repetition_penalty", "no_repeat_ngram_size",
    "min_new_tokens", "min_length", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
    "num_beams", "length_penalty", "early_stopping", "renormalize_logits", "exponential_decay_length_penalty",
    "forced_eos_token_id", "forced_bos_token_id", "remove_invalid_values", "encoder_repetition_penalty",
    "encoder_no_repeat_ngram_size", "prompt_lookup_num_tokens", "max_matching_ngram_size",
)


def structured_outputs(request) -> dict | None:
    """The engine's structured_outputs setting of a request: from response_format (json_object,
    json_schema), structured_outputs or a guided_* field; None when unconstrained."""
    given = constraint_fields(request)
    if not given:
        return None
    name, value = given[0], getattr(request, given[0])
    if name == "response_format":
        return {"json_object": True} if value.type == "json_object" else {"json": value.json_schema.schema_}
    if name == "structured_outputs":
        return value.constraint()
    return {name.removeprefix("guided_"): value}

def settings_of(request: OpenAIRequest) -> dict:
    """The generation settings a request asks for (validated by the engine when used)."""
    settings: dict = {}
    max_tokens = getattr(request, "max_completion_tokens", None)
    max_tokens = request.max_tokens if max_tokens is None else max_tokens
    if max_tokens is not None:
        settings["max_new_tokens"] = max_tokens
    if request.temperature is not None:
        if request.temperature == 0:
            settings["do_sample"] = False
        else:
            settings.update(do_sample=True, temperature=request.temperature)
    if request.top_p is not None:
        settings["top_p"] = request.top_p
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name) is not None:
            settings[name] = getattr(request, name)
    if request.stop is not None:
        settings["stop_strings"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.ignore_eos:
        settings["eos_token_id"] = []  # the decoder adds stop_token_ids to the eos tokens left
    if request.min_tokens is not None:
        settings["min_new_tokens"] = request.min_tokens
    if request.logit_bias:
        settings["sequence_bias"] = [[[int(token)], float(bias)] for token, bias in request.logit_bias.items()]
    constraint = structured_outputs(request)
    if constraint is not None:
        settings["structured_outputs"] = constraint
    for name in EXTRA_SETTINGS:
        value = getattr(request, name)
        if value is None:
            continue
        if name == "sequence_bias":
            value = [[list(ids), bias] for ids, bias in value] + settings.get("sequence_bias", [])
        elif name == "top_k" and value < 0:
            value = 0  # vLLM's -1: off
        elif name == "exponential_decay_length_penalty":
            value = list(value)
        settings[name] = value
    return settings


# the request field each engine setting comes from, where the names differ
_FIELDS = {"max_new_tokens": "max_tokens", "do_sample": "temperature", "stop_strings": "stop",
           "sequence_bias": "logit_bias", "min_new_tokens": "min_tokens", "adapter": "model"}


def field_of(request: OpenAIRequest, setting: str | None) -> str | None:
    """The field of `request` that an engine error about `setting` is about (the request's own
    name for it: logit_bias for sequence_bias, stop for stop_strings, messages for a chat's
    prompt)."""
    if setting is None:
        return None
    if setting == "prompt":
        return "messages" if isinstance(request, ChatCompletionRequest) else "prompt"
    if setting in type(request).model_fields and getattr(request, setting) is not None:
        return setting  # the request named the engine's setting itself
    if setting == "max_new_tokens" and getattr(request, "max_completion_tokens", None) is not None:
        return "max_completion_tokens"
    if setting == "structured_outputs":  # from a constraint field, or tool_choice's grammar of the tools
        given = constraint_fields(request)
        return given[0] if given else "tools" if getattr(request, "tools", None) else setting
    if setting == "eos_token_id":
        return "stop_token_ids" if request.stop_token_ids else "ignore_eos" if request.ignore_eos else None
    return _FIELDS.get(setting, setting)


def for_request(error: ApiError, request: OpenAIRequest, prompt_index: int | None = None) -> ApiError:
    """A decoder's refusal, whose param names a GenerateRequest field ("settings.top_k",
    "prompt", "messages.0.content.1"), as the OpenAI request's own field; the message speaks of
    that field too (stop, not stop_strings): the route's name for the field, then what the
    engine front said of it (`error.predicate`; a message without one stays whole).
    `prompt_index`: which prompt of a list it was."""
    param = error.param
    if param is None:
        return error
    field, spoken = openai_field(param, request, prompt_index)
    if param == "settings.adapter":  # the adapter its model names, unloaded meanwhile
        return ApiError(404, error.message, param="model", kind="invalid_request_error", code="model_not_found")
    message = error.message
    if error.predicate is not None and spoken != param.removeprefix("settings."):
        message = spoken + error.predicate
    if field == param and message == error.message:
        return error
    return ApiError(error.status, message, param=field, kind=error.kind, code=error.code)


def openai_field(param: str, request: OpenAIRequest, prompt_index: int | None) -> tuple[str | None, str]:
    """(the OpenAI request's field, how a message names it) of a GenerateRequest field. Where
    the names are the same thing said otherwise (prompt and messages, logprobs and top_logprobs)
    the message keeps the engine's name."""
    chat = isinstance(request, ChatCompletionRequest)
    if param.startswith("settings."):
        setting = param.removeprefix("settings.")
        field = field_of(request, setting)
        return field, field or setting
    if param == "prompt":
        return ("messages" if chat else "prompt" if prompt_index is None else f"prompt.{prompt_index}"), param
    if param == "logprobs":
        return ("top_logprobs" if chat and request.top_logprobs else "logprobs"), param
    if param == "prompt_logprobs":
        return "echo", "echo with logprobs"
    return param, param


def wants_logprobs(request: OpenAIRequest) -> int | None:
    """None, or how many alternatives each token's log-probability comes with (0: just its own)."""
    if request.logprobs is None or request.logprobs is False:  # not `in (None, False)`: completions' 0 == False
        if request.top_logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set", param="top_logprobs")
        return None
    if not isinstance(request.logprobs, bool):  # the legacy completions form: an int
        return request.logprobs
    return request.top_logprobs or 0


def generate_request(request: OpenAIRequest, prompt=None, index: int = 0, adapter: str | None = None,
                     adapter_path: str | None = None) -> dict:
    """The decoder's GenerateRequest fields for choice `index` of `prompt` (one of the
    request's prompts; chat: its messages). Choice j of a seeded request takes seed + j.
    `adapter`: the LoRA adapter the request's `model` names (the engine's `adapter` setting), and
    where it lives (`adapter_path`: a decoder replica that does not know it reads it there)."""
    settings = settings_of(request)
    if adapter is not None:
        settings["adapter"] = adapter
    body: dict = {"settings": settings, "logprobs": wants_logprobs(request),
                  "stop_token_ids": request.stop_token_ids, "priority": request.priority}
    if adapter_path is not None:
        body["adapter_path"] = adapter_path
    if request.seed is not None:
        body["seed"] = (request.seed + index) % 2**63
    if isinstance(request, ChatCompletionRequest):
        body["messages"] = [m.model_dump(exclude_none=True) for m in request.messages]
        body["add_generation_prompt"] = request.add_generation_prompt
        if request.chat_template_kwargs:
            body["chat_template_kwargs"] = request.chat_template_kwargs
        if request.tools:  # with "none" too: the decoder checks their schemas, and leaves them out of the prompt
            choice = request.tool_choice
            body.update(tools=request.tools, tool_choice=choice.model_dump() if isinstance(choice, BaseModel)
                        else choice or "auto", parallel_tool_calls=request.parallel_tool_calls is not False)
    else:
        body["prompt"] = prompt
        body["add_special_tokens"] = request.add_special_tokens
        if request.echo and request.logprobs is not None:
            body["prompt_logprobs"] = request.logprobs
    return body


def typed(request: GenerateRequest | dict) -> GenerateRequest:
    """A GenerateRequest, from its fields (generate_request's, or a handle caller's dict); a bad
    one is an ApiError naming its field."""
    if isinstance(request, GenerateRequest):
        return request
    try:
        return GenerateRequest.checked(request)
    except Refused as e:
        raise ApiError(400, str(e), param=e.field, predicate=e.predicate) from None


def with_id(request: GenerateRequest) -> GenerateRequest:
    """The request with a request id (Serve's, or a random one) where it came without."""
    return request if request.request_id else replace(request, request_id=request_id())
