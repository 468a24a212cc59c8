"""The response bodies, built as dicts from the decoder's answers (their shapes, for the OpenAPI
document, are openai.py's): a completion and its choices, log-probabilities in OpenAI's two
shapes, usage, one streamed chunk, embeddings, and a transcription's subtitle files.
"""

from __future__ import annotations

import time


def _clock(seconds: float, mark: str) -> str:
    """hh:mm:ss<mark>mmm, as subtitle files write a time."""
    millis = max(0, round(seconds * 1000))
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}{mark}{rest % 1000:03d}"


def subtitles(segments, kind: str) -> str:
    """Segments (start, end, text) as an SRT or WebVTT file, as OpenAI's response_format srt / vtt."""
    cues = [(s.start, s.end, s.text.strip()) for s in segments]
    if kind == "srt":
        return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{t}\n\n" for i, (a, b, t) in enumerate(cues, 1))
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{t}\n\n" for a, b, t in cues)


def completion_logprobs(tokens: list, chat: bool, offset: int = 0) -> dict | None:
    """OpenAI's logprobs object from the front's TokenTexts (id, text, logprob, top): chat's
    `content` list, or the legacy completions shape (tokens, token_logprobs, top_logprobs,
    text_offset), whose offsets count from `offset` (the characters of the choice's text before
    these tokens). A prompt token echoed has logprob None where it is the first (nothing before it)."""
    if chat:
        return {"content": [{"token": t.text, "logprob": t.logprob, "bytes": list(t.text.encode()),
                             "top_logprobs": [{"token": text, "logprob": lp, "bytes": list(text.encode())}
                                              for _, text, lp in (t.top or [])]} for t in tokens]}
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None and not t.top else
                             {text: lp for _, text, lp in (t.top or [])} for t in tokens],
            "text_offset": offsets}


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish_reason ("stop", "length" or "tool_calls") of the decoder's."""
    return None if reason is None else reason if reason in ("length", "tool_calls") else "stop"


def completion_response(request_id: str, model: str, choices: list[dict], usage: dict, fingerprint: str,
                        chat: bool = False) -> dict:
    """The body of a finished completion (`chat`: a chat.completion); `choices` as
    `completion_choice` gives them."""
    return {"id": request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "system_fingerprint": fingerprint, "choices": choices, "usage": usage}


def completion_choice(index: int, text: str, reason: str, logprobs: dict | None, chat: bool,
                      tool_calls: list[dict] | None = None, reasoning: str | None = None) -> dict:
    if chat:
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        if reasoning is not None:  # a thinking model's: `reasoning`, and vLLM's older name
            message.update(reasoning=reasoning or None, reasoning_content=reasoning or None)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; prompt_tokens_details.cached_tokens as OpenAI's and vLLM's prefix caching report it."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def stream_chunk(request_id: str, model: str, created: int, index: int, text: str, reason: str | None,
                 chat: bool, fingerprint: str, logprobs: dict | None = None, first: bool = False,
                 tool_calls: list[dict] | None = None, reasoning: str = "") -> dict:
    """One server-sent event's body; `tool_calls` go as OpenAI's deltas (each call whole, with its
    index); a thinking model's reasoning as `reasoning` (and vLLM's older `reasoning_content`)."""
    if chat:
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        if reasoning:
            delta.update(reasoning=reasoning, reasoning_content=reasoning)
        if tool_calls:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(tool_calls)]
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(reason)}
        kind = "text_completion"
    return {"id": request_id, "object": kind, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": [choice]}


def embedding_response(model: str, vectors: list[list[float]], prompt_tokens: int, encoding_format: str) -> dict:
    import base64
    import struct

    def encoded(vector: list[float]):
        if encoding_format == "float":
            return vector
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
