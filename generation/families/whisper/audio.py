"""Whisper's audio front end: audio in (files, bytes, arrays), log-mel features out.

Features match transformers 4.57 `WhisperFeatureExtractor` (n_fft 400, hop 160, 30 s windows):
pad or cut each clip to 30 s, a centred Hann-window STFT with reflect padding, the power
spectrum through the slaney mel filter bank, log10 clamped at 1e-10, each clip's values held
within 8 of its maximum, then (x + 4) / 4. The last STFT frame is dropped, as transformers does,
so 30 s give 3000 frames. numpy only: decoding and resampling files need the `audio` extra.
"""

from __future__ import annotations

import functools
import importlib
import io
import math
import os
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SAMPLING_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
CHUNK_SECONDS = 30
N_FRAMES = CHUNK_SECONDS * SAMPLING_RATE // HOP_LENGTH  # 3000 frames in one window
MIN_SAMPLING_RATE = 1000
MAX_SAMPLING_RATE = 768000

_EXTRA_HINT = "install the audio extra: pip install 'raymuter[audio]'"


# --- features -------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogMelFeatures:
    """Encoder input for a batch of clips.

    features: [B, n_mels, T] float32 (T = 3000 for 30 s windows, more for long-form).
    attention_mask: [B, T] int32, 1 where the frame starts inside the clip: transformers'
    `return_attention_mask=True` (the sample mask taken every hop).
    """

    features: np.ndarray
    attention_mask: np.ndarray

    @property
    def num_frames(self) -> np.ndarray:
        """[B] frames of each clip: what Whisper long-form decodes up to (`attention_mask.sum(-1)`)."""
        return self.attention_mask.sum(axis=-1)


def mel_filters(n_mels: int, sampling_rate: int = SAMPLING_RATE) -> np.ndarray:
    """[N_FFT // 2 + 1, n_mels] float64, read-only: slaney-scale, slaney-normalised triangles.

    As transformers' `mel_filter_bank(norm="slaney", mel_scale="slaney")` with Whisper's band
    0..8000 Hz: mel centres evenly spaced on the slaney scale (linear below 1 kHz, logarithmic
    above), each triangle scaled by 2 / its width in Hz so that every band keeps equal energy.
    """
    _check_int("n_mels", n_mels, 1, 1024)
    _check_int("sampling_rate", sampling_rate, MIN_SAMPLING_RATE, MAX_SAMPLING_RATE)
    return _mel_filters(int(n_mels), int(sampling_rate))


@functools.lru_cache(maxsize=16)
def _mel_filters(n_mels: int, sampling_rate: int) -> np.ndarray:
    mel_edges = np.linspace(_hertz_to_mel(0.0), _hertz_to_mel(8000.0), n_mels + 2)
    hertz_edges = _mel_to_hertz(mel_edges)
    fft_hertz = np.linspace(0, sampling_rate // 2, N_FFT // 2 + 1)
    slopes = hertz_edges[None, :] - fft_hertz[:, None]  # [bins, n_mels + 2]
    widths = np.diff(hertz_edges)
    rising = -slopes[:, :-2] / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    triangles = np.maximum(0.0, np.minimum(rising, falling))
    triangles *= 2.0 / (hertz_edges[2:] - hertz_edges[:-2])
    triangles.setflags(write=False)
    return triangles


def _hertz_to_mel(hertz):
    hertz = np.asarray(hertz, np.float64)
    log_part = 15.0 + np.log(np.maximum(hertz, 1000.0) / 1000.0) * (27.0 / np.log(6.4))
    return np.where(hertz >= 1000.0, log_part, 3.0 * hertz / 200.0)


def _mel_to_hertz(mels):
    mels = np.asarray(mels, np.float64)
    log_part = 1000.0 * np.exp(np.log(6.4) / 27.0 * (np.maximum(mels, 15.0) - 15.0))
    return np.where(mels >= 15.0, log_part, 200.0 * mels / 3.0)


@functools.lru_cache(maxsize=1)
def hann_window() -> np.ndarray:
    """[N_FFT] float64, read-only: the periodic Hann window (`torch.hann_window(400)`)."""
    window = np.hanning(N_FFT + 1)[:-1]
    window.setflags(write=False)
    return window


def log_mel_spectrogram(
    waveforms: np.ndarray, n_mels: int = 80, sampling_rate: int = SAMPLING_RATE
) -> np.ndarray:
    """[B, L] float32 samples -> [B, n_mels, L // HOP_LENGTH] float32 Whisper log-mel.

    Frames are strided views of the reflect-padded batch, so one `rfft` call covers every frame
    of every clip. Computed in float64: transformers' numpy path within ~1e-7, its torch float32
    path within ~1e-4 (that path's own rounding near the clamp). 30 s of audio cost ~10 ms on
    one core (transformers' torch path: ~8 ms) and ~27 MB of temporaries, growing with B * L.
    """
    waveforms = np.asarray(waveforms, np.float32).astype(np.float64)
    padded = np.pad(waveforms, ((0, 0), (N_FFT // 2, N_FFT // 2)), mode="reflect")
    frames = sliding_window_view(padded, N_FFT, axis=-1)[:, ::HOP_LENGTH][:, :-1]  # [B, T, N_FFT]
    spectrum = np.fft.rfft(frames * hann_window(), axis=-1)  # [B, T, N_FFT // 2 + 1]
    power = spectrum.real**2 + spectrum.imag**2
    log_mel = np.log10(np.maximum(power @ mel_filters(n_mels, sampling_rate), 1e-10))  # [B, T, n_mels]
    log_mel = np.maximum(log_mel, log_mel.max(axis=(1, 2), keepdims=True) - 8.0)
    return np.ascontiguousarray(((log_mel + 4.0) / 4.0).transpose(0, 2, 1), dtype=np.float32)


def whisper_features(
    audios: Sequence[np.ndarray],
    n_mels: int = 80,
    sampling_rate: int = SAMPLING_RATE,
    long_form: bool = False,
    chunk_seconds: float = CHUNK_SECONDS,
) -> LogMelFeatures:
    """Log-mel features of a batch of mono clips of any lengths, as `WhisperFeatureExtractor`.

    `long_form=False`: each clip padded with zeros or cut to 30 s -> [B, n_mels, 3000], as
    `feature_extractor(audios, sampling_rate=16000, return_attention_mask=True)`.
    `long_form=True`: nothing is cut; every clip is padded to the longest one (and to at least
    30 s) -> [B, n_mels, T], as `truncation=False, padding="longest", return_attention_mask=True`
    when the longest clip has 30 s or more; shorter batches get the 30 s windows that transformers'
    docs then ask for. `num_frames` tells the decoder loop where each clip ends. `chunk_seconds`:
    the window (a model's preprocessor_config.json `chunk_length`; 30 for every real Whisper).

    >>> out = whisper_features([np.zeros(16000, np.float32), np.ones(800000, np.float32)])
    >>> out.features.shape, out.num_frames.tolist()
    ((2, 80, 3000), [100, 3000])
    >>> float(out.features[0].max())  # silence: the clamp at 1e-10, log10 -> -10, (x + 4) / 4
    -1.5
    >>> whisper_features([np.ones(800000, np.float32)], n_mels=128, long_form=True).features.shape
    (1, 128, 5000)
    """
    clips = _as_clips(audios)
    _check_int("sampling_rate", sampling_rate, MIN_SAMPLING_RATE, MAX_SAMPLING_RATE)
    if not isinstance(chunk_seconds, (int, float)) or isinstance(chunk_seconds, bool) or not 0 < chunk_seconds <= 600:
        raise ValueError(f"chunk_seconds must be a number of seconds in (0, 600], not {chunk_seconds!r}")
    window_samples = int(round(chunk_seconds * sampling_rate))
    lengths = np.array([len(clip) for clip in clips])
    total = max(window_samples, int(lengths.max())) if long_form else window_samples
    waveforms = np.zeros((len(clips), total), np.float32)
    for row, clip in enumerate(clips):
        waveforms[row, : min(len(clip), total)] = clip[:total]
    features = log_mel_spectrogram(waveforms, n_mels, sampling_rate)
    frame_starts = np.arange(features.shape[-1]) * HOP_LENGTH
    attention_mask = (frame_starts[None, :] < lengths[:, None]).astype(np.int32)
    return LogMelFeatures(features, attention_mask)


def _as_clips(audios) -> list[np.ndarray]:
    if isinstance(audios, np.ndarray) and audios.ndim < 2:
        raise ValueError(
            f"audios: expected a batch (a list of 1-D arrays), got one array of shape {audios.shape}; "
            "wrap a single clip in a list"
        )
    clips = [np.asarray(audio) for audio in audios]
    if not clips:
        raise ValueError("audios: the batch is empty")
    return [_checked_samples(f"audios[{index}]", clip) for index, clip in enumerate(clips)]


# --- loading --------------------------------------------------------------------------------


def load_audio(source, sampling_rate: float | None = None) -> np.ndarray:
    """Mono float32 samples at 16 kHz from a file path, the bytes of a file, or an array.

    Files (WAV, FLAC, OGG/Vorbis, MP3 where libsndfile >= 1.1 reads it, and the other formats
    of `soundfile`) are decoded with `soundfile`, their channels averaged (as transformers' ASR
    pipeline and librosa's `to_mono` do), then resampled with `soxr` at HQ quality (librosa's
    default resampler) to `ceil(n * 16000 / rate)` samples. An array must be 1-D, float and
    finite, and comes with its `sampling_rate`; a file's rate is read from the file.
    """
    if isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
        if sampling_rate is not None:
            raise ValueError(
                f"sampling_rate: {sampling_rate!r} given with a file; a file's rate is read from the file "
                "(pass a rate only with an array)"
            )
        samples, sampling_rate = _decode(source)
    else:
        if sampling_rate is None:
            raise ValueError("sampling_rate: required with an array of samples (the rate it was recorded at, in Hz)")
        samples = np.asarray(source)
        if not np.issubdtype(samples.dtype, np.floating):
            raise ValueError(
                f"audio: expected float samples in [-1, 1], got dtype {samples.dtype} "
                "(divide integer PCM by its full scale, e.g. 32768 for int16)"
            )
        samples = _checked_samples("audio", samples)
        _check_sampling_rate(sampling_rate)
    return _resample(samples, sampling_rate)


def _decode(source) -> tuple[np.ndarray, int]:
    """[n] float32 mono samples and the file's rate; ValueError naming the file when unreadable."""
    soundfile = _import_optional("soundfile")
    name = os.fspath(source) if isinstance(source, (str, os.PathLike)) else f"<{len(source)} bytes>"
    if isinstance(source, (str, os.PathLike)) and not os.path.isfile(source):
        raise ValueError(f"audio file {name!r}: no such file")
    try:
        file_or_buffer = source if isinstance(source, (str, os.PathLike)) else io.BytesIO(bytes(source))
        with soundfile.SoundFile(file_or_buffer) as file:
            rate = file.samplerate
            samples = file.read(dtype="float32", always_2d=True)  # [n, channels]
    except (RuntimeError, TypeError, ValueError) as error:  # soundfile's errors are RuntimeError
        raise ValueError(f"audio file {name!r}: cannot be decoded ({error})") from error
    if samples.shape[0] == 0:
        raise ValueError(f"audio file {name!r}: holds no samples")
    _check_sampling_rate(rate, f"audio file {name!r}: sampling_rate")
    if not np.isfinite(samples).all():
        raise ValueError(f"audio file {name!r}: holds non-finite samples (NaN or infinity)")
    return samples.mean(axis=1, dtype=np.float32), rate


def _resample(samples: np.ndarray, sampling_rate: float) -> np.ndarray:
    """[n] float32 at `sampling_rate` -> [ceil(n * 16000 / sampling_rate)] float32 at 16 kHz."""
    if sampling_rate == SAMPLING_RATE:
        return np.array(samples, np.float32)
    soxr = _import_optional("soxr")
    resampled = soxr.resample(samples, sampling_rate, SAMPLING_RATE, quality="HQ")
    length = math.ceil(len(samples) * SAMPLING_RATE / sampling_rate)
    out = np.zeros(length, np.float32)
    out[: min(length, len(resampled))] = resampled[:length]
    return out


def _import_optional(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise ImportError(f"{name} is needed to load audio: {_EXTRA_HINT}") from error


# --- validation -----------------------------------------------------------------------------


def _checked_samples(field: str, samples: np.ndarray) -> np.ndarray:
    """The samples as float32 (as transformers casts them), or a ValueError naming the field."""
    if samples.ndim != 1:
        raise ValueError(
            f"{field}: expected 1-D mono samples, got shape {samples.shape} (average the channels first)"
        )
    if samples.size == 0:
        raise ValueError(f"{field}: holds no samples")
    if not (np.issubdtype(samples.dtype, np.floating) or np.issubdtype(samples.dtype, np.integer)):
        raise ValueError(f"{field}: expected real samples, got dtype {samples.dtype}")
    with np.errstate(over="ignore"):  # a float64 past float32's range becomes inf: refused below
        samples = samples.astype(np.float32, copy=False)
    finite = np.isfinite(samples)
    if not finite.all():
        first = int(np.argmin(finite))
        raise ValueError(f"{field}: holds non-finite samples (NaN or infinity, in float32) at index {first}")
    return samples


def _check_sampling_rate(sampling_rate, field: str = "sampling_rate") -> None:
    if isinstance(sampling_rate, bool) or not isinstance(sampling_rate, (int, float, np.integer, np.floating)):
        raise ValueError(f"{field}: expected a number of Hz, got {sampling_rate!r}")
    if not MIN_SAMPLING_RATE <= sampling_rate <= MAX_SAMPLING_RATE:  # NaN fails too
        raise ValueError(
            f"{field}: {sampling_rate!r} Hz cannot be resampled to 16 kHz; "
            f"allowed {MIN_SAMPLING_RATE}..{MAX_SAMPLING_RATE} Hz"
        )


def _check_int(field: str, value, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not low <= value <= high:
        raise ValueError(f"{field}: {value!r} is not an integer in {low}..{high}")
