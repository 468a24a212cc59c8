"""Whisper with timestamps and long-form audio against transformers 4.57 `generate`.

Invariants: with return_timestamps=True, a batch of short clips of different lengths gets
transformers' tokens and segments (start, end, tokens), its segment re-decode loop included; a
batch of clips longer than the window (the tiny fixture's window is 2 s: a 75 s clip is 38
windows) beside shorter ones decodes window after window to the same tokens and segments as
transformers' long-form generate, language given or detected, greedy or with beams; the window
split equals transformers' `_retrieve_segment` on any token sequence; the encoder runs through
the `encode` callable once per step; options not implemented and bad inputs are errors naming
the field.
"""

from __future__ import annotations

import numpy as np
import pytest

import generation
from generation import tasks
from generation.families.whisper.timestamps import Piece, split_segments

EOT, BEGIN = 883, 899  # the tiny Whisper's eos and <|0.00|>


@pytest.fixture(scope="module")
def model(s2s, load_model):
    return load_model(s2s["whisper-optimum"])


@pytest.fixture(scope="module")
def hf(whisper_hf):
    return whisper_hf


def reference(hf, clips, **settings):
    """transformers' generate(return_timestamps=True, return_segments=True) per clip: (tokens,
    [(start, end, tokens)]). Features as its docs say: one window each, or the whole clips with
    their attention mask when the longest is longer than a window."""
    import torch

    model, extractor = hf
    features = hf_features(extractor, clips, settings)
    with torch.no_grad():
        out = model.generate(features, return_timestamps=True, return_segments=True, **settings)
    return hf_rows(out, len(clips))


def hf_features(extractor, clips, settings: dict):
    """The clips' input features for transformers' generate: one window each, or the whole clips
    when the longest is longer than a window, their attention mask then put in `settings`."""
    if max(len(c) for c in clips) > extractor.n_samples:
        inputs = extractor(clips, sampling_rate=16000, return_tensors="pt", truncation=False, padding="longest",
                           return_attention_mask=True)
        settings["attention_mask"] = inputs.attention_mask
    else:
        inputs = extractor(clips, sampling_rate=16000, return_tensors="pt")
    return inputs.input_features


def hf_rows(out, count: int) -> list:
    """generate(return_segments=True)'s output per clip: (tokens, [(start, end, tokens)])."""
    rows = []
    for b in range(count):
        tokens = out["sequences"][b].tolist()
        while tokens and tokens[-1] == EOT:  # right padding (pad = eos); segments never hold eos
            tokens.pop()
        rows.append((tokens, [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in out["segments"][b]]))
    return rows


def ours(results):
    return [(r.tokens, [(s.start, s.end, s.tokens) for s in r.segments]) for r in results]


def noise(seconds, scale, seed):
    return (np.random.default_rng(seed).standard_normal(int(seconds * 16000)) * scale).astype(np.float32)


def short_clips():
    tone = np.sin(np.arange(24000) / 16000 * 2 * np.pi * 440).astype(np.float32)
    return [noise(1, 0.1, 0), tone, noise(0.5, 1.0, 1)]


def long_clips():
    tone = np.sin(np.arange(80000) / 16000 * 2 * np.pi * 440).astype(np.float32)
    return [noise(75, 0.1, 2), tone, noise(1.3, 0.3, 3), noise(9, 0.3, 4)]


@pytest.mark.parametrize("settings", [dict(language="en"), dict()], ids=["english", "detect"])
def test_short_clips_with_timestamps_equal_transformers(model, hf, settings):
    got = tasks.speech_to_text(generation.context(model), short_clips(), return_timestamps=True, **settings)
    expected = reference(hf, short_clips(), **settings)
    assert ours(got) == expected
    assert all(len(segments) > 1 for _, segments in expected)


# max_new_tokens 6 ends windows after a lone timestamp (no speech after it: seek past the window)
# and after a pair (seek to it); 3 leaves windows with no pair (one segment to the last timestamp)
@pytest.mark.parametrize("settings", [dict(language="en", max_new_tokens=6), dict(max_new_tokens=3)],
                         ids=["english", "detect-no-pairs"])
def test_long_clips_equal_transformers_long_form(model, hf, settings):
    ctx = generation.context(model, max_new_tokens=settings["max_new_tokens"])
    got = tasks.speech_to_text(ctx, long_clips(), language=settings.get("language"), return_timestamps=True)
    expected = reference(hf, long_clips(), **settings)
    assert ours(got) == expected
    assert expected[0][1][-1][0] > 70 and expected[2][1][-1][0] < 2  # the 75 s clip is read to its end


def test_a_clip_a_little_longer_than_the_window(model, hf):
    """32100 samples give 200 frames: transformers decodes them as one window with the segment loop."""
    clip = noise(32100 / 16000, 0.1, 5)
    for clips in ([clip], [clip, noise(0.5, 1.0, 1)]):
        got = tasks.speech_to_text(generation.context(model), clips, language="en", return_timestamps=True)
        assert ours(got) == reference(hf, clips, language="en")


def test_beams_with_timestamps_equal_transformers(model, hf):
    clips = long_clips()[1:3]
    got = tasks.speech_to_text(generation.context(model, num_beams=3, max_new_tokens=10), clips, language="en",
                               return_timestamps=True)
    assert ours(got) == reference(hf, clips, language="en", num_beams=3, max_new_tokens=10)


def test_text_leaves_the_timestamps_out_as_the_whisper_tokenizer(model, s2s):
    from transformers import WhisperTokenizerFast

    tokenizer = WhisperTokenizerFast.from_pretrained(s2s["hf/whisper"])
    for result in tasks.speech_to_text(generation.context(model), short_clips(), language="en", return_timestamps=True):
        assert any(t >= BEGIN for t in result.tokens)
        assert result.text == tokenizer.decode(result.tokens, skip_special_tokens=True)
        assert [s.text for s in result.segments] == [tokenizer.decode(s.tokens, skip_special_tokens=True)
                                                     for s in result.segments]


def test_the_encoder_runs_through_encode_once_per_step(model):
    shapes = []

    def encode(features):
        shapes.append(features.shape)
        return generation.runtime.encoders.encode_audio(model, features)

    ctx = generation.context(model, max_new_tokens=6)
    clips = [noise(5, 0.1, 6), noise(1, 0.1, 7)]
    got = tasks.speech_to_text(ctx, clips, language="en", encode=encode, return_timestamps=True)
    assert ours(got) == ours(tasks.speech_to_text(ctx, clips, language="en", return_timestamps=True))
    # the first window's encoding (language detection's input) is reused where a window is the
    # clip's first 200 frames: the 5 s clip's first step; the 1 s clip is zero-padded there
    assert shapes[0] == (2, 80, 200) and shapes[1] == (1, 80, 200)
    assert all(s[1:] == (80, 200) for s in shapes) and len(shapes) >= 4


def test_logprobs_follow_the_tokens(model):
    clips = short_clips()
    plain = tasks.speech_to_text(generation.context(model), clips, language="en", return_timestamps=True)
    got = tasks.speech_to_text(generation.context(model, token_logprobs=True), clips, language="en",
                               return_timestamps=True)
    assert ours(got) == ours(plain)
    for result in got:
        assert len(result.logprobs) == len(result.tokens)
        assert [p for s in result.segments for p in s.logprobs] == result.logprobs
        assert all(p <= 0 for p in result.logprobs)


def test_sampling_is_seeded_and_batch_independent(model):
    ctx = generation.context(model, max_new_tokens=8, do_sample=True, temperature=1.3, top_k=0)
    clips = [noise(3, 0.1, 8), noise(5, 0.1, 9)]
    def run(clips, seeds):
        return ours(tasks.speech_to_text(ctx, clips, language="en", seeds=seeds, return_timestamps=True))
    first = run(clips, [1, 2])
    assert run(clips, [1, 2]) == first
    assert run(clips[1:], [2]) == first[1:]
    assert run(clips, [3, 4]) != first


def test_bad_inputs_name_the_field(model, monkeypatch):
    ctx = generation.context(model, max_new_tokens=4)
    long = [noise(3, 0.1, 0)]
    with pytest.raises(ValueError, match=r"audios\[0\] lasts 3.0 s.*needs timestamps, and return_timestamps=False"):
        tasks.speech_to_text(ctx, long, return_timestamps=False)
    with pytest.raises(ValueError, match=r"generation_config.json's return_timestamps is false \(pass return_timestamps"):
        tasks.speech_to_text(ctx, long)
    with pytest.raises(ValueError, match="return_timestamps must be true, false or None, not 'yes'"):
        tasks.speech_to_text(ctx, long, return_timestamps="yes")
    with pytest.raises(ValueError, match="encode must be a function"):
        tasks.speech_to_text(ctx, long, encode="encoder")
    with pytest.raises(ValueError, match=r"encode returned 3 rows for 1 windows"):
        tasks.speech_to_text(ctx, long, language="en", return_timestamps=True,
                             encode=lambda f: generation.runtime.encoders.encode_audio(model, f.repeat(3, 0)))
    with pytest.raises(ValueError, match="num_return_sequences=2: speech_to_text gives one transcription per clip"):
        tasks.speech_to_text(generation.context(model, num_beams=2, num_return_sequences=2), long, language="en")
    with pytest.raises(ValueError, match="max_new_tokens=126 .* at most 125"):
        tasks.speech_to_text(generation.context(model, max_new_tokens=126), long, language="en", return_timestamps=True)
    monkeypatch.setitem(model.generation_config, "no_speech_threshold", 0.6)  # transformers fails on this too
    with pytest.raises(ValueError, match="no_speech_threshold: .* set logprob_threshold too"):
        tasks.speech_to_text(ctx, long, language="en", return_timestamps=True)
    monkeypatch.delitem(model.generation_config, "no_speech_threshold")
    for options, setting in ((dict(prompt_condition_type="all-segments"), "prompt_condition_type"),
                             (dict(temperature=(0.0, -0.2)), "temperature"), (dict(prompt_ids=[10**6]), "prompt_ids"),
                             (dict(logprob_threshold=0.5), "logprob_threshold")):
        with pytest.raises(ValueError) as raised:
            tasks.speech_to_text(ctx, long, language="en", return_timestamps=True, **options)
        assert raised.value.setting == setting


@pytest.mark.parametrize("seed", range(60))
def test_split_segments_equals_transformers_retrieve_segment(seed):
    import torch
    from transformers.models.whisper.generation_whisper import WhisperGenerationMixin

    rng = np.random.default_rng(seed)
    length = int(rng.integers(1, 14))
    stamp_rate = rng.choice([0.0, 0.3, 0.6])
    tokens = np.where(rng.random(length) < stamp_rate, rng.integers(BEGIN, BEGIN + 101, length),
                      rng.integers(0, 880, length))
    if seed % 4 == 0:
        tokens[-1] = BEGIN  # <|0.00|> last
    frames, seek = int(rng.integers(1, 201)), int(rng.integers(0, 7000))
    offset = seek * 0.02 / 2
    segments, advance = WhisperGenerationMixin._retrieve_segment(
        seek_sequence=torch.tensor(tokens), seek_outputs=[None], time_offset=torch.tensor([seek], dtype=torch.float64) * 0.02 / 2,
        timestamp_begin=BEGIN, seek_num_frames=torch.tensor([frames]), time_precision=0.02, time_precision_features=0.01,
        input_stride=2, prev_idx=0, idx=0, return_token_timestamps=False, decoder_input_ids=torch.zeros((1, 3)))
    pieces, got = split_segments(tokens.tolist(), BEGIN, offset, frames)
    assert got == int(advance)
    assert [(p.start, p.end, tokens[p.lo:p.hi].tolist()) for p in pieces] == \
        [(float(s["start"]), float(s["end"]), s["tokens"].tolist()) for s in segments]


def test_split_segments_window_end_as_transformers_float32_for_every_frame_count():
    """Without timestamps a segment ends at the window's end, which transformers computes in
    float32 (frames * 0.01 / 0.02, truncated): the same for every frame count of a real window."""
    import torch

    expected = [int(torch.tensor(n) * 0.01 / 0.02) for n in range(1, 3001)]
    got = [round(split_segments([7], BEGIN, 0.0, n)[0][0].end / 0.02) for n in range(1, 3001)]
    assert got == expected


def test_split_segments_worked_examples():
    # pairs, then a lone timestamp at the end: every segment kept, next window after this one
    assert split_segments([899, 5, 909, 909, 6, 919], BEGIN, 2.0, 200) == (
        [Piece(2.0, 2.2, 0, 3), Piece(2.2, 2.4, 3, 6)], 200)
    # the tokens after the last pair are dropped: the next window starts at <|0.40|>, 40 frames on
    pieces, advance = split_segments([899, 5, 909, 909, 6, 919, 919, 7], BEGIN, 0.0, 200)
    assert [(p.lo, p.hi) for p in pieces] == [(0, 3), (3, 7)] and pieces[-1].end == 0.4 and advance == 40
    # no pair: one segment to the last timestamp; with none, to the window's end (150 frames: 1.5 s)
    assert split_segments([903, 5, 6, 924], BEGIN, 0.0, 150) == ([Piece(0.0, 0.5, 0, 4)], 150)
    assert split_segments([5, 6], BEGIN, 1.0, 150) == ([Piece(1.0, 2.5, 0, 2)], 150)


def test_windows_are_rows_of_the_decoders_batch(model):
    """Through the decoder's service (deployments/services/generator.py, no Ray): a long clip with
    timestamps is decoded a row per window in the continuous batch, beside short transcriptions
    without timestamps; each equals speech_to_text, and model runs held a window and another
    request's row together."""
    import asyncio
    import threading

    from deployments.schema import TranscriptionRequest
    from deployments.services.generator import TextGenerator

    generator = TextGenerator.from_model(model.folder, slots=4, max_logprobs=-1, max_new_tokens=12)
    scheduler, runs = generator.batcher.scheduler, []
    cache, batcher = scheduler.state.cache, generator.batcher
    decode, submit = cache.decode, batcher.submit
    # The order is made, not left to the threads' timing (a short clip could otherwise end before
    # the long one's first window is in): the short clips are encoded once a window is in the
    # batch, and the step that first holds a window waits until both were submitted.
    window_in, shorts_in, short_submits = threading.Event(), threading.Event(), []

    def recorded(lengths, span=None):
        rows = list(scheduler.holder.values())
        windows, others = (sum(j.settings.timestamp_rules is not None for j in rows),
                           sum(j.settings.timestamp_rules is None for j in rows))
        runs.append((windows, others))
        if windows and not window_in.is_set():
            window_in.set()
            shorts_in.wait(timeout=60)
        return decode(lengths, span)

    def submitted(*args, timestamps=False, **kwargs):
        request = submit(*args, timestamps=timestamps, **kwargs)
        if not timestamps:
            short_submits.append(request)
            if len(short_submits) == 2:
                shorts_in.set()
        return request

    cache.decode, batcher.submit = recorded, submitted

    def encode(features):
        return generation.runtime.encoders.encode_audio(model, features)

    def encode_after_a_window(features):
        window_in.wait(timeout=60)
        return encode(features)

    long, short = noise(5, 0.1, 6), [noise(1, 0.1, 7), noise(1.5, 0.2, 8)]
    requests = [(long, TranscriptionRequest(language="en", timestamps=True), encode)] + [
        (clip, TranscriptionRequest(language="en", seed=i), encode_after_a_window) for i, clip in enumerate(short)]

    async def run():
        return await asyncio.gather(*[generator.transcribe(clip, request, coder) for clip, request, coder in requests])

    try:
        got = asyncio.run(run())
    finally:
        generator.close()
    ctx = generation.context(model, max_new_tokens=12)
    expected = tasks.speech_to_text(ctx, [long], language="en", return_timestamps=True)[0]
    assert got[0].tokens == expected.tokens
    assert [(s.start, s.end, s.tokens) for s in got[0].segments] == [(s.start, s.end, s.tokens) for s in expected.segments]
    for result, clip in zip(got[1:], short):
        assert result.tokens == tasks.speech_to_text(ctx, [clip], language="en")[0].tokens
    assert len(expected.segments) > 1 and any(windows and others for windows, others in runs), runs
