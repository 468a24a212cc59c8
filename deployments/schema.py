"""The typed requests and responses of the Python handle API (pydantic, no arrays).

    handle = serve.get_app_handle("raymuter")
    response = await handle.generate.remote(GenerateRequest(prompt="Once", settings={"max_new_tokens": 8}))
    async for chunk in handle.options(stream=True).generate_stream.remote(GenerateRequest(prompt="Once")):
        print(chunk.text, end="")

The same shapes travel between the ingress and the decoder deployment, so the HTTP routes and
the handles run one code path.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Message(BaseModel):
    """A chat message; `content` is text, or OpenAI's list of parts ({"type": "text", ...})."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None


class GenerateRequest(BaseModel):
    """One generation: a prompt (text or token ids) or chat messages (rendered with the model's
    chat template), generation settings (any generation_config.json field, validated by the
    engine), a seed (None: the server picks one), and log-probabilities on request (None: none;
    0: each token's own; k: also the k most likely tokens of each step). `stop_token_ids` end
    the generation as eos tokens do. `echo`: the response carries the prompt's text, and with
    `prompt_logprobs` (k alternatives) each prompt token's log-probability (None for the first).
    A refusal's `field` names a field of this request ("settings.top_k", "messages.0.content")."""

    model_config = ConfigDict(extra="forbid")

    prompt: str | list[int] | None = None
    messages: list[Message] | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    add_special_tokens: bool = True
    stop_token_ids: list[int] | None = None
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    chat_template_kwargs: dict[str, Any] | None = None  # messages: more of the chat template's variables
    # messages: OpenAI's tools, given to the template; tool_choice "auto" reads calls out of the output,
    # "required" or {"type": "function", "function": {"name": ...}} holds it to calls ("none": no tools)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)
    request_id: str | None = None
    # the decoder replica this request would rather run on (a stored response's: its prefix cache
    # holds the conversation); the prefix router sends it there unless that replica is far busier
    affinity: str | None = Field(default=None, max_length=128)
    # the scheduler's order (vLLM's `priority`): lower first; 0 interactive, batch rows above it
    # wait for interactive ones and give their slots up to them (preempted and resumed exactly)
    priority: int = Field(default=0, ge=0, le=1_000_000)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class TokenLogprob(BaseModel):
    """A token, its text, its log-probability, and the step's best alternatives."""

    id: int
    text: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None = None


class GenerateChunk(BaseModel):
    """A piece of a streamed generation: the new text and token ids since the last chunk. The
    last chunk has `finish_reason` ("stop", "length", "cancelled", "error", or "rejected": the
request was refused before it ran) and the counts."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None  # "rejected": 400 (bad input, `field` names it) or 503 (busy); "error": 400 or 500
    field: str | None = None
    predicate: str | None = None  # what `error` says of `field` after its name (a route names the field its own way)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # in the last chunk: prompt tokens that came from the prefix cache
    prompt_text: str | None = None  # echo: in the first chunk
    prompt_logprobs: list[TokenLogprob] | None = None  # echo with prompt_logprobs: in the first chunk (the
    # first token's logprob is None: nothing comes before it)
    tool_calls: list[dict] | None = None  # tools: the calls read out of the output, in the last chunk
    reasoning: str = ""  # a thinking model's chat: its reasoning since the last chunk (`text` is the answer's)
    replica: str | None = None  # in the last chunk: the decoder replica that ran it (GenerateRequest.affinity)


class GenerateResponse(BaseModel):
    """A whole generation."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens that came from the decoder replica's prefix cache
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None
    status: int | None = None
    field: str | None = None
    predicate: str | None = None  # what `error` says of `field` after its name (a route names the field its own way)
    prompt_text: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    tool_calls: list[dict] | None = None  # OpenAI's: [{"id", "type": "function", "function": {"name", "arguments"}}]
    reasoning: str | None = None  # a thinking model's chat: its reasoning apart from the answer (`text`)
    replica: str | None = None  # the decoder replica that ran it (GenerateRequest.affinity)


class EmbedRequest(BaseModel):
    """Embeddings of texts or token-id lists (handle.embed.remote(EmbedRequest(inputs=[...])));
    `dimensions` keeps the first that many of each (normalized again when the model normalizes)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] | list[list[int]] = Field(min_length=1)
    dimensions: int | None = Field(default=None, ge=1)
    request_id: str | None = None


class EmbedResponse(BaseModel):
    """One vector per input, in order, and the tokens they took; a refusal's `error`, `status`
    and `field` as a Refusal's."""

    embeddings: list[list[float]] = Field(default_factory=list)
    prompt_tokens: int = 0
    error: str | None = None
    status: int | None = None
    field: str | None = None
    predicate: str | None = None  # what `error` says of `field` after its name (a route names the field its own way)


class ModelCard(BaseModel):
    """What the decoder serves (GET /v1/models)."""

    id: str
    context_length: int | None
    slots: int
    kind: str  # "decoder", "encoder-decoder" or "embedding"
    has_chat_template: bool
    fingerprint: str = ""  # OpenAI's system_fingerprint: the version and the model's configuration


class Tokenized(BaseModel):
    """/tokenize's answer: the token ids, and their texts when asked."""

    tokens: list[int]
    token_strs: list[str] | None = None


class TranscriptionRequest(BaseModel):
    """Whisper over an uploaded clip: the language (None: detected), the task, timestamps
    (segments with start and end seconds), a sampling temperature (0: greedy; a list: the
    temperatures of the fallback, as transformers' generate(temperature=(...))), a previous-text
    `prompt` (transformers' prompt_ids), Whisper's long-form options (None: the model's
    generation_config.json), generation settings and a seed."""

    model_config = ConfigDict(extra="forbid")

    language: str | None = Field(default=None, max_length=64)
    task: Literal["transcribe", "translate"] = "transcribe"
    timestamps: bool = False
    temperature: float | list[float] = Field(default=0.0)
    prompt: str | None = Field(default=None, max_length=4096)
    compression_ratio_threshold: float | None = Field(default=None, ge=0, le=1e6)
    logprob_threshold: float | None = Field(default=None, ge=-1e6, le=0)
    no_speech_threshold: float | None = Field(default=None, ge=0, le=1)
    condition_on_prev_tokens: bool | None = None
    settings: dict[str, Any] = Field(default_factory=dict)
    seed: int | None = Field(default=None, ge=0, lt=2**63)

    @field_validator("temperature")
    @classmethod
    def _temperatures(cls, value):
        values = value if isinstance(value, list) else [value]
        if not 1 <= len(values) <= 16 or not all(0 <= t <= 2 for t in values):
            raise ValueError("temperature: a number from 0 to 2, or a list of 1 to 16 of them")
        return value


class Segment(BaseModel):
    id: int
    start: float
    end: float
    text: str
    tokens: list[int]


class Transcription(BaseModel):
    text: str
    tokens: list[int]
    duration: float
    language: str | None = None
    segments: list[Segment] | None = None


class Refusal(BaseModel):
    """A request the decoder refused before running it: 400 (bad input; `field` names it) or
    503 (busy)."""

    error: str
    status: int
    field: str | None = None
    predicate: str | None = None  # what `error` says of `field` after its name (a route names the field its own way)
