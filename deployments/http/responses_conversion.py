"""A Responses request as the chat request it is: its input items (and the stored conversation it
continues) as chat messages, its options as a chat request's fields (`chat_body`), and a chat
error's field named as the Responses API names it. Pure data, no Ray.
"""

from __future__ import annotations

import json

from .openai import ApiError

from .responses import RESPONSES_NAMES, ResponseRequest, new_id


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
