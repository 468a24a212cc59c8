"""An embedding model behind the front's door (generation.core.embed): its inputs checked by
field, one batched pooled pass, plain lists out, so a server serves embeddings as it serves
generation, never touching the engine's arrays.

    front = EmbeddingFront.from_model("folder")
    vectors = front.embed(front.prompts(["a text", [101, 2023]]), dimensions=256)
"""

from __future__ import annotations

from pathlib import Path

from generation.core.embed import embed, load_embedder
from generation.text.tokenizer import model_tokenizer

from .errors import Refused
from .front import detokenized
from .loading import load_model
from .options import EngineOptions


class EmbeddingFront:
    """A loaded embedding model and its tokenizer. A refusal names the request's field:
    `input.<i>` for an input, `dimensions`, `tokens.<i>` for /detokenize's ids."""

    def __init__(self, embedder, tokenizer):
        self.embedder, self.tokenizer = embedder, tokenizer

    @classmethod
    def from_model(cls, source: str | Path, options: EngineOptions | None = None) -> "EmbeddingFront":
        """The embedding model of `source`, loaded as `options` say (EngineOptions: its variant,
        provider, threads)."""
        embedder = load_model(source, options or EngineOptions(), loader=load_embedder)
        return cls(embedder, model_tokenizer(embedder))

    @property
    def context_length(self) -> int | None:
        return self.embedder.max_context

    @property
    def dimensions(self) -> int:
        return self.embedder.hidden_size

    def configuration(self) -> dict:
        """What its vectors depend on beside the weights (a fingerprint's part)."""
        return {"pooling": self.embedder.pooling, "normalize": self.embedder.normalize}

    def prompts(self, inputs: list) -> list[list[int]]:
        """Each input (a text, or token ids) as token ids, checked against the vocabulary and the context."""
        vocab, context, out = self.tokenizer.get_vocab_size(), self.context_length, []
        for i, item in enumerate(inputs):
            ids = self.tokenizer.encode(item).ids if isinstance(item, str) else list(item)
            if not ids:
                raise Refused("empty (it has no tokens)", f"input.{i}")
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise Refused(f"{bad} is not a token id of this model (0 to {vocab - 1})", f"input.{i}")
            if context and len(ids) > context:
                raise Refused(f"{len(ids)} tokens; the model's context is {context}", f"input.{i}")
            out.append(ids)
        return out

    def embed(self, prompts: list[list[int]], dimensions: int | None = None) -> list[list[float]]:
        """The pooled vectors of token-id prompts, the first `dimensions` of each (normalized again
        where the model normalizes); one pass, on the caller's thread."""
        if dimensions is not None and dimensions > self.dimensions:
            raise Refused(f"this model's embeddings have {self.dimensions} dimensions; at most that many, "
                          f"not {dimensions}", "dimensions")
        try:
            return embed(self.embedder, prompts, dimensions).tolist()
        except ValueError as e:  # what the checks above let through: still the request's
            raise Refused(str(e), "input", message=str(e)) from None

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token: int) -> str:
        return self.tokenizer.id_to_token(token) or ""

    def detokenize(self, ids: list[int]) -> str:
        return detokenized(self.tokenizer, self.tokenizer.get_vocab_size(), ids)
