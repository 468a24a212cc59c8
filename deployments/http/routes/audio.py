"""POST /v1/audio/transcriptions and /v1/audio/translations (OpenAI's): an uploaded audio file
(a multipart form, media.py) through Whisper, answered as JSON, text, SRT or WebVTT."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from ..answers import subtitles
from ..edge import ERRORS, answers, body_of
from ..ingress_state import IngressState, guarded
from ..media import AUDIO_FORM, audio_upload, transcription_of
from ..openai_replies import Transcription

router = APIRouter()


@router.post("/v1/audio/transcriptions", openapi_extra=body_of(None, "multipart/form-data", AUDIO_FORM),
             responses=answers(Transcription, *ERRORS, text=True))
async def transcriptions(request: Request, state: IngressState = Depends(guarded)):
    return await _audio(state, request, "transcribe")


@router.post("/v1/audio/translations", openapi_extra=body_of(None, "multipart/form-data", AUDIO_FORM),
             responses=answers(Transcription, *ERRORS, text=True))
async def translations(request: Request, state: IngressState = Depends(guarded)):
    return await _audio(state, request, "translate")


async def _audio(state: IngressState, request: Request, task: str):
    form, data = await audio_upload(request, state.max_body)
    card = await state.model_card()
    state.check_model(form.get("model"), card)
    fields, response_format = transcription_of(form, task)
    result = await state.transcribe(data, fields, form.filename)
    if response_format == "text":
        return PlainTextResponse(result.text)
    if response_format in ("srt", "vtt"):
        return PlainTextResponse(subtitles(result.segments or [], response_format))
    if response_format == "verbose_json":
        return {"task": task, "language": result.language, "duration": result.duration, "text": result.text,
                "segments": [s.model_dump() for s in result.segments or []]}
    return {"text": result.text}
