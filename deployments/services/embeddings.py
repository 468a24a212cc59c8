"""A decoder replica that serves an embedding model (generation.core.embed): /v1/embeddings and
the handle's `embed`. Each request's inputs run as one batched pass on a worker thread, so the
replica's event loop keeps answering; generation routes refuse, naming the model."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from ..errors import RequestError
from ..metrics import EncoderMetrics
from ..schema import EmbedRequest, EmbedResponse, ModelCard, Tokenized


class EmbeddingService:
    """An embedding model's replica: its Embedder, tokenizer and metrics."""

    kind = "embedding"
    family = "text"
    takes_images = False
    batcher = None  # no batching loop: each request is one pass

    def __init__(self, name: str, embedder, tokenizer, fingerprint: str = ""):
        self.name, self.embedder, self.tokenizer, self.fingerprint = name, embedder, tokenizer, fingerprint
        self.metrics = EncoderMetrics(name, "embedding")

    @classmethod
    def from_model(cls, source: str | Path, name: str | None = None, threads: int | None = None,
                   provider: str | None = None, variant: str | None = None) -> "EmbeddingService":
        from generation.front import load_embedder, model_tokenizer

        from .generator import fingerprint

        embedder = load_embedder(source, variant=variant, provider=provider, threads=threads)
        name = name or (Path(source).name if Path(source).is_dir() else str(source))
        return cls(name, embedder, model_tokenizer(embedder),
                   fingerprint(name, embedder.max_context, 0, {"pooling": embedder.pooling,
                                                               "normalize": embedder.normalize}))

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, context_length=self.embedder.max_context, slots=0, kind=self.kind,
                         has_chat_template=False, fingerprint=self.fingerprint)

    def refuse_generation(self):
        raise RequestError(f"model: '{self.name}' is an embedding model: POST /v1/embeddings", "model")

    async def embed(self, request: EmbedRequest) -> EmbedResponse:
        from generation.front import embed

        if request.dimensions is not None and request.dimensions > self.embedder.hidden_size:
            raise RequestError(f"dimensions: this model's embeddings have {self.embedder.hidden_size} dimensions; "
                               f"at most that many, not {request.dimensions}", "dimensions")
        prompts = [self._ids(item, i) for i, item in enumerate(request.inputs)]
        started = time.perf_counter()
        try:
            vectors = await asyncio.to_thread(embed, self.embedder, prompts, request.dimensions)
        except ValueError as e:  # what the checks above let through: still the request's
            raise RequestError(str(e), "input") from None
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(len(prompts))
        return EmbedResponse(embeddings=vectors.tolist(), prompt_tokens=sum(len(p) for p in prompts))

    def _ids(self, item, i: int) -> list[int]:
        ids = self.tokenizer.encode(item).ids if isinstance(item, str) else list(item)
        if not ids:
            raise RequestError(f"input.{i}: empty (it has no tokens)", f"input.{i}")
        vocab = self.tokenizer.get_vocab_size()
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"input.{i}: {bad} is not a token id of this model (0 to {vocab - 1})", f"input.{i}")
        context = self.embedder.max_context
        if context and len(ids) > context:
            raise RequestError(f"input.{i}: {len(ids)} tokens; the model's context is {context}", f"input.{i}")
        return ids

    def tokenize(self, text: str | None, messages, add_special_tokens: bool | None, add_generation_prompt: bool,
                 variables, token_strs: bool) -> Tokenized:
        if messages is not None:
            raise RequestError(f"messages: '{self.name}' is an embedding model: it has no chat template", "messages")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens is not False).ids
        return Tokenized(tokens=ids, token_strs=[self.tokenizer.id_to_token(i) or "" for i in ids] if token_strs
                         else None)

    def detokenize(self, ids: list[int]) -> str:
        from generation.front import Refused, detokenized

        from .generator import request_error

        try:
            return detokenized(self.tokenizer, self.tokenizer.get_vocab_size(), ids)
        except Refused as e:
            raise request_error(e) from None

    def close(self) -> None:
        pass

    async def generate(self, request, encoder=None, images=()):
        self.refuse_generation()

    async def stream(self, request, encoder=None, images=()):
        self.refuse_generation()
        yield  # an async generator, as TextGenerator.stream
