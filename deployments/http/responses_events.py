"""The Responses API's answer: the response object, its usage and ending, and its typed stream
events (ResponseEvents) from the decoder's chunks. Pure data, no Ray.
"""

from __future__ import annotations

import json
import time

from .responses import ResponseRequest, new_id


# -- the response and its events --------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + completion_tokens}


def response_object(response_id: str, request: ResponseRequest, model: str, created: float, status: str,
                    output: list[dict] | None = None, usage_: dict | None = None, error: dict | None = None,
                    incomplete: dict | None = None) -> dict:
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": request.background, "error": error, "incomplete_details": incomplete,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens, "model": model,
        "output": output or [], "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": request.reasoning.effort if request.reasoning else None, "summary": None},
        "store": request.store, "temperature": request.temperature,
        "text": {"format": (request.text.format if request.text and request.text.format else {"type": "text"})},
        "tool_choice": request.tool_choice or "auto", "tools": request.tools or [], "top_p": request.top_p,
        "truncation": request.truncation or "disabled", "usage": usage_, "user": request.user,
        "metadata": request.metadata or {},
        "completed_at": time.time() if status in ("completed", "incomplete", "failed", "cancelled") else None,
    }


def ending(reason: str | None, error: str | None = None) -> tuple[str, dict | None, dict | None]:
    """(status, error, incomplete_details) of the decoder's finish_reason."""
    if reason == "length":
        return "incomplete", None, {"reason": "max_output_tokens"}
    if reason == "cancelled":
        return "cancelled", None, None
    if reason == "error":
        return "failed", {"code": "server_error", "message": error or "the generation failed"}, None
    return "completed", None, None


def _whole(arguments: str) -> bool:
    """A call's arguments written to the end (JSON): not the call max_output_tokens cut."""
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


# The event that ends a response's stream, by the response's status
ENDS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed",
        "cancelled": "response.failed"}


def sse(kind: str, sequence: int, **fields) -> str:
    """A typed event as a server-sent event: its kind, then its body with its sequence_number."""
    body = {"type": kind, "sequence_number": sequence, **fields}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n"


def ends(piece: str | None) -> bool:
    """Whether a server-sent event (sse) is the one that ends its stream."""
    return piece is not None and piece.startswith(tuple(f"event: {kind}\n" for kind in set(ENDS.values())))


class ResponseEvents:
    """The output items of a response as its chunks come, and the typed server-sent events that
    say so: a reasoning item while the model reasons, a message item while it answers, a
    function_call item per call (read out at the end), each added, its deltas, then done. The
    whole (non-streamed) answer is built through the same steps, its events unused. With `keep`,
    `log` holds every event made, a sequence_number its index (a background stream's, for its
    readers and a resume)."""

    def __init__(self, response: dict, keep: bool = False):
        self.response, self.sequence, self.output = response, 0, []
        self.log: list[str] | None = [] if keep else None
        self._open: dict | None = None  # the item whose deltas are coming
        self._message_seen = False

    def event(self, kind: str, **fields) -> str:
        piece = sse(kind, self.sequence, **fields)
        self.sequence += 1
        if self.log is not None:
            self.log.append(piece)
        return piece

    def start(self, created: dict | None = None) -> list[str]:
        """response.created (with `created`: a background response's, queued), response.in_progress."""
        return [self.event("response.created", response=created or self.response),
                self.event("response.in_progress", response=self.response)]

    def reasoning(self, delta: str) -> list[str]:
        if not delta:
            return []
        out = self._opened("reasoning")
        item = self._open
        item["content"][0]["text"] += delta
        return out + [self.event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=delta)]

    def text(self, delta: str, logprobs: list[dict] | None = None) -> list[str]:
        if not delta and not logprobs:
            return []
        out = self._opened("message")
        item = self._open
        part = item["content"][0]
        part["text"] += delta
        if logprobs is not None:
            part.setdefault("logprobs", []).extend(logprobs)
        return out + [self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=delta, logprobs=logprobs or [])]

    def finish(self, tool_calls: list[dict] | None, status: str) -> list[str]:
        """The open item done, an empty message where nothing was said, and the calls' items."""
        out = self._closed(status)
        if not self._message_seen and not tool_calls:
            out += self._opened("message") + self._closed(status)
        for call in tool_calls or []:
            function = call["function"]
            item = {"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": function["name"],
                    "arguments": "", "status": "in_progress"}
            self.output.append(item)
            index = len(self.output) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"] = function["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=function["arguments"]))
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=function["name"], arguments=function["arguments"]))
            cut = status == "incomplete" and not _whole(function["arguments"])
            item["status"] = "incomplete" if cut else "completed"
            out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def _opened(self, kind: str) -> list[str]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self._closed("completed")
        if kind == "reasoning":
            item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "status": "in_progress",
                    "content": [{"type": "reasoning_text", "text": ""}]}
        else:
            self._message_seen = True
            item = {"type": "message", "id": new_id("msg"), "role": "assistant", "status": "in_progress",
                    "content": [{"type": "output_text", "text": "", "annotations": []}]}
        self.output.append(item)
        self._open = item
        index = len(self.output) - 1
        added = {**item, "content": []}
        return out + [self.event("response.output_item.added", output_index=index, item=added),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part={**item["content"][0], "text": ""})]

    def _closed(self, status: str) -> list[str]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = self.output.index(item)
        part = item["content"][0]
        item["status"] = "incomplete" if status == "incomplete" else "completed"
        done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": part.get("logprobs") or []}
        return [self.event(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"], **extra),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def end(self, response: dict) -> str:
        return self.event(ENDS[response["status"]], response=response)
