"""The transcription routes' fields as the `openai` client sends them: a previous-text `prompt`
(transformers' prompt_ids), `response_format` srt and vtt, `timestamp_granularities[]=segment`
(verbose_json), and Whisper's long-form options as extra form fields, each equal to the engine's
`speech_to_text` on the same clip; their bad values get a 400 naming the field."""

from __future__ import annotations

import re

import httpx
import pytest

import generation
from generation.families.whisper.prompt import prompt_ids
from generation.tasks import speech_to_text
from test_serve_seq2seq import transcribe, wav


@pytest.fixture(scope="module")
def whisper(serve_apps, load_model):
    return load_model(serve_apps.s2s["whisper-optimum"])


@pytest.fixture(scope="module")
def client(serve_apps):
    import openai

    return openai.OpenAI(base_url=serve_apps.speech + "/v1", api_key="unused", max_retries=0)


def engine(whisper, clip, **options):
    return speech_to_text(generation.context(whisper), [clip], **options)[0]


def test_prompt_through_the_openai_client(client, whisper):
    data, clip = wav(1.5, 4)
    text = "the quick brown fox"
    out = client.audio.transcriptions.create(model="whisper", file=("clip.wav", data), prompt=text, language="en")
    expected = engine(whisper, clip, language="en", prompt_ids=prompt_ids(whisper, text))
    assert out.text == expected.text
    assert expected.tokens != engine(whisper, clip, language="en").tokens  # the prompt changed the output


def test_verbose_json_segments_through_the_openai_client(client, whisper):
    data, clip = wav(5.0, 2)
    out = client.audio.transcriptions.create(model="whisper", file=("clip.wav", data), language="en",
                                             response_format="verbose_json", timestamp_granularities=["segment"])
    expected = engine(whisper, clip, language="en", return_timestamps=True)
    assert out.text == expected.text and out.language == "english" and out.duration == pytest.approx(5.0)
    assert [(s.start, s.end, s.text) for s in out.segments] == [(s.start, s.end, s.text) for s in expected.segments]
    assert len(out.segments) > 1


def clock(seconds: float, mark: str) -> str:
    millis = round(seconds * 1000)
    return f"{millis // 3600000:02d}:{millis // 60000 % 60:02d}:{millis // 1000 % 60:02d}{mark}{millis % 1000:03d}"


@pytest.mark.parametrize("kind", ["srt", "vtt"])
def test_subtitles_through_the_openai_client(client, whisper, kind):
    data, clip = wav(5.0, 2)
    out = client.audio.transcriptions.create(model="whisper", file=("clip.wav", data), language="en",
                                             response_format=kind)
    assert isinstance(out, str)
    segments = engine(whisper, clip, language="en", return_timestamps=True).segments
    mark = "," if kind == "srt" else "."
    cues = [f"{clock(s.start, mark)} --> {clock(s.end, mark)}\n{s.text.strip()}\n\n" for s in segments]
    if kind == "srt":
        assert out == "".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    else:
        assert out == "WEBVTT\n\n" + "".join(cues)
    assert re.search(r"00:00:0\d[,.]\d{3} --> ", out)


def test_long_form_options_as_form_fields(serve_apps, whisper):
    data, clip = wav(9.0, 5)
    fields = dict(condition_on_prev_tokens="true")
    out = transcribe(serve_apps.speech, data, response_format="verbose_json", language="en", **fields)
    assert out.status_code == 200, out.text
    expected = engine(whisper, clip, language="en", return_timestamps=True, condition_on_prev_tokens=True)
    assert [s["tokens"] for s in out.json()["segments"]] == [s.tokens for s in expected.segments]
    assert expected.tokens != engine(whisper, clip, language="en", return_timestamps=True).tokens
    # every window below logprob_threshold 0 and above a no-speech probability of 0: all skipped
    out = transcribe(serve_apps.speech, data, response_format="verbose_json", language="en", logprob_threshold="0",
                     no_speech_threshold="0")
    assert out.status_code == 200, out.text
    expected = engine(whisper, clip, language="en", return_timestamps=True, logprob_threshold=0.0,
                      no_speech_threshold=0.0)
    assert out.json()["segments"] == [] and out.json()["text"] == "" == expected.text and not expected.segments


def test_temperature_fallback_through_the_handle(serve_apps, whisper):
    """A list of temperatures (the handle's TranscriptionRequest) falls back as the engine does."""
    from ray import serve

    from deployments.schema import TranscriptionRequest

    data, clip = wav(9.0, 6)
    serve_apps.app("speech")
    handle = serve.get_app_handle("speech")
    request = TranscriptionRequest(language="en", timestamps=True, temperature=[0.0, 0.6], logprob_threshold=-1.0,
                                   seed=3)
    out = handle.transcribe.remote(data, request).result(timeout_s=120)
    expected = engine(whisper, clip, language="en", return_timestamps=True, temperature=(0.0, 0.6),
                      logprob_threshold=-1.0, seeds=[3])
    assert out.tokens == expected.tokens
    assert expected.tokens != engine(whisper, clip, language="en", return_timestamps=True).tokens


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "xml"}, "response_format"),
    ({"timestamp_granularities[]": "word", "response_format": "verbose_json"}, "timestamp_granularities"),
    ({"timestamp_granularities[]": "segment"}, "timestamp_granularities"),
    ({"prompt": "say <|en|> now"}, "prompt"),
    ({"prompt": "x" * 5000}, "prompt"),
    ({"condition_on_prev_tokens": "maybe"}, "condition_on_prev_tokens"),
    ({"logprob_threshold": "1"}, "logprob_threshold"),
    ({"no_speech_threshold": "0.5"}, "no_speech_threshold"),
])
def test_bad_fields_name_the_field(serve_apps, fields, param):
    out = httpx.post(serve_apps.speech + "/v1/audio/transcriptions", files={"file": ("clip.wav", wav(1.0)[0])},
                     data={"model": "whisper", **fields}, timeout=60)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()
