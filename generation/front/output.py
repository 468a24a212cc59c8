"""Output processing: a row's tokens into text deltas, stop strings applied, tool calls read out.

The engine ends a row at the token that completes a stop string (generation.core.stop_strings, as
transformers' StopStringCriteria); here its text is cut before the string, and while the text
ends with what may become a stop string that much is held back, so no client ever sees a stop
string's start. A request with tools holds its text to the end, where its calls are read out in
the template family's format (generation.text.tool_calls).

Log-probabilities go out as JSON numbers: every value is finite and at least LOGPROB_FLOOR
(vLLM's clamp, `max(logprob, -9999.0)` in its chat and completions serving), and an alternative
the sampling filters removed (top_k, top_p, min_p: log-probability -inf) is left out, so a step
may list fewer alternatives than asked. Done here, where TokenTexts are made, so every route,
stream, batch line and the handle API give the same numbers.

    deltas = TextDeltas(tokenizer, stop_strings=["\\n\\n"])
    piece = deltas.add([token_id, ...])     # the text that may go out now
    rest = deltas.finish()                  # what was held back, cut at the stop string
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

from generation.core.stop_strings import cut_at_stop
from generation.text.tokenizer import Detokenizer


class TextDeltas:
    """A row's text as it grows: `add` gives the piece that may go out, `finish` the rest."""

    def __init__(self, tokenizer, stop_strings: list[str] = (), hold_all: bool = False):
        self.stops, self.hold_all = list(stop_strings), hold_all
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.detokenizer = Detokenizer(tokenizer)
        self.text, self.sent = "", 0

    def add(self, token_ids) -> str:
        for token in token_ids:
            self.text += self.detokenizer.add(token)
        visible = cut_at_stop(self.text, self.stops)
        end = len(visible) if len(visible) < len(self.text) else max(self.sent, len(visible) - self.hold)
        if self.hold_all:
            end = self.sent
        piece, self.sent = visible[self.sent:end], max(self.sent, end)
        return piece

    def finish(self) -> str:
        """The text not sent yet, the row's last characters decoded, cut at a stop string."""
        self.text += self.detokenizer.flush()
        return self.visible[self.sent:]

    @property
    def visible(self) -> str:
        """The whole text a client sees (cut before a stop string)."""
        return cut_at_stop(self.text, self.stops)


def tool_calls(template: str | None, request, text: str, cut: bool = False) -> tuple[str, list[dict] | None]:
    """The output's text outside its tool calls and the calls as OpenAI gives them (ids
    call_<request>_<k>), read in the template family's format; (text, None) without calls.
    `cut`: the budget ended it; an output held to calls (tool_choice "required" or a named
    function) then ends in the call it was writing, its arguments as far as written, as OpenAI's."""
    from generation.text.tool_calls import cut_calls, parse_calls, tool_format

    names = [t["function"]["name"] for t in request.tools]
    choice = request.tool_choice
    if cut and choice != "auto":  # the grammar held it to calls (prompts.py: not "auto" nor "none")
        forced = choice["function"]["name"] if isinstance(choice, dict) else None
        parsed = cut_calls(tool_format(template), text, names, forced)
    else:
        parsed = parse_calls(tool_format(template), text, names)
    if not parsed.calls:
        return text, None
    base = (request.request_id or secrets.token_hex(8)).replace("-", "")[:24]
    calls = [{"id": f"call_{base}_{k}", "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(parsed.calls)]
    return parsed.content or "", calls


LOGPROB_FLOOR = -9999.0  # vLLM's: no JSON parser reads -Infinity or NaN


def clamped(logprob: float) -> float:
    """A log-probability JSON carries: at least LOGPROB_FLOOR (-inf and NaN become it)."""
    logprob = float(logprob)
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR


def kept(token: int, logprob: float) -> bool:
    """An alternative worth listing: a token (the engine pads with id -1 past a top_k's
    candidates) that the sampling filters left a chance (not -inf, not NaN)."""
    return token >= 0 and logprob > -math.inf


@dataclass(frozen=True)
class TokenText:
    """A token as a client reads it: its id, text, log-probability (None: the prompt's first)
    and the step's best alternatives [(id, text, logprob)]."""

    id: int
    text: str
    logprob: float | None
    top: list[tuple[int, str, float]] | None = None


class TokenTexts:
    """Tokens' texts (special tokens kept, as vLLM's logprobs show them), and log-probabilities as TokenTexts."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def of(self, token, top: int) -> TokenText:
        """A batcher Token (id, logprob, top [(id, logprob)]) with `top` alternatives."""
        alternatives = None
        if top and token.top is not None:
            alternatives = [(i, self.text(i), clamped(lp)) for i, lp in token.top[:top] if kept(i, lp)]
        logprob = None if token.logprob is None else clamped(token.logprob)
        return TokenText(token.id, self.text(token.id), logprob, alternatives)

    def of_prompt(self, prompt: list[int], found, top: int | None) -> list[TokenText] | None:
        """Each prompt token's TokenText (the first one's logprob None: nothing comes before it),
        from the batcher's prompt pass at admission (`found`: PromptLogprobs); None when not asked."""
        if top is None or found is None:
            return None
        out = [TokenText(prompt[0], self.text(prompt[0]), None)]
        for i, token in enumerate(prompt[1:]):
            alternatives = None
            if top and found.top is not None:
                alternatives = [(int(t), self.text(int(t)), clamped(lp)) for t, lp in
                                zip(found.top_ids[i][:top], found.top[i][:top]) if kept(int(t), lp)]
            out.append(TokenText(token, self.text(token), clamped(found.logprob[i]), alternatives))
        return out
