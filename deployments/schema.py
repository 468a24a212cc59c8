"""The typed requests and responses of the Python handle API (no arrays): a generation's and a
transcription's are the engine front's own dataclasses, the rest pydantic models.

    handle = serve.get_app_handle("raymuter")
    response = await handle.generate.remote(GenerateRequest(prompt="Once", settings={"max_new_tokens": 8}))
    async for event in handle.options(stream=True).generate_stream.remote(GenerateRequest(prompt="Once")):
        print(event.text, end="")  # Deltas, then the Finish (echo: an Echo first, its prompt_text)

The same shapes travel between the ingress and the decoder deployment, so the HTTP routes and
the handles run one code path; a generation's request is the engine front's own EngineRequest.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from generation.front import Delta, Echo, EngineRequest, Finish, Generation, SpeechRequest

__all__ = ["Delta", "Echo", "EmbedRequest", "EmbedResponse", "EngineRequest", "Finish", "GenerateRequest",
           "GenerateResponse", "Generation", "ModelCard", "Segment", "SpeechRequest", "Tokenized",
           "Transcription", "TranscriptionRequest"]


# The handle API's request is the engine front's own (a frozen dataclass that checks its fields
# when made, refusing a bad one by name): it crosses the Ray hop as it is.
GenerateRequest = EngineRequest


# A generation's answer is the front's own too: handle.generate gives a Generation (text,
# token_ids, logprobs, reasoning, echo, finish; the Finish's fields read on it: finish_reason,
# prompt_tokens, completion_tokens, cached_tokens, tool_calls, error, replica), and
# handle.generate_stream the front's events: an Echo (echo only), Deltas (text, token_ids, logprobs,
# reasoning), then one Finish (the text not sent yet, why it ended, the counts, tool calls;
# "rejected" with `error`, `status` and `field`: refused before it ran).
GenerateResponse = Generation


class EmbedRequest(BaseModel):
    """Embeddings of texts or token-id lists (handle.embed.remote(EmbedRequest(inputs=[...])));
    `dimensions` keeps the first that many of each (normalized again when the model normalizes)."""

    model_config = ConfigDict(extra="forbid")

    inputs: list[str] | list[list[int]] = Field(min_length=1)
    dimensions: int | None = Field(default=None, ge=1)
    request_id: str | None = None


class EmbedResponse(BaseModel):
    """One vector per input, in order, and the tokens they took; the handle API's refusal: its
    `error`, `status` and `field` (over HTTP, OpenAI's error)."""

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
    adapters: list[str] = Field(default_factory=list)  # the LoRA adapters a request's `model` may name


class Tokenized(BaseModel):
    """/tokenize's answer: the token ids, and their texts when asked."""

    tokens: list[int]
    token_strs: list[str] | None = None


# The handle API's transcription request is the engine front's own SpeechRequest (refused by
# field when made), as a generation's is its EngineRequest.
TranscriptionRequest = SpeechRequest


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


