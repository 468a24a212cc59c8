"""Whisper's long-form options against transformers 4.57 generate: prompt_ids (both condition
types), condition_on_prev_tokens, the temperature fallback (compression_ratio_threshold,
logprob_threshold) and no_speech_threshold, each on clips where it changes the output.

Sampling is compared exactly: transformers' `torch.multinomial` is replaced, for the test, by
the engine's own inverse-CDF draw from its counter-based uniforms (logits.rng), with the seeds the
engine gives a clip's k-th decode (`derived_seed(seed, k)`, one decode per window and try), so
a fallback at a temperature above 0 draws the same tokens in both. (The tiny fixture's window
is 2 s: max_source_positions 100, 200 mel frames.)
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import generation
from generation import tasks
from generation.logits.rng import derived_seed, uniforms
from test_whisper_windows import hf_features, hf_rows

EOT = 883
PREV = 896  # <|startofprev|>


@pytest.fixture(scope="module")
def model(s2s, load_model):
    return load_model(s2s["whisper-optimum"])


@contextlib.contextmanager
def engine_sampling(seed: int):
    """transformers' multinomial draws as the engine's: the c-th generate call of the clip (one
    window's try) samples with derived_seed(seed, c), its n-th draw with uniform n."""
    import torch
    from transformers.generation.utils import GenerationMixin

    calls, draws = [-1], [0]
    generate, multinomial = GenerationMixin.generate, torch.multinomial

    def counted(self, *args, **kwargs):
        calls[0] += 1
        draws[0] = 0
        return generate(self, *args, **kwargs)

    def drawn(probs, num_samples=1, *args, **kwargs):
        assert probs.shape[0] == 1 and num_samples == 1
        u = uniforms(np.array([derived_seed(seed, calls[0])], np.uint64), np.array([draws[0]], np.uint64))
        draws[0] += 1
        cdf = np.cumsum(probs.double().numpy(), axis=1)
        token = min(int((cdf < u[:, None] * cdf[:, -1:]).sum()), probs.shape[1] - 1)
        return torch.tensor([[token]])

    GenerationMixin.generate, torch.multinomial = counted, drawn
    try:
        yield
    finally:
        GenerationMixin.generate, torch.multinomial = generate, multinomial


@pytest.fixture(scope="module")
def hf(whisper_hf):
    return whisper_hf


def reference(hf, clip, seed: int = 0, **settings):
    """transformers generate(return_segments=True) of one clip: (tokens, [(start, end, tokens)])."""
    import torch

    model, extractor = hf
    features = hf_features(extractor, [clip], settings)
    if "prompt_ids" in settings:
        settings["prompt_ids"] = torch.tensor(settings["prompt_ids"])
    with torch.no_grad(), engine_sampling(seed):
        out = model.generate(features, return_segments=True, **settings)
    return hf_rows(out, 1)[0]


def ours(model, clip, seed: int = 0, max_new_tokens: int = 8, **options):
    ctx = generation.context(model, max_new_tokens=max_new_tokens)
    r = tasks.speech_to_text(ctx, [clip], seeds=[seed], **options)[0]
    return r.tokens, [(s.start, s.end, s.tokens) for s in r.segments or []]


def noise(seconds, scale, seed):
    return (np.random.default_rng(seed).standard_normal(int(seconds * 16000)) * scale).astype(np.float32)


LONG = noise(9, 0.3, 4)  # 5 windows and more
SHORT = noise(1.2, 0.2, 1)


def same(model, hf, clip, expect_change: dict | None = None, seed: int = 0, max_new_tokens: int = 8, **options):
    """Ours equals transformers with `options`; and, against `expect_change` (the options
    without the one under test), transformers' output differs (the option does something)."""
    expected = reference(hf, clip, seed, max_new_tokens=max_new_tokens, **options)
    got = ours(model, clip, seed, max_new_tokens, **options)
    if not options.get("return_timestamps"):
        expected = (expected[0], [])
    assert got == expected
    if expect_change is not None:
        assert reference(hf, clip, seed, max_new_tokens=max_new_tokens, **expect_change) != expected
    return expected


def test_prompt_ids_are_transformers_get_prompt_ids(s2s, model):
    from transformers import WhisperProcessor

    from generation.families.whisper.prompt import prompt_ids

    processor = WhisperProcessor.from_pretrained(s2s["hf/whisper"])
    for text in ("hello there", "  Quilter  ", "a, b; c?"):
        assert prompt_ids(model, text) == processor.get_prompt_ids(text).tolist()
    with pytest.raises(ValueError, match="prompt: .*<|en|>"):
        prompt_ids(model, "say <|en|> now")


@pytest.mark.parametrize("timestamps", [False, True], ids=["plain", "timestamps"])
def test_prompt_ids_short_form(model, hf, timestamps):
    from generation.families.whisper.prompt import prompt_ids

    ids = prompt_ids(model, "the quick brown fox")
    settings = dict(language="en", return_timestamps=timestamps)
    same(model, hf, SHORT, settings, prompt_ids=ids, **settings)


@pytest.mark.parametrize("kind", ["first-segment", "all-segments"])
def test_prompt_ids_long_form(model, hf, kind):
    from generation.families.whisper.prompt import prompt_ids

    ids = prompt_ids(model, "jumps over the lazy dog")
    settings = dict(language="en", return_timestamps=True, condition_on_prev_tokens=kind == "all-segments")
    out = same(model, hf, LONG, settings, prompt_ids=ids, prompt_condition_type=kind, max_new_tokens=6, **settings)
    assert len(out[1]) > 3


def test_condition_on_previous_tokens(model, hf):
    settings = dict(language="en", return_timestamps=True)
    out = same(model, hf, LONG, settings, condition_on_prev_tokens=True, max_new_tokens=6, **settings)
    assert len(out[1]) > 3


def mean_logprobs(model, clip, max_new_tokens=8):
    """Each window's mean log-probability (eos included) when greedy: where to set thresholds."""
    ctx = generation.context(model, max_new_tokens=max_new_tokens, token_logprobs=True)
    r = tasks.speech_to_text(ctx, [clip], language="en", return_timestamps=True)[0]
    return [float(np.mean(s.logprobs)) for s in r.segments]


@pytest.mark.parametrize("seed", [0, 1])
def test_temperature_fallback_on_logprob_threshold(model, hf, seed):
    rated = mean_logprobs(model, LONG, 6)
    threshold = float(np.median(rated))  # about half the windows fall back
    settings = dict(language="en", return_timestamps=True, temperature=(0.0, 0.4, 0.8))
    same(model, hf, LONG, settings, seed, max_new_tokens=6, logprob_threshold=threshold, **settings)


def test_temperature_fallback_on_compression_ratio(model, hf):
    settings = dict(language="en", return_timestamps=True, temperature=(0.0, 0.6))
    same(model, hf, LONG, settings, 3, max_new_tokens=12, compression_ratio_threshold=1.0, **settings)


def test_fallback_with_condition_on_previous_tokens(model, hf):
    """A window that ends at a temperature of 0.5 or more stops the conditioning of the next."""
    rated = mean_logprobs(model, LONG, 6)
    settings = dict(language="en", return_timestamps=True, temperature=(0.0, 0.6), condition_on_prev_tokens=True)
    same(model, hf, LONG, settings, 2, max_new_tokens=6, logprob_threshold=float(np.median(rated)), **settings)


def test_short_clip_fallback_without_timestamps(model, hf):
    settings = dict(language="en", temperature=(0.0, 1.0))
    same(model, hf, SHORT, settings, 5, logprob_threshold=0.0, **settings)


def test_no_speech_threshold_skips_windows(model, hf):
    """Every window is below logprob_threshold 0; those whose <|nospeech|> probability is above
    the median are skipped (no segment, seek past the window)."""
    from generation.families.whisper import audio
    from generation.families.whisper.windows import clip_windows
    from generation.families.whisper.options import WhisperOptions
    from generation.runtime.encoders import encode_audio

    ctx = generation.context(model)
    features = audio.whisper_features([LONG], chunk_seconds=2, long_form=True)
    clip = clip_windows(ctx, features.features, features.num_frames, [[884, 885, 894]], [0],
                        WhisperOptions(logprob_threshold=0.0, no_speech_threshold=0.5))[0]
    probs = []
    while not clip.done:  # each window's probability, as if none were skipped
        encoder = encode_audio(model, clip.inputs()[None])
        clip.rate_silence(model, encoder)
        probs.append(clip.no_speech)
        clip.seek += clip.window
    # halfway between the two middle probabilities: with an odd count the median is one window's
    # own, and which side of it that window's probability falls (ours, transformers') is float noise
    ordered = sorted(probs)
    threshold = float(ordered[len(ordered) // 2 - 1] + ordered[len(ordered) // 2]) / 2
    assert ordered[len(ordered) // 2 - 1] < threshold < ordered[len(ordered) // 2], probs
    # transformers rates a window's log-probabilities only with a temperature given (None fails there)
    settings = dict(language="en", return_timestamps=True, logprob_threshold=0.0, temperature=0.0)
    out = same(model, hf, LONG, settings, max_new_tokens=6, no_speech_threshold=threshold, **settings)
    assert out[1], "every window was skipped"
