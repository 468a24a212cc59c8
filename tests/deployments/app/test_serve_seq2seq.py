"""Encoder-decoder models through the server: the Encoder deployment runs sources and audio, the
decoder generates from its outputs (never opened by the ingress). Marian completions equal
`text_to_text`; Whisper's audio routes equal `speech_to_text` (short clips, timestamps,
translation, long-form over several windows); bad files get 400 naming `file`."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest

import generation
from generation.tasks import speech_to_text, text_to_text


@pytest.fixture(scope="module")
def marian(serve_apps, load_model):
    return load_model(serve_apps.s2s["marian-optimum"])


@pytest.fixture(scope="module")
def whisper(serve_apps, load_model):
    return load_model(serve_apps.s2s["whisper-optimum"])


def wav(seconds: float, seed: int = 0) -> tuple[bytes, np.ndarray]:
    import soundfile as sf

    from generation.families.whisper.audio import load_audio

    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    clip = (0.3 * np.sin(2 * np.pi * (200 + 300 * seed) * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, clip, 16000, format="WAV", subtype="FLOAT")
    data = buffer.getvalue()
    return data, load_audio(data)


def test_marian_completions_equal_text_to_text(serve_apps, marian):
    sources = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [30, 31]]
    for i, source in enumerate(sources):
        out = httpx.post(serve_apps.translate + "/v1/completions", json=dict(model="marian", prompt=source),
                         timeout=60).json()
        assert out["choices"][0]["text"] == text_to_text(generation.context(marian, max_new_tokens=12), [source])[0].text
    sampled = dict(model="marian", prompt=sources[1], seed=4, temperature=0.8, top_k=10)
    out = httpx.post(serve_apps.translate + "/v1/completions", json=sampled, timeout=60).json()
    expected = text_to_text(generation.context(marian, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=10),
                            [sources[1]], seeds=[4])[0].text
    assert out["choices"][0]["text"] == expected
    streamed = httpx.post(serve_apps.translate + "/v1/completions", json={**sampled, "stream": True}, timeout=60)
    pieces = [line for line in streamed.text.splitlines() if line.startswith("data: {")]
    import json

    assert "".join(json.loads(p[6:])["choices"][0]["text"] for p in pieces) == expected


def test_marian_bad_sources(serve_apps, marian):
    too_long = list(range(5, 5 + marian.config["max_position_embeddings"] + 1))
    out = httpx.post(serve_apps.translate + "/v1/completions", json=dict(model="marian", prompt=too_long), timeout=60)
    assert out.status_code == 400 and out.json()["error"]["param"] == "prompt"
    assert "the encoder takes at most" in out.json()["error"]["message"]
    out = httpx.post(serve_apps.translate + "/v1/chat/completions",
                     json=dict(model="marian", messages=[{"role": "user", "content": "x"}]), timeout=60)
    assert out.status_code == 400 and out.json()["error"]["param"] == "messages"


def transcribe(url, data, route="transcriptions", **fields):
    return httpx.post(f"{url}/v1/audio/{route}", files={"file": ("clip.wav", data)},
                      data={"model": "whisper", **fields}, timeout=120)


def test_transcriptions_equal_speech_to_text(serve_apps, whisper):
    from test_serve import metric

    queued = "raymuter:request_queue_time_seconds_count"
    before = metric(httpx.get(serve_apps.speech + "/metrics").text, queued)
    data, clip = wav(1.5)
    out = transcribe(serve_apps.speech, data)
    assert out.status_code == 200, out.text
    assert out.json() == {"text": speech_to_text(generation.context(whisper), [clip])[0].text}
    out = transcribe(serve_apps.speech, data, response_format="text", language="en")
    assert out.text == speech_to_text(generation.context(whisper), [clip], language="en")[0].text
    out = transcribe(serve_apps.speech, data, route="translations", language="en").json()
    assert out["text"] == speech_to_text(generation.context(whisper), [clip], language="en", task="translate")[0].text
    # one window, no timestamps: all three went through the decoder's continuous batch
    assert metric(httpx.get(serve_apps.speech + "/metrics").text, queued) - before == 3


def test_timestamps_and_long_form_equal_speech_to_text(serve_apps, whisper):
    from test_serve import metric

    queued = "raymuter:request_queue_time_seconds_count"
    for seconds, seed in [(1.5, 1), (5.0, 2)]:  # one window, then three (the tiny model's windows are 2 s)
        data, clip = wav(seconds, seed)
        before = metric(httpx.get(serve_apps.speech + "/metrics").text, queued)
        out = transcribe(serve_apps.speech, data, response_format="verbose_json", language="en").json()
        # each window was a row of the decoder's continuous batch (2 s windows: 5 s take 3 or more)
        rows = metric(httpx.get(serve_apps.speech + "/metrics").text, queued) - before
        assert rows >= (1 if seconds < 2 else 3), (seconds, rows)
        expected = speech_to_text(generation.context(whisper), [clip], language="en", return_timestamps=True)[0]
        assert out["text"] == expected.text and out["duration"] == pytest.approx(seconds)
        assert [(s["start"], s["end"], s["tokens"]) for s in out["segments"]] == \
            [(s.start, s.end, s.tokens) for s in expected.segments]
    data, clip = wav(5.0, 3)
    plain = transcribe(serve_apps.speech, data).json()  # long-form needs timestamps: on, then dropped
    assert plain["text"] == speech_to_text(generation.context(whisper), [clip], return_timestamps=True)[0].text


@pytest.mark.parametrize("data, fields, status, param", [
    (b"", {}, 400, "file"),
    (b"RIFF not really a wave file", {}, 400, "file"),
    (None, {}, 400, "file"),
    ("ok", {"model": "other"}, 404, "model"),
    ("ok", {"response_format": "docx"}, 400, "response_format"),
    ("ok", {"language": "klingon"}, 400, "language"),
    ("ok", {"prompt": "earlier <|de|> text"}, 400, "prompt"),
])
def test_bad_audio_requests_name_the_field(serve_apps, data, fields, status, param):
    if data == "ok":
        data = wav(1.0)[0]
    files = None if data is None else {"file": ("clip.wav", data)}
    out = httpx.post(serve_apps.speech + "/v1/audio/transcriptions", files=files,
                     data={"model": "whisper", **fields} if files else None,
                     **({} if files else {"json": {"model": "whisper"}}), timeout=60)
    assert out.status_code == status, out.text
    assert out.json()["error"]["param"] == param
    assert transcribe(serve_apps.speech, wav(1.0)[0]).status_code == 200  # still serving


def test_audio_to_a_text_model_is_refused(serve_apps):
    out = httpx.post(serve_apps.real + "/v1/audio/transcriptions", files={"file": ("a.wav", wav(1.0)[0])},
                     data={"model": "tiny"}, timeout=60)
    assert out.status_code == 400 and "does not take audio" in out.json()["error"]["message"]


def test_encoder_metrics_and_the_transcribe_handle(serve_apps, whisper):
    from ray import serve

    from deployments.schema import Transcription, TranscriptionRequest

    from test_serve import metric

    before = httpx.get(serve_apps.speech + "/metrics").text
    data, clip = wav(1.0, 5)
    result = serve.get_app_handle("speech").transcribe.remote(data, TranscriptionRequest(language="en")).result()
    assert isinstance(result, Transcription)
    assert result.text == speech_to_text(generation.context(whisper), [clip], language="en")[0].text
    after = httpx.get(serve_apps.speech + "/metrics").text
    assert metric(after, "raymuter:encoder_latency_seconds_count") > metric(before, "raymuter:encoder_latency_seconds_count")
    assert metric(after, "raymuter:encoder_inputs_total") - metric(before, "raymuter:encoder_inputs_total") == 1


def test_a_repeated_source_is_encoded_once(serve_apps, marian):
    from test_serve import metric

    source = [40, 41, 42, 43, 44]
    before = httpx.get(serve_apps.translate + "/metrics").text
    texts = [httpx.post(serve_apps.translate + "/v1/completions", json=dict(model="marian", prompt=source),
                        timeout=60).json()["choices"][0]["text"] for _ in range(3)]
    after = httpx.get(serve_apps.translate + "/metrics").text
    assert texts == [text_to_text(generation.context(marian, max_new_tokens=12), [source])[0].text] * 3
    assert metric(after, "raymuter:encoder_cache_misses_total") - metric(before, "raymuter:encoder_cache_misses_total") == 1
    assert metric(after, "raymuter:encoder_cache_hits_total") - metric(before, "raymuter:encoder_cache_hits_total") == 2


def test_feature_cache_evicts_the_least_recently_used():
    from deployments.services.feature_cache import FeatureCache

    cache = FeatureCache(max_bytes=100)
    for name in "abc":
        cache.put(name, name.upper(), 40)  # c pushes a out (120 > 100)
    assert cache.get("a") is None and cache.get("b") == "B" and len(cache) == 2
    cache.put("d", "D", 40)  # b was used last: c goes
    assert cache.get("c") is None and cache.get("b") == "B" and cache.get("d") == "D"
    cache.put("huge", "H", 101)
    assert cache.get("huge") is None and cache.bytes == 80


def test_translations_through_the_openai_client(serve_apps, whisper):
    """/v1/audio/translations as the openai client calls it: Whisper's task=translate, every format."""
    import openai

    client = openai.OpenAI(base_url=serve_apps.speech + "/v1", api_key="unused", max_retries=0)
    data, clip = wav(1.5, 3)
    expected = speech_to_text(generation.context(whisper), [clip], task="translate")[0].text
    out = client.audio.translations.create(model="whisper", file=("clip.wav", data))
    assert out.text == expected
    text = client.audio.translations.create(model="whisper", file=("clip.wav", data), response_format="text")
    assert text == expected
    verbose = client.audio.translations.create(model="whisper", file=("clip.wav", data),
                                               response_format="verbose_json")
    assert verbose.text == speech_to_text(generation.context(whisper), [clip], task="translate",
                                          return_timestamps=True)[0].text
