"""Tasks over encoder-decoder and vision-language models: text, audio or images in, text out.

    ctx = generation.context(generation.load("marian-folder"), max_new_tokens=64)
    out = text_to_text(ctx, ["How are you?", "Good morning"])   # [TaskResult(text, tokens, ...)]
    out = speech_to_text(whisper_ctx, ["clip.wav", samples_16k], language="en")
    out = speech_to_text(whisper_ctx, ["hour.wav"], return_timestamps=True)  # out[0].segments
    out = image_text_to_text(qwen2vl_ctx, [["Describe", image, "in a word."], ["no image"]])
    out = image_chat(smolvlm_ctx, [[{"role": "user", "content": [{"type": "image", "image": image},
                                                                 {"type": "text", "text": "What is it?"}]}]])
    out = image_chat(qwen2vl_ctx, [[{"role": "user", "content": [{"type": "video", "path": "clip.mp4"},
                                                                 {"type": "text", "text": "What happens?"}]}]])
    out = image_to_text(vit_gpt2_ctx, [image, "photo.png"])              # captions

Each task asks the model's family (`generation.families`) to prepare its batch: tokenize or
featurize it, run the encoder once (a server can run that step in its own deployment), and give
the decoder's prompts; then it generates with every setting of the context, beam search
included. Whisper with timestamps, or with audio longer than its window, decodes window after
window (`generation.families.whisper.windows`), running the encoder once per window.
Vision-language prompts run the vision encoder once per image (the family's, or the caller's
`encode`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .core.context import Context
from .engine.generate import Generated, generate
from .families import module, vl_prompts
from .families.whisper.windows import Segment, decode_windows, transcript
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


def _family(ctx: Context, task: str, names: tuple[str, ...], what: str):
    """The family module of the context's model, one of `names`; else an error naming the task."""
    if ctx.model.family not in names:
        raise ValueError(f"{task} takes {what}; {ctx.model.folder} is a {ctx.model.family} model")
    return module(ctx.model.family)


def text_to_text(ctx: Context, sources, seeds=None) -> list[TaskResult]:
    """Translate / summarise / rewrite each source: its text, tokens and log-probabilities."""
    prepared = _family(ctx, "text_to_text", ("seq2seq",), "an encoder-decoder text model (Marian, T5, BART)"
                       ).prepare(ctx, sources)
    rows = generate(ctx, prepared.prompts, seeds=seeds, encoder=prepared.encoder)
    return [_result(ctx, row) for row in rows]


def _result(ctx: Context, row) -> TaskResult:
    tokens, logprobs = (row.tokens, row.logprobs) if isinstance(row, Generated) else (row, None)
    text = model_tokenizer(ctx.model).decode(tokens, skip_special_tokens=True) if ctx.model.tokenizer_path else ""
    return TaskResult(text, tokens, logprobs)


def speech_to_text(ctx: Context, audios, sampling_rate: int = 16000, language=None, task: str | None = None,
                   seeds=None, return_timestamps: bool | None = None, encode=None, **options) -> list[TaskResult]:
    """Transcribe (or translate) each clip: float arrays at `sampling_rate`, or audio files.
    Tokens, text and segments are what transformers 4.57 Whisper generate returns.

    return_timestamps: each result's segments (start and end in seconds, tokens, text), as
    `generate(return_timestamps=True, return_segments=True)`; None: generation_config.json's
    return_timestamps. A clip longer than the window (30 s for real Whisper models) is decoded
    window after window (`generation.families.whisper.windows`), which needs timestamps: None turns them on for
    the batch, unless generation_config.json sets return_timestamps false, which is an error
    then, as return_timestamps=False is (as in transformers).
    encode: [n, n_mels, frames] log-mel windows -> EncoderOutputs (default: this model's encoder).
    options: is_multilingual, and Whisper's long-form options as transformers' generate takes
    them (`generation.families.whisper.options`): temperature (one, or a tuple to fall back
    through), compression_ratio_threshold, logprob_threshold, no_speech_threshold,
    condition_on_prev_tokens, prompt_ids (`whisper.prompt.prompt_ids` of a text),
    prompt_condition_type; each, when not given, generation_config.json's.
    """
    speech = _family(ctx, "speech_to_text", ("whisper",), "a Whisper model").prepare(
        ctx, audios, sampling_rate=sampling_rate, language=language, task=task, seeds=seeds,
        return_timestamps=return_timestamps, encode=encode, **options)
    if not speech.windowed:
        rows = generate(ctx, speech.prompts, seeds=speech.seeds, encoder=speech.encoder)
        return [_result(ctx, row) for row in rows]
    segments = decode_windows(ctx, speech.features.features, speech.features.num_frames, speech.prompts,
                              speech.encode, speech.seeds, speech.encoder, speech.options, speech.timestamps)
    if not speech.timestamps:
        return [replace(timestamped(ctx, row), segments=None) for row in segments]
    return [timestamped(ctx, row) for row in segments]


def timestamped(ctx: Context, segments: list[Segment]) -> TaskResult:
    """A clip's segments as a TaskResult: tokens one after another, text without timestamps."""
    text, tokens, logprobs = transcript(ctx, segments)
    return TaskResult(text, tokens, logprobs, segments)


def image_text_to_text(ctx: Context, prompts, seeds=None, encode=None) -> list[TaskResult]:
    """Answer each prompt of a Qwen2-VL or Idefics3 (SmolVLM) model: a list of parts, in order,
    each a text, a list of token ids, an image or (Qwen2-VL) a video, made into the prompt the
    model's processor makes of them, and `encode` (the vision encoder's stand-in, which a server
    runs in its own deployment) as `generation.families.vl_prompts.prepare_parts` says. Tokens,
    text and log-probabilities are what transformers 4.57 generate gives with every setting of
    the context (beam search included).
    """
    prepared = vl_prompts.prepare_parts(ctx, prompts, encode)
    return [_result(ctx, row) for row in generate(ctx, prepared.prompts, seeds=seeds, encoder=prepared.encoder)]


def image_chat(ctx: Context, conversations, seeds=None, encode=None,
               add_generation_prompt: bool = True) -> list[TaskResult]:
    """Answer each chat conversation of a Qwen2-VL or Idefics3 model: messages
    [{"role": ..., "content": text or [{"type": "text", "text": ...}, {"type": "image", "image":
    <image as image_text_to_text takes it>} or {"type": "image", "path": <file>}, and for
    Qwen2-VL {"type": "video", "video": <a [frames, H, W, 3] uint8 array, a list of frames, a video
    file's bytes>} or {"type": "video", "path": <video file, decoded with PyAV>}, ...]}].
    The prompt's ids are what transformers 4.57 `processor.apply_chat_template(conversation,
    add_generation_prompt=..., tokenize=True)` gives with the model folder's chat template;
    tokens as image_text_to_text. encode: as image_text_to_text's."""
    prepared = vl_prompts.prepare_chat(ctx, conversations, encode, add_generation_prompt)
    return [_result(ctx, row) for row in generate(ctx, prepared.prompts, seeds=seeds, encoder=prepared.encoder)]


def image_to_text(ctx: Context, images, seeds=None, encode=None) -> list[TaskResult]:
    """Caption each image with a vision-encoder-decoder (ViT encoder, GPT-2 decoder that
    cross-attends): images as `load_image` takes them (str: a file path), preprocessed as
    ViTImageProcessor; tokens and text as transformers 4.57 generate(pixel_values) gives them,
    with every setting of the context. encode: pixel_values [n, 3, H, W] -> EncoderOutputs
    (default: this model's encoder, `runtime.encoders.encode_pixels`), for a server's own deployment."""
    prepared = _family(ctx, "image_to_text", ("vit_gpt2",), "a vision-encoder-decoder (ViT + GPT-2)"
                       ).prepare(ctx, images, encode)
    rows = generate(ctx, prepared.prompts, seeds=seeds, encoder=prepared.encoder)
    return [_result(ctx, row) for row in rows]
