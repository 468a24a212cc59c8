"""Tasks over encoder-decoder models: text in or audio in, text out.

    ctx = generation.context(generation.load("marian-folder"), max_new_tokens=64)
    out = text_to_text(ctx, ["How are you?", "Good morning"])   # [TaskResult(text, tokens, ...)]
    out = speech_to_text(whisper_ctx, ["clip.wav", samples_16k], language="en")

Each task tokenizes or featurizes its batch, runs the encoder once (`generation.seq2seq`; a
server can run that step in its own deployment), and generates from the decoder's prompt
(decoder_start_token_id) with every setting of the context, beam search included.
"""

from __future__ import annotations

from dataclasses import dataclass

from .context import Context
from .generate import Generated, generate
import numpy as np

from .seq2seq import EncoderOutputs, encode_audio, encode_text
from .text import model_tokenizer


@dataclass
class TaskResult:
    """One source's output: its text, its tokens (without the decoder prompt and the final eos),
    and each token's log-probability when the context has token_logprobs."""

    text: str
    tokens: list[int]
    logprobs: list[float] | None = None


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
    over the language tokens) and the task (default transcribe), then <|notimestamps|>."""
    config = ctx.model.generation_config
    start = decoder_start(ctx)
    prompts = [[start] for _ in range(len(encoder))]
    lang_to_id, task_to_id = config.get("lang_to_id") or {}, config.get("task_to_id") or {}
    if lang_to_id:
        if language is None:
            from .seq2seq import run_first_steps

            logits, _ = run_first_steps(ctx.model, [[start]] * len(encoder), encoder)
            ids = np.array(sorted(lang_to_id.values()))
            chosen = ids[logits[:, ids].argmax(axis=1)]
        else:
            languages = [language] * len(encoder) if isinstance(language, str) else list(language)
            if len(languages) != len(encoder):
                raise ValueError(f"language: give one language, or one per clip ({len(encoder)}), not {len(languages)}")
            chosen = []
            for name in languages:
                token = name if name in lang_to_id else f"<|{str(name).lower()}|>"
                if token not in lang_to_id:
                    raise ValueError(f"language {name!r} is not one of this model's: "
                                     f"{', '.join(k.strip('<|>') for k in lang_to_id)}")
                chosen.append(lang_to_id[token])
        task = task or "transcribe"
        if task not in task_to_id:
            raise ValueError(f"task must be one of {', '.join(task_to_id)}, not {task!r}")
        for prompt, lang in zip(prompts, chosen):
            prompt += [int(lang), int(task_to_id[task])]
    elif language is not None or task not in (None, "transcribe"):
        raise ValueError(f"{ctx.model.folder} is an English-only model: language and task do not apply")
    if timestamps:
        raise ValueError("timestamps are not supported yet")
    no_timestamps = config.get("no_timestamps_token_id")
    if no_timestamps is not None:
        for prompt in prompts:
            prompt.append(int(no_timestamps))
    return prompts


def speech_to_text(ctx: Context, audios, sampling_rate: int = 16000, language=None, task: str | None = None,
                   seeds=None) -> list[TaskResult]:
    """Transcribe (or translate) each clip: float arrays at `sampling_rate`, or audio files.
    Clips up to one window long (30 s for real Whisper models); tokens and text are what
    transformers' Whisper generate returns (the decoder prompt dropped)."""
    from . import audio

    if not isinstance(audios, (list, tuple)) or not audios:
        raise ValueError("audios must be a non-empty list of arrays or audio files")
    clips = [audio.load_audio(a) if isinstance(a, (str, bytes)) or hasattr(a, "__fspath__")
             else audio.load_audio(a, sampling_rate) for a in audios]
    window = _preprocessor(ctx).get("chunk_length", audio.CHUNK_SECONDS)
    for i, clip in enumerate(clips):
        if len(clip) > window * audio.SAMPLING_RATE:
            raise ValueError(f"audios[{i}] lasts {len(clip) / audio.SAMPLING_RATE:.1f} s; this model's window is "
                             f"{window} s and long-form decoding is not supported yet")
    features = audio.whisper_features(clips, n_mels=ctx.model.config.get("num_mel_bins", 80), chunk_seconds=window)
    encoder = encode_audio(ctx.model, features.features)
    prompts = whisper_prompts(ctx, encoder, language, task)
    rows = generate(ctx, prompts, seeds=seeds, encoder=encoder)
    return [_result(ctx, row) for row in rows]
