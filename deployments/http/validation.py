"""A request body into its shape: checked before validation (`check_json`: depth, strings), then
validated into one of openai.py's shapes (`parse`); the first problem becomes an ApiError that
names the request's own field (`logit_bias`, `stop`, `messages.0.content.1.image_url`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ValidationError

from .openai import ApiError

MAX_DEPTH = 32  # JSON nesting of a body (a chat message with parts is 6 deep)


def check_json(value, path: str = "", depth: int = 0) -> None:
    """ApiError 400 for a body nested deeper than MAX_DEPTH or holding a string that is not
    valid Unicode (a lone surrogate, which JSON's \\ud800 escapes allow): neither can reach the
    tokenizer, the chat template or Ray's serialization. Iterative, so no nesting overflows it."""
    stack = [(value, path, depth)]
    while stack:
        item, where, level = stack.pop()
        if level > MAX_DEPTH:
            raise ApiError(400, f"{where or 'the body'}: nested more than {MAX_DEPTH} levels deep",
                           param=where or None)
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{where or 'the body'}: not valid Unicode (a lone surrogate escape)",
                               param=where or None) from None
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = f"{where}.{key}" if where else str(key)
                stack.append((key, where, level + 1))
                stack.append((child, child_path, level + 1))
        elif isinstance(item, list):
            for i, child in enumerate(item):
                stack.append((child, f"{where}.{i}" if where else str(i), level + 1))


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "dict", "list", "tuple", "any", "bytes"}


def field_path(loc) -> str | None:
    """A pydantic error location as the request's dotted field: union members' tags
    ('str', 'list[int]', 'ImageURL') and dict-key markers left out ('stop.str' -> 'stop')."""
    parts = []
    for part in loc:
        if isinstance(part, int):
            parts.append(str(part))
        elif not ("[" in part or "-" in part or part in _TYPE_TAGS or part[:1].isupper()):
            parts.append(part)
    return ".".join(parts) or None


def validation_error(errors: list[dict]) -> ApiError:
    """The first problem of pydantic's errors (`ValidationError.errors()`) as an ApiError naming
    its field. Where a union failed on every member, a member's specific complaint (a string too
    long) beats "not a valid string"; where all are type mismatches, they are listed together."""
    field = field_path(errors[0]["loc"])
    same = [e for e in errors if field_path(e["loc"]) == field or
            (field_path(e["loc"]) or "").startswith(f"{field}.")]
    specific = [e for e in same if not e["type"].endswith("_type") and e["type"] not in ("int_parsing", "float_parsing")]
    if specific:
        chosen = specific[0]
        field, message = field_path(chosen["loc"]), chosen["msg"]
    else:
        chosen = same[0]
        message = " or ".join(dict.fromkeys(e["msg"] for e in same))
    message = message.removeprefix("Value error, ")
    if chosen["type"] == "extra_forbidden":
        message = f"unknown field '{field}'"
    named = re.match(r"^([a-z_]+): ", message) if field is None else None
    if named:  # a check across fields that names the one at fault first (best_of, a second constraint)
        return ApiError(400, message, param=named.group(1))
    if field is None:
        return ApiError(400, message)
    return ApiError(400, f"{field}: {message}", param=field, predicate=f": {message}")


def parse(kind: type[BaseModel], body: dict):
    """Validate a JSON body; the first problem becomes an ApiError naming its field."""
    try:
        return kind.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors(include_url=False)) from None
