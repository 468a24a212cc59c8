"""The one shape of the encoder and vision replicas' services (encoder.py, vision.py): the model,
loaded and checked to be of the service's kind, its metrics, and its cache by content."""

from __future__ import annotations

from pathlib import Path

from generation.front import EngineOptions

from ..metrics import EncoderMetrics
from .feature_cache import FeatureCache


class EncodingService:
    """A replica's model of family kind KIND (generation.front.EncoderFront.from_model refuses another
    kind, saying what it lacks), its metrics named ROLE, and a FeatureCache of `cache_bytes`."""

    KIND: str  # "encoder-decoder" or "vision"
    ROLE: str  # the metrics' name: "encoder" or "vision"

    def __init__(self, source: str | Path, name: str | None = None, options: EngineOptions | None = None,
                 cache_bytes: int = 256 * 2**20):
        from generation.front import EncoderFront

        self.encoder = EncoderFront.from_model(source, self.KIND, options)
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, self.ROLE)
        self.cache = FeatureCache(cache_bytes)

    def _cache_by(self, key):
        """The (lookup, store) callbacks the engine's cached encoders take, over this replica's
        cache, an item filed under `key(content)`."""
        return (lambda content: self.cache.get(key(content)),
                lambda content, value, size: self.cache.put(key(content), value, size))
