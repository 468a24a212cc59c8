"""What a request brings besides its JSON: an audio upload (a multipart form read as it arrives,
stopped at the body limit: multipart_upload.py; its fields checked into a TranscriptionRequest), and the images and videos of chat
messages (data URLs always; http(s) URLs fetched when the server allows remote media), handed to
the Vision deployment. Every problem is an ApiError naming the form field or the message part.
"""

from __future__ import annotations

from fastapi import Request

from ..schema import GenerateRequest, TranscriptionRequest
from .edge import check_length
from .multipart_upload import Upload, read_upload
from .openai import ApiError

AUDIO_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")  # OpenAI's
# The multipart form of /v1/audio/transcriptions and /v1/audio/translations (the OpenAPI document's).
AUDIO_FORM = {"type": "object", "required": ["file", "model"], "properties": {
    "file": {"type": "string", "format": "binary", "description": "WAV, FLAC, OGG or MP3"},
    "model": {"type": "string"}, "language": {"type": "string", "maxLength": 64},
    "prompt": {"type": "string", "maxLength": 4096,
               "description": "previous text the transcription continues (Whisper's prompt_ids)"},
    "response_format": {"type": "string", "enum": list(AUDIO_FORMATS)},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
    "timestamp_granularities[]": {"type": "array", "items": {"type": "string", "enum": ["segment"]},
                                  "description": "with response_format verbose_json"},
    "compression_ratio_threshold": {"type": "number", "minimum": 0, "maximum": 1e6},
    "logprob_threshold": {"type": "number", "minimum": -1e6, "maximum": 0},
    "no_speech_threshold": {"type": "number", "minimum": 0, "maximum": 1},
    "condition_on_prev_tokens": {"type": "boolean"}}}


# -- an audio upload ------------------------------------------------------------------------------
FORM_BYTES = 64 * 2**10  # what the form may hold beside its file (its fields, boundaries, headers)


async def audio_upload(request: Request, max_body: int) -> tuple[Upload, bytes]:
    """The audio routes' multipart form (its fields: `get`, `getlist`) and its file's bytes, read
    as the body arrives (multipart_upload.py): 413 for a body declared over `max_body` or the
    moment the file passes it (a body without Content-Length is read no further), 400 for a body
    that is no multipart form or has no file."""
    check_length(request, max_body)
    data = bytearray()

    async def begin(filename: str) -> None:
        pass

    async def write(piece: bytes) -> None:
        data.extend(piece)

    def too_large(what: str) -> ApiError:
        return ApiError(413, f"file: {what}; this server takes at most {max_body}", param="file",
                        code="body_too_large")

    form = await read_upload(request, "file", max_body, FORM_BYTES, begin, write, 2**20, too_large)
    if form.filename is None:
        raise ApiError(400, "file: required (the audio file, as a multipart upload)", param="file")
    return form, bytes(data)


def transcription_of(form, task: str) -> tuple[TranscriptionRequest, str]:
    """The form's fields as the decoder's TranscriptionRequest for `task` (transcribe or
    translate), and the response_format asked for."""
    response_format = form.get("response_format") or "json"
    if response_format not in AUDIO_FORMATS:
        raise ApiError(400, f"response_format: one of {', '.join(AUDIO_FORMATS)}, not '{response_format!s:.40}'",
                       param="response_format")
    granularities = form.getlist("timestamp_granularities[]") or form.getlist("timestamp_granularities")
    if any(g != "segment" for g in granularities):
        raise ApiError(400, "timestamp_granularities: only 'segment' is supported",
                       param="timestamp_granularities")
    if granularities and response_format != "verbose_json":
        raise ApiError(400, "timestamp_granularities: needs response_format verbose_json",
                       param="timestamp_granularities")
    condition = form.get("condition_on_prev_tokens")
    if condition not in (None, "", "true", "false"):
        raise ApiError(400, "condition_on_prev_tokens: true or false", param="condition_on_prev_tokens")
    fields = TranscriptionRequest(language=_form_text(form, "language", 64) or None, task=task,
                                  timestamps=response_format in ("verbose_json", "srt", "vtt"),
                                  temperature=_form_number(form, "temperature", float, 0, 2) or 0.0,
                                  prompt=_form_text(form, "prompt", 4096) or None,
                                  compression_ratio_threshold=_form_number(
                                      form, "compression_ratio_threshold", float, 0, 1e6),
                                  logprob_threshold=_form_number(form, "logprob_threshold", float, -1e6, 0),
                                  no_speech_threshold=_form_number(form, "no_speech_threshold", float, 0, 1),
                                  condition_on_prev_tokens=None if not condition else condition == "true",
                                  seed=_form_number(form, "seed", int, 0, 2**63 - 1))
    return fields, response_format


def _form_text(form, name: str, most: int) -> str | None:
    value = form.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > most):
        raise ApiError(400, f"{name}: a text of at most {most} characters", param=name)
    return value


def _form_number(form, name: str, kind, low, high):
    """A number field of a multipart form, or None; 400 naming it when it is not one in [low, high]."""
    value = form.get(name)
    if value in (None, ""):
        return None
    try:
        number = kind(value)
    except (TypeError, ValueError):
        number = None
    if number is None or not low <= number <= high:
        raise ApiError(400, f"{name}: {'an integer' if kind is int else 'a number'} from {low} to {high}, "
                            f"not {str(value)[:40]!r}", param=name)
    return number


# -- images and videos of chat messages -------------------------------------------------------------
class Media:
    """How this server takes a chat message's images and videos: remote URLs or not, and the
    largest file it fetches."""

    def __init__(self, allow_remote: bool, max_body: int):
        self.allow_remote, self.max_body = allow_remote, max_body

    async def vision_replies(self, request: GenerateRequest, vision) -> list:
        """The Vision deployment's replies for the images and videos of a chat request, in order
        (the decoder opens them): image_url parts; video_url parts (a video file) and video parts
        (a list of frames as image URLs, or a video file's URL). Data URLs always; http(s) URLs
        when allow_remote."""
        if request.messages is None:
            return []
        replies = []
        for i, message in enumerate(request.messages):
            if not isinstance(message.get("content"), list):
                continue
            for j, part in enumerate(message["content"]):
                kind = part.get("type")
                if kind not in ("image_url", "video_url", "video"):
                    continue
                field = f"messages.{i}.content.{j}.{kind}"
                what = "image" if kind == "image_url" else "video"
                if vision is None:
                    raise ApiError(400, f"{field}: this model takes no {what}s", param=field)
                value = part.get(kind)
                if isinstance(value, list):  # a video's frames
                    frames = [await self.bytes_of(url, f"{field}.{k}", "image") for k, url in enumerate(value)]
                    replies.append(vision.encode_video.remote(frames, field))
                    continue
                data = await self.bytes_of(value.get("url") if isinstance(value, dict) else value, field, what)
                encode = vision.encode_image if what == "image" else vision.encode_video
                replies.append(encode.remote(data, field))
        return replies

    async def bytes_of(self, url, field: str, what: str = "image") -> bytes:
        """The bytes of an image or video URL (`what`): a base64 data URL's, or a fetched one's."""
        import base64
        import binascii

        example = "data:image/png;base64,..." if what == "image" else "data:video/mp4;base64,..."
        if not isinstance(url, str) or not url:
            raise ApiError(400, f"{field}: give the {what} as {{\"url\": \"{example}\"}}", param=field)
        if url.startswith("data:"):
            head, _, payload = url.partition(",")
            if not head.endswith(";base64"):
                raise ApiError(400, f"{field}: a data URL must be base64 (data:{what}/...;base64,...)", param=field)
            try:
                return base64.b64decode(payload, validate=True)
            except (binascii.Error, ValueError):
                raise ApiError(400, f"{field}: the data URL's base64 does not decode", param=field) from None
        if url.startswith(("http://", "https://")):
            return await self._fetched(url, field, what)
        raise ApiError(400, f"{field}: {'an image' if what == 'image' else 'a video'} URL is a data: URL or http(s)://, "
                            f"not {url[:40]!r}", param=field)

    async def _fetched(self, url: str, field: str, what: str) -> bytes:
        if not self.allow_remote:
            raise ApiError(400, f"{field}: remote {what} URLs are off on this server (allow_remote_images); "
                                f"send the {what} as a data URL", param=field)
        import httpx

        try:
            async with httpx.AsyncClient(timeout=10, follow_redirects=True) as client:
                response = await client.get(url)
                response.raise_for_status()
        except httpx.HTTPError as e:
            raise ApiError(400, f"{field}: could not fetch the {what}: {e}", param=field) from None
        if len(response.content) > self.max_body:
            raise ApiError(413, f"{field}: the {what} has {len(response.content)} bytes; at most {self.max_body}",
                           param=field, code="body_too_large")
        return response.content
