"""Chat prompts: the model folder's chat template, rendered as transformers renders it.

The template comes from `chat_template.jinja` in the folder, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates of which "default" is used). It runs in
jinja2's immutable sandbox with transformers' settings (trim_blocks, lstrip_blocks, loop
controls, `raise_exception`, `tojson`), so the token ids equal
`tokenizer.apply_chat_template(messages, add_generation_prompt=True)`.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template refused the messages."""


def chat_template(folder: Path) -> str | None:
    """The folder's chat template text, or None."""
    folder = Path(folder)
    for candidate in (folder / "chat_template.jinja", folder / "genai" / "chat_template.jinja"):
        if candidate.is_file():
            return candidate.read_text()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, list):
            value = next((t["template"] for t in value if t.get("name") == "default"), None)
        if isinstance(value, str):
            return value
    return None


def special_tokens(folder: Path) -> dict[str, str]:
    """bos_token, eos_token, ... as the template sees them (tokenizer_config.json)."""
    config = Path(folder) / "tokenizer_config.json"
    out: dict[str, str] = {}
    if config.is_file():
        for name, value in json.loads(config.read_text()).items():
            if name.endswith("_token"):
                value = value.get("content") if isinstance(value, dict) else value
                if isinstance(value, str):
                    out[name] = value
    return out


@lru_cache(maxsize=16)
def _compiled(template: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ChatTemplateError(f"the chat template refused the messages: {message}")

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the model's chat template does not parse: {e}") from None


def render_chat(template: str | None, messages: list[dict], tokens: dict[str, str] | None = None,
                add_generation_prompt: bool = True, variables: dict | None = None) -> str:
    """The prompt text of `messages` ([{"role": ..., "content": ...}]); tokenize it without
    adding special tokens (the template places them). `variables`: more of the template's
    variables (transformers' `apply_chat_template(**kwargs)`: enable_thinking, ...), over the
    special tokens."""
    if template is None:
        raise ChatTemplateError("this model has no chat template (chat_template.jinja or tokenizer_config.json's "
                                "chat_template); send a plain prompt instead")
    try:
        return _compiled(template).render(**{**(tokens or {}), **(variables or {}), "messages": messages,
                                             "add_generation_prompt": add_generation_prompt})
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input error
        raise ChatTemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from None
