"""A decoder replica that serves an embedding model through the front (generation.front's
EmbeddingFront): /v1/embeddings and the handle's `embed`. Each request's inputs run as one
batched pass on a worker thread, so the replica's event loop keeps answering; generation routes
refuse, naming the model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from generation.front import EmbeddingFront, EngineOptions, Refused

from ..errors import RequestError
from ..metrics import EncoderMetrics
from ..schema import EmbedRequest, EmbedResponse, ModelCard, Tokenized


class EmbeddingService:
    """An embedding model's replica: its EmbeddingFront and metrics."""

    kind = "embedding"
    family = "text"
    takes_images = False
    batcher = None  # no batching loop: each request is one pass

    def __init__(self, name: str, front: EmbeddingFront, fingerprint: str = ""):
        self.name, self.front, self.fingerprint = name, front, fingerprint
        self.metrics = EncoderMetrics(name, "embedding")

    @classmethod
    def from_model(cls, source: str | Path, name: str | None = None,
                   options: EngineOptions | None = None) -> "EmbeddingService":
        from .generator import fingerprint

        front = EmbeddingFront.from_model(source, options)
        name = name or (Path(source).name if Path(source).is_dir() else str(source))
        return cls(name, front, fingerprint(name, front.context_length, 0, front.configuration()))

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, context_length=self.front.context_length, slots=0, kind=self.kind,
                         has_chat_template=False, fingerprint=self.fingerprint)

    def refuse_generation(self):
        raise RequestError(f"model: '{self.name}' is an embedding model: POST /v1/embeddings", "model")

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        started = time.perf_counter()
        try:
            prompts = self.front.prompts(request.inputs)
            vectors = await asyncio.to_thread(self.front.embed, prompts, request.dimensions)
        except Refused as e:
            raise RequestError(str(e), e.field, e.predicate) from None
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(len(prompts))
        return EmbedResponse(embeddings=vectors, prompt_tokens=sum(len(p) for p in prompts))

    def tokenize(self, text: str | None, messages, add_special_tokens: bool | None, add_generation_prompt: bool,
                 variables, token_strs: bool) -> Tokenized:
        if messages is not None:
            raise RequestError(f"messages: '{self.name}' is an embedding model: it has no chat template", "messages")
        ids = self.front.tokenize(text, add_special_tokens is not False)
        return Tokenized(tokens=ids, token_strs=[self.front.token_text(i) for i in ids] if token_strs else None)

    def detokenize(self, ids: list[int]) -> str:
        try:
            return self.front.detokenize(ids)
        except Refused as e:
            raise RequestError(str(e), e.field, e.predicate) from None

    def close(self) -> None:
        pass

    async def generate(self, request, encoder=None, images=()):
        self.refuse_generation()

    async def stream(self, request, encoder=None, images=()):
        self.refuse_generation()
        yield  # an async generator, as TextGenerator.stream
