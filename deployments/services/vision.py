"""The vision replica's work, free of Ray: an image or video file in, its features out, cached by
content.

A vision-language model's image and video preprocessing and vision encoder run in their own
deployment, scaled apart from the decoder. The ingress hands it each image and video of a chat
request (the bytes of a data URL or a fetched file; a video also as its frames' image files) and
passes the reply, unopened, to the decoder, which places the features in the prompt
(`prompt_images`). The same image or video twice is encoded once. The features and their layout
are the engine's (`generation.families.vl_prompts.ImageFeatures`); this module only moves them.

    encode_image(bytes) -> ImageFeatures(the image's layout in a prompt, features [tokens, hidden])
    encode_video(bytes or [frame bytes, ...]) -> ImageFeatures(the video's layout, its features)
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import RequestError
from ..metrics import EncoderMetrics
from .feature_cache import FeatureCache


class VisionService:
    def __init__(self, source: str | Path, name: str | None = None, threads: int | None = None,
                 provider: str | None = None, variant: str | None = None, cache_bytes: int = 256 * 2**20):
        import generation
        from generation import families

        self.model = generation.load(source, variant=variant, provider=provider, threads=threads)
        if families.family(self.model).KIND != "vision":
            raise ValueError(f"{source} has no vision encoder (onnx/vision_encoder.onnx): it is a "
                             f"{self.model.family} model")
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, "vision")
        self.cache = FeatureCache(cache_bytes)

    def encode_image(self, data: bytes, name: str = "image"):
        """An image file's features, preprocessed as the model's transformers processor does
        (Qwen2-VL or Idefics3); the same bytes again come from the cache."""
        from generation.families.images import load_image
        from generation.families.vl_prompts import encode_image, preprocess

        started = time.perf_counter()
        self.metrics.items.inc()

        def encoded():
            try:
                images = preprocess(self.model, [load_image(bytes(data), name)])
            except ValueError as e:
                raise RequestError(f"{name}: not an image this server reads: {e}", name) from None
            return encode_image(self.model, images)
        return self._cached(self.cache.key("image", bytes(data)), started, encoded)

    def encode_video(self, data: bytes | list[bytes], name: str = "video"):
        """A video's features: a video file (decoded with PyAV: every frame) or its frames' image
        files, preprocessed as the model's transformers processor does (Qwen2-VL); the same bytes
        again come from the cache. A video of more tokens than the model's context is refused
        before the encoder runs."""
        from generation.families.videos import takes_videos, video_frames
        from generation.families.vl_prompts import encode_video, preprocess

        started = time.perf_counter()
        self.metrics.items.inc()
        if not takes_videos(self.model):
            raise RequestError(f"{name}: this model ('{self.name}', {self.model.family}) takes images, not videos",
                               name)
        frames = isinstance(data, (list, tuple))
        key = self.cache.key("video-frames", *map(bytes, data)) if frames else self.cache.key("video", bytes(data))

        def encoded():
            try:
                videos = preprocess(self.model, [], [video_frames([bytes(d) for d in data] if frames else bytes(data),
                                                                  name)])
            except ValueError as e:
                raise RequestError(str(e) if str(e).startswith(name) else f"{name}: {e}", name) from None
            context = self.model.max_context
            if context and videos.video_features > context:
                raise RequestError(f"{name}: the video makes {videos.video_features} video tokens; the model's "
                                   f"context holds {context}", name)
            return encode_video(self.model, videos)
        return self._cached(key, started, encoded)

    def _cached(self, key, started: float, encoded):
        """The features under `key`: from the cache (a hit), else `encoded()` stored there (a
        miss); the latency since `started` observed either way."""
        out = self.cache.get(key)
        if out is not None:
            self.metrics.cache_hits.inc()
        else:
            out = encoded()
            self.cache.put(key, out, out.nbytes)
            self.metrics.cache_misses.inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return out


def prompt_images(model, messages: list[dict], images: list, add_generation_prompt: bool = True,
                  variables: dict | None = None):
    """A chat prompt's token ids and its PromptImages (None without images; `images`: the
    vl_prompts.ImageFeatures of its image and video parts, in order): the model's chat template
    rendered with `{"type": "image"}` and `{"type": "video"}` parts (and `variables`), each
    placeholder replaced by its image's or video's expansion, as transformers'
    processor.apply_chat_template does (`generation.families.vl_prompts`)."""
    from generation.families.vl_prompts import chat_ids, join_images, placed_images

    joined = join_images(images) if images else None
    try:
        ids = chat_ids(model, [messages], joined, add_generation_prompt, variables)[0]
    except ValueError as e:
        raise RequestError(f"messages: {e}", "messages") from None
    if joined is None:
        return ids, None
    return ids, placed_images(model, ids, joined, images)
