"""Whisper's audio front end against transformers 4.57 `WhisperFeatureExtractor`, and audio loading.

Invariants: features equal the extractor's within 1e-4 (its default torch float32 path) and
1e-5 (its float64 numpy path) for 80 and 128 mel bins, in 30 s windows and long-form; a batch
equals its clips one by one; a file loads to what decoding with soundfile, averaging channels
and resampling the array with soxr gives; every bad input raises a ValueError naming it.
"""

import functools
import math

import numpy as np
import pytest
import scipy.signal
import soundfile
import soxr
from transformers import WhisperFeatureExtractor

from generation.families.whisper import audio

RATE = audio.SAMPLING_RATE


@functools.cache
def extractor(n_mels):
    return WhisperFeatureExtractor(feature_size=n_mels)  # the defaults of whisper's config: nothing downloaded


def signal(kind, seconds, rate=RATE, seed=0):
    """[round(seconds * rate)] float32 synthetic audio."""
    t = np.arange(round(seconds * rate)) / rate
    if kind == "silence":
        x = np.zeros_like(t)
    elif kind == "tones":
        x = 0.5 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 3000 * t)
    elif kind == "noise":
        x = 0.3 * np.random.default_rng(seed).standard_normal(len(t))
    elif kind == "chirp":  # 50 Hz -> 8 kHz over the clip
        x = 0.8 * np.sin(2 * np.pi * (50 * t + (8000 - 50) / (2 * seconds) * t**2))
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


KINDS = ["silence", "tones", "noise", "chirp"]


def reference(n_mels, clips, **kwargs):
    return extractor(n_mels)(clips, sampling_rate=RATE, return_attention_mask=True, return_tensors="np", **kwargs)


class TestFilterBank:
    """The mel filters are transformers' slaney bank, computed here without transformers."""

    @pytest.mark.parametrize("n_mels", [80, 128])
    def test_equals_transformers(self, n_mels):
        np.testing.assert_allclose(audio.mel_filters(n_mels), extractor(n_mels).mel_filters, rtol=0, atol=1e-12)

    def test_cached_and_read_only(self):
        assert audio.mel_filters(80, 16000) is audio.mel_filters(80, 16000)
        with pytest.raises(ValueError, match="read-only"):
            audio.mel_filters(80, 16000)[0, 0] = 1.0


class TestFeatures:
    """Features equal WhisperFeatureExtractor's for every kind of audio and length."""

    @pytest.mark.parametrize("n_mels", [80, 128])
    @pytest.mark.parametrize("seconds", [1, 29.9, 30])
    def test_30s_windows_match_transformers(self, n_mels, seconds):
        clips = [signal(kind, seconds) for kind in KINDS]
        ours = audio.whisper_features(clips, n_mels=n_mels)
        assert ours.features.shape == (len(KINDS), n_mels, 3000) and ours.features.dtype == np.float32
        for row, clip in enumerate(clips):
            expected = reference(n_mels, clip)
            diff = np.abs(ours.features[row] - expected.input_features[0]).max()
            assert diff < 1e-4, (KINDS[row], diff)
            np.testing.assert_array_equal(ours.attention_mask[row], expected.attention_mask[0])
        assert ours.num_frames.tolist() == [min(3000, math.ceil(seconds * RATE / 160))] * len(KINDS)

    @pytest.mark.parametrize("n_mels", [80, 128])
    def test_float64_numpy_path_within_1e_5(self, n_mels):
        """Beside the torch path's float32 rounding, transformers' own numpy path agrees closer still."""
        clips = [signal(kind, 30) for kind in ("tones", "chirp")]
        ours = audio.whisper_features(clips, n_mels=n_mels).features
        theirs = extractor(n_mels)._np_extract_fbank_features(np.stack(clips), "cpu")
        assert np.abs(ours - theirs).max() < 1e-5

    @pytest.mark.parametrize("n_mels", [80, 128])
    def test_long_form_75s_matches_transformers(self, n_mels):
        clip = signal("chirp", 75) + signal("noise", 75) * 0.1
        ours = audio.whisper_features([clip], n_mels=n_mels, long_form=True)
        expected = reference(n_mels, clip, truncation=False, padding="longest")
        assert ours.features.shape == expected.input_features.shape == (1, n_mels, 7500)
        assert np.abs(ours.features - expected.input_features).max() < 1e-4
        np.testing.assert_array_equal(ours.attention_mask, expected.attention_mask)
        assert ours.num_frames.tolist() == [7500]

    def test_long_form_batch_of_different_lengths_matches_transformers(self):
        clips = [signal("tones", 75), signal("noise", 41.3), signal("chirp", 1), signal("silence", 30)]
        ours = audio.whisper_features(clips, long_form=True)
        expected = reference(80, clips, truncation=False, padding="longest")
        assert np.abs(ours.features - expected.input_features).max() < 1e-4
        np.testing.assert_array_equal(ours.attention_mask, expected.attention_mask)
        assert ours.num_frames.tolist() == [7500, 4130, 100, 3000]

    def test_long_form_of_short_clips_is_the_30s_window(self):
        clips = [signal("tones", 1), signal("noise", 12)]
        long_form = audio.whisper_features(clips, long_form=True)
        window = audio.whisper_features(clips)
        np.testing.assert_array_equal(long_form.features, window.features)
        np.testing.assert_array_equal(long_form.attention_mask, window.attention_mask)

    def test_batch_equals_one_by_one(self):
        clips = [signal("chirp", 3.3), signal("noise", 31, seed=2), signal("silence", 0.01), signal("tones", 17)]
        batch = audio.whisper_features(clips, n_mels=128)
        for row, clip in enumerate(clips):
            single = audio.whisper_features([clip], n_mels=128)
            np.testing.assert_array_equal(batch.features[row], single.features[0])
            np.testing.assert_array_equal(batch.attention_mask[row], single.attention_mask[0])

    def test_float64_and_integer_inputs_are_cast_as_transformers_does(self):
        clip = signal("tones", 2).astype(np.float64)
        np.testing.assert_array_equal(
            audio.whisper_features([clip]).features, audio.whisper_features([clip.astype(np.float32)]).features
        )
        pcm = (signal("noise", 2) * 1000).astype(np.int16)
        expected = reference(80, pcm.astype(np.float32)).input_features
        assert np.abs(audio.whisper_features([pcm]).features - expected).max() < 1e-4


def write(path, samples, rate, **kwargs):
    soundfile.write(path, samples, rate, **kwargs)
    return path


def resampled(samples, rate):
    """What the libraries' documented behaviour gives: soxr HQ, the length librosa fixes."""
    out = soxr.resample(samples, rate, RATE, quality="HQ")
    length = math.ceil(len(samples) * RATE / rate)
    return np.pad(out, (0, max(0, length - len(out))))[:length]


class TestLoadAudio:
    """A file loads as soundfile decodes it, its channels averaged, resampled by soxr to 16 kHz."""

    @pytest.mark.parametrize(
        "name, rate, channels, subtype",
        [("8k.wav", 8000, 1, "PCM_16"), ("44k.flac", 44100, 1, "PCM_24"), ("stereo.ogg", 44100, 2, "VORBIS"),
         ("stereo.wav", 48000, 2, "FLOAT"), ("16k.wav", 16000, 1, "PCM_16")],
    )
    def test_file_matches_resampling_the_array(self, tmp_path, name, rate, channels, subtype):
        left = signal("tones", 1.5, rate)
        samples = np.stack([left, signal("chirp", 1.5, rate) * 0.5], axis=1)[:, :channels]
        path = write(tmp_path / name, samples, rate, subtype=subtype)
        decoded, decoded_rate = soundfile.read(path, dtype="float32", always_2d=True)
        assert decoded_rate == rate
        mono = decoded.mean(axis=1, dtype=np.float32)
        loaded = audio.load_audio(path)
        assert loaded.dtype == np.float32 and loaded.shape == (math.ceil(len(left) * RATE / rate),)
        expected = mono if rate == RATE else resampled(mono, rate)
        np.testing.assert_allclose(loaded, expected, rtol=0, atol=1e-7)
        np.testing.assert_array_equal(loaded, audio.load_audio(mono, sampling_rate=rate))
        np.testing.assert_array_equal(loaded, audio.load_audio(path.read_bytes()))
        np.testing.assert_array_equal(loaded, audio.load_audio(str(path)))

    @pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
    def test_resampling_agrees_with_an_independent_polyphase_filter(self, rate):
        clip = signal("tones", 2, rate)
        ours = audio.load_audio(clip, sampling_rate=rate)
        g = math.gcd(rate, RATE)
        theirs = scipy.signal.resample_poly(clip.astype(np.float64), RATE // g, rate // g)
        assert len(ours) == len(theirs) == 2 * RATE
        assert np.abs(ours - theirs)[200:-200].max() < 5e-3  # filters differ; edges differ more

    def test_mp3_where_libsndfile_reads_it(self, tmp_path):
        if "MP3" not in soundfile.available_formats():
            pytest.skip(f"libsndfile {soundfile.__libsndfile_version__} has no MP3")
        clip = signal("tones", 2, 44100)
        loaded = audio.load_audio(write(tmp_path / "a.mp3", clip, 44100, format="MP3"))
        direct = audio.load_audio(clip, sampling_rate=44100)
        assert loaded.shape == direct.shape
        assert np.abs(loaded - direct)[1000:-1000].max() < 0.05  # a lossy codec, gapless in libsndfile

    def test_16k_array_is_a_float32_copy(self):
        clip = signal("noise", 1).astype(np.float64)
        loaded = audio.load_audio(clip, sampling_rate=16000)
        assert loaded.dtype == np.float32 and not np.shares_memory(loaded, clip)
        np.testing.assert_array_equal(loaded, clip.astype(np.float32))

    def test_missing_library_names_the_extra(self, monkeypatch):
        monkeypatch.setitem(__import__("sys").modules, "soxr", None)
        with pytest.raises(ImportError, match=r"raymuter\[audio\]"):
            audio.load_audio(signal("tones", 1, 8000), sampling_rate=8000)


class TestBadInput:
    """Each bad input raises a ValueError that names what was wrong."""

    def test_unreadable_file(self, tmp_path):
        path = tmp_path / "noise.wav"
        path.write_bytes(np.random.default_rng(0).bytes(4096))
        with pytest.raises(ValueError, match=r"noise\.wav.*cannot be decoded"):
            audio.load_audio(path)
        with pytest.raises(ValueError, match=r"<4096 bytes>.*cannot be decoded"):
            audio.load_audio(path.read_bytes())

    def test_empty_file(self, tmp_path):
        path = tmp_path / "empty.wav"
        path.write_bytes(b"")
        with pytest.raises(ValueError, match=r"empty\.wav.*cannot be decoded"):
            audio.load_audio(path)

    def test_file_without_samples(self, tmp_path):
        path = write(tmp_path / "zero.wav", np.zeros(0, np.float32), 16000)
        with pytest.raises(ValueError, match=r"zero\.wav.*holds no samples"):
            audio.load_audio(path)

    def test_missing_file(self, tmp_path):
        with pytest.raises(ValueError, match=r"nowhere\.wav.*no such file"):
            audio.load_audio(tmp_path / "nowhere.wav")

    @pytest.mark.parametrize("rate", [0, -8000, 1e12, 999, float("nan"), float("inf"), True, "16k"])
    def test_rate_that_cannot_be_resampled(self, rate):
        with pytest.raises(ValueError, match=r"sampling_rate"):
            audio.load_audio(signal("tones", 1), sampling_rate=rate)

    def test_file_at_a_rate_that_cannot_be_resampled(self, tmp_path):
        path = write(tmp_path / "slow.wav", signal("tones", 1, 500), 500)
        with pytest.raises(ValueError, match=r"slow\.wav.*sampling_rate: 500 Hz cannot be resampled"):
            audio.load_audio(path)

    def test_rate_given_with_a_file_or_missing_with_an_array(self, tmp_path):
        path = write(tmp_path / "a.wav", signal("tones", 1), 16000)
        with pytest.raises(ValueError, match=r"sampling_rate.*read from the file"):
            audio.load_audio(path, sampling_rate=16000)
        with pytest.raises(ValueError, match=r"sampling_rate: required"):
            audio.load_audio(signal("tones", 1))

    @pytest.mark.parametrize(
        "samples, message",
        [(np.zeros((2, 1600), np.float32), r"1-D.*\(2, 1600\)"), (np.zeros(0, np.float32), "no samples"),
         (np.array([0.0, np.nan, 0.0]), r"non-finite.*index 1"),
         (np.array([0.0, 0.0, np.inf]), r"non-finite.*index 2"), (np.array([0.0, 1e300]), r"non-finite.*index 1"),
         (np.zeros(1600, np.int16), "dtype int16")],
    )
    def test_bad_array_to_load(self, samples, message):
        with pytest.raises(ValueError, match=message):
            audio.load_audio(samples, sampling_rate=16000)

    @pytest.mark.parametrize(
        "audios, message",
        [([np.zeros((1600, 2), np.float32)], r"audios\[0\]: expected 1-D"),
         ([signal("tones", 1), np.array([np.nan])], r"audios\[1\].*non-finite"),
         (signal("tones", 1), "wrap a single clip in a list"), ([], "empty"),
         ([np.zeros(0)], r"audios\[0\].*no samples"), ([np.array([1j, 0j])], "complex")],
    )
    def test_bad_batch_to_features(self, audios, message):
        with pytest.raises(ValueError, match=message):
            audio.whisper_features(audios)

    @pytest.mark.parametrize("n_mels", [0, -80, 80.0, 5000])
    def test_bad_mel_count(self, n_mels):
        with pytest.raises(ValueError, match="n_mels"):
            audio.whisper_features([signal("tones", 1)], n_mels=n_mels)
