"""Speech-to-text (Whisper, short-form) against transformers' Whisper `generate()`.

Invariants: for a batch of clips of different lengths, the tokens equal transformers' for each
clip alone, with a given language, with translate, and with language detection; the decoder
prompt is the one transformers builds; files load like arrays; sampling is seeded and batch
independent; bad audio, an unknown language and a clip longer than the window without
timestamps say what is wrong. (The tiny fixture's window is 2 s: max_source_positions 100, 200
mel frames.) Timestamps and long-form: test_whisper_windows.py.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation import tasks
from generation.families.whisper import speech


@pytest.fixture(scope="module")
def model(s2s, load_model):
    return load_model(s2s["whisper-optimum"])


@pytest.fixture(scope="module")
def reference(whisper_hf):
    import torch

    hf, extractor = whisper_hf

    def generate(clip, **settings):
        features = extractor(clip, sampling_rate=16000, return_tensors="pt").input_features
        with torch.no_grad():
            return hf.generate(features, **settings)[0].tolist()
    return generate


def clips():
    rng = np.random.default_rng(0)
    tone = np.sin(np.arange(24000) / 16000 * 2 * np.pi * 440).astype(np.float32)
    return [rng.standard_normal(16000).astype(np.float32) * 0.1, tone, rng.standard_normal(8000).astype(np.float32)]


@pytest.mark.parametrize("settings", [dict(language="en"), dict(language="de", task="translate"), dict()],
                         ids=["english", "translate", "detect"])
def test_speech_to_text_equals_transformers(model, reference, settings):
    ctx = generation.context(model, max_new_tokens=24)
    got = tasks.speech_to_text(ctx, clips(), **settings)
    for clip, result in zip(clips(), got):
        assert result.tokens == reference(clip, max_new_tokens=24, **settings)
        assert isinstance(result.text, str)


def test_decoder_prompt_and_language_detection(model):
    ctx = generation.context(model)
    lang_to_id = model.generation_config["lang_to_id"]
    features = generation.families.whisper.audio.whisper_features(clips(), chunk_seconds=2)
    encoder = generation.runtime.encoders.encode_audio(model, features.features)
    given = speech.whisper_prompts(ctx, encoder, language="de", task="translate")
    assert given == [[884, lang_to_id["<|de|>"], 893, 898]] * 3
    detected = speech.whisper_prompts(ctx, encoder)
    assert all(p[0] == 884 and p[1] in lang_to_id.values() and p[2:] == [894, 898] for p in detected)


def test_files_load_like_arrays(model, tmp_path):
    import soundfile

    ctx = generation.context(model, max_new_tokens=10)
    path = tmp_path / "clip.wav"
    soundfile.write(path, clips()[0], 16000, subtype="FLOAT")
    from_file = tasks.speech_to_text(ctx, [str(path)], language="en")[0].tokens
    assert from_file == tasks.speech_to_text(ctx, clips()[:1], language="en")[0].tokens


def test_sampling_is_seeded_and_batch_independent(model):
    ctx = generation.context(model, max_new_tokens=12, do_sample=True, temperature=1.2, top_k=0)
    first = [r.tokens for r in tasks.speech_to_text(ctx, clips(), language="en", seeds=[1, 2, 3])]
    assert [r.tokens for r in tasks.speech_to_text(ctx, clips(), language="en", seeds=[1, 2, 3])] == first
    assert tasks.speech_to_text(ctx, clips()[1:2], language="en", seeds=[2])[0].tokens == first[1]


def test_bad_audio_says_what_is_wrong(model, tmp_path):
    ctx = generation.context(model, max_new_tokens=4)
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    with pytest.raises(ValueError, match="bad.wav"):
        tasks.speech_to_text(ctx, [str(bad)])
    with pytest.raises(ValueError, match=r"audios\[0\] lasts 3.0 s, longer than this model's 2 s window"):
        tasks.speech_to_text(ctx, [np.zeros(48000, np.float32)])
    with pytest.raises(ValueError, match="language 'xx' is not a Whisper language"):
        tasks.speech_to_text(ctx, clips()[:1], language="xx")
    with pytest.raises(ValueError, match="task must be one of"):
        tasks.speech_to_text(ctx, clips()[:1], language="en", task="summarise")


def test_cached_window_encoding_equals_the_plain_encoder(model):
    """encode_audio_cached (a server's encoder replica) gives encode_audio's hidden states, and a
    window seen before (same shape and bytes) is not encoded again."""
    from generation.runtime.encoders import encode_audio, encode_audio_cached

    frames = 2 * model.config["max_source_positions"]
    windows = np.random.default_rng(0).standard_normal((2, model.config["num_mel_bins"], frames)).astype(np.float32)
    kept = {}

    def store(content, hidden, nbytes):
        kept[content] = hidden

    plain = encode_audio(model, windows)
    out, computed = encode_audio_cached(model, windows, kept.get, store)
    assert computed == 2 and all(np.array_equal(a, b) for a, b in zip(out.hidden, plain.hidden))
    again, computed = encode_audio_cached(model, windows[::-1].astype(np.float64), kept.get, store)
    assert computed == 0 and np.array_equal(again.hidden[0], plain.hidden[1])
