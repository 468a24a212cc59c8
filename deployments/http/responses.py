"""OpenAI's Responses API as shapes over the chat route's: a request's input items (and the
stored conversation it continues) as chat messages, its options as a chat request's fields
(`chat_body`), the decoder's answer as the response's output items, and the typed stream events
(`ResponseEvents`). Pure data, no Ray: routes/responses.py and response_runs.py run them.

A next turn (`previous_response_id`) is the stored conversation plus the new input, rendered
with the chat template as the chat request with those messages is: its tokens are that chat's.
Instructions are not carried from turn to turn (OpenAI's rule); reasoning items given back as
input are left out, as chat templates leave a past turn's thinking out.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from generation.front import limits

from .openai import INT_MAX, ApiError

# Fields of a chat request the Responses API names otherwise (a request that gives the chat's
# name is told the Responses name).
CHAT_ONLY = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
             "response_format": "text.format", "logprobs": "top_logprobs", "n": None, "stream_options": None,
             "echo": None, "add_generation_prompt": None, "functions": "tools", "function_call": "tool_choice"}
# A chat field's Responses name, for errors the chat validation or the decoder gives.
RESPONSES_NAMES = {"max_completion_tokens": "max_output_tokens", "logprobs": "top_logprobs"}
INCLUDES = ("message.output_text.logprobs", "reasoning.encrypted_content", "message.input_image.image_url")


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: dict[str, Any] | None = None  # {"type": "text" | "json_object" | "json_schema", ...}
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, no effect


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # accepted, no effect
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted: the reasoning comes whole
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponseRequest(BaseModel):
    """POST /v1/responses. Settings beyond OpenAI's (seed, top_k, repetition_penalty, stop,
    chat_template_kwargs, ...) are the chat route's, under the same names."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(max_length=512)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=limits.MAX_MESSAGES)]  # a text: any length
    instructions: str | None = None
    previous_response_id: str | None = Field(default=None, max_length=256)
    max_output_tokens: int | None = Field(default=None, ge=0, le=INT_MAX)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=limits.MAX_LOGPROBS)
    include: list[Literal[INCLUDES]] | None = Field(default=None, max_length=len(INCLUDES))
    store: bool = True
    background: bool = False
    stream: bool = False
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    user: str | None = Field(default=None, max_length=1024)
    # accepted, with no effect on the output
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    safety_identifier: str | None = Field(default=None, max_length=1024)

    @model_validator(mode="before")
    @classmethod
    def _no_chat_fields(cls, body):
        """A chat request's field is named with the Responses field it takes (before `input`,
        which a chat body lacks, is missed)."""
        for name, instead in CHAT_ONLY.items():
            if isinstance(body, dict) and name in body:
                raise ValueError(f"{name}: not a field of /v1/responses" + (f"; it takes {instead}" if instead else ""))
        return body


# -- the OpenAPI document's shapes (the routes build them as dicts) ---------------------------------------
class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]  # cached_tokens: from the decoder replica's prefix cache
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"]
    created_at: float
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    previous_response_id: str | None
    store: bool
    background: bool


class ResponseItemList(BaseModel):
    object: Literal["list"]
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response"]
    deleted: bool


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


# -- input items as chat messages -------------------------------------------------------------------------
def input_items(value: str | list[dict]) -> list[dict]:
    """The request's input as items, each with an id (a text input is one user message), a
    message's text content as a part (input_text; an assistant's output_text), as OpenAI lists
    input items and its SDK's types read them; messages_of joins the parts back."""
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value
    out = []
    for item in items:
        item = dict(item)
        item.setdefault("type", "message")
        item.setdefault("id", new_id({"message": "msg", "function_call": "fc"}.get(item["type"], "item")))
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                said = item.get("role") == "assistant"
                item["content"] = [{"type": "output_text", "text": item["content"], "annotations": []} if said else
                                   {"type": "input_text", "text": item["content"]}]
        out.append(item)
    return out


def messages_of(items: list[dict]) -> list[dict]:
    """The chat messages of input items: a message's input_text / output_text parts as text,
    its input_image parts as image_url parts; a function_call as an assistant message's tool
    call (calls in a row, or after an assistant message, join that message); a
    function_call_output as a tool message; reasoning items left out. ApiError naming
    input.N... for an item the server cannot take."""
    messages: list[dict] = []
    for n, item in enumerate(items):
        kind, where = item.get("type"), f"input.{n}"
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = "".join(_part_text(p, f"{where}.output.{k}") for k, p in enumerate(output))
            if not isinstance(output, str):
                raise ApiError(400, f"{where}.output: a function_call_output's output is a string (or text parts)",
                               param=f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _text(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue
        else:
            raise ApiError(400, f"{where}.type: '{kind}' items are not served here; this server takes message, "
                                "function_call, function_call_output and reasoning items", param=f"{where}.type")
    return messages


def _text(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{name}: a {item.get('type')} item needs its {name} (a string)",
                       param=f"{where}.{name}")
    return value


def _part_text(part, where: str) -> str:
    if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text") and \
            isinstance(part.get("text"), str):
        return part["text"]
    raise ApiError(400, f"{where}: a text part is {{\"type\": \"input_text\", \"text\": ...}}", param=where)


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(400, f"{where}.role: a message's role is user, assistant, system or developer, not "
                            f"{json.dumps(role)[:64]}", param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content: a message's content is a string or a list of parts",
                       param=f"{where}.content")
    parts = []
    for k, part in enumerate(content):
        at = f"{where}.content.{k}"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise ApiError(400, f"{at}.image_url: an input_image is given by its image_url (a data URL, or "
                                    "http(s) where the server fetches images); file_id is not served here",
                               param=f"{at}.image_url")
            parts.append({"type": "image_url", "image_url": {"url": url, "detail": part.get("detail") or "auto"}})
        elif kind in ("input_file", "input_audio"):
            raise ApiError(400, f"{at}.type: {kind} parts are not served here", param=f"{at}.type")
        else:
            parts.append({"type": "text", "text": _part_text(part, at)})
    if all(p["type"] == "text" for p in parts):  # text only: the content as one string, as a chat client sends it
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def assistant_turn(text: str, tool_calls: list[dict] | None) -> dict:
    """A response's output as the assistant message a next turn's conversation holds."""
    if tool_calls:
        return {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
    return {"role": "assistant", "content": text}


# -- options as a chat request ----------------------------------------------------------------------------
def chat_body(request: ResponseRequest, messages: list[dict]) -> dict:
    """The chat request (ChatCompletionRequest's fields) a response runs as."""
    extra = dict(request.model_extra or {})  # ResponseRequest refused the chat-only fields
    body = {**extra, "model": request.model, "messages": messages, "stream": False}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "metadata", "service_tier"):
        if getattr(request, name) is not None:
            body[name] = getattr(request, name)
    if request.max_output_tokens is not None:
        body["max_completion_tokens"] = request.max_output_tokens
    if request.tools:
        body["tools"] = [_chat_tool(t, f"tools.{k}") for k, t in enumerate(request.tools)]
    if request.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(request.tool_choice)
    form = request.text.format if request.text else None
    if form is not None:
        body["response_format"] = _chat_format(form)
    if request.top_logprobs is not None or "message.output_text.logprobs" in (request.include or ()):
        body.update(logprobs=True, top_logprobs=request.top_logprobs or 0)
    return body


def _chat_tool(tool: dict, where: str) -> dict:
    if tool.get("type") != "function":
        raise ApiError(400, f"{where}.type: only function tools are served here, not {json.dumps(tool.get('type'))[:64]}",
                       param=f"{where}.type")
    if not isinstance(tool.get("name"), str):
        raise ApiError(400, f"{where}.name: a function tool needs its name", param=f"{where}.name")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict) -> str | dict:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    if isinstance(choice, dict):
        raise ApiError(400, "tool_choice: none, auto, required or {\"type\": \"function\", \"name\": ...}",
                       param="tool_choice")
    return choice


def _chat_format(form: dict) -> dict:
    kind = form.get("type")
    if kind == "json_schema":
        schema = {k: form[k] for k in ("name", "description", "schema", "strict") if k in form}
        return {"type": "json_schema", "json_schema": schema}
    return {k: v for k, v in form.items()}


def responses_field(param: str, instructions: str | None = None, conversation: list[dict] = ()) -> str:
    """The Responses field of a chat request's field (input for messages.3.content,
    max_output_tokens for max_completion_tokens, text.format for response_format, tools.0.name
    for tools.0.function.name). Where the request gave `instructions` (the chat's first message,
    before the `conversation`), messages.0 is instructions, and so is the whole prompt
    (`messages`: too long for the context) where they hold most of its characters."""
    head, _, rest = param.partition(".")
    if head == "messages" and instructions:
        if rest.split(".")[0] == "0" or (not rest and len(instructions) > len(json.dumps(list(conversation)))):
            return "instructions"
    if head == "messages":
        return "input"
    if head == "response_format":
        return "text.format"
    if head == "tools" and rest.split(".")[1:2] == ["function"]:
        pieces = rest.split(".")
        return ".".join(["tools", pieces[0], *pieces[2:]])
    if head in RESPONSES_NAMES:
        return RESPONSES_NAMES[head] + (f".{rest}" if rest else "")
    return param


def responses_error(error: ApiError, instructions: str | None = None, conversation: list[dict] = ()) -> ApiError:
    """An error the chat route's validation or the decoder gave, naming the Responses field
    (responses_field); its message says the field's name, then what it said of it (the error's
    predicate)."""
    if error.param is None:
        return error
    field = responses_field(error.param, instructions, conversation)
    if field == error.param:
        return error
    predicate = error.predicate
    if predicate is None and error.message.startswith(error.param):
        predicate = error.message[len(error.param):]  # a validation error: "field: what is wrong"
    message = error.message if predicate is None else field + predicate
    return ApiError(error.status, message, param=field, kind=error.kind, code=error.code, predicate=predicate)


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
