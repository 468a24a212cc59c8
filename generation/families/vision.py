"""Vision-language prompts: image features in the prompt's embeddings, M-RoPE positions, and the
vision encoder run.

A vision-language decoder takes `inputs_embeds`: every step embeds its tokens with the model's
`embed_tokens.onnx`, and in prompt steps the embeddings of the image tokens are replaced by the
vision encoder's features, in order, as transformers' `masked_scatter` does:

    prompt  [t t <vs> <img> <img> <img> <img> <ve> t]   features [f0 f1 f2 f3 (f4 f5 ...: the next row's)]
    embeds  [e e  e    f0    f1    f2    f3    e   e]

A row's features are those after the rows before it (`split_features`); each row keeps a cursor
(the image tokens of its prompt before the piece), so a prompt that runs in pieces across an
image takes the right features in every piece.

Qwen2-VL's positions have 3 axes (temporal, height, width: `rope_positions`, as transformers 4.57
`Qwen2VLModel.get_rope_index`): text tokens count up on all axes, an image's tokens take the rows
and columns of its grid after the spatial merge, and the text after an image continues from the
largest position so far + 1. New tokens sit at `index + delta` on all axes, delta being the
prompt's largest position + 1 - its length (the cache's per-slot position offset).

`encode_images` runs the vision encoder alone (a server can run it in its own deployment and
cache the features of repeated images by content hash).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from ..runtime.hooks import Hooks


@dataclass
class PromptImages:
    """The image inputs of a batch of prompts, one entry per prompt: the features of its image
    tokens in order ([k_b, hidden], k_b its image tokens; more rows are fine) and its positions
    ([3, L_b] M-RoPE positions, or None: each token at its index). Passed as `encoder=` to
    prefill / admit / generate / beam_search, as an encoder-decoder's EncoderOutputs are."""

    features: list[np.ndarray]
    positions: list[np.ndarray | None]
    image_token_id: int
    # Qwen2-VL videos: each prompt's features of its video tokens, placed after the images as
    # transformers' second masked_scatter places them (None: no videos)
    video_features: list[np.ndarray] | None = None
    video_token_id: int | None = None

    def take(self, rows) -> "PromptImages":
        rows = list(rows)
        videos = None if self.video_features is None else [self.video_features[i] for i in rows]
        return PromptImages([self.features[i] for i in rows], [self.positions[i] for i in rows], self.image_token_id,
                            videos, self.video_token_id)

    def kinds(self):
        """(token id, per-row features) of images, then of videos where there are any."""
        yield self.image_token_id, self.features
        if self.video_features is not None:
            yield self.video_token_id, self.video_features

    def __len__(self) -> int:
        return len(self.features)

    @property
    def source_ids(self):
        return None  # the encoder_ processors read a decoder-only model's prompt

    def deltas(self, lengths) -> list[int | None]:
        """Each row's M-RoPE delta: its largest position + 1 - its length (None: no positions)."""
        return [None if p is None else int(p.max()) + 1 - int(n) for p, n in zip(self.positions, lengths)]

    def embeddings(self, embed, ids: np.ndarray, real: np.ndarray, prompts, offset: int) -> np.ndarray:
        """The embeddings [n, S, hidden] of a piece `ids` [n, S] that starts at token `offset` of
        each row (`real[b]` of its tokens are the row's, the rest padding), the features of its
        image tokens in place. A row's cursor is the image tokens of its prompt before the piece."""
        embeds = embed(ids)
        for token, features in self.kinds():
            for b, prompt in enumerate(prompts):
                where = np.flatnonzero(ids[b, :real[b]] == token)
                if where.size:
                    cursor = int(np.count_nonzero(np.asarray(prompt[:offset]) == token))
                    embeds[b, where] = features[b][cursor:cursor + where.size]
        return embeds

    def prefix_key(self, prompt: list[int]) -> list[int]:
        """The one-row `prompt` as a prefix store names it (cache/prefix.py): each image or video
        token replaced by a hash of its feature row and its M-RoPE position, so a cached prefix
        holds the same images at the same places, not only the same placeholders."""
        out = [int(t) for t in prompt]
        ids = np.asarray(out)
        positions = self.positions[0]
        for token, features in self.kinds():
            for k, i in enumerate(np.flatnonzero(ids == token).tolist()):
                digest = hashlib.blake2b(np.ascontiguousarray(features[0][k]).tobytes(), digest_size=7)
                if positions is not None:
                    digest.update(np.ascontiguousarray(positions[:, i]).tobytes())
                out[i] = (1 << 62) | int.from_bytes(digest.digest(), "little")
        return out

    def piece_positions(self, default: np.ndarray, real: np.ndarray, offset: int) -> np.ndarray:
        """[3, n, S] positions of a piece: each row's own from `offset` on, `default` [n, S]
        (the index) for rows without positions and for padding."""
        out = np.broadcast_to(default, (3, *default.shape)).copy()
        for b, positions in enumerate(self.positions):
            if positions is not None and real[b]:
                out[:, b, :real[b]] = positions[:, offset:offset + real[b]]
        return out


def split_features(prompts: list[list[int]], features: np.ndarray, image_token_id: int) -> list[np.ndarray]:
    """Each prompt's rows of `features` [N, hidden]: the features of all image tokens of all rows
    in order (transformers' masked_scatter over the batch), a row starting after those of the
    rows before it. More features than image tokens are fine; fewer are an error."""
    counts = [int(np.count_nonzero(np.asarray(p, np.int64) == image_token_id)) for p in prompts]
    if sum(counts) > len(features):
        raise ValueError(f"the prompts hold {sum(counts)} image tokens (id {image_token_id}; per prompt {counts}) "
                         f"but image features has {len(features)} rows")
    ends = np.cumsum(counts)
    return [features[end - count:end] for end, count in zip(ends.tolist(), counts)]


@dataclass(frozen=True)
class VisionTokens:
    """The special tokens and merge size that place images in a Qwen2-VL prompt (config.json)."""

    image: int
    video: int
    vision_start: int
    merge: int
    vision_end: int = -1

    @classmethod
    def of(cls, config: dict) -> "VisionTokens":
        keys = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
        missing = [k for k in keys if not isinstance(config.get(k), int)]
        if missing:
            raise ValueError(f"config.json lacks {', '.join(missing)}: not a Qwen2-VL model")
        merge = (config.get("vision_config") or {}).get("spatial_merge_size", 2)
        return cls(config["image_token_id"], config["video_token_id"], config["vision_start_token_id"], merge,
                   config["vision_end_token_id"])


def rope_positions(prompts: list[list[int]], tokens: VisionTokens, image_grids=(), video_grids=()
                   ) -> tuple[list[np.ndarray], np.ndarray]:
    """The M-RoPE positions [3, L_b] of each prompt and its delta, as transformers 4.57
    `Qwen2VLModel.get_rope_index` (unpadded rows): grids [t, h, w] of the images and videos of
    all prompts in order, consumed row after row.

    A row's images and videos are counted by the token after each vision_start; each one starts
    at the next image (video) token and spans t * (h/merge) * (w/merge) tokens, positioned
    (t, h, w index) + the text before it; the text after it starts at the largest position + 1.

    >>> t = VisionTokens(image=9, video=8, vision_start=7, merge=2)
    >>> positions, delta = rope_positions([[1, 7, 9, 9, 5]], t, image_grids=[(1, 2, 4)])
    >>> positions[0].tolist(), delta.tolist()
    ([[0, 1, 2, 2, 4], [0, 1, 2, 2, 4], [0, 1, 2, 3, 4]], [0])
    """
    images, videos = [np.asarray(g, np.int64).reshape(-1, 3) for g in (image_grids, video_grids)]
    image_index = video_index = 0
    out, deltas = [], []
    for prompt in prompts:
        ids = np.asarray(prompt, np.int64)
        after_start = ids[np.flatnonzero(ids[:-1] == tokens.vision_start) + 1]
        remain_images = int(np.count_nonzero(after_start == tokens.image))
        remain_videos = int(np.count_nonzero(after_start == tokens.video))
        parts, start, next_position = [], 0, 0
        for _ in range(remain_images + remain_videos):
            at_image = _index(ids, tokens.image, start) if remain_images else len(ids) + 1
            at_video = _index(ids, tokens.video, start) if remain_videos else len(ids) + 1
            if at_image < at_video:
                grid, end = images[image_index], at_image
                image_index, remain_images = image_index + 1, remain_images - 1
            else:
                grid, end = videos[video_index], at_video
                video_index, remain_videos = video_index + 1, remain_videos - 1
            t, h, w = int(grid[0]), int(grid[1]) // tokens.merge, int(grid[2]) // tokens.merge
            text = end - start
            parts.append(np.broadcast_to(np.arange(text) + next_position, (3, text)))
            grid_positions = np.stack([a.ravel() for a in np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                                                      indexing="ij")])
            parts.append(grid_positions + text + next_position)
            next_position = int(parts[-1].max()) + 1
            start = end + t * h * w
        if start < len(ids):
            parts.append(np.broadcast_to(np.arange(len(ids) - start) + next_position, (3, len(ids) - start)))
        positions = np.concatenate(parts, axis=1) if parts else np.zeros((3, 0), np.int64)
        out.append(positions.astype(np.int64))
        deltas.append(int(positions.max()) + 1 - len(ids) if positions.size else 0)
    return out, np.array(deltas, np.int64)


def _index(ids: np.ndarray, token: int, start: int) -> int:
    """`list.index(token, start)`, as transformers finds the next image (absent: an error, as there)."""
    where = np.flatnonzero(ids[start:] == token)
    if not where.size:
        raise ValueError(f"a prompt announces an image or video (token after vision_start) but has no token "
                         f"{token} after position {start}")
    return start + int(where[0])


def vision_inputs(grid_thw: np.ndarray, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """The grid-dependent inputs of the dynamic Qwen2-VL vision encoder, as transformers 4.57
    `Qwen2VisionTransformerPretrainedModel.rot_pos_emb` and its cu_seqlens: each patch's (row,
    column) in merge-block order [N, 2], and the attention bias [N, N] (0 within a frame of one
    image, -inf across)."""
    positions, sizes = [], []
    for t, h, w in np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist():
        rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows = rows.reshape(blocks).transpose(0, 2, 1, 3).ravel()
        cols = cols.reshape(blocks).transpose(0, 2, 1, 3).ravel()
        positions.append(np.tile(np.stack([rows, cols], -1), (t, 1)))
        sizes += [h * w] * t
    frame = np.repeat(np.arange(len(sizes)), sizes)
    bias = np.where(frame[:, None] == frame[None, :], np.float32(0), np.float32(-np.inf))
    return np.concatenate(positions).astype(np.int64), bias


def encode_images(model, pixel_values: np.ndarray, grid_thw: np.ndarray) -> np.ndarray:
    """The vision encoder's features [sum(t*h*w) / merge^2, hidden] of images (or videos) given as
    Qwen2-VL patches `pixel_values` [sum(t*h*w), C*T*P*P] and their grids `grid_thw` [n, 3], in
    order. Each image runs alone (attention never crosses images; the encoder's cost grows with
    the square of an image's patches, not the batch's)."""
    if model.vision_session is None:
        raise ValueError(f"{model.folder} has no vision encoder (vision_encoder.onnx): it takes no images")
    grid_thw = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    pixel_values = np.asarray(pixel_values, np.float32)
    sizes = grid_thw.prod(axis=1)
    if pixel_values.ndim != 2 or len(pixel_values) != sizes.sum():
        raise ValueError(f"pixel_values has shape {pixel_values.shape}; the grids {grid_thw.tolist()} need "
                         f"{int(sizes.sum())} patch rows")
    merge = VisionTokens.of(model.config).merge
    names = {i.name for i in model.vision_session.get_inputs()}
    out, start = [], 0
    for grid, size in zip(grid_thw, sizes.tolist()):
        positions, bias = vision_inputs(grid[None], merge)
        feeds = {"pixel_values": pixel_values[start:start + size], "vision_position_ids": positions,
                 "attention_bias": bias, "image_grid_thw": grid[None]}
        out.append(model.vision_session.run(None, {k: v for k, v in feeds.items() if k in names})[0])
        start += size
    if not out:
        return np.zeros((0, model.graph.hidden_size), np.float32)
    return np.concatenate(out)


def check_images(model, prompts: list[list[int]], images) -> "PromptImages | None":
    """The PromptImages a decoder-only batch runs with (None: text only), or ValueError: images
    for a model without a vision encoder, a row count that is not the prompts', features short of
    a prompt's image tokens, image or video tokens with no features."""
    if images is not None and not isinstance(images, PromptImages):
        raise ValueError(f"encoder= of a decoder-only model must be vision.PromptImages, not {type(images).__name__}")
    kinds = [("image", model.config.get("image_token_id")), ("video", model.config.get("video_token_id"))]
    if images is not None:  # (only videos may lack features then)
        kinds = [] if images.video_features is not None else kinds[1:]
    for kind, token in kinds if model.graph.has_inputs_embeds else ():
        for i, prompt in enumerate(prompts):
            count = int(np.count_nonzero(np.asarray(prompt, np.int64) == token)) if isinstance(token, int) else 0
            if count:
                where = "encoder=PromptImages" if images is None else "PromptImages.video_features"
                raise ValueError(f"prompts[{i}] holds {count} {kind} tokens (id {token}) but no {kind} features "
                                 f"were given ({where})")
    if images is None:
        return None
    if not model.graph.has_inputs_embeds or model.vision_session is None:
        raise ValueError(f"{model.folder} is a text-only model (no vision encoder): it takes no images")
    if len(images) != len(prompts):
        raise ValueError(f"image inputs have {len(images)} rows for {len(prompts)} prompts")
    if images.video_features is not None and len(images.video_features) != len(prompts):
        raise ValueError(f"video inputs have {len(images.video_features)} rows for {len(prompts)} prompts")
    for i, prompt in enumerate(prompts):
        for (token, rows), what in zip(images.kinds(), ("image", "video")):
            count, features = int(np.count_nonzero(np.asarray(prompt, np.int64) == token)), rows[i]
            if count > len(features):
                raise ValueError(f"prompts[{i}] holds {count} {what} tokens (id {token}) but has "
                                 f"features for {len(features)}")
            if features.ndim != 2 or (count and features.shape[1] != model.graph.hidden_size):
                raise ValueError(f"{what} features of prompt {i} have shape {features.shape}; the decoder takes "
                                 f"[tokens, {model.graph.hidden_size}]")
        positions = images.positions[i]
        if positions is not None and positions.shape != (3, len(prompt)):
            raise ValueError(f"positions of prompt {i} have shape {positions.shape}, expected (3, {len(prompt)})")
    return images


def join_images(encoders: list) -> PromptImages:
    """The jobs' PromptImages as one batch's (the scheduler admits them together); a text-only job
    (None) beside image ones gets no features (index positions). ValueError for inputs that are
    no PromptImages, as check_images says it."""
    for e in encoders:
        if e is not None and not isinstance(e, PromptImages):
            raise ValueError(f"encoder= of a decoder-only model must be vision.PromptImages, not {type(e).__name__}")
    some = next(e for e in encoders if e is not None)
    encoders = [e or PromptImages([np.zeros((0, 1), np.float32)], [None], some.image_token_id) for e in encoders]
    videos = None
    if any(e.video_features is not None for e in encoders):
        videos = [v for e in encoders for v in (e.video_features or [np.zeros((0, 1), np.float32)] * len(e))]
    token = next((e.video_token_id for e in encoders if e.video_token_id is not None), None)
    return PromptImages([f for e in encoders for f in e.features], [p for e in encoders for p in e.positions],
                        some.image_token_id, videos, token)


# The hooks of every decoder-only family (text, idefics3, qwen2_vl): prompts with images, their
# features in the embeddings and their positions (generation.runtime.hooks)
PROMPT_IMAGES = Hooks(join=join_images, prompt_inputs=check_images, prompt_types=(PromptImages,))
