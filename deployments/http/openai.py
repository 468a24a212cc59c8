"""The OpenAI-compatible request and response shapes, and how a request maps onto the engine.

Pure data, no Ray and no arrays: the ingress checks a body (`check_json`: depth, strings),
validates it into `CompletionRequest` / `ChatCompletionRequest` (pydantic), turns it into
generation settings with `settings_of`, and builds the response from the engine's tokens with
`completion_response`. Every rejection is an `ApiError` that renders as OpenAI's error body,
naming the request's own field (`logit_bias`, `stop`, `messages.0.content.1.image_url`).

OpenAI fields map onto transformers' settings: max_tokens -> max_new_tokens, temperature (0 means
greedy), top_p, seed, stop -> stop_strings, logit_bias -> sequence_bias, logprobs / top_logprobs;
vLLM's stop_token_ids join the eos tokens, min_tokens is min_new_tokens, ignore_eos drops the eos
tokens. Raymuter's own fields carry the rest of the generation config (num_beams, length_penalty,
repetition_penalty, no_repeat_ngram_size, top_k, min_p, ...). Fields that do not change the
output (store, metadata, user, service_tier, parallel_tool_calls, response_format text) are
accepted; one that would and is not supported (presence_penalty, suffix, best_of > n) is refused
by name. Chat takes tools (tool_choice none, auto, required or a named function;
generation.text.tools). The output's constraint comes from response_format (json_object, json_schema),
vLLM's structured_outputs or its older guided_json / guided_regex / guided_choice /
guided_grammar: one per request, the engine's structured_outputs setting.

Every number has its range here (generation.core.limits), so the OpenAPI document states them and no
request can reach the engine with a value it cannot hold; the engine checks what depends on the
model (token ids against its vocabulary, lengths against its context).
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

from generation.core import limits

INT_MAX = 2**31 - 1  # the largest count or length a request may give (the model's context is far below)
TOKEN_ID = Annotated[int, Field(ge=0, le=INT_MAX)]
MAX_DEPTH = 32  # JSON nesting of a body (a chat message with parts is 6 deep)

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

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code

    def __reduce__(self):  # crosses Ray's process boundary intact (handle callers get it)
        return type(self), (self.status, self.message, self.param, self.kind, self.code)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# -- a body before validation ---------------------------------------------------------------------
def check_json(value, path: str = "", depth: int = 0) -> None:
    """ApiError 400 for a body nested deeper than MAX_DEPTH or holding a string that is not
    valid Unicode (a lone surrogate, which JSON's \\ud800 escapes allow): neither can reach the
    tokenizer, the chat template or Ray's serialization. Iterative, so no nesting overflows it."""
    stack = [(value, path, depth)]
    while stack:
        item, where, level = stack.pop()
        if level > MAX_DEPTH:
            raise ApiError(400, f"{where or 'the body'}: nested more than {MAX_DEPTH} levels deep",
                           param=where or None)
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where or 'the body'}: not valid Unicode (a lone surrogate escape)",
                               param=where or None) from None
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                stack.append((key, where, level + 1))
                stack.append((child, child_path, level + 1))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                stack.append((child, f"{where}.{i}" if where else str(i), level + 1))


# -- requests -----------------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's; usage comes once, at the end


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema: the schema the output follows (strict or not: it is
    always held to the schema)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="response", max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs its json_schema: {\"name\": ..., \"schema\": {...}}")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"json_schema is given with type '{self.type}'; set type to 'json_schema'")
        return self


class FunctionName(BaseModel):
    name: str = Field(max_length=64)


class NamedToolChoice(_Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: a call of that function."""

    type: Literal["function"]
    function: FunctionName


GRAMMAR_TEXT = Annotated[str, Field(min_length=1, max_length=limits.MAX_GRAMMAR_LENGTH)]
CHOICES = Annotated[list[Annotated[str, Field(min_length=1, max_length=limits.MAX_GRAMMAR_LENGTH)]],
                    Field(min_length=1, max_length=limits.MAX_CONSTRAINT_CHOICES)]


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: exactly one constraint."""

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: GRAMMAR_TEXT | None = None
    choice: CHOICES | None = None
    grammar: GRAMMAR_TEXT | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, "json_" if name == "json" else name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar or json_object, not "
                             f"{', '.join(given) or 'none'}")
        return self

    def constraint(self) -> dict:
        """The engine's structured_outputs setting."""
        if self.json_ is not None:
            return {"json": self.json_}
        if self.json_object:
            return {"json_object": True}
        name = next(n for n in ("regex", "choice", "grammar") if getattr(self, n) is not None)
        return {name: getattr(self, name)}


STOP = Annotated[str, Field(min_length=1, max_length=limits.MAX_STOP_LENGTH)]
UNIT = Annotated[float, Field(ge=0, le=1)]
POSITIVE = Annotated[float, Field(gt=0, le=limits.MAX_FLOAT)]


class _Request(_Strict):
    model: str = Field(max_length=512)
    # 0: a prompt-only pass: no token; the prompt's blocks stay in the decoder replica's prefix cache
    # (a later request that starts with it runs only its rest), and echo with logprobs scores it
    max_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=limits.MAX_CHOICES)
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # a negative one (int64, as vLLM) wraps
    stop: STOP | list[STOP] | None = Field(default=None, max_length=limits.MAX_STOP_STRINGS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[Annotated[str, Field(pattern=r"^\d{1,10}$")],
                     Annotated[float, Field(ge=-limits.MAX_BIAS, le=limits.MAX_BIAS)]] | None = \
        Field(default=None, max_length=limits.MAX_SEQUENCES)
    top_logprobs: int | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    # accepted, with no effect on the output
    user: str | None = Field(default=None, max_length=1024)
    store: bool | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = \
        Field(default=None, max_length=16)
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = Field(default=None, max_length=128)  # chat only
    # structured outputs (one constraint per request, from whichever field gives it): vLLM's
    # structured_outputs and its older guided_* fields, beside OpenAI's response_format
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: GRAMMAR_TEXT | None = None
    guided_choice: CHOICES | None = None
    guided_grammar: GRAMMAR_TEXT | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    # vLLM's
    stop_token_ids: list[TOKEN_ID] | None = Field(default=None, max_length=limits.MAX_SEQUENCES)
    min_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    ignore_eos: bool = False  # generate to max_tokens whatever the eos token
    # Raymuter's own (see EXTRA_SETTINGS)
    top_k: int | None = Field(default=None, ge=-1, le=INT_MAX)  # -1 or 0: off (vLLM's -1)
    min_p: UNIT | None = None
    typical_p: float | None = Field(default=None, gt=0, le=1)
    epsilon_cutoff: float | None = Field(default=None, ge=0, lt=1)
    eta_cutoff: float | None = Field(default=None, ge=0, lt=1)
    repetition_penalty: POSITIVE | None = None
    no_repeat_ngram_size: int | None = Field(default=None, ge=0, le=limits.MAX_NGRAM_SIZE)
    min_new_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    min_length: int | None = Field(default=None, ge=0, le=INT_MAX)
    bad_words_ids: list[Annotated[list[TOKEN_ID], Field(min_length=1, max_length=limits.MAX_SEQUENCE_LENGTH)]] | None \
        = Field(default=None, min_length=1, max_length=limits.MAX_SEQUENCES)
    suppress_tokens: list[TOKEN_ID] | None = Field(default=None, max_length=2**18)
    begin_suppress_tokens: list[TOKEN_ID] | None = Field(default=None, max_length=2**18)
    sequence_bias: list[tuple[Annotated[list[TOKEN_ID], Field(min_length=1, max_length=limits.MAX_SEQUENCE_LENGTH)],
                              Annotated[float, Field(ge=-limits.MAX_BIAS, le=limits.MAX_BIAS)]]] | None = \
        Field(default=None, min_length=1, max_length=limits.MAX_SEQUENCES)
    num_beams: int | None = Field(default=None, ge=1, le=limits.MAX_BEAMS)
    length_penalty: float | None = Field(default=None, ge=-limits.MAX_FLOAT, le=limits.MAX_FLOAT)
    early_stopping: bool | Literal["never"] | None = None
    renormalize_logits: bool | None = None
    exponential_decay_length_penalty: tuple[Annotated[int, Field(ge=0, le=INT_MAX)], POSITIVE] | None = None
    forced_eos_token_id: TOKEN_ID | Annotated[list[TOKEN_ID], Field(max_length=limits.MAX_SEQUENCES)] | None = None
    forced_bos_token_id: TOKEN_ID | None = None
    remove_invalid_values: bool | None = None
    encoder_repetition_penalty: POSITIVE | None = None
    encoder_no_repeat_ngram_size: int | None = Field(default=None, ge=0, le=limits.MAX_NGRAM_SIZE)
    prompt_lookup_num_tokens: int | None = Field(default=None, ge=1, le=limits.MAX_LOOKUP_TOKENS)
    max_matching_ngram_size: int | None = Field(default=None, ge=1, le=limits.MAX_MATCHING_NGRAM_SIZE)

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_additive_penalties(cls, value: float, info) -> float:
        if value != 0:
            raise ValueError(f"{info.field_name} has no transformers processor; use repetition_penalty "
                             "(multiplicative, as transformers) or no_repeat_ngram_size")
        return value

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None):
        if value:
            from generation.text.tools import ToolError, check_tools

            try:
                check_tools(value)
            except ToolError as e:
                raise ValueError(str(e)) from None
        return value

    @model_validator(mode="after")
    def _tool_choice_of_the_tools(self):
        choice = self.tool_choice
        if self.tools and not isinstance(self, ChatCompletionRequest):
            raise ValueError("tools: tool calling takes /v1/chat/completions")
        if isinstance(choice, NamedToolChoice) or choice == "required":
            if not self.tools:
                raise ValueError("tool_choice: a named function or \"required\" needs tools")
            names = [t["function"]["name"] for t in self.tools]
            if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
                raise ValueError(f"tool_choice: '{choice.function.name}' is not one of the tools ({', '.join(names)})")
            other = constraint_fields(self)
            if other:
                raise ValueError(f"tool_choice: \"required\" or a named function holds the output to tool calls, "
                                 f"and {other[0]} already constrains it")
        return self

    @model_validator(mode="after")
    def _one_constraint(self):
        given = constraint_fields(self)
        if len(given) > 1:
            raise ValueError(f"{given[1]}: a request takes one constraint, and {given[0]} already gives one")
        return self


CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar")


def constraint_fields(request) -> list[str]:
    """The fields of `request` that constrain its output (response_format text does not)."""
    found = []
    for name in CONSTRAINT_FIELDS:
        value = getattr(request, name)
        if value is None or name == "response_format" and value.type == "text":
            continue
        found.append(name)
    return found


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


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text or token ids), or a list of them (each gets `n`
    choices: choice j of prompt i is index i * n + j, as OpenAI numbers them)."""

    prompt: (Annotated[str, Field(max_length=2**26)] | Annotated[list[TOKEN_ID], Field(max_length=2**24)]
             | Annotated[list[Annotated[str, Field(max_length=2**26)]], Field(min_length=1, max_length=limits.MAX_PROMPTS)]
             | Annotated[list[Annotated[list[TOKEN_ID], Field(max_length=2**24)]],
                         Field(min_length=1, max_length=limits.MAX_PROMPTS)])
    echo: bool = False
    logprobs: Annotated[int, Strict()] | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)  # not a bool
    add_special_tokens: bool = True  # vLLM's: the tokenizer's bos/eos around a text prompt
    suffix: None = None  # insertion (text after the completion) is not supported
    best_of: int | None = Field(default=None, ge=1, le=limits.MAX_CHOICES)

    @model_validator(mode="after")
    def _best_of_is_n(self):
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: only best_of = n is supported (each choice is returned)")
        return self

    def prompts(self) -> list:
        """The request's prompts: one text or token-id list each."""
        if isinstance(self.prompt, str) or not self.prompt or isinstance(self.prompt[0], int):
            return [self.prompt]
        return list(self.prompt)


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    detail: Literal["auto", "low", "high"] | None = None


class VideoURL(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str


VIDEO_FRAMES = Annotated[list[str], Field(min_length=1, max_length=limits.MAX_VIDEO_FRAMES)]


class ContentPart(BaseModel):
    """A part of a message's content: text, an image as a data URL (http(s) where the server
    allows remote images), or a video: vLLM's video_url (a video file's data URL), or transformers'
    {"type": "video", "video": [frame data URLs, ...]} (or one video file's URL)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url", "video_url", "video"]
    text: str | None = None
    image_url: ImageURL | str | None = None
    video_url: VideoURL | str | None = None
    video: VIDEO_FRAMES | str | None = None

    @model_validator(mode="after")
    def _has_its_content(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its text")
        if self.type == "image_url" and self.image_url is None:
            raise ValueError("an image_url part needs its image_url ({\"url\": \"data:image/png;base64,...\"})")
        if self.type == "video_url" and self.video_url is None:
            raise ValueError("a video_url part needs its video_url ({\"url\": \"data:video/mp4;base64,...\"})")
        if self.type == "video" and self.video is None:
            raise ValueError("a video part needs its video: its frames as image data URLs "
                             "([\"data:image/png;base64,...\", ...]) or a video file's URL")
        return self


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | Annotated[list[ContentPart], Field(max_length=1024)] | None = None
    name: str | None = Field(default=None, max_length=256)


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions: messages, rendered with the model folder's chat template."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=limits.MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    logprobs: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)  # the template's variables
    add_generation_prompt: bool = True  # vLLM's

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_the_messages(cls, value: dict | None):
        if value and {"messages", "add_generation_prompt"} & set(value):
            raise ValueError("messages and add_generation_prompt are the request's own fields, not template variables")
        return value


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a prompt, or messages through the chat template."""

    model: str | None = Field(default=None, max_length=512)
    prompt: Annotated[str, Field(max_length=2**26)] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=limits.MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template places them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = Field(default=None, max_length=512)
    tokens: list[TOKEN_ID] = Field(max_length=2**24)


# -- responses (the OpenAPI document's; the routes build them as dicts) ---------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the replica's prefix cache held (not computed again)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobContent(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobContent] | None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class ModelInfo(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    context_length: int | None
    slots: int
    kind: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelInfo]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class Transcription(BaseModel):
    text: str


def _clock(seconds: float, mark: str) -> str:
    """hh:mm:ss<mark>mmm, as subtitle files write a time."""
    millis = max(0, round(seconds * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{mark}{rest % 1000:03d}"


def subtitles(segments, kind: str) -> str:
    """Segments (start, end, text) as an SRT or WebVTT file, as OpenAI's response_format srt / vtt."""
    cues = [(s.start, s.end, s.text.strip()) for s in segments]
    if kind == "srt":
        return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t}\n\n" for i, (a, b, t) in enumerate(cues, 1))
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{t}\n\n" for a, b, t in cues)


# -- validation --------------------------------------------------------------------------------------
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple", "any", "bytes"}


def field_path(loc) -> str | None:
    """A pydantic error location as the request's dotted field: union members' tags
    ('str', 'list[int]', 'ImageURL') and dict-key markers left out ('stop.str' -> 'stop')."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif not ("[" in part or "-" in part or part in _TYPE_TAGS or part[:1].isupper()):
            parts.append(part)
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> ApiError:
    """The first problem of pydantic's errors (`ValidationError.errors()`) as an ApiError naming
    its field. Where a union failed on every member, a member's specific complaint (a string too
    long) beats "not a valid string"; where all are type mismatches, they are listed together."""
    field = field_path(errors[0]["loc"])
    same = [e for e in errors if field_path(e["loc"]) == field or
            (field_path(e["loc"]) or "").startswith(f"{field}.")]
    specific = [e for e in same if not e["type"].endswith("_type") and e["type"] not in ("int_parsing", "float_parsing")]
    if specific:
        chosen = specific[0]
        field, message = field_path(chosen["loc"]), chosen["msg"]
    else:
        chosen = same[0]
        message = " or ".join(dict.fromkeys(e["msg"] for e in same))
    message = message.removeprefix("Value error, ")
    if chosen["type"] == "extra_forbidden":
        message = f"unknown field '{field}'"
    named = re.match(r"^([a-z_]+): ", message) if field is None else None
    if named:  # a check across fields that names the one at fault first (best_of, a second constraint)
        return ApiError(400, message, param=named.group(1))
    return ApiError(400, f"{field}: {message}" if field else message, param=field)


def parse(kind: type[BaseModel], body: dict):
    """Validate a JSON body; the first problem becomes an ApiError naming its field."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None


# -- the engine's settings ------------------------------------------------------------------------------
def settings_of(request: _Request) -> dict:
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
           "sequence_bias": "logit_bias", "min_new_tokens": "min_tokens"}


def field_of(request: _Request, setting: str | None) -> str | None:
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


def for_request(error: ApiError, request: _Request, prompt_index: int | None = None) -> ApiError:
    """A decoder's refusal, whose param names a GenerateRequest field ("settings.top_k",
    "prompt", "messages.0.content.1"), as the OpenAI request's own field; the message speaks of
    that field too (stop, not stop_strings). `prompt_index`: which prompt of a list it was."""
    param = error.param
    if param is None:
        return error
    chat = isinstance(request, ChatCompletionRequest)
    message = error.message
    if param.startswith("settings."):
        setting = param.removeprefix("settings.")
        field = field_of(request, setting)
        if field and field != setting:
            message = message.replace(setting, field)
    elif param == "prompt":
        field = "messages" if chat else "prompt" if prompt_index is None else f"prompt.{prompt_index}"
    elif param == "logprobs":
        field = "top_logprobs" if chat and request.top_logprobs else "logprobs"
    elif param == "prompt_logprobs":
        field, message = "echo", message.replace("prompt_logprobs", "echo with logprobs")
    else:
        field = param
    if field == param and message == error.message:
        return error
    return ApiError(error.status, message, param=field, kind=error.kind, code=error.code)


def wants_logprobs(request: _Request) -> int | None:
    """None, or how many alternatives each token's log-probability comes with (0: just its own)."""
    if request.logprobs is None or request.logprobs is False:  # not `in (None, False)`: completions' 0 == False
        if request.top_logprobs:
            raise ApiError(400, "top_logprobs: needs logprobs set", param="top_logprobs")
        return None
    if not isinstance(request.logprobs, bool):  # the legacy completions form: an int
        return request.logprobs
    return request.top_logprobs or 0


def generate_request(request: _Request, prompt=None, index: int = 0) -> dict:
    """The decoder's GenerateRequest fields for choice `index` of `prompt` (one of the
    request's prompts; chat: its messages). Choice j of a seeded request takes seed + j."""
    body: dict = {"settings": settings_of(request), "logprobs": wants_logprobs(request),
                  "stop_token_ids": request.stop_token_ids}
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


# -- responses ------------------------------------------------------------------------------------------
def completion_logprobs(tokens: list[dict], chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object from the decoder's TokenLogprob dicts: chat's `content` list, or
    the legacy completions shape (tokens, token_logprobs, top_logprobs, text_offset), whose
    offsets count from `offset` (the characters of the choice's text before these tokens). A
    prompt token echoed has logprob None where it is the first (nothing before it)."""
    if chat:
        return {"content": [{"token": t["text"], "logprob": t["logprob"], "bytes": list(t["text"].encode()),
                             "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}
                                              for _, text, lp in (t.get("top") or [])]} for t in tokens]}
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t["text"])
    return {"tokens": [t["text"] for t in tokens], "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [None if t["logprob"] is None and not t.get("top") else
                             {text: lp for _, text, lp in (t.get("top") or [])} for t in tokens],
            "text_offset": offsets}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason ("stop", "length" or "tool_calls") of the decoder's."""
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


def completion_response(request_id: str, model: str, choices: list[dict], usage: dict, fingerprint: str,
                        chat: bool = False) -> dict:
    """The body of a finished completion (`chat`: a chat.completion); `choices` as
    `completion_choice` gives them."""
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": choices, "usage": usage}


def completion_choice(index: int, text: str, reason: str, logprobs: dict | None, chat: bool,
                      tool_calls: list[dict] | None = None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens as OpenAI's and vLLM's prefix caching report it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def stream_chunk(request_id: str, model: str, created: int, index: int, text: str, reason: str | None,
                 chat: bool, fingerprint: str, logprobs: dict | None = None, first: bool = False,
                 tool_calls: list[dict] | None = None) -> dict:
    """One server-sent event's body; `tool_calls` go as OpenAI's deltas (each call whole, with its
    index)."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": [choice]}


# -- embeddings ------------------------------------------------------------------------------------
EMBEDDING_TEXT = Annotated[str, Field(min_length=1, max_length=2**24)]
EMBEDDING_IDS = Annotated[list[TOKEN_ID], Field(min_length=1, max_length=2**20)]


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (OpenAI's): a text, token ids, or a list of either; `dimensions`
    keeps the first that many of each vector; `encoding_format` base64: each vector's float32
    little-endian bytes, base64-encoded (what the openai client asks by default and decodes)."""

    model: str = Field(max_length=512)
    input: (EMBEDDING_TEXT | EMBEDDING_IDS
            | Annotated[list[EMBEDDING_TEXT], Field(min_length=1, max_length=limits.MAX_EMBEDDING_INPUTS)]
            | Annotated[list[EMBEDDING_IDS], Field(min_length=1, max_length=limits.MAX_EMBEDDING_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1, le=INT_MAX)
    user: str | None = Field(default=None, max_length=256)

    def inputs(self) -> list[str] | list[list[int]]:
        if isinstance(self.input, str):
            return [self.input]
        return [self.input] if self.input and isinstance(self.input[0], int) else list(self.input)


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def embedding_response(model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str) -> dict:
    import base64
    import struct

    def encoded(vector: list[float]):
        if encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
