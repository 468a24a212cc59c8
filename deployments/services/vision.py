"""The vision replica's work, free of Ray: an image or video file in, its features out, cached by
content.

A vision-language model's image and video preprocessing and vision encoder run in their own
deployment, scaled apart from the decoder. The ingress hands it each image and video of a chat
request (the bytes of a data URL or a fetched file; a video also as its frames' image files) and
passes the reply, unopened, to the decoder, whose engine front places the features in the prompt
(generation.front.prompts). The same image or video twice is encoded once. The features and their layout
are the engine's (`generation.families.vl_prompts.ImageFeatures`); this module only moves them.

    encode_image(bytes) -> ImageFeatures(the image's layout in a prompt, features [tokens, hidden])
    encode_video(bytes or [frame bytes, ...]) -> ImageFeatures(the video's layout, its features)
"""

from __future__ import annotations

import time

from generation.front import Refused

from ..errors import RequestError
from .encoding import EncodingService
from .generator import request_error


class VisionService(EncodingService):
    KIND, ROLE = "vision", "vision"

    def encode_image(self, data: bytes, name: str = "image"):
        """An image file's features, preprocessed as the model's transformers processor does
        (Qwen2-VL or Idefics3); the same bytes again come from the cache."""
        started = time.perf_counter()
        self.metrics.items.inc()
        return self._cached(self.cache.key("image", bytes(data)), started, lambda: self.encoder.encode_image(data, name))

    def encode_video(self, data: bytes | list[bytes], name: str = "video"):
        """A video's features: a video file (decoded with PyAV: every frame) or its frames' image
        files, preprocessed as the model's transformers processor does (Qwen2-VL); the same bytes
        again come from the cache. A video of more tokens than the model's context is refused
        before the encoder runs."""
        started = time.perf_counter()
        self.metrics.items.inc()
        if not self.encoder.takes_videos:
            raise RequestError(f"{name}: this model ('{self.name}', {self.encoder.family}) takes images, not videos",
                               name)
        frames = isinstance(data, (list, tuple))
        key = self.cache.key("video-frames", *map(bytes, data)) if frames else self.cache.key("video", bytes(data))
        return self._cached(key, started, lambda: self.encoder.encode_video(data, name))

    def _cached(self, key, started: float, encoded):
        """The features under `key`: from the cache (a hit), else `encoded()` stored there (a
        miss); the latency since `started` observed either way. A refusal names the part."""
        out = self.cache.get(key)
        if out is not None:
            self.metrics.cache_hits.inc()
        else:
            try:
                out = encoded()
            except Refused as e:
                raise request_error(e) from None
            self.cache.put(key, out, out.nbytes)
            self.metrics.cache_misses.inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return out
