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
`image_inputs` then runs the vision encoder and returns the features and positions for
`generate(encoder=...)`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from ..text.tokenizer import model_tokenizer


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
    # tokens + vision_end), the video token id and the video tokens in all
    video_pixels: np.ndarray | None = None
    video_grids: np.ndarray | None = None
    video_ids: list[list[int]] = field(default_factory=list)
    video_token: int = -1
    video_features: int = 0

    def encode(self, model, encode=None, videos: bool = False) -> np.ndarray:
        """The features of the images (of the videos: `videos`), checked against their tokens."""
        from .idefics3 import encode_frames
        from .vision import encode_images

        if videos:
            features = (encode or (lambda p, g: encode_images(model, p, g)))(self.video_pixels, self.video_grids)
            return _checked(features, self.video_features, f"videos of grids {np.asarray(self.video_grids).tolist()}",
                            "video")
        if self.family == "idefics3":
            features = (encode or (lambda p: encode_frames(model, p)))(self.pixel_values)
            what = f"{len(self.pixel_values)} frames"
        else:
            features = (encode or (lambda p, g: encode_images(model, p, g)))(self.pixel_values, self.grids)
            what = f"images of grids {np.asarray(self.grids).tolist()}"
        return _checked(features, self.features, what, "image")


def _checked(features, count: int, what: str, kind: str) -> np.ndarray:
    features = np.asarray(features)
    if features.ndim != 2:
        raise ValueError(f"the vision encoder gave features of shape {features.shape}; expected [tokens, hidden]")
    if len(features) != count:
        raise ValueError(f"the vision encoder gave {len(features)} features for {count} {kind} tokens ({what})")
    return features


def family(model) -> str:
    kind = model.config.get("model_type")
    return "idefics3" if kind == "idefics3" else "qwen2_vl"


def _json(path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def preprocess(model, images: list[np.ndarray], videos=()) -> Images:
    """The batch's images (RGB uint8 arrays) and Qwen2-VL videos ([frames, H, W, 3] uint8)
    preprocessed as the model's image processor."""
    folder = model.folder
    if family(model) == "idefics3":
        if len(videos):
            raise ValueError(f"{folder} is an Idefics3 model: it takes images, not videos")
        from .idefics3 import idefics3_pixels, image_prompt, image_seq_len

        seq_len = image_seq_len(model, _json(folder / "processor_config.json"))
        pixel_values, grids = idefics3_pixels(images, _json(folder / "preprocessor_config.json"))
        texts = [image_prompt(rows, cols, seq_len) for rows, cols in grids]
        tokenizer = model_tokenizer(model)
        ids = [tokenizer.encode(text, add_special_tokens=False).ids for text in texts]
        token = model.config["image_token_id"]
        return Images("idefics3", pixel_values, grids, ids, texts, token, len(pixel_values) * seq_len)
    from .images import qwen2vl_pixels
    from .vision import VisionTokens

    tokens = VisionTokens.of(model.config)
    pixel_values, grids = qwen2vl_pixels(images, _json(folder / "preprocessor_config.json"))
    counts = (grids.prod(axis=1) // tokens.merge ** 2).tolist()
    pad = model_tokenizer(model).id_to_token(tokens.image) if model.tokenizer_path else ""
    ids = [[tokens.vision_start] + [tokens.image] * n + [tokens.vision_end] for n in counts]
    out = Images("qwen2_vl", pixel_values, grids, ids, [pad * n for n in counts], tokens.image, sum(counts))
    if len(videos):
        from .images import qwen2vl_video_pixels

        out.video_pixels, out.video_grids = qwen2vl_video_pixels(videos, _json(folder / "preprocessor_config.json"))
        counts = (out.video_grids.prod(axis=1) // tokens.merge ** 2).tolist()
        out.video_ids = [[tokens.vision_start] + [tokens.video] * n + [tokens.vision_end] for n in counts]
        out.video_token, out.video_features = tokens.video, sum(counts)
    return out


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
    from .vision import PromptImages, VisionTokens, rope_positions, split_features

    kinds = [("image", images.token, images.ids, images.features)]
    if images.video_ids:
        kinds.append(("video", images.video_token, images.video_ids, images.video_features))
    for kind, token, expansions, count in kinds:
        given = sum(int(np.count_nonzero(np.array(p, np.int64) == token)) for p in ids)
        if given != count:
            raise ValueError(f"the prompts hold {given} {kind} tokens (id {token}) for {len(expansions)} {kind}s of "
                             f"{count} features: a token id list holds {kind} tokens of no {kind}")
    features = images.encode(model, encode) if images.ids else np.zeros((0, model.graph.hidden_size), np.float32)
    videos = None
    if images.video_ids:
        videos = split_features(ids, images.encode(model, encode, videos=True), images.video_token)
    positions = [None] * len(ids)
    if images.family == "qwen2_vl":
        positions, _ = rope_positions(ids, VisionTokens.of(model.config), image_grids=images.grids,
                                      video_grids=images.video_grids if images.video_ids else ())
    return PromptImages(split_features(ids, features, images.token), positions, images.token, videos,
                        images.video_token if videos is not None else None)


def chat_images(conversations) -> list[list]:
    """The images of each conversation in order: content parts {"type": "image", "image": ...}
    (or "path": a file), as transformers' processor.apply_chat_template collects them."""
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
                if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
                    raise ValueError(f"{where} must be {{'type': 'text', 'text': ...}} or "
                                     f"{{'type': 'image', 'image': ...}}, not {part!r:.80}")
                if part["type"] == "image":
                    keys = [k for k in ("image", "path") if k in part]
                    if len(keys) != 1:
                        raise ValueError(f"{where}: an image part holds the image under 'image' (or a file under "
                                         "'path'); remote 'url's are not fetched")
                    found.append((part[keys[0]], where))
        out.append(found)
    return out


def chat_ids(model, conversations, images: Images | None, add_generation_prompt: bool = True,
             variables: dict | None = None) -> list[list[int]]:
    """Each conversation's token ids as transformers 4.57 `processor.apply_chat_template(...,
    tokenize=True)`: the folder's template rendered, each image placeholder replaced by its
    image's expansion text (in order over the batch; images None: no images), the whole text
    tokenized with the tokenizer's special tokens unless it starts with the bos token (the
    processor's rule). `variables`: more of the template's variables (render_chat)."""
    from ..text.chat import chat_template, render_chat, special_tokens

    template, names = chat_template(model.folder), special_tokens(model.folder)
    tokenizer = model_tokenizer(model)
    placeholder = tokenizer.id_to_token(images.token) if images is not None else None
    texts = images.texts if images is not None else []
    out, index = [], 0
    for c, messages in enumerate(conversations):
        text = render_chat(template, list(messages), names, add_generation_prompt, variables)
        pieces = text.split(placeholder) if placeholder else [text]
        text = pieces[0]
        for piece in pieces[1:]:
            if index >= len(texts):
                raise ValueError(f"conversations[{c}]: the chat template wrote more image placeholders "
                                 f"({placeholder}) than the conversations hold images ({len(texts)})")
            text += texts[index] + piece
            index += 1
        bos = names.get("bos_token")
        out.append(tokenizer.encode(text, add_special_tokens=not (bos and text.startswith(bos))).ids)
    if index != len(texts):
        raise ValueError(f"the chat template wrote {index} image placeholders ({placeholder}) for "
                         f"{len(texts)} images")
    return out


# -- one image at a time (a server's vision replica encodes each image apart, cached) ----------
@dataclass
class ImageFeatures:
    """One image through the vision encoder: its layout in a prompt (an `Images` of one image,
    without its pixels) and its features [tokens, hidden]."""

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


def join_images(parts: list[ImageFeatures]) -> Images:
    """Several one-image layouts as one `Images`, in order, as `preprocess` would give for them
    together (Qwen2-VL's grids one array, Idefics3's one list)."""
    first = parts[0].images
    layouts = [p.images for p in parts]
    grids = (np.concatenate([np.asarray(p.grids) for p in layouts]) if first.family == "qwen2_vl"
             else [g for p in layouts for g in p.grids])
    return Images(first.family, first.pixel_values, grids, [i for p in layouts for i in p.ids],
                  [t for p in layouts for t in p.texts], first.token, sum(p.features for p in layouts))


def placed_images(model, ids: list[int], joined: Images, parts: list[ImageFeatures]):
    """The vision.PromptImages of one prompt `ids` holding the images `parts` (joined:
    `join_images(parts)`), from their features as encoded, not encoded again."""
    features = np.concatenate([p.features for p in parts])
    return image_inputs(model, [ids], joined, encode=lambda *_: features)
