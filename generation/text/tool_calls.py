"""Tool calling: the tool-call format a chat template writes, the grammar that holds an output to
tool calls, and the calls read back out of an output.

OpenAI's tools ([{"type": "function", "function": {"name", "description", "parameters"}}]) go to
the template as transformers' `apply_chat_template(tools=...)` passes them (dicts as given); an
assistant message's tool_calls go with their arguments as objects, not JSON text, as vLLM
renders them (templates write `arguments | tojson`). What a model writes for a call depends on
its template's family (`tool_format`, read from the template's text):

    hermes       <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one per call
                 (Hermes 2 Pro, Qwen2.5, Qwen3: the template names <tool_call>)
    llama3_json  {"name": ..., "parameters": {...}}, calls separated by "; ", optionally after
                 <|python_tag|> (Llama 3.1 to 3.3's JSON tool calling)
    mistral      [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
    json         {"name": ..., "arguments": {...}}, a JSON list for several (a template that
                 writes no format of its own)

tool_choice "required" or a named function holds the output to calls of the given tools
(`tool_grammar`: a Lark grammar for llguidance, each call's JSON the tool's parameters schema);
"auto" lets the model write text or calls, and `parse_calls` reads them out of the text. Such a
forced output that the budget cut is still calls (`cut_calls`): the last one as far as it was
written, as OpenAI returns a call cut by max_tokens.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field

from ..logits.constraints import JSON_LAYOUT, GrammarBudget, schema_error

FORMATS = ("hermes", "llama3_json", "mistral", "json")


class ToolError(ValueError):
    """A tool or a tool message that cannot go to the model; `field` names the request's part."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class ToolCall:
    """A call as OpenAI returns it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass
class Parsed:
    """An output read for tool calls: its text outside the calls (None when there is none) and
    the calls, in order."""

    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def tool_format(template: str | None) -> str:
    """The tool-call format a chat template writes (module docstring), from its text."""
    text = template or ""
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ('"parameters"' in text and "tools" in text):
        return "llama3_json"
    return "json"


def check_tools(tools) -> list[dict]:
    """OpenAI's tools, checked: each {"type": "function", "function": {"name": identifier,
    "description"?, "parameters"?: a JSON schema object}}, names unique. ToolError naming the
    field (tools.2.function.name) otherwise."""
    if not isinstance(tools, (list, tuple)) or not tools:
        raise ToolError("tools", "tools must be a non-empty list of {\"type\": \"function\", \"function\": {...}}")
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ToolError(where, f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", name):
            raise ToolError(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ "
                                                      f"or -, not {name!r:.80}")
        if name in seen:
            raise ToolError(f"{where}.function.name", f"{where}.function.name: '{name}' is named twice")
        seen.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                                                            "object")
    return list(tools)


def check_tool_schemas(tools: list[dict], budget: GrammarBudget) -> None:
    """Each tool's parameters compiled as a JSON schema within `budget`, whatever the tool_choice
    (constraints.schema_error: keywords llguidance does not implement pass, a malformed schema does
    not); ToolError naming tools.i.function.parameters otherwise. An agent sends the same tools
    every turn: each schema's verdict is kept (_schema_error, by its JSON text)."""
    for i, tool in enumerate(tools):
        where = f"tools.{i}.function.parameters"
        parameters = tool["function"].get("parameters") or {"type": "object", "properties": {}}
        try:
            error = _schema_error(json.dumps(parameters, sort_keys=True), budget)
        except (TypeError, ValueError):  # not JSON text (a handle's Python objects): checked as they are
            error = schema_error(parameters, budget)
        if error:
            raise ToolError(where, f"{where} is not a JSON schema this server compiles: {error}")


@functools.lru_cache(maxsize=256)
def _schema_error(parameters: str, budget: GrammarBudget) -> str:
    return schema_error(json.loads(parameters), budget)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as the template reads them: an assistant message's tool_calls with their
    arguments as objects (OpenAI sends JSON text). ToolError naming the message's field when
    the arguments are not JSON."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if calls:
            rendered = []
            for j, call in enumerate(calls):
                function = dict(call.get("function") or {})
                arguments = function.get("arguments")
                if isinstance(arguments, str):
                    try:
                        function["arguments"] = json.loads(arguments) if arguments.strip() else {}
                    except ValueError as e:
                        raise ToolError(f"messages.{i}.tool_calls.{j}.function.arguments",
                                        f"messages.{i}.tool_calls.{j}.function.arguments is not JSON: {e}") from None
                rendered.append({**call, "function": function})
            message = {**message, "tool_calls": rendered}
        out.append(message)
    return out


def _arguments_key(fmt: str) -> str:
    return "parameters" if fmt == "llama3_json" else "arguments"


def call_schema(fmt: str, tools: list[dict], name: str | None = None) -> dict:
    """The JSON schema of one call in format `fmt`: {"name": one of the tools (or `name`), its
    arguments key: that tool's parameters schema}."""
    key = _arguments_key(fmt)
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        options.append({"type": "object", "properties": {"name": {"const": function["name"]}, key: parameters},
                        "required": ["name", key], "additionalProperties": False})
    if not options:
        raise ToolError("tool_choice", f"tool_choice names the function '{name}', which is not one of the tools")
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_LAYOUT}  # a call written as structured_outputs' JSON is


def tool_grammar(fmt: str, tools: list[dict], name: str | None = None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's, with %json) for an output that is tool calls only: one, or
    with `parallel` one or more, of `tools` (only `name` when given) in format `fmt`."""
    call = "%json " + json.dumps(call_schema(fmt, tools, name))
    if fmt == "hermes":
        one, sep = '"<tool_call>\\n" body "\\n</tool_call>"', '"\\n"'
    elif fmt == "llama3_json":
        one, sep = "body", '"; "'
    elif fmt == "mistral":
        more = ' (", " body)*' if parallel else ""
        return f'start: "[TOOL_CALLS] [" body{more} "]"\nbody: {call}'
    else:
        if parallel:
            return f'start: body | "[" body (", " body)* "]"\nbody: {call}'
        return f"start: body\nbody: {call}"
    many = f" ({sep} call)*" if parallel else ""
    return f"start: call{many}\ncall: {one}\nbody: {call}"


def _objects(text: str) -> list[tuple[int, int, object]]:
    """The JSON values that start at each '{' or '[' of `text` and parse, left to right, not
    overlapping: (start, end, value)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text):
        starts = [i for i in (text.find("{", at), text.find("[", at)) if i >= 0]
        if not starts:
            break
        start = min(starts)
        try:
            value, end = decoder.raw_decode(text, start)
        except ValueError:
            at = start + 1
            continue
        found.append((start, end, value))
        at = end
    return found


def _call(value, key: str) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_calls(fmt: str, text: str, names=None) -> Parsed:
    """The tool calls in an output of format `fmt` (names outside `names`, when given, are not
    calls), and its text outside them. Text that only looks like a call stays text."""
    names = set(names) if names is not None else None
    key = _arguments_key(fmt)

    def known(call):
        return call is not None and (names is None or call.name in names)

    if fmt == "hermes":
        calls, rest, at = [], [], 0
        for m in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text, re.S):
            try:
                call = _call(json.loads(m.group(1)), key)
            except ValueError:
                call = None
            if known(call):
                rest.append(text[at:m.start()])
                calls.append(call)
                at = m.end()
        rest.append(text[at:])
        content = "".join(rest).strip()
        return Parsed(content or None, calls) if calls else Parsed(text, [])
    body, head = text, ""
    if fmt == "mistral":
        marker = text.find("[TOOL_CALLS]")
        if marker < 0:
            return Parsed(text, [])
        head, body = text[:marker], text[marker + len("[TOOL_CALLS]"):]
    elif fmt == "llama3_json":
        head, tag, body = text.partition("<|python_tag|>")
        if not tag:
            head, body = "", text
    calls, spans = [], []
    for start, end, value in _objects(body):
        items = value if isinstance(value, list) else [value]
        found = [_call(v, key) for v in items]
        if found and all(known(c) for c in found):
            calls += found
            spans.append((start, end))
    if not calls:
        return Parsed(text, [])
    rest, at = [head], 0
    for start, end in spans:
        rest.append(body[at:start])
        at = end
    rest.append(body[at:])
    content = re.sub(r"^[\s;]+|[\s;]+$", "", "".join(rest))
    return Parsed(content or None, calls)


# a call's start as the grammar writes it ({"name": "...", "arguments": ...), each piece optional
# after the one before, so that a start cut anywhere matches as far as it was written
_CUT_CALL = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"(?:\s*:\s*(?:"(?P<name>(?:[^"\\]|\\.)*)(?P<named>")?'
                       r'(?:\s*,\s*"(?:arguments|parameters)"\s*:\s*(?P<arguments>.*))?)?)?)?)?)?)?)?)?', re.S)


def cut_calls(fmt: str, text: str, names: list[str], forced: str | None = None) -> Parsed:
    """The calls of an output held to calls (tool_choice "required" or a named function: the
    grammar wrote nothing else) that the budget cut: each whole one, then the cut one with its
    name and its arguments' text as far as it was written (not JSON yet), as OpenAI returns a
    call cut by max_tokens. Whole calls are read as JSON objects, whatever of the format's
    markup the cut left (a hermes call without its </tool_call>). A name cut short is the
    `forced` function's, or that of the one tool whose name it begins; where none is known the
    text stays text (parse_calls).

    >>> cut_calls("hermes", '<tool_call>\\n{"name": "get_weather", "arguments": {"city": "Pa', ["get_weather"]).calls
    [ToolCall(name='get_weather', arguments='{"city": "Pa')]
    >>> cut_calls("json", '{"name": "get_w', ["get_weather", "get_time"]).calls
    [ToolCall(name='get_weather', arguments='')]
    """
    if not text.strip():  # a budget of no tokens: no call begun
        return Parsed(text, [])
    key, calls, end = _arguments_key(fmt), [], 0
    for start, stop, value in _objects(text):
        found = [_call(v, key) for v in (value if isinstance(value, list) else [value])]
        if found and all(c is not None and c.name in names for c in found):
            calls, end = calls + found, stop
    start = text.find("{", end)
    cut = _CUT_CALL.match(text, start) if start >= 0 else None
    if cut is None and calls:  # cut between calls
        return Parsed(None, calls)
    written = "" if cut is None else cut.group("name") or ""  # tool names are [a-zA-Z0-9_-]: no escapes
    if cut is not None and cut.group("named"):
        candidates = [n for n in names if n == written]
    else:
        candidates = [n for n in ([forced] if forced else names) if n.startswith(written)]
    if len(candidates) != 1:
        return Parsed(None, calls) if calls else parse_calls(fmt, text, names)
    arguments = "" if cut is None else cut.group("arguments") or ""
    try:  # the arguments whole, the call's closing brace cut: as _call gives them
        value, stop = json.JSONDecoder().raw_decode(arguments)
        if isinstance(value, dict) and not arguments[stop:].strip():
            arguments = json.dumps(value, ensure_ascii=False)
    except ValueError:
        pass
    return Parsed(None, calls + [ToolCall(candidates[0], arguments)])
