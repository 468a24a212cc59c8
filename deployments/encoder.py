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

from .errors import RequestError
from .feature_cache import FeatureCache
from .metrics import EncoderMetrics


class EncoderService:
    def __init__(self, source: str | Path, name: str | None = None, threads: int | None = None,
                 provider: str | None = None, variant: str | None = None, cache_bytes: int = 256 * 2**20):
        import generation

        self.model = generation.load(source, variant=variant, provider=provider, threads=threads)
        if not self.model.is_seq2seq:
            raise ValueError(f"{source} has no encoder (config.json is_encoder_decoder is not true)")
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, "encoder")
        self.cache = FeatureCache(cache_bytes)

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
        """Whisper's encoder over log-mel windows (one row each; windows seen before come from
        the cache)."""
        import numpy as np

        from generation.seq2seq import EncoderOutputs, encode_audio

        started = time.perf_counter()
        windows = np.ascontiguousarray(windows, np.float32)
        keys = [self.cache.key(w.shape, w.tobytes()) for w in windows]
        hidden = [self.cache.get(k) for k in keys]
        todo = [i for i, h in enumerate(hidden) if h is None]
        if todo:
            out = encode_audio(self.model, windows[todo])
            for i, h in zip(todo, out.hidden):
                hidden[i] = h
                self.cache.put(keys[i], h, h.nbytes)
        self._count(len(windows), len(todo), started)
        return EncoderOutputs(hidden)

    def _count(self, inputs: int, computed: int, started: float) -> None:
        self.metrics.latency.observe(time.perf_counter() - started)
        self.metrics.items.inc(inputs)
        self.metrics.cache_misses.inc(computed)
        self.metrics.cache_hits.inc(inputs - computed)

    def encode_text(self, sources: list):
        """A text encoder over texts or token id lists; a source longer than the encoder's
        positions is a RequestError naming the prompt."""
        import generation
        from generation.tasks import encode_sources

        from generation.seq2seq import EncoderOutputs

        started = time.perf_counter()
        keys = [self.cache.key("text", s) for s in sources]
        cached = [self.cache.get(k) for k in keys]
        todo = [i for i, c in enumerate(cached) if c is None]
        if todo:
            try:
                out = encode_sources(generation.context(self.model), [sources[i] for i in todo])
            except ValueError as e:
                raise RequestError(f"prompt: {e}", "prompt") from None
            for j, i in enumerate(todo):
                cached[i] = (out.hidden[j], out.source_ids[j])
                self.cache.put(keys[i], cached[i], out.hidden[j].nbytes)
        self._count(len(sources), len(todo), started)
        return EncoderOutputs([c[0] for c in cached], [list(c[1]) for c in cached])
