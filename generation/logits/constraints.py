"""Structured outputs: a row's tokens held to a JSON schema, a regex, a choice of strings or a
grammar, by llguidance (the grammar engine onnxruntime-genai and vLLM use; a Rust library with a
numpy interface and no torch: the engine needs nothing else).

A row's constraint is its setting `structured_outputs`, vLLM's field: one of {"json": schema},
{"json_object": true}, {"regex": pattern}, {"choice": [strings]} or {"grammar": Lark text (GBNF
is converted)}, normalized to a hashable (kind, text) pair (`params.settings`). Each row with one holds
an llguidance matcher (`RowConstraint`) that follows the row's generated tokens: before a mask is
computed it is brought to them, consuming the new ones and rolling back past tokens that are no
longer the row's (a beam that took another beam's history, candidates that were not accepted),
so it advances only by committed tokens, whatever moved the row. The mask applies after
transformers' processors and the custom ones, before the warpers, as a `LogitsProcessor` passed
to transformers' generate would: tokens the grammar forbids get -inf. A row whose tokens the
grammar cannot follow (a beam kept alive with a forbidden token, as transformers keeps -inf
beams) is masked everywhere from then on.

Compiled grammars are cached by content, per model tokenizer and budget (`Grammars`): a row
starts from a copy of its grammar's matcher. A grammar compiles within a `GrammarBudget`
(llguidance's parser limits, which then hold at every step too): compiling it also computes its
first mask and a probe step (the first token it allows, consumed and rolled back), where an
explosive regex or a rule of thousands of alternatives meets its limits, so such a constraint is
refused when it is checked rather than midway. A row whose scores its constraint leaves without a
token (a limit met at a later step, or processors that forbid every token the grammar allows)
ends there (`DeadEnd`): as vLLM, whose llguidance matcher in an error state allows only eos.
"""

from __future__ import annotations

import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import numpy as np

from ..params.checks import SettingError

FIELD = "structured_outputs"
NEG_INF = np.float32(-np.inf)
# JSON as json.dumps writes it: ", " and ": ", no other whitespace (llguidance would allow any,
# which a small model fills). A schema's "x-guidance" options override it.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's LLParserLimits that a GrammarBudget sets (the rest keep llguidance's defaults)
PARSER_LIMITS = ("max_grammar_size", "initial_lexer_fuel", "step_lexer_fuel", "step_max_items", "max_items_in_row",
                 "max_lexer_states")


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's constraint may cost. `seconds`: to compile it (its first mask and probe
    step included), a server's check before queueing the request (deployments' TextGenerator; the
    engine itself takes no time). The rest are llguidance's parser limits (`LLParserLimits`), held
    while compiling and at every step after: `max_grammar_size` symbols (an alternative, a schema
    property: one or a few each; llguidance's default 500000), `initial_lexer_fuel` for building a
    regex (x{N} spends about 4 per repetition; llguidance's default 1000000, where x{100000} costs
    25 ms a step with 32000 ids), and llguidance's own defaults for the per-step work:
    `step_lexer_fuel`, `step_max_items`, `max_items_in_row` (Earley items of one row: a rule of
    2000 alternatives meets it) and `max_lexer_states`."""

    seconds: float = 1.0
    max_grammar_size: int = 4096
    initial_lexer_fuel: int = 50_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_items_in_row: int = 2000
    max_lexer_states: int = 250_000

    def __post_init__(self):
        if not (isinstance(self.seconds, (int, float)) and not isinstance(self.seconds, bool)
                and math.isfinite(self.seconds) and 0 < self.seconds <= 3600):
            raise SettingError("grammar_budget", f"grammar_budget.seconds must be a number in (0, 3600], "
                                                 f"not {self.seconds!r}")
        for name in PARSER_LIMITS:
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**31 - 1):
                raise SettingError("grammar_budget", f"grammar_budget.{name} must be an integer from 1 to "
                                                     f"{2**31 - 1}, not {value!r}")

    @classmethod
    def of(cls, values) -> "GrammarBudget":
        """A budget from a GrammarBudget, None (the defaults) or a dict of some of its fields
        (AppConfig.grammar_budget, `raymuter serve --grammar-budget`); SettingError naming an
        unknown field."""
        if values is None or isinstance(values, cls):
            return values or cls()
        known = [f.name for f in fields(cls)]
        if not isinstance(values, dict):
            raise SettingError("grammar_budget", f"grammar_budget must be an object of {', '.join(known)}, "
                                                 f"not {values!r}")
        unknown = [k for k in values if k not in known]
        if unknown:
            raise SettingError("grammar_budget", f"grammar_budget.{unknown[0]} is not a budget field "
                                                 f"(one of {', '.join(known)})")
        return cls(**values)

    def limits(self):
        import llguidance

        return llguidance.LLParserLimits(**{name: getattr(self, name) for name in PARSER_LIMITS},
                                         verbose_errors=False)  # no parser state in the messages


class DeadEnd(RuntimeError):
    """A constrained row whose scores its constraint left without a token: it ends there, as
    finish_reason "stop" (the scheduler's; not an error of the request or the server)."""


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

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # noqa: BLE001 - its parser raises bare Exceptions too (an undefined rule)
            raise ValueError(f"the GBNF grammar does not parse: {one_line(str(e))}") from None
    return llguidance.LLMatcher.grammar_from_lark(text)


def schema_error(schema, budget: GrammarBudget) -> str:
    """Why a JSON schema (a tool's parameters) does not compile within `budget`, or "" when it
    does. Lenient: keywords llguidance does not implement are left out (the schema is checked,
    not enforced), a malformed one is not."""
    import llguidance

    try:
        text = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={**JSON_LAYOUT, "lenient": True})
    except (ValueError, TypeError) as e:
        return one_line(str(e))
    error = llguidance.LLMatcher.validate_grammar(text, None, limits=budget.limits())
    return _budget_reason(text, error, budget) if error else ""


# llguidance's words for each limit it met (its messages), and the budget field that sets it
_LIMIT_WORDS = (("grammar size", "max_grammar_size"), ("too many expressions", "initial_lexer_fuel"),
                ("initial lexer configuration", "initial_lexer_fuel"), ("items; max is", "max_items_in_row"),
                ("Too many items", "step_max_items"), ("too many states", "max_lexer_states"),
                ("lex fuel", "step_lexer_fuel"))


def over_budget(error: str, budget: GrammarBudget) -> str:
    """llguidance's `error` for a limit it met, naming the budget field and its value."""
    reason = one_line(error)
    name = next((name for words, name in _LIMIT_WORDS if words in reason), None)
    limit = f"grammar_budget.{name} is {getattr(budget, name)}" if name else "the grammar_budget's limits"
    return f"over the grammar budget: {reason} ({limit})"


def _budget_reason(text: str, error: str, budget: GrammarBudget, tokenizer=None) -> str:
    """llguidance's `error` about grammar `text` as one line; over_budget's words when the grammar
    is valid within llguidance's own default limits (so the budget refused it)."""
    import llguidance

    if llguidance.LLMatcher.validate_grammar(text, tokenizer):
        return one_line(error)
    return over_budget(error, budget)


def one_line(error: str) -> str:
    """llguidance's error as one line: its lines up to the source excerpt (" 1 | ...") or the parser
    state ("<state>"), carets dropped."""
    lines = []
    for line in error.splitlines():
        if re.match(r"^\s*\d+ \|", line) or line.strip() == "<state>":
            break
        line = line.replace("<non-verbose/>", "")  # where verbose_errors=False leaves out the parser's state
        if line.strip() and line.strip() != "^":
            lines.append(" ".join(line.split()))
    return " ".join(lines) or error.strip()


class Grammars:
    """One model's grammar compiler: its tokenizer as llguidance reads it (built on first use),
    the budget every grammar compiles within, and the matchers of the grammars seen, by content
    (the most recent `size`)."""

    def __init__(self, tokenizer_path, vocab: int, eos: tuple[int, ...], size: int = 256,
                 budget: GrammarBudget | None = None):
        self.tokenizer_path, self.vocab, self.eos, self.size = tokenizer_path, vocab, tuple(eos), size
        self.budget = budget or GrammarBudget()
        self._tokenizer = None
        self._compiled: OrderedDict = OrderedDict()
        self._lock = threading.Lock()  # requests are checked on their threads, rows start on the loop's

    @classmethod
    def of(cls, ctx) -> "Grammars":
        """The context's model's Grammars (one per model, eos and grammar budget)."""
        key = ("grammars", tuple(ctx.settings.eos_token_id), ctx.grammar_budget)
        found = ctx.model.extras.get(key)
        if found is None:
            found = ctx.model.extras[key] = cls(ctx.model.tokenizer_path, ctx.model.vocab_size,
                                                ctx.settings.eos_token_id, budget=ctx.grammar_budget)
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

    @property
    def ready(self) -> bool:
        """Whether the tokenizer is built (`prepare`)."""
        return self._tokenizer is not None

    def prepare(self) -> None:
        """Build the tokenizer now (once per model: 0.1-0.3 s for 32000 ids), so that it is not
        counted in a request's budget."""
        with self._lock:
            self.tokenizer  # noqa: B018 - built on first use

    def compiled(self, constraint: tuple[str, str]) -> bool:
        """Whether `constraint` is compiled already (a matcher of it is a copy)."""
        with self._lock:
            return constraint in self._compiled

    def matcher(self, constraint: tuple[str, str]):
        """A fresh matcher of `constraint` (compiled once, then copied); SettingError naming the
        setting when the schema or grammar is not one llguidance takes, or not within the budget.
        Thread-safe."""
        with self._lock:
            template = self._compiled.get(constraint)
            if template is not None:
                self._compiled.move_to_end(constraint)
                return template.deep_copy()
        with self._lock:
            tokenizer = self.tokenizer
        template = compile_within(constraint, tokenizer, self.budget, self.vocab)
        with self._lock:
            self._compiled[constraint] = template
            while len(self._compiled) > self.size:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def check(self, constraint: tuple[str, str] | None) -> None:
        """SettingError naming the setting when the constraint does not compile within the budget."""
        if constraint is not None and not self.compiled(constraint):
            self.matcher(constraint)


def compile_within(constraint: tuple[str, str], tokenizer, budget: GrammarBudget, vocab: int):
    """The matcher of `constraint` at its start, compiled within `budget`: its grammar
    validated, its first mask computed, and a probe step (the lowest token id it allows, eos
    aside, consumed, the next mask computed, then rolled back), where an explosive regex
    (x{1000000}: "too many expressions") or a rule of thousands of alternatives ("row has N
    items") meets llguidance's limits. SettingError naming the setting otherwise."""
    import llguidance
    import llguidance.numpy as lnp

    kind = constraint[0]
    try:
        text = grammar(constraint)
    except (ValueError, TypeError) as e:
        raise SettingError(FIELD, f"{FIELD}.{kind}: {one_line(str(e))}") from None
    limits = budget.limits()
    error = llguidance.LLMatcher.validate_grammar(text, tokenizer, limits=limits)
    if error:
        raise SettingError(FIELD, f"{FIELD}.{kind}: {_budget_reason(text, error, budget, tokenizer)}")
    template = llguidance.LLMatcher(tokenizer, text, log_level=0, limits=limits)
    if template.is_error():
        reason = _budget_reason(text, template.get_error(), budget, tokenizer)
        raise SettingError(FIELD, f"{FIELD}.{kind}: {reason}")
    mask = lnp.allocate_token_bitmask(1, vocab)
    lnp.fill_next_token_bitmask(template, mask, 0)
    if not template.is_error():
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), axis=1, count=vocab, bitorder="little")[0])
        eos = set(tokenizer.eos_tokens)
        probe = next((int(t) for t in allowed if int(t) not in eos), None)
        if probe is not None and template.consume_token(probe):
            lnp.fill_next_token_bitmask(template, mask, 0)
            if not template.is_error():
                template.rollback(1)
    if template.is_error():
        raise SettingError(FIELD, f"{FIELD}.{kind}: {over_budget(template.get_error(), budget)}")
    return template


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

    def dead_end(self) -> str:
        """Why no token is left to this row (its scores are -inf everywhere), for DeadEnd."""
        if self.matcher.is_error():
            return (f"{FIELD}: the constraint met a limit of the grammar budget midway "
                    f"({one_line(self.matcher.get_error())}); the output ends there")
        if self.ended or self.matcher.is_stopped():
            return (f"{FIELD}: the output is complete and only eos may follow, which the other settings forbid "
                    "(min_new_tokens, bad_words_ids, ...); it ends there")
        return (f"{FIELD}: the other settings (bad_words_ids, suppress_tokens, min_new_tokens, ...) forbid every "
                "token the constraint allows; the output ends there")

    def allowed(self, vocab: int) -> np.ndarray:
        """The tokens the grammar allows after the tokens followed, [vocab] bool (none when
        they hold a forbidden one or the matcher met a limit, only eos after the output's end)."""
        if self.blocked or self.ended:
            out = np.zeros(vocab, bool)
            if self.ended:
                out[[t for t in self.eos if t < vocab]] = True
            return out
        import llguidance.numpy as lnp

        mask = lnp.allocate_token_bitmask(1, vocab)
        lnp.fill_next_token_bitmask(self.matcher, mask, 0)
        if self.matcher.is_error():  # a step limit met computing it (llguidance then allows eos): none
            return np.zeros(vocab, bool)
        return np.unpackbits(mask.view(np.uint8), axis=1, count=vocab, bitorder="little")[0].astype(bool)


def dead_ends(scores: np.ndarray, constraints: list) -> dict:
    """The constrained rows of processed `scores` [n, V] that hold no token (-inf everywhere: the
    constraint met a limit of its budget midway, or the processors forbid every token it allows,
    as min_new_tokens forbids eos once the grammar is complete): {row: DeadEnd saying why}."""
    rows = [r for r, row in enumerate(constraints) if row is not None]
    if not rows:
        return {}
    empty = (scores[rows] == NEG_INF).all(axis=1)
    return {rows[i]: DeadEnd(constraints[rows[i]].dead_end()) for i in np.flatnonzero(empty).tolist()}


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
        for matcher, i in live:
            if matcher.is_error():  # a step limit met computing its mask (llguidance then allows eos): none
                mask[i] = 0
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
