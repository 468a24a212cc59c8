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

from .decoder import RequestError
from .metrics import EncoderMetrics


class EncoderService:
    def __init__(self, source: str | Path, name: str | None = None, threads: int | None = None,
                 provider: str | None = None, variant: str | None = None):
        import generation

        self.model = generation.load(source, variant=variant, provider=provider, threads=threads)
        if not self.model.is_seq2seq:
            raise ValueError(f"{source} has no encoder (config.json is_encoder_decoder is not true)")
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, "encoder")

    def decode_audio(self, data: bytes, filename: str = "file") -> "object":
        """An uploaded file's samples (mono, 16 kHz)."""
        from generation.audio import load_audio

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
        """Whisper's encoder over log-mel windows (one row each)."""
        from generation.seq2seq import encode_audio

        started = time.perf_counter()
        out = encode_audio(self.model, windows)
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(len(out))
        self.metrics.cache_misses.inc(len(out))
        return out

    def encode_text(self, sources: list):
        """A text encoder over texts or token id lists; a source longer than the encoder's
        positions is a RequestError naming the prompt."""
        import generation
        from generation.tasks import encode_sources

        started = time.perf_counter()
        try:
            out = encode_sources(generation.context(self.model), sources)
        except ValueError as e:
            raise RequestError(f"prompt: {e}", "prompt") from None
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(len(out))
        self.metrics.cache_misses.inc(len(out))
        return out
