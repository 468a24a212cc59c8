"""Vision-language prompts: images to the token ids and image inputs of a Qwen2-VL or Idefics3
(SmolVLM) prompt, as the model's transformers 4.57 processor makes them.

Each image has an expansion: what its placeholder token (the image token, `<|image_pad|>` or
`<image>`) becomes in the prompt, as text and as token ids:

    Qwen2-VL   <|image_pad|> * features          (the chat template writes the vision_start /
                                                  vision_end around it; a part-built prompt gets
                                                  them from `ids`)
    Idefics3   Idefics3Processor's frames text    (`idefics3.image_prompt`)

A prompt is built from parts (`part_ids`: texts and token ids, each image as vision_start +
pads + vision_end or as the Idefics3 expansion), or from a chat conversation (`chat_ids`: the
model's template rendered as `processor.apply_chat_template`, each placeholder replaced by the
image's expansion text, the whole text tokenized once as the processor's tokenizer call does).
Qwen2-VL videos take the same ways, their placeholder `<|video_pad|>` (`generation.families.videos`).
`image_inputs` then runs the vision encoder and returns the features and positions for
`generate(encoder=...)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..text.tokenizer import model_tokenizer
from . import Prepared, module


@dataclass
class Images:
    """The preprocessed images of a batch, in order: the vision encoder's input, and each
    image's expansion as ids (for part-built prompts) and as text (for chat prompts)."""

    family: str  # "qwen2_vl" or "idefics3"
    pixel_values: np.ndarray
    grids: np.ndarray | list  # Qwen2-VL: image_grid_thw [n, 3]; Idefics3: (rows, cols) per image
    ids: list[list[int]]
    texts: list[str]
    token: int  # the image token id
    features: int  # image tokens in all
    # Qwen2-VL videos, in order: patches, video_grid_thw, each one's ids (vision_start + video
    # tokens + vision_end), the video token id, the video tokens in all, and each one's expansion
    # of the chat's video placeholder as text (its video tokens)
    video_pixels: np.ndarray | None = None
    video_grids: np.ndarray | None = None
    video_ids: list[list[int]] = field(default_factory=list)
    video_token: int = -1
    video_features: int = 0
    video_texts: list[str] = field(default_factory=list)

    def encode(self, model, encode=None, videos: bool = False) -> np.ndarray:
        """The features of the images (of the videos: `videos`), checked against their tokens:
        the family's vision encoder, or `encode`."""
        features, what = module(self.family).image_features(model, self, encode, videos)
        return _checked(features, self.video_features if videos else self.features, what,
                        "video" if videos else "image")


def _checked(features, count: int, what: str, kind: str) -> np.ndarray:
    features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"the vision encoder gave features of shape {features.shape}; expected [tokens, hidden]")
    if len(features) != count:
        raise ValueError(f"the vision encoder gave {len(features)} features for {count} {kind} tokens ({what})")
    return features


def folder_json(path) -> dict:
    """A JSON file of a model folder (empty where the folder has none)."""
    return json.loads(path.read_text()) if path.exists() else {}


def preprocess(model, images: list[np.ndarray], videos=()) -> Images:
    """The batch's images (RGB uint8 arrays) and videos ([frames, H, W, 3] uint8) preprocessed as
    the model's image processor (its family's `preprocess`)."""
    family = module(model.family)
    if family.KIND != "vision":
        raise ValueError(f"{model.folder} is a text-only model (no vision_encoder.onnx): it takes no images")
    return family.preprocess(model, images, videos)


def part_ids(layout, images: Images) -> list[list[int]]:
    """Each prompt's ids from its parts: ("text", ids) as they are, ("image", i) as image i's
    expansion, ("video", i) as video i's."""
    expansions = {"image": images.ids, "video": images.video_ids}
    return [[t for kind, part in parts for t in (part if kind == "text" else expansions[kind][part])]
            for parts in layout]


def image_inputs(model, ids: list[list[int]], images: Images, encode=None):
    """The vision.PromptImages of prompts `ids` holding `images`: the features of each prompt's
    image tokens (the vision encoder, or `encode`, run once over the batch's images, and once
    more over its videos) and, for Qwen2-VL, the M-RoPE positions."""
    _check_tokens(ids, images)
    features = images.encode(model, encode) if images.ids else np.zeros((0, model.graph.hidden_size), np.float32)
    videos = images.encode(model, encode, videos=True) if images.video_ids else None
    return _prompt_images(model, ids, images, features, videos)


def _check_tokens(ids: list[list[int]], images: Images) -> None:
    kinds = [("image", images.token, images.ids, images.features)]
    if images.video_ids:
        kinds.append(("video", images.video_token, images.video_ids, images.video_features))
    for kind, token, expansions, count in kinds:
        given = sum(int(np.count_nonzero(np.array(p, np.int64) == token)) for p in ids)
        if given != count:
            raise ValueError(f"the prompts hold {given} {kind} tokens (id {token}) for {len(expansions)} {kind}s of "
                             f"{count} features: a token id list holds {kind} tokens of no {kind}")


def _prompt_images(model, ids, images: Images, features: np.ndarray, videos: np.ndarray | None):
    """PromptImages from the features of all images [tokens, hidden] and of all videos (None: no videos)."""
    from .vision import PromptImages, split_features

    videos = None if videos is None else split_features(ids, videos, images.video_token)
    positions = module(images.family).positions(model, ids, images)
    return PromptImages(split_features(ids, features, images.token), positions, images.token, videos,
                        images.video_token if videos is not None else None)


def chat_images(conversations) -> list[list]:
    """The images of each conversation in order, (image, where): content parts {"type": "image",
    "image": ...} (or "path": a file), as transformers' processor.apply_chat_template collects them."""
    return [[(value, where) for kind, value, where in row if kind == "image"] for row in chat_media(conversations)]


def chat_media(conversations) -> list[list[tuple[str, object, str]]]:
    """The images and videos of each conversation in order, (kind, value, where): content parts
    {"type": "image", "image": ...} and {"type": "video", "video": ...} (or "path": a file), as
    transformers' processor.apply_chat_template collects them (remote "url"s are not fetched)."""
    out = []
    for c, messages in enumerate(conversations):
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError(f"conversations[{c}] must be a non-empty list of messages")
        found = []
        for m, message in enumerate(messages):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise ValueError(f"conversations[{c}][{m}] must be a message {{'role': ..., 'content': ...}}")
            content = message["content"]
            if isinstance(content, str):
                continue
            if not isinstance(content, (list, tuple)):
                raise ValueError(f"conversations[{c}][{m}].content must be a text or a list of parts")
            for p, part in enumerate(content):
                where = f"conversations[{c}][{m}].content[{p}]"
                if not isinstance(part, dict) or part.get("type") not in ("text", "image", "video"):
                    raise ValueError(f"{where} must be {{'type': 'text', 'text': ...}}, {{'type': 'image', 'image': "
                                     f"...}} or {{'type': 'video', 'video': ...}}, not {part!r:.80}")
                kind = part["type"]
                if kind != "text":
                    keys = [k for k in (kind, "path") if k in part]
                    if len(keys) != 1:
                        raise ValueError(f"{where}: {_a(kind)} part holds the {kind} under '{kind}' (or a file "
                                         "under 'path'); remote 'url's are not fetched")
                    found.append((kind, part[keys[0]], where))
        out.append(found)
    return out


def chat_ids(model, conversations, images: Images | None, add_generation_prompt: bool = True,
             variables: dict | None = None) -> list[list[int]]:
    """Each conversation's token ids as transformers 4.57 `processor.apply_chat_template(...,
    tokenize=True)`: the folder's template rendered, each image placeholder replaced by its
    image's expansion text and each video placeholder (Qwen2-VL's <|video_pad|>, where the batch
    has videos) by its video's (in order over the batch; images None: no images), the whole text
    tokenized with the tokenizer's special tokens unless it starts with the bos token (the
    processor's rule). `variables`: more of the template's variables (render_chat)."""
    import re

    from ..text.chat import chat_template, render_chat, special_tokens

    template, names = chat_template(model.folder), special_tokens(model.folder)
    tokenizer = model_tokenizer(model)
    expansions = {}  # placeholder -> (kind, its expansions in order)
    if images is not None:
        expansions[tokenizer.id_to_token(images.token)] = ("image", images.texts)
        if images.video_ids:
            expansions[tokenizer.id_to_token(images.video_token)] = ("video", images.video_texts)
    split = re.compile("(" + "|".join(map(re.escape, expansions)) + ")") if expansions else None
    out, used = [], dict.fromkeys(expansions, 0)
    for c, messages in enumerate(conversations):
        text = render_chat(template, list(messages), names, add_generation_prompt, variables)
        pieces = split.split(text) if split else [text]
        for k in range(1, len(pieces), 2):  # the placeholders, between the texts
            placeholder = pieces[k]
            kind, texts = expansions[placeholder]
            if used[placeholder] >= len(texts):
                raise ValueError(f"conversations[{c}]: the chat template wrote more {kind} placeholders "
                                 f"({placeholder}) than the conversations hold {kind}s ({len(texts)})")
            pieces[k] = texts[used[placeholder]]
            used[placeholder] += 1
        text = "".join(pieces)
        bos = names.get("bos_token")
        out.append(tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))).ids)
    for placeholder, (kind, texts) in expansions.items():
        if used[placeholder] != len(texts):
            raise ValueError(f"the chat template wrote {used[placeholder]} {kind} placeholders ({placeholder}) for "
                             f"{len(texts)} {kind}s")
    return out


# -- one image or video at a time (a server's vision replica encodes each apart, cached) --------
@dataclass
class ImageFeatures:
    """One image (or video) through the vision encoder: its layout in a prompt (an `Images` of
    one image or one video, without its pixels) and its features [tokens, hidden]."""

    images: Images
    features: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.features.nbytes


def encode_image(model, images: Images) -> ImageFeatures:
    """The features of one preprocessed image (`preprocess(model, [image])`), its pixels dropped:
    what places it in a prompt is its layout."""
    features = images.encode(model)
    images.pixel_values = np.zeros(0, np.float32)
    return ImageFeatures(images, features)


def encode_video(model, videos: Images) -> ImageFeatures:
    """The features of one preprocessed video (`preprocess(model, [], [video])`), its pixels
    dropped, as encode_image."""
    features = videos.encode(model, videos=True)
    videos.pixel_values = videos.video_pixels = np.zeros(0, np.float32)
    return ImageFeatures(videos, features)


def join_images(parts: list[ImageFeatures]) -> Images:
    """Several one-image or one-video layouts as one `Images`, in order, as `preprocess` would
    give for them together (Qwen2-VL's grids one array, Idefics3's one list; the videos' apart)."""
    first = parts[0].images
    layouts = [p.images for p in parts]
    videos = [p for p in layouts if p.video_ids]
    grids = module(first.family).join_grids([p.grids for p in layouts])
    return Images(first.family, first.pixel_values, grids, [i for p in layouts for i in p.ids],
                  [t for p in layouts for t in p.texts], first.token, sum(p.features for p in layouts),
                  None, np.concatenate([p.video_grids for p in videos]) if videos else None,
                  [i for p in videos for i in p.video_ids], videos[0].video_token if videos else -1,
                  sum(p.video_features for p in videos), [t for p in videos for t in p.video_texts])


def placed_images(model, ids: list[int], joined: Images, parts: list[ImageFeatures]):
    """The vision.PromptImages of one prompt `ids` holding the images and videos `parts`
    (joined: `join_images(parts)`), from their features as encoded, not encoded again."""
    _check_tokens([ids], joined)
    images = [p.features for p in parts if not p.images.video_ids]
    videos = [p.features for p in parts if p.images.video_ids]
    features = np.concatenate(images) if images else np.zeros((0, model.graph.hidden_size), np.float32)
    return _prompt_images(model, [ids], joined, features, np.concatenate(videos) if videos else None)


# -- prompts of a request (the vision-language families' `prepare`) -----------------------------
def prepare_parts(ctx, prompts, encode=None) -> Prepared:
    """Each prompt of a Qwen2-VL or Idefics3 (SmolVLM) model as its decoder ids and PromptImages
    (None without images): a list of parts, in order, each a text (tokenized without special
    tokens), a list of token ids, or an image (a PIL image, an [H, W, 3] uint8 array, encoded
    bytes, or a pathlib.Path). The ids are what the model's processor makes of the text with an
    image placeholder where each image is:

    - Qwen2-VL: an image becomes <|vision_start|>, one image token per feature, <|vision_end|>;
      pixels as Qwen2VLImageProcessor (`generation.families.images`), M-RoPE positions. A video part (a
      [frames, H, W, 3] uint8 array) becomes <|vision_start|>, its video tokens, <|vision_end|>,
      pixels as Qwen2VLImageProcessor(videos=...) with the video processor's settings
      (`generation.families.videos`), its features in the video tokens as transformers' second
      masked_scatter places them.
      encode: (pixel_values [patches, C*T*P*P], image_grid_thw [n, 3]) -> features [tokens, hidden]
      (default `vision.encode_images`), run on the images, then on the videos.
    - Idefics3: an image becomes Idefics3Processor's expansion of <image> (frames with row and
      column tokens, then the global image), tokenized; pixels as Idefics3ImageProcessor
      (`generation.families.idefics3`). encode: pixel_values [frames, 3, F, F] -> features
      [frames * image_seq_len, hidden] (default `idefics3.encode_frames`).

    encode runs the batch's images in order; a server runs it in its own deployment and caches
    features by image content.
    """
    model = ctx.model
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts, each a list of texts, token id lists and images")
    _check_encode(encode)
    layout, images, videos = _prompt_parts(model, prompts)
    if not images and not videos:
        return Prepared([[t for _, part in parts for t in part] for parts in layout], None)
    prepared = preprocess(model, images, videos)
    ids = part_ids(layout, prepared)
    return Prepared(ids, image_inputs(model, ids, prepared, encode))


def prepare_chat(ctx, conversations, encode=None, add_generation_prompt: bool = True) -> Prepared:
    """Each chat conversation of a Qwen2-VL or Idefics3 model as its decoder ids and PromptImages
    (None without images or videos): messages
    [{"role": ..., "content": text or [{"type": "text", "text": ...}, {"type": "image", "image":
    <image as prepare_parts takes it>} or {"type": "image", "path": <file>}, {"type": "video",
    "video": <a [frames, H, W, 3] uint8 array, a list of frames, or a video file's bytes>} or
    {"type": "video", "path": <video file>} (Qwen2-VL; `videos.video_frames`), ...]}].
    The prompt's ids are what transformers 4.57 `processor.apply_chat_template(conversation,
    add_generation_prompt=..., tokenize=True)` gives with the model folder's chat template;
    encode: as prepare_parts'."""
    from pathlib import Path

    from .images import load_image
    from .videos import takes_videos, video_frames

    model = ctx.model
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("conversations must be a non-empty list of conversations (lists of messages)")
    _check_encode(encode)
    images, videos = [], []
    for kind, value, where in (item for row in chat_media(conversations) for item in row):
        if model.vision_session is None:
            raise ValueError(f"{where} is {_a(kind)}, but {model.folder} is a text-only model (no "
                             f"vision_encoder.onnx): it takes no {kind}s")
        if kind == "image":
            images.append(load_image(Path(value) if isinstance(value, str) else value, where))
        elif not takes_videos(model):
            raise ValueError(f"{where} is a video, but {model.folder} is a {model.family} model: it takes no videos")
        else:
            videos.append(video_frames(value, where))
    prepared = preprocess(model, images, videos) if images or videos else None
    ids = chat_ids(model, conversations, prepared, add_generation_prompt)
    return Prepared(ids, image_inputs(model, ids, prepared, encode) if prepared is not None else None)


def _a(kind: str) -> str:
    return f"an {kind}" if kind == "image" else f"a {kind}"


def _check_encode(encode) -> None:
    if encode is not None and not callable(encode):
        raise ValueError(f"encode must be a function of the images' pixel values, not {encode!r}")


def _prompt_parts(model, prompts) -> tuple[list[list[tuple[str, object]]], list[np.ndarray], list[np.ndarray]]:
    """Per prompt its parts as ("text", ids), ("image", index into the images) or ("video",
    index into the videos), and the images (RGB uint8 arrays) and videos ([frames, H, W, 3]
    uint8 arrays) of all prompts in order."""
    from .images import load_image

    images, videos, layout = [], [], []
    tokenizer = None
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompts[{i}] must be a list of parts (texts, token id lists, images), "
                             f"not {type(prompt).__name__}")
        parts = []
        for j, part in enumerate(prompt):
            if isinstance(part, str):
                tokenizer = tokenizer or model_tokenizer(model)
                parts.append(("text", tokenizer.encode(part, add_special_tokens=False).ids))
            elif isinstance(part, (list, tuple)):
                parts.append(("text", list(part)))
            else:
                if model.vision_session is None:
                    raise ValueError(f"prompts[{i}][{j}] is an image, but {model.folder} is a text-only model "
                                     "(no vision_encoder.onnx): it takes no images")
                if isinstance(part, np.ndarray) and part.ndim == 4:
                    videos.append(part)
                    parts.append(("video", len(videos) - 1))
                    continue
                images.append(load_image(part, f"prompts[{i}][{j}]"))
                parts.append(("image", len(images) - 1))
        layout.append(parts)
    return layout, images, videos
