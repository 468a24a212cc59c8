"""Tasks over encoder-decoder and vision-language models: text, audio or images in, text out.

    ctx = generation.context(generation.load("marian-folder"), max_new_tokens=64)
    out = text_to_text(ctx, ["How are you?", "Good morning"])   # [TaskResult(text, tokens, ...)]
    out = speech_to_text(whisper_ctx, ["clip.wav", samples_16k], language="en")
    out = speech_to_text(whisper_ctx, ["hour.wav"], return_timestamps=True)  # out[0].segments
    out = image_text_to_text(qwen2vl_ctx, [["Describe", image, "in a word."], ["no image"]])
    out = image_chat(smolvlm_ctx, [[{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": "What is it?"}]}]])
    out = image_to_text(vit_gpt2_ctx, [image, "photo.png"])              # captions

Each task tokenizes or featurizes its batch, runs the encoder once (`generation.runtime.encoders`; a
server can run that step in its own deployment), and generates from the decoder's prompt
(decoder_start_token_id) with every setting of the context, beam search included. Whisper with
timestamps, or with audio longer than its window, decodes window after window
(`generation.families.whisper.longform`), running the encoder once per window. Vision-language prompts run the
vision encoder once per image (`generation.families.vision.encode_images`, or the caller's `encode`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from .core.context import Context
from .core.generate import Generated, generate
from .core.inputs import check_seeds
from .core.settings import SettingError
from .families.whisper.longform import ClipWindows, Segment, clip_windows, decode_windows, run_encoder, window_frames
from .runtime.encoders import EncoderOutputs, encode_audio, encode_cached, encode_pixels, encode_text
from .text.tokenizer import model_tokenizer


@dataclass
class TaskResult:
    """One source's output: its text, its tokens (without the decoder prompt and the final eos),
    and each token's log-probability when the context has token_logprobs. Whisper with
    timestamps: the tokens of its segments one after another (timestamp tokens included, as
    transformers returns them), the text without the timestamps, and the segments."""

    text: str
    tokens: list[int]
    logprobs: list[float] | None = None
    segments: list[Segment] | None = None


def decoder_start(ctx: Context) -> int:
    """The decoder's first token: generation_config.json, else config.json."""
    model = ctx.model
    for source in (model.generation_config, model.config):
        value = source.get("decoder_start_token_id")
        if isinstance(value, int):
            return value
    raise ValueError(f"{model.folder}: neither generation_config.json nor config.json gives decoder_start_token_id")


def encode_sources(ctx: Context, sources) -> EncoderOutputs:
    """Texts (tokenized with the model's tokenizer, special tokens added as transformers'
    tokenizer does) or token id lists, through the encoder. A source longer than the encoder's
    positions is an error naming it."""
    model = ctx.model
    if not isinstance(sources, (list, tuple)) or not sources:
        raise ValueError("sources must be a non-empty list of texts or token id lists")
    ids = []
    tokenizer = None
    for i, source in enumerate(sources):
        if isinstance(source, str):
            tokenizer = tokenizer or model_tokenizer(model)
            ids.append(tokenizer.encode(source).ids)
        elif isinstance(source, (list, tuple)) and all(isinstance(t, int) and 0 <= t < model.vocab_size for t in source):
            ids.append(list(source))
        else:
            raise ValueError(f"sources[{i}] must be a text or a list of token ids of this model, not {source!r:.60}")
        if not ids[-1]:
            raise ValueError(f"sources[{i}] is empty")
        limit = model.config.get("max_position_embeddings")
        if isinstance(limit, int) and len(ids[-1]) > limit:
            raise ValueError(f"sources[{i}] has {len(ids[-1])} tokens; the encoder takes at most {limit}")
    return encode_text(model, ids)


def encode_sources_cached(ctx: Context, sources: list, lookup, store) -> tuple[EncoderOutputs, int]:
    """`encode_sources` through `seq2seq.encode_cached`: a source's content is the source as
    given (text or ids), its value its (hidden states, source ids). Returns the outputs and how
    many sources ran through the encoder."""
    def encode(rows):
        out = encode_sources(ctx, [sources[i] for i in rows])
        return [((h, ids), h.nbytes) for h, ids in zip(out.hidden, out.source_ids)]

    values, computed = encode_cached(list(sources), lookup, store, encode)
    return EncoderOutputs([h for h, _ in values], [list(ids) for _, ids in values]), computed


def text_to_text(ctx: Context, sources, seeds=None) -> list[TaskResult]:
    """Translate / summarise / rewrite each source: its text, tokens and log-probabilities."""
    encoder = encode_sources(ctx, sources)
    prompts = [[decoder_start(ctx)]] * len(encoder)
    rows = generate(ctx, prompts, seeds=seeds, encoder=encoder)
    return [_result(ctx, row) for row in rows]


def _result(ctx: Context, row) -> TaskResult:
    tokens, logprobs = (row.tokens, row.logprobs) if isinstance(row, Generated) else (row, None)
    text = model_tokenizer(ctx.model).decode(tokens, skip_special_tokens=True) if ctx.model.tokenizer_path else ""
    return TaskResult(text, tokens, logprobs)


def _preprocessor(ctx: Context) -> dict:
    import json

    path = ctx.model.folder / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def whisper_prompts(ctx: Context, encoder: EncoderOutputs, language=None, task: str | None = None,
                    timestamps: bool = False) -> list[list[int]]:
    """Each clip's decoder prompt as transformers 4.57 Whisper builds it: <|startoftranscript|>,
    then for a multilingual model the language (given, or detected from the first step's logits
    over the language tokens) and the task (default transcribe), then <|notimestamps|> unless
    `timestamps`. `encoder`: the outputs of each clip's first window (what detection reads)."""
    config = ctx.model.generation_config
    start = decoder_start(ctx)
    prompts = [[start] for _ in range(len(encoder))]
    lang_to_id, task_to_id = config.get("lang_to_id") or {}, config.get("task_to_id") or {}
    if lang_to_id:
        if language is None:
            from .cache.cross import run_first_steps

            logits, _ = run_first_steps(ctx.model, [[start]] * len(encoder), encoder)
            ids = np.array(sorted(lang_to_id.values()))
            chosen = ids[logits[:, ids].argmax(axis=1)]
        else:
            languages = [language] * len(encoder) if isinstance(language, str) else list(language)
            if len(languages) != len(encoder):
                raise SettingError("language", f"language: give one language, or one per clip ({len(encoder)}), "
                                               f"not {len(languages)}")
            chosen = []
            for name in languages:
                token = name if name in lang_to_id else f"<|{str(name).lower()}|>"
                if token not in lang_to_id:
                    raise SettingError("language", f"language {name!r:.40} is not one of this model's: "
                                                   f"{', '.join(k.strip('<|>') for k in lang_to_id)}")
                chosen.append(lang_to_id[token])
        task = task or "transcribe"
        if task not in task_to_id:
            raise SettingError("task", f"task must be one of {', '.join(task_to_id)}, not {task!r:.40}")
        for prompt, lang in zip(prompts, chosen):
            prompt += [int(lang), int(task_to_id[task])]
    elif language is not None or task not in (None, "transcribe"):
        raise SettingError("language", f"{ctx.model.folder.name} is an English-only model: language and task do "
                                       "not apply")
    no_timestamps = config.get("no_timestamps_token_id")
    if no_timestamps is not None and not timestamps:
        for prompt in prompts:
            prompt.append(int(no_timestamps))
    return prompts


# Whisper generate options that change its output and that this engine does not implement
# (name: its off value): a model whose generation_config.json turns one on is refused rather
# than decoded differently. compression_ratio_threshold and logprob_threshold alone only choose
# a temperature fallback, which needs a list of temperatures: with one, the output is the same.
WHISPER_NOT_IMPLEMENTED = {"no_speech_threshold": None, "condition_on_prev_tokens": False}


@dataclass
class Speech:
    """Clips ready to decode (the first half of `speech_to_text`): their log-mel features, the
    encoder's outputs for their first windows, their decoder prompts (language given or
    detected) and seeds, whether they decode with timestamps, and the `encode` that runs the
    encoder on later windows."""

    features: object  # audio.LogMelFeatures
    first: EncoderOutputs
    prompts: list[list[int]]
    seeds: list[int]
    timestamps: bool
    encode: Callable

    def windows(self, ctx: Context) -> list[ClipWindows]:
        """Each clip's windows, to decode one after another (timestamps)."""
        return clip_windows(ctx, self.features.features, self.features.num_frames, self.prompts, self.seeds)


def prepare_speech(ctx: Context, audios, sampling_rate: int = 16000, language=None, task: str | None = None,
                   seeds=None, return_timestamps: bool | None = None, encode=None) -> Speech:
    """Everything `speech_to_text` does before decoding (its arguments, checked): the features,
    the first windows through the encoder, the prompts. A server decodes the result in its
    batch (a row per clip, or with timestamps a row per window)."""
    from .families.whisper import audio

    if not isinstance(audios, (list, tuple)) or not audios:
        raise ValueError("audios must be a non-empty list of arrays or audio files")
    if return_timestamps not in (None, True, False):
        raise ValueError(f"return_timestamps must be true, false or None, not {return_timestamps!r}")
    if ctx.settings.num_return_sequences > 1:
        raise ValueError(f"num_return_sequences={ctx.settings.num_return_sequences}: speech_to_text gives one "
                         "transcription per clip (set it to 1)")
    if encode is not None and not callable(encode):
        raise ValueError(f"encode must be a function of log-mel features, not {encode!r}")
    clips = [audio.load_audio(a) if isinstance(a, (str, bytes)) or hasattr(a, "__fspath__")
             else audio.load_audio(a, sampling_rate) for a in audios]
    seeds = check_seeds(seeds, len(clips))
    window = _preprocessor(ctx).get("chunk_length", audio.CHUNK_SECONDS)
    frames = window_frames(ctx)
    if round(window * audio.SAMPLING_RATE) // audio.HOP_LENGTH != frames:
        raise ValueError(f"{ctx.model.folder}: preprocessor_config.json's chunk_length ({window} s) is not the "
                         f"encoder's window ({frames} frames)")
    long_form = max(len(clip) for clip in clips) > window * audio.SAMPLING_RATE
    timestamps = _timestamps_on(ctx, clips, window, return_timestamps)
    encode = encode or (lambda features: encode_audio(ctx.model, features))
    n_mels = ctx.model.config.get("num_mel_bins", 80)
    features = audio.whisper_features(clips, n_mels=n_mels, long_form=long_form, chunk_seconds=window)
    first = run_encoder(encode, features.features[..., :frames])
    prompts = whisper_prompts(ctx, first, language, task, timestamps=timestamps)
    check_decoder_length(ctx, max(len(p) for p in prompts))
    return Speech(features, first, prompts, seeds, timestamps, encode)


def speech_to_text(ctx: Context, audios, sampling_rate: int = 16000, language=None, task: str | None = None,
                   seeds=None, return_timestamps: bool | None = None, encode=None) -> list[TaskResult]:
    """Transcribe (or translate) each clip: float arrays at `sampling_rate`, or audio files.
    Tokens, text and segments are what transformers 4.57 Whisper generate returns.

    return_timestamps: each result's segments (start and end in seconds, tokens, text), as
    `generate(return_timestamps=True, return_segments=True)`; None: generation_config.json's
    return_timestamps. A clip longer than the window (30 s for real Whisper models) is decoded
    window after window (`generation.families.whisper.longform`), which needs timestamps: None turns them on for
    the batch, unless generation_config.json sets return_timestamps false, which is an error
    then, as return_timestamps=False is (as in transformers).
    encode: [n, n_mels, frames] log-mel windows -> EncoderOutputs (default: this model's encoder).
    """
    speech = prepare_speech(ctx, audios, sampling_rate, language, task, seeds, return_timestamps, encode)
    if not speech.timestamps:
        rows = generate(ctx, speech.prompts, seeds=speech.seeds, encoder=speech.first)
        return [_result(ctx, row) for row in rows]
    segments = decode_windows(ctx, speech.features.features, speech.features.num_frames, speech.prompts,
                              speech.encode, speech.seeds, speech.first)
    return [timestamped(ctx, row) for row in segments]


def _timestamps_on(ctx: Context, clips, window: float, asked: bool | None) -> bool:
    """Whether the clips decode with timestamps, as transformers decides: `asked`, else the
    generation config's return_timestamps; a clip longer than the window needs them."""
    config = ctx.model.generation_config
    timestamps = config.get("return_timestamps") if asked is None else asked
    longest = int(np.argmax([len(clip) for clip in clips]))
    long_form = len(clips[longest]) > window * 16000
    if long_form and timestamps is False:
        source = "return_timestamps=False" if asked is False else "generation_config.json's return_timestamps is false"
        raise ValueError(f"audios[{longest}] lasts {len(clips[longest]) / 16000:.1f} s, longer than this model's "
                         f"{window} s window: long-form decoding needs timestamps, and {source} "
                         "(pass return_timestamps=True)")
    timestamps = bool(timestamps) or long_form
    for key, off in WHISPER_NOT_IMPLEMENTED.items():
        if config.get(key, off) not in (off, None) and (timestamps or key != "condition_on_prev_tokens"):
            raise ValueError(f"generation_config.json sets {key}={config[key]!r}; Whisper's {key} is not "
                             f"implemented here (set it to {off!r})")
    return timestamps


def check_decoder_length(ctx: Context, prompt: int) -> None:
    """As transformers' Whisper generate: the prompt and max_new_tokens within the decoder's positions."""
    limit, new = ctx.model.config.get("max_target_positions"), ctx.settings.max_new_tokens
    if isinstance(limit, int) and new is not None and new + prompt > limit:
        raise SettingError("max_new_tokens", f"max_new_tokens={new} and the {prompt}-token decoder prompt exceed "
                                             f"the decoder's {limit} positions: max_new_tokens can be at most "
                                             f"{limit - prompt}")


def timestamped(ctx: Context, segments: list[Segment]) -> TaskResult:
    """A clip's segments as a TaskResult: tokens one after another, text without timestamps."""
    begin = ctx.model.generation_config["no_timestamps_token_id"] + 1
    tokenizer = model_tokenizer(ctx.model) if ctx.model.tokenizer_path else None

    def text(tokens):
        return tokenizer.decode([t for t in tokens if t < begin], skip_special_tokens=True) if tokenizer else ""
    for segment in segments:
        segment.text = text(segment.tokens)
    tokens = [t for s in segments for t in s.tokens]
    logprobs = None if not ctx.token_logprobs else [p for s in segments for p in s.logprobs]
    return TaskResult(text(tokens), tokens, logprobs, segments)


def image_text_to_text(ctx: Context, prompts, seeds=None, encode=None) -> list[TaskResult]:
    """Answer each prompt of a Qwen2-VL or Idefics3 (SmolVLM) model: a list of parts, in order,
    each a text (tokenized without special tokens), a list of token ids, or an image (a PIL
    image, an [H, W, 3] uint8 array, encoded bytes, or a pathlib.Path). Tokens, text and
    log-probabilities are what transformers 4.57 generate gives with every setting of the
    context (beam search included), the prompt being what the model's processor makes of the
    text with an image placeholder where each image is:

    - Qwen2-VL: an image becomes <|vision_start|>, one image token per feature, <|vision_end|>;
      pixels as Qwen2VLImageProcessor (`generation.families.images`), M-RoPE positions. A video part (a
      [frames, H, W, 3] uint8 array) becomes <|vision_start|>, its video tokens, <|vision_end|>,
      pixels as Qwen2VLImageProcessor(videos=...), its features in the video tokens as
      transformers' second masked_scatter places them.
      encode: (pixel_values [patches, C*T*P*P], image_grid_thw [n, 3]) -> features [tokens, hidden]
      (default `vision.encode_images`), run on the images, then on the videos.
    - Idefics3: an image becomes Idefics3Processor's expansion of <image> (frames with row and
      column tokens, then the global image), tokenized; pixels as Idefics3ImageProcessor
      (`generation.families.idefics3`). encode: pixel_values [frames, 3, F, F] -> features
      [frames * image_seq_len, hidden] (default `idefics3.encode_frames`).

    encode runs the batch's images in order; a server runs it in its own deployment and caches
    features by image content.
    """
    from .families.vl_prompts import image_inputs, part_ids, preprocess

    model = ctx.model
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of prompts, each a list of texts, token id lists and images")
    _check_encode(encode)
    layout, images, videos = _prompt_parts(model, prompts)
    if not images and not videos:
        ids = [[t for _, part in parts for t in part] for parts in layout]
        return [_result(ctx, row) for row in generate(ctx, ids, seeds=seeds)]
    prepared = preprocess(model, images, videos)
    ids = part_ids(layout, prepared)
    inputs = image_inputs(model, ids, prepared, encode)
    return [_result(ctx, row) for row in generate(ctx, ids, seeds=seeds, encoder=inputs)]


def image_chat(ctx: Context, conversations, seeds=None, encode=None,
               add_generation_prompt: bool = True) -> list[TaskResult]:
    """Answer each chat conversation of a Qwen2-VL or Idefics3 model: messages
    [{"role": ..., "content": text or [{"type": "text", "text": ...}, {"type": "image", "image":
    <image as image_text_to_text takes it>} or {"type": "image", "path": <file>}, ...]}].
    The prompt's ids are what transformers 4.57 `processor.apply_chat_template(conversation,
    add_generation_prompt=..., tokenize=True)` gives with the model folder's chat template;
    tokens as image_text_to_text. encode: as image_text_to_text's."""
    from pathlib import Path

    from .families.images import load_image
    from .families.vl_prompts import chat_ids, chat_images, image_inputs, preprocess

    model = ctx.model
    if not isinstance(conversations, (list, tuple)) or not conversations:
        raise ValueError("conversations must be a non-empty list of conversations (lists of messages)")
    _check_encode(encode)
    found = chat_images(conversations)
    images = []
    for image, where in (item for row in found for item in row):
        if model.vision_session is None:
            raise ValueError(f"{where} is an image, but {model.folder} is a text-only model (no vision_encoder.onnx): "
                             "it takes no images")
        images.append(load_image(Path(image) if isinstance(image, str) else image, where))
    prepared = preprocess(model, images) if images else None
    ids = chat_ids(model, conversations, prepared, add_generation_prompt)
    inputs = image_inputs(model, ids, prepared, encode) if images else None
    return [_result(ctx, row) for row in generate(ctx, ids, seeds=seeds, encoder=inputs)]


def _check_encode(encode) -> None:
    if encode is not None and not callable(encode):
        raise ValueError(f"encode must be a function of the images' pixel values, not {encode!r}")


def _prompt_parts(model, prompts) -> tuple[list[list[tuple[str, object]]], list[np.ndarray], list[np.ndarray]]:
    """Per prompt its parts as ("text", ids), ("image", index into the images) or ("video",
    index into the videos), and the images (RGB uint8 arrays) and videos ([frames, H, W, 3]
    uint8 arrays) of all prompts in order."""
    from .families.images import load_image

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


def image_to_text(ctx: Context, images, seeds=None, encode=None) -> list[TaskResult]:
    """Caption each image with a vision-encoder-decoder (ViT encoder, GPT-2 decoder that
    cross-attends): images as `load_image` takes them (str: a file path), preprocessed as
    ViTImageProcessor; tokens and text as transformers 4.57 generate(pixel_values) gives them,
    with every setting of the context. encode: pixel_values [n, 3, H, W] -> EncoderOutputs
    (default: this model's encoder, `seq2seq.encode_pixels`), for a server's own deployment."""
    from pathlib import Path

    from .families.images import vit_pixels

    if not isinstance(images, (list, tuple)) or not images:
        raise ValueError("images must be a non-empty list of images")
    if ctx.model.encoder is None or not ctx.model.encoder.takes_images:
        raise ValueError(f"{ctx.model.folder} has no image encoder (a vision-encoder-decoder's encoder_model.onnx "
                         "taking pixel_values): it takes no images")
    if encode is not None and not callable(encode):
        raise ValueError(f"encode must be a function of pixel_values, not {encode!r}")
    pixels = vit_pixels([Path(i) if isinstance(i, str) else i for i in images], _preprocessor(ctx))
    encoder = (encode or (lambda p: encode_pixels(ctx.model, p)))(pixels)
    rows = generate(ctx, [[decoder_start(ctx)]] * len(images), seeds=seeds, encoder=encoder)
    return [_result(ctx, row) for row in rows]
