"""Encoder-decoder models (Marian, T5, BART, Whisper, a ViT + GPT-2 vision-encoder-decoder): the
encoder run, the decoder's first step, and the decoder's cache.

The encoder runs once per request (`encode_text`, `encode_audio`, `encode_pixels`: a separate
callable, so a server can run it in its own deployment and hand the decoder only the hidden
states). The decoder's first step runs its prompt (decoder_start_token_id, or Whisper's forced
prefix) with no cache (`use_cache_branch` False, empty pasts) and computes the cross-attention
cache (`present.N.encoder.*`); later steps feed it back unchanged (their encoder presents are
dummies). A GPT-2 decoder keeps no cross cache: it takes encoder_hidden_states at every step. The decoder takes no position_ids: positions come from the cache length, so the rows
of one group share a decoder length (they all start at the same prompt length and step
together), and sources of different lengths batch with `encoder_attention_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EncoderOutputs:
    """The encoder's outputs, one entry per row: hidden states [S_b, H] (float32) and, for text
    encoders, the source token ids (encoder_repetition_penalty and encoder_no_repeat_ngram_size
    read them; None for audio)."""

    hidden: list[np.ndarray]
    source_ids: list[list[int]] | None = None

    def take(self, rows) -> "EncoderOutputs":
        rows = list(rows)
        return EncoderOutputs([self.hidden[i] for i in rows],
                              None if self.source_ids is None else [self.source_ids[i] for i in rows])

    def __len__(self) -> int:
        return len(self.hidden)


def join_outputs(outputs: list[EncoderOutputs]) -> EncoderOutputs:
    """The rows of several EncoderOutputs as one batch's, in order (an encoder-decoder's jobs
    admitted together; every job has its own)."""
    ids = None if outputs[0].source_ids is None else [i for e in outputs for i in e.source_ids]
    return EncoderOutputs([h for e in outputs for h in e.hidden], ids)


def encode_text(model, sources: list[list[int]]) -> EncoderOutputs:
    """Run a text encoder over `sources` (token id lists of any lengths, padded together)."""
    encoder = model.encoder
    if encoder is None or "input_ids" not in encoder.input_names:
        raise ValueError(f"{model.folder} has no text encoder (encoder inputs: {encoder and encoder.input_names})")
    if not sources or any(len(s) == 0 for s in sources):
        raise ValueError("sources must be non-empty token id lists")
    lengths = [len(s) for s in sources]
    pad = model.config.get("pad_token_id") or 0
    ids = np.full((len(sources), max(lengths)), pad, np.int64)
    mask = np.zeros_like(ids)
    for i, s in enumerate(sources):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    feeds = {"input_ids": ids}
    if "attention_mask" in encoder.input_names:
        feeds["attention_mask"] = mask
    hidden = encoder.session.run([encoder.output_name], feeds)[0]
    return EncoderOutputs([hidden[i, :n] for i, n in enumerate(lengths)], [list(map(int, s)) for s in sources])


def encode_audio(model, features: np.ndarray) -> EncoderOutputs:
    """Run an audio encoder (Whisper) over log-mel `features` [B, n_mels, frames]."""
    encoder = model.encoder
    if encoder is None or not encoder.takes_audio:
        raise ValueError(f"{model.folder} has no audio encoder (encoder inputs: {encoder and encoder.input_names})")
    hidden = encoder.session.run([encoder.output_name], {"input_features": np.asarray(features, np.float32)})[0]
    return EncoderOutputs(list(hidden))


def encode_cached(contents: list, lookup, store, encode) -> tuple[list, int]:
    """Each item's encoding, an item seen before taken from a cache the caller keeps (a server's
    encoder replica): `lookup(content)` gives an item's value or None, `store(content, value,
    nbytes)` keeps one, `encode(rows)` gives the missing rows' (value, nbytes) pairs. Returns the
    values in order and how many were encoded."""
    values = [lookup(c) for c in contents]
    todo = [i for i, v in enumerate(values) if v is None]
    if todo:
        for i, (value, nbytes) in zip(todo, encode(todo)):
            values[i] = value
            store(contents[i], value, nbytes)
    return values, len(todo)


def encode_audio_cached(model, windows, lookup, store) -> tuple[EncoderOutputs, int]:
    """Whisper's encoder over log-mel `windows` [n, n_mels, frames] (one row each, as
    `windows.run_encoder` hands them to its `encode`), through `encode_cached`: a window's
    content is its (shape, bytes), its value its hidden states. Returns the outputs and how many
    windows ran through the encoder."""
    windows = np.ascontiguousarray(windows, np.float32)

    def encode(rows):
        return [(h, h.nbytes) for h in encode_audio(model, windows[rows]).hidden]

    hidden, computed = encode_cached([(w.shape, w.tobytes()) for w in windows], lookup, store, encode)
    return EncoderOutputs(hidden), computed


def encode_pixels(model, pixel_values: np.ndarray) -> EncoderOutputs:
    """Run an image encoder (a vision-encoder-decoder's ViT) over `pixel_values` [B, C, H, W]."""
    encoder = model.encoder
    if encoder is None or not encoder.takes_images:
        raise ValueError(f"{model.folder} has no image encoder (encoder inputs: {encoder and encoder.input_names})")
    hidden = encoder.session.run([encoder.output_name], {"pixel_values": np.asarray(pixel_values, np.float32)})[0]
    return EncoderOutputs(list(hidden))
