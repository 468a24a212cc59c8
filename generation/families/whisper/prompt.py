"""Whisper's decoder prompt as transformers 4.57 builds it (`WhisperGenerationMixin.
_retrieve_init_tokens` and `_set_language_and_task`), from every source it reads.

    [decoder_start] + language + task + <|notimestamps|> (unless timestamps)

- `language` / `task` arguments override generation_config.json's `language` / `task`; an
  English-only config (`is_multilingual: false`) refuses either argument, a config without
  `lang_to_id` / `task_to_id` refuses `language` / `task`.
- With neither set anywhere, the legacy `forced_decoder_ids` (generation_config.json, else
  config.json) give the tokens after decoder_start, position by position from 1 ([1, None]: the
  language, detected).
- The language slot (position 1) is the argument's language, or, where nothing fixed it and the
  config has `lang_to_id`, the one detected from the first step's logits over the language
  tokens, per clip; it replaces what `forced_decoder_ids` put there.
- A task argument appends its token (even after a forced one); a language without a task
  appends <|transcribe|> unless a task token is already there.
- <|notimestamps|> ends the prompt without timestamps (appended unless already last); with
  timestamps a last <|notimestamps|> is dropped. None entries are dropped.
"""

from __future__ import annotations

from typing import Callable

from ...params.checks import SettingError
from .languages import LANGUAGES, TASKS, TO_LANGUAGE_CODE


def language_id(config: dict, language) -> int:
    """A language's token id, as transformers' `language_to_id`: a token in lang_to_id
    (<|de|>), a name (german, or an alias: castilian) or a code (de), in any case."""
    if not isinstance(language, str):
        raise SettingError("language", f"language must be a string (a code, a name or a token), not {language!r:.40}")
    lang_to_id = config["lang_to_id"]
    name = language.lower()
    if name in lang_to_id:
        token = name
    elif name in TO_LANGUAGE_CODE:
        token = f"<|{TO_LANGUAGE_CODE[name]}|>"
    elif name in LANGUAGES:
        token = f"<|{name}|>"
    else:
        raise SettingError("language", f"language {language!r:.40} is not a Whisper language (a code such as 'de', "
                                       "a name such as 'german', or a token such as '<|de|>')")
    if token not in lang_to_id:
        raise SettingError("language", f"language {language!r:.40} ({token}) is not one of this model's: "
                                       f"{', '.join(k.strip('<|>') for k in lang_to_id)}")
    return int(lang_to_id[token])


def set_language_and_task(config: dict, language=None, task: str | None = None,
                          is_multilingual: bool | None = None) -> dict:
    """generation_config.json with the arguments that override it, checked as transformers'
    `_set_language_and_task` (a copy: the model's config is left as it is)."""
    config = dict(config)
    if is_multilingual is not None:
        if "is_multilingual" not in config:
            raise SettingError("is_multilingual", "is_multilingual: generation_config.json has no is_multilingual "
                                                  "(an outdated Whisper generation config)")
        config["is_multilingual"] = is_multilingual
    if "is_multilingual" in config and not config["is_multilingual"] and (task is not None or language is not None):
        raise SettingError("language" if language is not None else "task",
                           "this is an English-only Whisper model (generation_config.json: is_multilingual false): "
                           "language and task do not apply")
    if language is not None:
        if "lang_to_id" not in config:
            raise SettingError("language", "language: generation_config.json has no lang_to_id (an English-only or "
                                           "outdated Whisper generation config)")
        config["language"] = language
    if task is not None:
        if "task_to_id" not in config:
            raise SettingError("task", "task: generation_config.json has no task_to_id (an English-only or outdated "
                                       "Whisper generation config)")
        config["task"] = task
    return config


def _forced_tokens(config: dict, model_config: dict) -> list:
    """The tokens `forced_decoder_ids` put after decoder_start (positions 1, 2, ... in order)."""
    forced = config.get("forced_decoder_ids")
    if forced is None:
        forced = model_config.get("forced_decoder_ids")
    if not forced or forced[0][0] != 1:
        return []
    tokens, rest = [], list(forced)
    while rest and rest[0][0] == len(tokens) + 1:
        tokens.append(rest.pop(0)[1])
    if rest:
        raise ValueError(f"forced_decoder_ids {forced} do not follow Whisper's prompt pattern: they must give every "
                         f"position from 1 up to {rest[0][0]}")
    return tokens


def init_tokens(config: dict, model_config: dict, start: int, count: int, language=None,
                task: str | None = None, timestamps: bool = False, is_multilingual: bool | None = None,
                detect: Callable[[], list[int]] | None = None) -> list[list[int]]:
    """Each of `count` clips' decoder prompt (see the module docstring). config:
    generation_config.json; model_config: config.json (its forced_decoder_ids, the fallback);
    detect(): each clip's detected language token, called only where the language is open."""
    config = set_language_and_task(config, language, task, is_multilingual)
    task, language = config.get("task"), config.get("language")
    init = [start]
    if task is None and language is None:
        init += _forced_tokens(config, model_config)
    open_language = len(init) <= 1 or init[1] is None
    if isinstance(language, (list, tuple)):
        if any(name is None for name in language):
            raise SettingError("language", "language: give None, one language, or one per clip, not a list "
                                           "holding None")
        if len(language) != count:
            raise SettingError("language", f"language: give one language, or one per clip ({count}), "
                                           f"not {len(language)}")
        languages = list(language)
    else:
        languages = [None] * count if language is None else [language]
    rows = [list(init) for _ in languages]
    lang_ids = None
    if language is not None:
        lang_ids = [language_id(config, name) for name in languages]
    elif "lang_to_id" in config and open_language and detect is not None:
        lang_ids = [int(i) for i in detect()]
    for row, lang in zip(rows, lang_ids or ()):
        if len(row) > 1:
            row[1] = lang
        else:
            row.append(lang)
    task_ids = config.get("task_to_id") or {}
    no_timestamps = config.get("no_timestamps_token_id")
    for row in rows:
        if task is not None:
            if task not in TASKS:
                raise SettingError("task", f"task must be one of {', '.join(TASKS)}, not {task!r:.40}")
            if task not in task_ids:
                raise SettingError("task", f"task {task!r}: generation_config.json's task_to_id has no such task")
            row.append(int(task_ids[task]))
        elif language is not None and "task_to_id" in config and not any(t in row for t in task_ids.values()):
            row.append(int(task_ids["transcribe"]))
        if not timestamps and "no_timestamps_token_id" in config and row[-1] != no_timestamps:
            row.append(no_timestamps)
        elif timestamps and row[-1] == no_timestamps:
            row.pop()
        row[:] = [int(t) for t in row if t is not None]
    return [list(rows[0]) for _ in range(count)] if len(rows) == 1 and count > 1 else rows


def detected_language(config: dict, prompt: list[int]) -> str | None:
    """The language code a decoder prompt holds (its position 1), None where it holds none."""
    names = {int(v): k.strip("<|>") for k, v in (config.get("lang_to_id") or {}).items()}
    return names.get(prompt[1]) if len(prompt) > 1 else None


def prompt_ids(model, text: str) -> list[int]:
    """A previous-text prompt's ids, as transformers' `WhisperTokenizer.get_prompt_ids`:
    <|startofprev|>, then " " + the stripped text without special tokens; a text holding a
    special token (<|en|>, a timestamp, ...) is refused."""
    from ...text.tokenizer import model_tokenizer

    if not isinstance(text, str):
        raise SettingError("prompt", f"prompt must be a string, not {type(text).__name__}")
    tokenizer = model_tokenizer(model)
    start = tokenizer.token_to_id("<|startofprev|>")
    first_special = tokenizer.token_to_id("<|endoftext|>")
    if start is None or first_special is None:
        raise SettingError("prompt", f"{model.folder.name}: the tokenizer has no <|startofprev|> or <|endoftext|>; "
                                     "a previous-text prompt needs both")
    ids = tokenizer.encode(" " + text.strip(), add_special_tokens=False).ids
    special = next((t for t in ids if t >= first_special), None)
    if special is not None:
        raise SettingError("prompt", f"prompt: the text holds the special token {tokenizer.id_to_token(special)}, "
                                     "which a previous-text prompt may not")
    return [start] + ids
