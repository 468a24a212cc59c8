"""The vision replica's work, free of Ray: an image file in, its features out, cached by content.

A vision-language model's image preprocessing and vision encoder run in their own deployment,
scaled apart from the decoder. The ingress hands it each image of a chat request (the bytes of
a data URL or a fetched file) and passes the reply, unopened, to the decoder, which places the
features in the prompt (`prompt_images`). The same image twice is encoded once.

    encode_image(bytes) -> ImageFeatures(features [tokens, hidden], grid [t, h, w])
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .decoder import RequestError
from .encoder import FeatureCache
from .metrics import EncoderMetrics


@dataclass
class ImageFeatures:
    """One image through the vision encoder: its features (one per image token) and its grid."""

    features: object  # np.ndarray [tokens, hidden]
    grid: list[int]  # [t, h, w] patches, before the spatial merge


class VisionService:
    def __init__(self, source: str | Path, name: str | None = None, threads: int | None = None,
                 provider: str | None = None, variant: str | None = None, cache_bytes: int = 256 * 2**20):
        import generation

        self.model = generation.load(source, variant=variant, provider=provider, threads=threads)
        if self.model.vision_session is None:
            raise ValueError(f"{source} has no vision encoder (onnx/vision_encoder.onnx)")
        import json

        path = self.model.folder / "preprocessor_config.json"
        self.preprocessor = json.loads(path.read_text()) if path.exists() else {}
        self.name = name or Path(source).name
        self.metrics = EncoderMetrics(self.name, "vision")
        self.cache = FeatureCache(cache_bytes)

    def encode_image(self, data: bytes, name: str = "image") -> ImageFeatures:
        from generation.images import qwen2vl_pixels
        from generation.vision import encode_images

        started = time.perf_counter()
        self.metrics.items.inc()
        key = self.cache.key("image", bytes(data))
        cached = self.cache.get(key)
        if cached is not None:
            self.metrics.cache_hits.inc()
            self.metrics.latency.observe(time.perf_counter() - started)
            return cached
        try:
            pixels, grids = qwen2vl_pixels([bytes(data)], self.preprocessor)
        except ValueError as e:
            raise RequestError(f"{name}: not an image this server reads: {e}", name) from None
        out = ImageFeatures(encode_images(self.model, pixels, grids), [int(x) for x in grids[0]])
        self.cache.put(key, out, out.features.nbytes)
        self.metrics.cache_misses.inc()
        self.metrics.latency.observe(time.perf_counter() - started)
        return out


IMAGE_MARK = "<|raymuter:image|>"  # stands for an image in the rendered chat text


def prompt_images(model, tokenizer, text: str, images: list[ImageFeatures]):
    """A chat prompt's token ids and its PromptImages (one row): the rendered `text` holds one
    IMAGE_MARK per image, in order; each becomes <|vision_start|>, one image token per feature,
    <|vision_end|>, as Qwen2-VL's chat template and processor write an image."""
    import numpy as np

    from generation.vision import PromptImages, VisionTokens, rope_positions, split_features

    pieces = text.split(IMAGE_MARK)
    if len(pieces) - 1 != len(images):
        raise RequestError(f"messages: the chat template kept {len(pieces) - 1} of the {len(images)} images",
                           "messages")
    tokens = VisionTokens.of(model.config)
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        ids += tokenizer.encode(piece, add_special_tokens=False).ids if piece else []
        if i < len(images):
            ids += [tokens.vision_start] + [tokens.image] * len(images[i].features) + [tokens.vision_end]
    grids = np.array([image.grid for image in images], np.int64).reshape(-1, 3)
    positions, _ = rope_positions([ids], tokens, image_grids=grids)
    features = np.concatenate([image.features for image in images]) if images else None
    rows = split_features([ids], features, tokens.image) if images else [np.zeros((0, 1), np.float32)]
    return ids, PromptImages(rows, positions, tokens.image)
