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

from generation.front import EncoderFront, Refused

from .encoding import EncodingService
from .generator import request_error


class EncoderService(EncodingService):
    KIND, ROLE = "encoder-decoder", "encoder"

    def decode_audio(self, data: bytes, filename: str = "file") -> "object":
        """An uploaded file's samples (mono, 16 kHz)."""
        started = time.perf_counter()
        try:
            samples = EncoderFront.decode_audio(data, filename)
        except Refused as e:
            raise request_error(e) from None
        self.metrics.latency.observe(time.perf_counter() - started)
        return samples

    def encode_features(self, windows):
        """Whisper's encoder over log-mel windows (one row each; windows seen before come from
        the cache)."""
        started = time.perf_counter()
        out, computed = self.encoder.encode_audio(windows, self._cache_by(lambda window: self.cache.key(*window)))
        self._count(len(out), computed, started)
        return out

    def encode_text(self, sources: list):
        """A text encoder over texts or token id lists; a source longer than the encoder's
        positions is a RequestError naming the prompt."""
        started = time.perf_counter()
        try:
            out, computed = self.encoder.encode_texts(sources, self._cache_by(lambda source: self.cache.key("text", source)))
        except Refused as e:
            raise request_error(e) from None
        self._count(len(sources), computed, started)
        return out

    def _count(self, inputs: int, computed: int, started: float) -> None:
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(inputs)
        self.metrics.cache_misses.inc(computed)
        self.metrics.cache_hits.inc(inputs - computed)
