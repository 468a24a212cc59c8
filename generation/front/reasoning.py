"""Reasoning output: a thinking model's reasoning apart from its answer.

Models that think (Qwen3, SmolLM3, DeepSeek-R1 distills, Magistral) write their reasoning
between markers (`<think>` ... `</think>`, `[THINK]` ... `[/THINK]`) before the answer; their chat
templates often open the block in the prompt, so the output starts inside it. A chat whose
model has a parser (chosen from its template: the markers it writes, or by name) gets its text
split: the reasoning (markers left out) and the content, as vLLM's and SGLang's reasoning
parsers split it. Where the block is opened but never closed (the row was cut short), all of
the text is reasoning, as vLLM's DeepSeek-R1 parser reads it.

    split = ReasoningSplit(PARSERS["think"], inside=True)
    split.add("Let me see.</thi")  # -> ("Let me see.", "")  ("</thi" may begin the end marker)
    split.add("nk>Four.")          # -> ("", "Four.")
    split.finish()                 # -> ("", "")
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParser:
    """A reasoning block's markers."""

    name: str
    start: str
    end: str


PARSERS = {p.name: p for p in (ReasoningParser("think", "<think>", "</think>"),
                               ReasoningParser("mistral", "[THINK]", "[/THINK]"))}
CHOICES = ("auto", "none", *PARSERS)  # what --reasoning-parser takes


def parser_for(template: str | None, choice: str = "auto") -> ReasoningParser | None:
    """The parser of a chat template: `choice` by name, "none", or "auto": the first whose start
    marker the template writes (None: the model does not think, its text is all content)."""
    if choice not in CHOICES:
        raise ValueError(f"reasoning_parser: one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "none":
        return None
    if choice != "auto":
        return PARSERS[choice]
    return next((p for p in PARSERS.values() if template and p.start in template), None)


def opened_in(prompt_text: str, parser: ReasoningParser) -> bool:
    """Whether the prompt leaves a reasoning block open (the template opened it for the model)."""
    return prompt_text.rfind(parser.start) > prompt_text.rfind(parser.end)


class ReasoningSplit:
    """A stream of text split into (reasoning, content) pieces. `inside`: the text starts inside
    a reasoning block. A piece that may be the start of a marker is held back until it is told
    apart; the markers themselves go to neither side."""

    def __init__(self, parser: ReasoningParser, inside: bool = False):
        self.parser, self.inside = parser, inside
        self.pending = ""  # text not split yet: it may begin a marker
        self.reasoning, self.content = "", ""  # all of each so far
        self.seen_block = inside  # a block was opened (the output is a thinking model's)

    def add(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) the text completes."""
        text, reasoning, content = self.pending + text, [], []
        self.pending = ""
        while text:
            marker = self.parser.end if self.inside else self.parser.start
            at = text.find(marker)
            if at >= 0:
                (reasoning if self.inside else content).append(text[:at])
                text, self.inside = text[at + len(marker):], not self.inside
                self.seen_block = True
                continue
            keep = _partial(text, marker)
            (reasoning if self.inside else content).append(text[:len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        return self._took("".join(reasoning), "".join(content))

    def finish(self) -> tuple[str, str]:
        """What was held back: a marker's start that never completed is text."""
        text, self.pending = self.pending, ""
        return self._took(text, "") if self.inside else self._took("", text)

    def _took(self, reasoning: str, content: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.content += content
        return reasoning, content


def _partial(text: str, marker: str) -> int:
    """How many characters at the end of `text` are a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
