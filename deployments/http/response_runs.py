"""The ingress's side of /v1/responses: a response run through the decoder as the chat request
it is (responses.py), answered whole, as typed events, or in the background; kept in the
shared store (deployments.app.Records) for a next turn, GET, DELETE, input_items and cancel.

A next turn asks for the decoder replica that ran the turn before (GenerateRequest.affinity), so
from any ingress replica it lands where the prefix cache holds the conversation. A background
response runs on the ingress replica that took it (its owner), as a task no client holds; every
BEAT_SECONDS the owner beats in the stored record (its heartbeat, a streamed response's new
events) and learns whether a client cancelled or deleted it from any replica. Streamed, its
creator follows its events here as they come; a client that resumes it (GET ?stream=true) reads
them from the store, from any replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse

from generation.front import Delta, Finish

from ..services.response_store import RUNNING
from .answers import completion_logprobs
from .assembly import gathered
from .decoder_calls import DecoderCalls
from .openai import ApiError, ChatCompletionRequest
from .responses import ResponseRequest, new_id
from .responses_conversion import assistant_turn, chat_body, input_items, messages_of, responses_error
from .responses_events import ENDS, ResponseEvents, ending, ends, response_object, sse, usage
from .to_decoder import generate_request, typed
from .validation import parse

logger = logging.getLogger("ray.serve")
BEAT_SECONDS = 0.5  # a background run's heartbeat (the store fails it after response_store.STALE_SECONDS without)
RESUME_POLL_SECONDS = 0.25  # how often a resumed stream reads the store for the events that came since
SSE = "text/event-stream"


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
    ended: bool = False  # its last event made (or its run gone)
    grew: asyncio.Event = field(default_factory=asyncio.Event)  # set as events come, for `follow`

    def __post_init__(self):
        self.events = ResponseEvents(self.object("in_progress"), keep=self.kept_events)

    @property
    def kept_events(self) -> bool:
        """Whether the store keeps its events (a background stream's, for a client that resumes)."""
        return self.request.background and self.request.stream

    def told(self, pieces: list[str]) -> list[str]:
        self.grew.set()
        return pieces

    async def follow(self):
        """Its events as they come (a background stream's creator), to its end."""
        sent = 0
        while True:
            log = self.events.log
            while sent < len(log):
                sent += 1
                yield log[sent - 1]
            if self.ended:
                return
            self.grew.clear()
            await self.grew.wait()

    def object(self, status: str, **fields) -> dict:
        return response_object(self.id, self.request, self.model, self.created, status, **fields)

    def pieces(self, event) -> list[str]:
        """An event's items' events (and its text kept for the conversation): a Delta's, or the
        Finish's last text (a Responses request never echoes)."""
        if not isinstance(event, (Delta, Finish)):
            return []
        out = self.events.reasoning(event.reasoning)
        tokens = event.logprobs if isinstance(event, Delta) else None
        logprobs = None if tokens is None else completion_logprobs(tokens, chat=True)["content"]
        if event.text or logprobs:
            self.answer.append(event.text)
            out += self.events.text(event.text, logprobs)
        return self.told(out)

    def finish(self, last, error: ApiError | None = None, cancelled: bool = False) -> list[str]:
        """The last items' events; `final` is the whole response. `last`: the stream's last event
        (its Finish, unless the stream was cut)."""
        finish = last if isinstance(last, Finish) else None
        if error is not None:
            status, failure, incomplete = "failed", {"code": "server_error" if error.status >= 500 else
                                                     "invalid_prompt", "message": error.message}, None
        elif cancelled or last is None:
            status, failure, incomplete = "cancelled", None, None
        else:
            status, failure, incomplete = ending(finish and finish.finish_reason, finish and finish.error)
        calls = finish.tool_calls if finish is not None else None
        out = self.events.finish(calls, status)
        counts = None if finish is None else usage(finish.prompt_tokens, finish.completion_tokens,
                                                   finish.cached_tokens)
        self.final = self.object(status, output=self.events.output, usage_=counts, error=failure,
                                 incomplete=incomplete)
        self.replica = finish.replica if finish is not None else None
        self.calls = calls
        return self.told(out)

    def end(self) -> str:
        """The event that ends the stream (after finish)."""
        return self.told([self.events.end(self.final)])[0]

    def record(self, status: str | None = None) -> dict:
        """What the store keeps: the response (as it is while it runs, with `status`; else
        finished), its input items, the conversation it ends (once finished) and, for a
        background stream, its events so far."""
        if status is not None:
            record = {"response": self.object(status), "input_items": self.items, "history": self.history,
                      "replica": None}
        else:
            turn = assistant_turn("".join(self.answer), self.calls)
            record = {"response": self.final, "input_items": self.items, "history": self.history + [turn],
                      "replica": self.replica}
        return {**record, "events": list(self.events.log)} if self.kept_events else record


class ResponseRuns:
    """/v1/responses on an ingress replica: `calls` reach the decoder, `store` the shared
    Records deployment (or a LocalHandle of a ResponseStore)."""

    def __init__(self, calls: DecoderCalls, store):
        self.calls, self.store = calls, store
        self.background: set[asyncio.Task] = set()  # runs no client holds (a reference keeps them alive)

    async def create(self, http: Request, request: ResponseRequest, model: str, rid: str, adapter: str | None = None,
                     adapter_path: str | None = None):
        if request.background and not request.store:
            raise ApiError(400, "background: a background response is kept for polling; it needs store true",
                           param="background")
        previous = await self._previous(request.previous_response_id)
        items = input_items(request.input)
        history = (previous["history"] if previous else []) + messages_of(items)
        instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
        try:
            chat = parse(ChatCompletionRequest, chat_body(request, instructions + history))
        except ApiError as e:
            raise responses_error(e, request.instructions, history) from None
        fields = generate_request(chat, None, 0, adapter, adapter_path)
        fields.update(request_id=rid, affinity=previous["replica"] if previous else None)
        run = ResponseRun(new_id("resp"), request, model, items, history)
        decoder_request = typed(fields)
        if request.background:
            return await self._background(run, decoder_request, chat)
        chunks = self._chunks(run, decoder_request, chat)
        if request.stream:
            first = await chunks.__anext__()  # a refusal before any byte is the route's 4xx / 503
            return StreamingResponse(self._streamed(run, first, chunks), media_type=SSE)
        await gathered(http, [asyncio.ensure_future(self._drained(run, chunks))])
        await self._keep(run)
        return run.final

    async def retrieve(self, response_id: str) -> dict:
        return (await self._record(response_id))["response"]

    async def resume(self, response_id: str, after: int | None) -> StreamingResponse:
        """A background stream's events after sequence number `after` (all without), as they
        come, to its end (GET ?stream=true&starting_after=N), from the store: any replica."""
        found = await self.store.events_after.remote(response_id, -1 if after is None else after)
        if found is None:
            raise _unknown(response_id, "response_id")
        if found["events"] is None:
            raise ApiError(400, f"stream: '{response_id}' was not created with background and stream true; only "
                                "such a response's events are kept to stream again", param="stream")
        return StreamingResponse(self._resumed(response_id, -1 if after is None else after, found), media_type=SSE)

    async def delete(self, response_id: str) -> dict:
        if not await self.store.delete.remote(response_id):
            raise _unknown(response_id, "response_id")
        return {"id": response_id, "object": "response", "deleted": True}

    async def cancel(self, response_id: str) -> dict:
        record = await self._record(response_id)
        if not record["response"].get("background"):
            raise ApiError(400, f"response_id: '{response_id}' was not created with background true; only a "
                                "background response can be cancelled", param="response_id")
        record = await self.store.cancel_response.remote(response_id)
        if record is None:  # deleted meanwhile
            raise _unknown(response_id, "response_id")
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
    async def _chunks(self, run: ResponseRun, request, chat):
        """The decoder's chunks; a refusal names the Responses field."""
        try:
            async for chunk in self.calls.chunks(request, chat):
                yield chunk
        except ApiError as e:
            raise responses_error(e, run.request.instructions, run.history) from None

    async def _streamed(self, run: ResponseRun, first, chunks):
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
        yield run.end()

    async def _drained(self, run: ResponseRun, chunks) -> None:
        last = None
        try:
            async for chunk in chunks:
                last = chunk
                run.pieces(chunk)
        finally:
            await chunks.aclose()
        run.finish(last)

    async def _background(self, run: ResponseRun, request, chat):
        """The response queued in the store at once; a task runs it to the end whatever its
        client does (`_owned`). Streamed, the client follows its events as they come."""
        run.told(run.events.start(run.object("queued")))
        queued = run.record("queued")
        await self.store.put.remote(queued)
        task = asyncio.create_task(self._owned(run, request, chat))
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return StreamingResponse(run.follow(), media_type=SSE) if run.request.stream else queued["response"]

    async def _owned(self, run: ResponseRun, request, chat) -> None:
        """A background run: beats every BEAT_SECONDS (its heartbeat, a stream's new events) and
        stops when the store says cancel (kept, cancelled) or stop (deleted, or failed: nothing
        written); its end written only over the record still running (store.update)."""
        try:
            if await self.store.update.remote(run.record("in_progress")):
                drained = asyncio.ensure_future(self._drained(run, self._chunks(run, request, chat)))
                stop, error = await self._beating(run, drained)
            else:
                stop, error = "stop", None  # deleted before it started
            if run.final is None or stop is not None or error is not None:
                api_error = error if isinstance(error, ApiError) or error is None else \
                    ApiError(500, f"the background response failed ({type(error).__name__})")
                if error is not None and not isinstance(error, ApiError):
                    logger.error("background response %s failed: %r", run.id, error)
                run.finish(None, api_error, cancelled=stop is not None)
            run.end()
            if stop != "stop":
                await self.store.update.remote(run.record())
        except Exception as e:  # noqa: BLE001 - the store gone: its record fails by its heartbeat
            logger.error("background response %s: the store failed (%r)", run.id, e)
        finally:
            run.ended = True
            run.grew.set()

    async def _beating(self, run: ResponseRun, drained: asyncio.Future) -> tuple[str | None, Exception | None]:
        """The run drained while its owner beats; (cancel / stop / None, its error)."""
        log = run.events.log if run.kept_events else []  # the events the store keeps
        kept, stop = len(log), None
        try:
            while not drained.done():
                await asyncio.wait([drained], timeout=BEAT_SECONDS)
                if drained.done():
                    break
                beat = await self.store.beat.remote(run.id, kept, log[kept:])
                kept = beat["kept"]
                if beat["run"] != "on":
                    drained.cancel()
                    stop = beat["run"]
                    break
            await asyncio.gather(drained, return_exceptions=True)
        except Exception as e:  # noqa: BLE001 - the store gone: the run ends, failed
            drained.cancel()
            return stop, e
        if drained.cancelled() or drained.exception() is None:
            return stop, None
        return stop, drained.exception()

    async def _resumed(self, response_id: str, after: int, found: dict):
        """The stored events after `after`, read again every RESUME_POLL_SECONDS while the
        response runs; where it ended without its last event (its owner stopped), that event."""
        while True:
            for piece in found["events"]:
                after += 1
                yield piece
            response = found["response"]
            if response["status"] not in RUNNING:
                if not ends(found["last"]):
                    yield sse(ENDS[response["status"]], after + 1, response=response)
                return
            await asyncio.sleep(RESUME_POLL_SECONDS)
            found = await self.store.events_after.remote(response_id, after)
            if found is None:  # deleted while it ran
                return

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
