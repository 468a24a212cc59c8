"""Structured outputs: a row's tokens held to a JSON schema, a regex, a choice of strings or a
grammar, by llguidance (the grammar engine onnxruntime-genai and vLLM use; a Rust library with a
numpy interface and no torch: the engine needs nothing else).

A row's constraint is its setting `structured_outputs`, vLLM's field: one of {"json": schema},
{"json_object": true}, {"regex": pattern}, {"choice": [strings]} or {"grammar": Lark text (GBNF
is converted)}, normalized to a hashable (kind, text) pair (`core.settings`). Each row with one holds
an llguidance matcher (`RowConstraint`) that follows the row's generated tokens: before a mask is
computed it is brought to them, consuming the new ones and rolling back past tokens that are no
longer the row's (a beam that took another beam's history, candidates that were not accepted),
so it advances only by committed tokens, whatever moved the row. The mask applies after
transformers' processors and the custom ones, before the warpers, as a `LogitsProcessor` passed
to transformers' generate would: tokens the grammar forbids get -inf. A row whose tokens the
grammar cannot follow (a beam kept alive with a forbidden token, as transformers keeps -inf
beams) is masked everywhere from then on.

Compiled grammars are cached by content, per model tokenizer (`Grammars`): a row starts from a
copy of its grammar's matcher.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from ..core.settings import SettingError

FIELD = "structured_outputs"
NEG_INF = np.float32(-np.inf)
# JSON as json.dumps writes it: ", " and ": ", no other whitespace (llguidance would allow any,
# which a small model fills). A schema's "x-guidance" options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar(constraint: tuple[str, str]) -> str:
    """The llguidance grammar of a normalized constraint."""
    import llguidance

    kind, text = constraint
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(json.loads(text), defaults=JSON_LAYOUT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    if "::=" in text:  # GBNF (llama.cpp's, vLLM's grammar field): llguidance converts it to Lark
        from llguidance.gbnf_to_lark import gbnf_to_lark

        text = gbnf_to_lark(text)
    return llguidance.LLMatcher.grammar_from_lark(text)


def one_line(error: str) -> str:
    """llguidance's error as one line: its lines up to the source excerpt (" 1 | ..."), carets dropped."""
    lines = []
    for line in error.splitlines():
        if re.match(r"^\s*\d+ \|", line):
            break
        if line.strip() and line.strip() != "^":
            lines.append(" ".join(line.split()))
    return " ".join(lines) or error.strip()


class Grammars:
    """One model's grammar compiler: its tokenizer as llguidance reads it (built on first use)
    and the matchers of the grammars seen, by content (the most recent `size`)."""

    def __init__(self, tokenizer_path, vocab: int, eos: tuple[int, ...], size: int = 256):
        self.tokenizer_path, self.vocab, self.eos, self.size = tokenizer_path, vocab, tuple(eos), size
        self._tokenizer = None
        self._compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # requests are checked on their threads, rows start on the loop's

    @classmethod
    def of(cls, ctx) -> "Grammars":
        """The context's model's Grammars (one per model and eos)."""
        key = ("grammars", tuple(ctx.settings.eos_token_id))
        found = ctx.model.extras.get(key)
        if found is None:
            found = ctx.model.extras[key] = cls(ctx.model.tokenizer_path, ctx.model.vocab_size,
                                                ctx.settings.eos_token_id)
        return found

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            if self.tokenizer_path is None:
                raise SettingError(FIELD, f"{FIELD} needs the model's tokenizer.json, which its folder lacks")
            self._tokenizer = llguidance.LLTokenizer(self.tokenizer_path.read_text(), n_vocab=self.vocab,
                                                     eos_token=list(self.eos) or None)
        return self._tokenizer

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The eos ids the grammar ends with (the tokenizer's where the settings give none)."""
        with self._lock:
            return tuple(self.tokenizer.eos_tokens)

    def matcher(self, constraint: tuple[str, str]):
        """A fresh matcher of `constraint` (compiled once, then copied); SettingError naming the
        setting when the schema or grammar is not one llguidance takes. Thread-safe."""
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template.deep_copy()
        import llguidance

        try:
            text = grammar(constraint)
        except (ValueError, TypeError) as e:
            raise SettingError(FIELD, f"{FIELD}.{constraint[0]}: {e}") from None
        with self._lock:
            tokenizer = self.tokenizer
        error = llguidance.LLMatcher.validate_grammar(text, tokenizer)
        if error:
            raise SettingError(FIELD, f"{FIELD}.{constraint[0]}: {one_line(error)}")
        template = llguidance.LLMatcher(tokenizer, text, log_level=0)
        if template.is_error():
            raise SettingError(FIELD, f"{FIELD}.{constraint[0]}: {one_line(template.get_error())}")
        with self._lock:
            self._compiled[constraint] = template
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def check(self, constraint: tuple[str, str] | None) -> None:
        """SettingError naming the setting when the constraint does not compile."""
        if constraint is not None:
            self.matcher(constraint)


@dataclass
class RowConstraint:
    """A row's matcher, the tokens it has consumed (`tokens[:count]`), where the row's generated
    tokens start (its prompt length) and the tokenizer's eos ids."""

    matcher: object
    start: int
    eos: tuple[int, ...] = ()
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(64, np.int64))
    count: int = 0
    blocked: bool = False  # the row's tokens hold one the grammar forbids (after the consumed ones)
    ended: bool = False  # an eos followed the consumed tokens where the grammar could end: only eos after it

    @property
    def consumed(self) -> list[int]:
        return self.tokens[:self.count].tolist()

    def follow(self, generated: np.ndarray) -> bool:
        """Bring the matcher to the row's generated tokens: roll back past the first one that
        differs from what it consumed, then consume the rest, stopping before a token the
        grammar forbids (never consumed: the matcher stays usable) or at an eos where the
        grammar is complete (the output's end: what follows is not the grammar's). Whether the
        tokens are the grammar's."""
        generated = np.asarray(generated, np.int64)
        same = min(self.count, len(generated))
        differ = np.flatnonzero(self.tokens[:same] != generated[:same])
        common = int(differ[0]) if len(differ) else same
        if common < self.count:
            self.matcher.rollback(self.count - common)
            self.count = common
        self.blocked = self.ended = False
        for token in generated[common:].tolist():
            if self.matcher.validate_tokens([token]) == 1 and self.matcher.consume_token(token):
                if self.count == len(self.tokens):
                    self.tokens = np.concatenate([self.tokens, np.zeros_like(self.tokens)])
                self.tokens[self.count] = token
                self.count += 1
            elif token in self.eos and self.matcher.is_accepting():
                self.ended = True
                break
            else:
                self.blocked = True
                break
        return not self.blocked

    def allowed(self, vocab: int) -> np.ndarray:
        """The tokens the grammar allows after the tokens followed, [vocab] bool (none when
        they hold a forbidden one, only eos after the output's end)."""
        if self.blocked or self.ended:
            out = np.zeros(vocab, bool)
            if self.ended:
                out[[t for t in self.eos if t < vocab]] = True
            return out
        import llguidance.numpy as lnp

        mask = lnp.allocate_token_bitmask(1, vocab)
        lnp.fill_next_token_bitmask(self.matcher, mask, 0)
        return np.unpackbits(mask.view(np.uint8), axis=1, count=vocab, bitorder="little")[0].astype(bool)


def constrain(scores: np.ndarray, constraints: list, history: np.ndarray, length: np.ndarray) -> np.ndarray:
    """-inf in `scores` [n, V] where a constrained row's grammar forbids the token, each row's
    matcher first brought to its generated tokens (history [n, W], length [n]). The masks of all
    rows are computed at once, on llguidance's threads. In place."""
    import llguidance.numpy as lnp

    vocab = scores.shape[1]
    rows = [r for r, row in enumerate(constraints) if row is not None]
    if len({id(constraints[r]) for r in rows}) < len(rows):  # one row at several positions: in order
        for r in rows:
            constraints[r].follow(history[r, constraints[r].start:int(length[r])])
            np.putmask(scores[r], ~constraints[r].allowed(vocab), NEG_INF)
        return scores
    mask = lnp.allocate_token_bitmask(len(rows), vocab)
    mask[:] = 0
    live, ended = [], []
    for i, r in enumerate(rows):
        row = constraints[r]
        row.follow(history[r, row.start:int(length[r])])
        if row.ended:
            ended.append(i)
        elif not row.blocked:
            live.append((row.matcher, i))
    if live:
        lnp.fill_next_token_bitmask_par(executor(), live, mask)
    forbidden = np.unpackbits(~mask.view(np.uint8), axis=1, count=vocab, bitorder="little").view(bool)
    for i in ended:
        forbidden[i] = ~constraints[rows[i]].allowed(vocab)
    if len(rows) == len(scores):  # every row constrained: in place
        np.putmask(scores, forbidden, NEG_INF)
        return scores
    block = scores[rows]
    np.putmask(block, forbidden, NEG_INF)
    scores[rows] = block
    return scores


_EXECUTOR = None


def executor():
    """llguidance's thread pool for the masks of a batch (one per process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR
