"""A completion's answer assembled from its choices' decoder calls: the whole body (`whole_answer`:
every choice gathered, the client's leaving cancels them) or server-sent events (`event_stream`:
the choices' streams merged as their chunks come, the usage and [DONE] in the body's last write).

An error before any byte is the route's 4xx or 503; one after the stream began is its last event.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from generation.front import Delta, Echo, Finish

from .answers import completion_choice, completion_logprobs, completion_response, stream_chunk, usage
from .decoder_calls import DecoderCalls
from .openai import ApiError


async def whole_answer(calls: DecoderCalls, http: Request, jobs, rid, model, fingerprint, chat, body) -> dict:
    """The completion's body: each job (prompt index, GenerateRequest) one choice, in order."""
    results = await gathered(http, [asyncio.ensure_future(calls.choice(r, body, p)) for p, r in jobs])
    choices, prompt_tokens, cached_tokens = [], 0, 0
    for k, ((p, _), result) in enumerate(zip(jobs, results)):
        text, tokens = result.text, list(result.logprobs or [])
        if result.prompt_text is not None:  # echo: the prompt, then the completion
            text = result.prompt_text + text
            tokens = list(result.prompt_logprobs or []) + tokens
        logprobs = None if result.logprobs is None else completion_logprobs(tokens, chat)
        choices.append(completion_choice(k, text, result.finish_reason, logprobs, chat, result.tool_calls,
                                         result.reasoning))
        if k % body.n == 0:  # a prompt's n choices: its tokens once
            prompt_tokens += result.prompt_tokens
            cached_tokens += result.cached_tokens
    return completion_response(rid, model, choices, usage(prompt_tokens, sum(r.completion_tokens for r in results),
                                                          cached_tokens), fingerprint, chat)


async def gathered(http: Request, calls: list) -> list:
    """The calls' results; the client leaving first (499) or one call failing cancels the rest."""
    gathered = asyncio.gather(*calls)
    gone = asyncio.ensure_future(client_gone(http))
    try:
        done, _ = await asyncio.wait([gathered, gone], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this request cancelled (a cancelled batch's line, a replica that stops)
        gathered.cancel()
        gathered.add_done_callback(_retrieved)  # its CancelledError is this one: not logged as never retrieved
        raise
    finally:
        gone.cancel()
    if gathered not in done:  # the client left first: its choices stop and free their slots
        gathered.cancel()
        await asyncio.gather(gathered, return_exceptions=True)
        raise ApiError(499, "the client closed the connection")
    try:
        return gathered.result()
    except BaseException:
        for call in calls:  # one choice failed: the others are not waited for
            call.cancel()
        raise


def _retrieved(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


async def event_stream(calls: DecoderCalls, jobs, rid, model, fingerprint, chat, body) -> StreamingResponse:
    """The completion as server-sent events, once every choice's first chunk came (an error
    before then is the route's answer, and stops the other choices)."""
    streams = [calls.chunks(r, body, p) for p, r in jobs]
    firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
    try:
        await asyncio.gather(*firsts)  # errors before any byte: a 4xx/503
    except BaseException:
        for first in firsts:  # the other choices' decoder requests stop too
            first.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        raise
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    events = _events([f.result() for f in firsts], streams, rid, model, int(time.time()), fingerprint, chat, body,
                     include_usage)
    return EventStream(events, media_type="text/event-stream")


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _text_of(item, chat: bool, offset: int):
    """An event's tokens (TokenTexts), its text and its logprobs object (`offset`: its choice's
    characters so far): an Echo's prompt, a Delta's new text, a Finish's last text."""
    if isinstance(item, Echo):
        tokens, text = item.prompt_logprobs, item.prompt_text
    elif isinstance(item, Delta):
        tokens, text = item.logprobs, item.text
    else:
        tokens, text = None, item.text
    if tokens is None:
        return (), text, None  # the common chunk: its text only
    return tokens, text, completion_logprobs(tokens, chat, offset)


async def _events(firsts, streams, rid, model, created, fingerprint, chat, body, include_usage):
    """The body's events: a chunk per choice as it comes; the last choice's last event, the usage
    and [DONE] in one last piece."""
    prompt_tokens, completion_tokens, cached_tokens, started, ended = 0, 0, 0, set(), 0
    offsets = [0] * len(streams)  # each choice's characters so far: its logprobs' text_offset runs on
    merged = merged_streams(firsts, streams)
    tail = ""  # the last choice's last event: it goes with the usage, [DONE] and the body's end
    try:
        async for i, item in merged:
            if isinstance(item, ApiError):
                yield _event(item.body())
                return
            tokens, text, logprobs = _text_of(item, chat, offsets[i])
            if not chat and tokens:
                offsets[i] += sum(len(t.text) for t in tokens)
            finish = item if isinstance(item, Finish) else None
            reason, reasoning = finish and finish.finish_reason, "" if isinstance(item, Echo) else item.reasoning
            if finish is not None:
                ended += 1
            if text or reasoning or reason or logprobs or (chat and i not in started):
                piece = _event(stream_chunk(rid, model, created, i, text, reason, chat, fingerprint,
                                            logprobs, first=i not in started, tool_calls=finish and finish.tool_calls,
                                            reasoning=reasoning))
                started.add(i)
                if ended == len(streams):
                    tail = piece
                else:
                    yield piece
            if finish is not None:
                if i % body.n == 0:
                    prompt_tokens += finish.prompt_tokens
                    cached_tokens += finish.cached_tokens
                completion_tokens += finish.completion_tokens
        if include_usage:
            tail += _event({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": model, "system_fingerprint": fingerprint,
                            "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached_tokens)})
        yield LastPiece(tail + "data: [DONE]\n\n")
    finally:
        await merged.aclose()  # the pumps of the other choices stop
        for stream in streams:
            await stream.aclose()


class LastPiece(str):
    """The last piece of an EventStream's body."""


class EventStream(StreamingResponse):
    """A StreamingResponse whose last piece (a LastPiece) ends the body in the same message:
    one write to the socket for a stream's last event, its usage, [DONE] and the end of the
    chunked body, where Starlette's makes one for each and one more for the end."""

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for chunk in self.body_iterator:
            last = isinstance(chunk, LastPiece)
            if not isinstance(chunk, (bytes, memoryview)):
                chunk = chunk.encode(self.charset)
            if not ended:
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
            ended = ended or last
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def client_gone(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: what the server
    passes on next is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def merged_streams(firsts: list, streams: list):
    """(choice index, chunk or ApiError) from the choices' streams as they come. One stream (n=1,
    the common case) is read directly: no task and queue between the decoder and the client."""
    if len(streams) == 1:
        try:
            yield 0, firsts[0]
            async for chunk in streams[0]:
                yield 0, chunk
        except ApiError as e:
            yield 0, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, first, stream):
        try:
            await queue.put((i, first))
            async for chunk in stream:
                await queue.put((i, chunk))
        except ApiError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, f, s)) for i, (f, s) in enumerate(zip(firsts, streams))]
    open_ = len(tasks)
    try:
        while open_:
            i, item = await queue.get()
            if item is None:
                open_ -= 1
                continue
            yield i, item
    finally:  # the client left (or every choice ended): the pumps stop before their streams are closed
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
