"""The encoder replica's work, free of Ray: texts and audio in, the encoder's outputs out.

An encoder-decoder model's encoder runs in its own deployment, scaled apart from the decoder.
The ingress hands it a request's text or uploaded file and passes the reply, unopened, to the
decoder (Ray moves the arrays between the replicas through its object store):

    decode_audio(bytes) -> 16 kHz samples          (bad files: RequestError naming the file)
    encode_features(windows [n, n_mels, frames]) -> EncoderOutputs   (Whisper, per window)
    encode_text(sources) -> EncoderOutputs          (Marian, T5, BART)
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import RequestError
from ..metrics import EncoderMetrics
from .feature_cache import FeatureCache


class EncoderService:
    def __init__(self, source: str | Path, name: str | None = None, threads: int | None = None,
                 provider: str | None = None, variant: str | None = None, cache_bytes: int = 256 * 2**20):
        import generation
        from generation import families

        self.model = generation.load(source, variant=variant, provider=provider, threads=threads)
        if families.family(self.model).KIND != "encoder-decoder":
            raise ValueError(f"{source} has no encoder: it is a {self.model.family} model, not an encoder-decoder")
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, "encoder")
        self.cache = FeatureCache(cache_bytes)

    def decode_audio(self, data: bytes, filename: str = "file") -> "object":
        """An uploaded file's samples (mono, 16 kHz)."""
        from generation.families.whisper.audio import load_audio

        if not data:
            raise RequestError(f"file: '{filename}' is empty", "file")
        started = time.perf_counter()
        try:
            samples = load_audio(bytes(data))
        except ValueError as e:
            raise RequestError(f"file: '{filename}' could not be read as audio: {e}", "file") from None
        self.metrics.latency.observe(time.perf_counter() - started)
        return samples

    def encode_features(self, windows):
        """Whisper's encoder over log-mel windows (one row each; windows seen before come from
        the cache)."""
        from generation.runtime.encoders import encode_audio_cached

        started = time.perf_counter()
        out, computed = encode_audio_cached(self.model, windows, *self._cache_by(lambda window: self.cache.key(*window)))
        self._count(len(out), computed, started)
        return out

    def encode_text(self, sources: list):
        """A text encoder over texts or token id lists; a source longer than the encoder's
        positions is a RequestError naming the prompt."""
        import generation
        from generation.families.seq2seq import encode_sources_cached

        started = time.perf_counter()
        try:
            out, computed = encode_sources_cached(generation.context(self.model), sources,
                                                  *self._cache_by(lambda source: self.cache.key("text", source)))
        except ValueError as e:
            raise RequestError(f"prompt: {e}", "prompt") from None
        self._count(len(sources), computed, started)
        return out

    def _cache_by(self, key):
        """The (lookup, store) callbacks the engine's cached encoders take, over this replica's
        cache, an item filed under `key(content)`."""
        return (lambda content: self.cache.get(key(content)),
                lambda content, value, size: self.cache.put(key(content), value, size))

    def _count(self, inputs: int, computed: int, started: float) -> None:
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(inputs)
        self.metrics.cache_misses.inc(computed)
        self.metrics.cache_hits.inc(inputs - computed)
