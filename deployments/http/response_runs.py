"""The ingress's side of /v1/responses: a response run through the decoder as the chat request
it is (responses.py), answered whole, as typed events, or in the background; kept in the
shared store (deployments.app.Responses) for a next turn, GET, DELETE, input_items and cancel.

A next turn asks for the decoder replica that ran the turn before (GenerateRequest.affinity), so
from any ingress replica it lands where the prefix cache holds the conversation. A background
response runs on the ingress replica that took it, as a task no client holds; a cancel that
reaches another ingress replica marks the stored record, which the runner reads every
CANCEL_POLL_SECONDS.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from ..schema import GenerateChunk
from ..services.response_store import RUNNING
from .answers import completion_logprobs
from .assembly import gathered
from .decoder_calls import DecoderCalls
from .openai import ApiError, ChatCompletionRequest
from .responses import (ResponseEvents, ResponseRequest, assistant_turn, chat_body, ending, input_items,
                        messages_of, new_id, response_object, responses_error, usage)
from .to_decoder import generate_request, typed
from .validation import parse

logger = logging.getLogger("ray.serve")
CANCEL_POLL_SECONDS = 0.5


@dataclass
class ResponseRun:
    """One response on its way: its request, what it continues, its items as they come."""

    id: str
    request: ResponseRequest
    model: str
    items: list[dict]  # this turn's input items
    history: list[dict]  # the conversation before its answer, instructions left out
    created: float = field(default_factory=time.time)
    events: ResponseEvents | None = None
    answer: list[str] = field(default_factory=list)
    final: dict | None = None
    replica: str | None = None  # the decoder replica that ran it (the next turn's affinity)
    calls: list | None = None  # the tool calls read out of its output

    def __post_init__(self):
        self.events = ResponseEvents(self.object("in_progress"))

    def object(self, status: str, **fields) -> dict:
        return response_object(self.id, self.request, self.model, self.created, status, **fields)

    def pieces(self, chunk: GenerateChunk) -> list[str]:
        """A chunk's events (and its text kept for the conversation)."""
        out = self.events.reasoning(chunk.reasoning)
        logprobs = None if chunk.logprobs is None else completion_logprobs(
            [t.model_dump() for t in chunk.logprobs], chat=True)["content"]
        if chunk.text or logprobs:
            self.answer.append(chunk.text)
            out += self.events.text(chunk.text, logprobs)
        return out

    def finish(self, last: GenerateChunk | None, error: ApiError | None = None, cancelled: bool = False) -> list[str]:
        """The last items' events; `final` is the whole response."""
        if error is not None:
            status, failure, incomplete = "failed", {"code": "server_error" if error.status >= 500 else
                                                     "invalid_prompt", "message": error.message}, None
        elif cancelled or last is None:
            status, failure, incomplete = "cancelled", None, None
        else:
            status, failure, incomplete = ending(last.finish_reason, last.error)
        calls = last.tool_calls if last is not None else None
        out = self.events.finish(calls, status)
        counts = usage(last.prompt_tokens or 0, last.completion_tokens or 0, last.cached_tokens or 0) \
            if last is not None and last.finish_reason is not None else None
        self.final = self.object(status, output=self.events.output, usage_=counts, error=failure,
                                 incomplete=incomplete)
        self.replica = last.replica if last is not None else None
        self.calls = calls
        return out

    def record(self, status: str | None = None) -> dict:
        """What the store keeps: the response (as it is while it runs, with `status`; else
        finished), its input items, and the conversation it ends (once finished)."""
        if status is not None:
            return {"response": self.object(status), "input_items": self.items, "history": self.history,
                    "replica": None}
        turn = assistant_turn("".join(self.answer), self.calls)
        return {"response": self.final, "input_items": self.items, "history": self.history + [turn],
                "replica": self.replica}


class ResponseRuns:
    """/v1/responses on an ingress replica: `calls` reach the decoder, `store` the shared
    Responses deployment (or a LocalHandle of a ResponseStore)."""

    def __init__(self, calls: DecoderCalls, store):
        self.calls, self.store = calls, store
        self.background: set[asyncio.Task] = set()  # runs no client holds (a reference keeps them alive)

    async def create(self, http: Request, request: ResponseRequest, model: str, rid: str):
        if request.background and not request.store:
            raise ApiError(400, "background: a background response is kept for polling; it needs store true",
                           param="background")
        if request.background and request.stream:
            raise ApiError(400, "stream: a background response is polled (GET /v1/responses/{id}), not streamed",
                           param="stream")
        previous = await self._previous(request.previous_response_id)
        items = input_items(request.input)
        history = (previous["history"] if previous else []) + messages_of(items)
        instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
        try:
            chat = parse(ChatCompletionRequest, chat_body(request, instructions + history))
        except ApiError as e:
            raise responses_error(e) from None
        fields = generate_request(chat, None, 0)
        fields.update(request_id=rid, affinity=previous["replica"] if previous else None)
        run = ResponseRun(new_id("resp"), request, model, items, history)
        decoder_request = typed(fields)
        if request.background:
            return await self._background(run, decoder_request, chat)
        chunks = self._chunks(decoder_request, chat)
        if request.stream:
            first = await chunks.__anext__()  # a refusal before any byte is the route's 4xx / 503
            return StreamingResponse(self._streamed(run, first, chunks), media_type="text/event-stream")
        await gathered(http, [asyncio.ensure_future(self._drained(run, chunks))])
        await self._keep(run)
        return run.final

    async def retrieve(self, response_id: str) -> dict:
        return (await self._record(response_id))["response"]

    async def delete(self, response_id: str) -> dict:
        if not await self.store.delete.remote(response_id):
            raise _unknown(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        record = await self._record(response_id)
        if not record["response"].get("background"):
            raise ApiError(400, f"response_id: '{response_id}' was not created with background true; only a "
                                "background response can be cancelled", param="response_id")
        record = await self.store.cancel.remote(response_id)
        response = record["response"]
        return {**response, "status": "cancelled"} if response["status"] in RUNNING else response

    async def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> dict:
        items = list((await self._record(response_id))["input_items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.get("id") for item in items]
            if after not in ids:
                raise ApiError(400, f"after: '{after}' is not an item of response '{response_id}'", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    # -- running ----------------------------------------------------------------------------
    async def _chunks(self, request, chat):
        """The decoder's chunks; a refusal names the Responses field."""
        try:
            async for chunk in self.calls.chunks(request, chat):
                yield chunk
        except ApiError as e:
            raise responses_error(e) from None

    async def _streamed(self, run: ResponseRun, first: GenerateChunk, chunks):
        """The typed events: created, in_progress, the items', then completed (or incomplete,
        failed); the response kept before the last event goes out."""
        for piece in run.events.start():
            yield piece
        last, error = first, None
        try:
            for piece in run.pieces(first):
                yield piece
            async for chunk in chunks:
                last = chunk
                for piece in run.pieces(chunk):
                    yield piece
        except ApiError as e:
            error = e
        finally:
            await chunks.aclose()
        for piece in run.finish(last, error):
            yield piece
        await self._keep(run)
        yield run.events.end(run.final)

    async def _drained(self, run: ResponseRun, chunks) -> None:
        last = None
        try:
            async for chunk in chunks:
                last = chunk
                run.pieces(chunk)
        finally:
            await chunks.aclose()
        run.finish(last)

    async def _background(self, run: ResponseRun, request, chat) -> dict:
        """The response queued in the store at once; a task runs it to the end whatever its
        client does, and stops when the stored record says cancel."""
        queued = run.record("queued")
        await self.store.put.remote(queued)

        async def work():
            await self.store.put.remote(run.record("in_progress"))
            drained = asyncio.ensure_future(self._drained(run, self._chunks(request, chat)))
            cancelled, error = False, None
            try:
                while not drained.done():
                    await asyncio.wait([drained], timeout=CANCEL_POLL_SECONDS)
                    if not drained.done() and await self.store.cancelled.remote(run.id):
                        drained.cancel()
                        cancelled = True
                        break
                await asyncio.gather(drained, return_exceptions=True)
                if not drained.cancelled() and drained.exception() is not None:
                    error = drained.exception()
            except Exception as e:  # noqa: BLE001 - the store gone: the run ends, failed
                drained.cancel()
                error = e
            if run.final is None or cancelled or error is not None:
                api_error = error if isinstance(error, ApiError) or error is None else \
                    ApiError(500, f"the background response failed ({type(error).__name__})")
                if error is not None and not isinstance(error, ApiError):
                    logger.error("background response %s failed: %r", run.id, error)
                run.finish(None, api_error, cancelled=cancelled)
            await self._keep(run)

        task = asyncio.create_task(work())
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return queued["response"]

    async def _keep(self, run: ResponseRun) -> None:
        if run.request.store:
            await self.store.put.remote(run.record())

    # -- the store ----------------------------------------------------------------------------
    async def _previous(self, response_id: str | None) -> dict | None:
        if response_id is None:
            return None
        record = await self.store.get.remote(response_id)
        if record is None:
            raise _unknown(response_id, "previous_response_id")
        if record["response"]["status"] in RUNNING:
            raise ApiError(400, f"previous_response_id: '{response_id}' is still {record['response']['status']}; "
                                "continue it once it has completed", param="previous_response_id")
        return record

    async def _record(self, response_id: str) -> dict:
        record = await self.store.get.remote(response_id)
        if record is None:
            raise _unknown(response_id, "response_id")
        return record


def _unknown(response_id: str, param: str) -> ApiError:
    return ApiError(404, f"{param}: no stored response '{response_id[:256]}' (unknown, deleted, expired, or "
                         "created with store false)", param=param, code="response_not_found")
