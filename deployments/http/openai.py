"""The OpenAI-compatible shapes: the request bodies the routes validate (pydantic), the response
bodies the OpenAPI document names, and `ApiError`, OpenAI's error body.

Pure data, no Ray and no arrays. Where the rest of a request's way goes:

    validation.py   a body checked (depth, strings) and validated into these shapes; the first
                    problem as an ApiError naming the request's own field
    to_decoder.py   a validated request as the decoder's GenerateRequest (settings_of,
                    generate_request), and a decoder refusal as the request's field (for_request)
    answers.py      the response bodies built from the decoder's answers

Fields that do not change the output (store, metadata, user, service_tier, parallel_tool_calls,
response_format text) are accepted; one that would and is not supported (suffix, best_of > n)
is refused by name. presence_penalty and frequency_penalty apply as OpenAI and vLLM define them
(generation.logits.processors.frequency_presence_penalty). Chat takes tools (tool_choice none,
auto, required or a named function; generation.text.tool_calls). The output's constraint comes
from response_format (json_object, json_schema), vLLM's structured_outputs or its older
guided_json / guided_regex / guided_choice / guided_grammar: one per request (constraint_fields).

Every number has its range here (generation.params.limits), so the OpenAPI document states them and no
request can reach the engine with a value it cannot hold; the engine checks what depends on the
model (token ids against its vocabulary, lengths against its context).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from generation.front import limits

INT_MAX = 2**31 - 1  # the largest count or length a request may give (the model's context is far below)
TOKEN_ID = Annotated[int, Field(ge=0, le=INT_MAX)]


class ApiError(Exception):
    """A request the server refuses: HTTP `status` with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, predicate: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.predicate = predicate  # what the message says of `param` after its name (generation.front.Refused)

    def __reduce__(self):  # crosses Ray's process boundary intact (handle callers get it)
        return type(self), (self.status, self.message, self.param, self.kind, self.code, self.predicate)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


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
    # OpenAI's (0: off; null: the model's or server's default), subtracted from the scores of the tokens
    # already generated, as vLLM does
    presence_penalty: float | None = Field(default=None, ge=-limits.MAX_ADDITIVE_PENALTY,
                                           le=limits.MAX_ADDITIVE_PENALTY)
    frequency_penalty: float | None = Field(default=None, ge=-limits.MAX_ADDITIVE_PENALTY,
                                            le=limits.MAX_ADDITIVE_PENALTY)
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
    # the scheduler's order, lower first: 0 (interactive) by default; a batch's lines run at 1, after
    # every interactive request (deployments/services/batches.py)
    priority: int = Field(default=0, ge=0, le=1_000_000)
    stop_token_ids: list[TOKEN_ID] | None = Field(default=None, max_length=limits.MAX_SEQUENCES)
    min_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    ignore_eos: bool = False  # generate to max_tokens whatever the eos token
    # Raymuter's own (to_decoder.EXTRA_SETTINGS)
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

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None):
        return checked_tools(value)

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


def checked_tools(value: list | None) -> list | None:
    """OpenAI's tools, each a function with a name and its parameters' schema (ValueError naming what is wrong)."""
    if value:
        from generation.front import ToolError, check_tools

        try:
            check_tools(value)
        except ToolError as e:
            raise ValueError(str(e)) from None
    return value


class LoadLoraRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's): an adapter's name, which a request's `model` then
    names, and its PEFT folder (on the decoder's machine) or hub id."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraRequest(_Strict):
    """POST /v1/unload_lora_adapter (vLLM's)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None  # vLLM's, accepted and not read


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a prompt, or messages through the chat template (with `tools`
    given to it as a chat gives them)."""

    model: str | None = Field(default=None, max_length=512)
    prompt: Annotated[str, Field(max_length=2**26)] | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=limits.MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template places them)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, max_length=64)
    tools: list[dict] | None = Field(default=None, max_length=128)  # messages only
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.tools and self.messages is None:
            raise ValueError("tools: go with messages (the chat template renders them)")
        return self

    @field_validator("tools")
    @classmethod
    def _tools(cls, value: list | None):
        return checked_tools(value)

    def template_variables(self) -> dict | None:
        """The chat template's variables: chat_template_kwargs, and the tools as a chat gives them."""
        if not self.tools:
            return self.chat_template_kwargs
        return {**(self.chat_template_kwargs or {}), "tools": self.tools}


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids to text."""

    model: str | None = Field(default=None, max_length=512)
    tokens: list[TOKEN_ID] = Field(max_length=2**24)


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
