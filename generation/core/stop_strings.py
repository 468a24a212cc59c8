"""Stop strings, matched on the decoded text as transformers' `StopStringCriteria` does.

A row stops at the token that completes a stop string: the string occurs in the row's text
(prompt included) and overlaps the text of that last token, so a token may overhang the string
at either end ("st" + "opera" stops at "stop"). The token is kept, as in transformers; the text
a caller shows is cut before the string or kept whole (`include_stop_str_in_output`).
"""

from __future__ import annotations

from typing import Sequence


class StopMatcher:
    """The stop strings of one row, checked after each of its tokens.

    >>> from tokenizers import Tokenizer, models
    >>> tok = Tokenizer(models.WordLevel({"st": 0, "opera": 1, "x": 2}, unk_token="x"))
    >>> tok.decoder = __import__("tokenizers").decoders.Fuse()
    >>> m = StopMatcher(tok, ["stop"], prompt=[2])
    >>> [m.add(t) for t in (0, 1)]
    [False, True]
    """

    def __init__(self, tokenizer, stop_strings: Sequence[str], prompt: Sequence[int] = ()):
        self.tokenizer, self.stops = tokenizer, tuple(stop_strings)
        self.window = max(len(s) for s in self.stops) + 1  # tokens of text that can hold a match
        self.ids = list(prompt)[-self.window:]
        self._decoded = self._text(self.ids)  # the text of self.ids: the next token's `before`

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, token: int) -> bool:
        """Whether `token` completes one of the stop strings. A step decodes the window once (and
        the token alone): the window before the token is the text the previous step decoded."""
        before = self._decoded
        self.ids = (self.ids + [int(token)])[-self.window - 1:]
        text = self._decoded = self._text(self.ids)
        start = len(before) if text.startswith(before) else len(text) - len(self._text([int(token)]))
        for stop in self.stops:
            if stop in text[max(0, start - len(stop) + 1):]:
                return True
        return False


def cut_at_stop(text: str, stop_strings: Sequence[str] | None, include: bool = False) -> str:
    """The text of a row that a stop string ended: up to the first stop string, with or without it.

    >>> cut_at_stop("Hello. World", ["."]), cut_at_stop("Hello. World", ["."], include=True)
    ('Hello', 'Hello.')
    """
    if not stop_strings:
        return text
    found = [(text.find(s), s) for s in stop_strings if s in text]
    if not found:
        return text
    at, stop = min(found)
    return text[:at + len(stop)] if include else text[:at]
