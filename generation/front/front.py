"""The engine front: one door from a server to the engine.

An `EngineRequest` goes in; events come out as its row runs in the continuous batch: `Echo` (the
prompt given back, once admitted), `Delta`s (text with stop strings applied, the tokens, their
log-probabilities) and one `Finish` (the rest of the text, tool calls, why it ended, counts).
Behind it: input processing (front/prompts.py), the batching loop (engine/batching.py, or a child
process: engine/process.py), output processing (front/output.py), Whisper's windows
(front/speech.py). A server adds transport, metrics and its own shapes; it never reaches past
this door into the engine.

    front = EngineFront.from_model("folder", EngineOptions(slots=8))
    async for event in front.stream(EngineRequest(prompt="Once", settings={"max_new_tokens": 8})):
        ...
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from pathlib import Path

from generation.engine.batching import ContinuousBatcher, QueueFull
from generation.params.checks import SettingError

from .errors import Overloaded, Refused, refused, request_field
from .loading import batcher_from_model, load_model, model_context, warm_rows
from .output import TextDeltas, TokenText, TokenTexts, tool_calls
from .options import EngineOptions
from .prompts import InputProcessor, Row
from .reasoning import ReasoningParser, ReasoningSplit, opened_in, parser_for
from .request import EngineRequest

logger = logging.getLogger("ray.serve")  # a replica's log, with Serve's request id, where one runs it


@dataclass
class Echo:
    """The prompt given back (echo), with its tokens' log-probabilities when asked."""

    prompt_text: str
    prompt_logprobs: list[TokenText] | None


@dataclass
class Delta:
    """The text that may go out now, and the tokens made since the last Delta (batcher Tokens:
    id, logprob, top, at) with their TokenTexts when log-probabilities were asked. A thinking
    model's chat: `text` is the answer's, `reasoning` the reasoning's (front/reasoning.py)."""

    text: str
    tokens: list
    logprobs: list[TokenText] | None
    reasoning: str = ""

    @property
    def token_ids(self) -> list[int]:
        return [t.id for t in self.tokens]


@dataclass
class Finish:
    """The row's end: the text not sent yet, its tool calls, why it ended ("stop", "length",
    "tool_calls", "cancelled", "error"), an error's message, status and request field, and the
    counts. `completion`: the batcher's Completion (queue time, first-token time)."""

    text: str
    finish_reason: str
    error: str | None
    status: int | None
    field: str | None
    predicate: str | None  # what `error` says of `field` after its name (Refused.predicate)
    tool_calls: list[dict] | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    completion: object
    reasoning: str = ""  # the reasoning not sent yet (a thinking model's chat)
    replica: str | None = None  # the serving replica that ran it (a server sets it; EngineRequest.affinity)


FINISH_FIELDS = frozenset(Finish.__dataclass_fields__) - {"text", "reasoning", "completion"}


@dataclass
class Generation:
    """A whole generation as one answer: its Deltas' text, token ids, log-probabilities (None:
    not asked) and reasoning (None: the model does not reason) joined, with the Finish's, its
    Echo (echo), and its Finish, whose fields read on it directly (`finish_reason`,
    `completion_tokens`, `tool_calls`, `error`, ...)."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenText] | None
    reasoning: str | None
    echo: Echo | None
    finish: Finish

    @classmethod
    def of(cls, events: list, logprobs: bool, reasoning: bool) -> "Generation":
        """The events of one stream (Echo, Deltas, one Finish) as one answer."""
        *deltas, finish = events
        echo = next((e for e in deltas if isinstance(e, Echo)), None)
        deltas = [e for e in deltas if isinstance(e, Delta)] + [finish]
        return cls("".join(d.text for d in deltas), [i for d in deltas[:-1] for i in d.token_ids],
                   [t for d in deltas[:-1] for t in d.logprobs or []] if logprobs else None,
                   "".join(d.reasoning for d in deltas) if reasoning else None, echo, finish)

    @classmethod
    def refused(cls, finish: "Finish") -> "Generation":
        return cls("", [], None, None, None, finish)

    @property
    def prompt_text(self) -> str | None:
        return None if self.echo is None else self.echo.prompt_text

    @property
    def prompt_logprobs(self) -> list[TokenText] | None:
        return None if self.echo is None else self.echo.prompt_logprobs

    def __getattr__(self, name: str):
        if name in FINISH_FIELDS:
            return getattr(self.finish, name)
        raise AttributeError(f"'Generation' object has no attribute '{name}'")


def rejected(error: str, status: int, field: str | None = None, predicate: str | None = None) -> Finish:
    """The Finish of a request refused before it ran ("rejected": 400 naming `field`, or 503)."""
    return Finish("", "rejected", error, status, field, predicate, None, 0, 0, 0, None)


class EngineFront:
    """A model's generation behind one door: its batcher, its input and output processing.

    `batcher`: ContinuousBatcher-like (submit -> Request). `inputs`: the model's InputProcessor.
    `tokenizer`: a `tokenizers.Tokenizer` or anything with encode(text, add_special_tokens).ids and
    decode(ids, skip_special_tokens)."""

    def __init__(self, batcher, inputs: InputProcessor, family: str = "text", defaults: dict | None = None,
                 reasoning: ReasoningParser | None = None):
        self.batcher, self.inputs, self.family = batcher, inputs, family
        self.tokenizer = inputs.tokenizer
        self.tokens = TokenTexts(inputs.tokenizer)
        self.defaults = dict(defaults or {})
        self.reasoning = reasoning  # how a chat's reasoning is told from its answer (None: all answer)

    @classmethod
    def over(cls, batcher, tokenizer, template: str | None = None, context_length: int = 4096,
             max_logprobs: int = 0) -> "EngineFront":
        """A front over a batcher of the caller's (a test's fake batcher) and a tokenizer, no
        model behind it: a text model's input processing with `template` as its chat template."""
        return cls(batcher, InputProcessor(tokenizer, template, None, context_length, max_logprobs=max_logprobs))

    @classmethod
    def from_model(cls, source: str | Path, options: EngineOptions | None = None, **settings) -> "EngineFront":
        """Load `source` (folder or hub id) and start its batcher as `options` say (EngineOptions;
        default: its defaults). `settings`: defaults over the model's generation_config.json for
        every request (max_new_tokens, ...)."""
        from generation import families
        from generation.text.chat import chat_template, special_tokens
        from generation.text.tokenizer import model_tokenizer

        options = options or EngineOptions()
        if options.engine_process:
            batcher = _engine_process(source, options, settings)
        else:
            batcher = batcher_from_model(ContinuousBatcher, source, options, **settings)
        model = batcher.ctx.model
        inputs = InputProcessor(model_tokenizer(model), chat_template(model.folder), special_tokens(model.folder),
                                batcher.capacity, options.max_logprobs, model, batcher.ctx, families.family(model).KIND)
        return cls(batcher, inputs, model.family, settings, parser_for(inputs.template, options.reasoning_parser))

    # -- what the model is ---------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """text, encoder-decoder or vision (generation.families' KIND)."""
        return self.inputs.kind

    @property
    def context_length(self) -> int | None:
        return self.inputs.context_length

    @property
    def vocab_size(self) -> int:
        ctx = getattr(self.batcher, "ctx", None)
        return ctx.model.vocab_size if ctx is not None else getattr(self.batcher, "vocab_size", 2**31)

    def configuration(self) -> list:
        """What the model runs with, for a fingerprint: its config files' texts."""
        ctx = getattr(self.batcher, "ctx", None)
        if ctx is None:
            return []
        from generation.runtime.model import config_texts

        return list(config_texts(ctx.model))

    def close(self) -> None:
        self.batcher.close()

    # -- a request ---------------------------------------------------------------------------
    def submit(self, request: EngineRequest, encoder=None, images=()):
        """Check and queue a request: (batcher Request, prompt ids). Bad input raises Refused
        naming the request's field; a full queue raises Overloaded. Its constraints compile here,
        on the caller's thread (`stream` compiles them on a worker thread)."""
        row = self.inputs.row(request, encoder, images)
        self._compile(request, row.settings)
        return self._queued(request, row), row.prompt

    async def stream(self, request: EngineRequest, encoder=None, images=(), interval=0.0):
        """Echo, Delta and Finish events as the row runs (see the module docstring). `interval`:
        seconds (or a function giving them) the tokens made after a Delta wait to go together.
        A consumer that stops early (a client that went away) cancels the row."""
        handle, prompt = await self._submitted(request, encoder, images)
        deltas = TextDeltas(self.tokenizer, request.stop_strings, hold_all=request.calls_tools)
        split = self._reasoning_split(request, prompt)
        echo = request.echo  # the prompt first, once the batcher admitted it (with its log-probabilities)
        try:
            async for tokens in handle.abatches(interval):
                if echo:
                    yield self._echo(request, handle, prompt)
                    echo = False
                text = deltas.add([t.id for t in tokens])
                reasoning, text = split.add(text) if split else ("", text)
                yield Delta(text, tokens, None if request.logprobs is None else
                            [self.tokens.of(t, request.logprobs) for t in tokens], reasoning)
            completion = handle.result(timeout=5)
        except (asyncio.CancelledError, GeneratorExit):
            handle.cancel()
            raise
        finish = self._finish(request, completion, deltas.finish(), deltas.visible, len(prompt), split)
        if echo and finish.finish_reason != "error":  # ended before its first token: the prompt still goes back
            yield self._echo(request, handle, prompt)
        yield finish

    def _reasoning_split(self, request: EngineRequest, prompt: list[int]) -> ReasoningSplit | None:
        """A chat's split of reasoning from answer, where the model thinks: inside a block from
        the start where the prompt's end left one open (the template opened it)."""
        if self.reasoning is None or request.messages is None:
            return None
        tail = self.tokenizer.decode(list(prompt[-32:]), skip_special_tokens=False)
        return ReasoningSplit(self.reasoning, inside=opened_in(tail, self.reasoning))

    def _finish(self, request: EngineRequest, completion, rest: str, visible: str, prompt_tokens: int,
                split: ReasoningSplit | None = None) -> Finish:
        status, field, predicate, error, calls = None, None, None, completion.error, None
        reason = completion.finish_reason
        if reason == "error":
            status = getattr(completion, "status", None) or 500
            setting = getattr(completion, "field", None)
            if status < 500 and setting is not None:  # refused while admitted: the engine's words, of the request's field
                words = refused(SettingError(setting, error), request_field(request, setting))
                field, predicate, error = words.field, words.predicate, str(words)
            if status >= 500:
                logger.error("request %s failed in the batch: %s", request.request_id, error)
        elif error:  # a stop its constraint made (it left no token): the client sees "stop"
            logger.warning("request %s ended early: %s", request.request_id, error)
        reasoning = ""
        if split is not None:  # the answer's text is what tool calls are read from
            (r1, rest), (r2, held) = split.add(rest), split.finish()
            reasoning, rest, visible = r1 + r2, rest + held, split.content
        if request.calls_tools and reason != "error":
            rest, calls = tool_calls(self.inputs.template, request, visible, cut=reason == "length")
            reason = "tool_calls" if calls and reason == "stop" else reason  # cut short: "length", as OpenAI
        return Finish(rest, reason, error, status, field, predicate, calls, prompt_tokens, len(completion.tokens),
                      getattr(completion, "cached_tokens", 0), completion, reasoning)

    def _echo(self, request: EngineRequest, handle, prompt: list[int]) -> Echo:
        text = request.prompt if isinstance(request.prompt, str) else \
            self.tokenizer.decode(list(prompt), skip_special_tokens=False)
        return Echo(text, self.tokens.of_prompt(prompt, getattr(handle, "prompt_logprobs", None),
                                                request.prompt_logprobs))

    async def _submitted(self, request: EngineRequest, encoder=None, images=()):
        """`submit`, its constraints compiled on a worker thread within the grammar budget's
        seconds first: the event loop serves the other streams and the batching loop steps
        meanwhile, and the engine then finds the compiled grammar in its cache."""
        row = self.inputs.row(request, encoder, images)
        grammars = self.inputs.grammars if (row.settings.get("structured_outputs") is not None or request.tools) \
            else None
        if grammars is not None:
            seconds = grammars.budget.seconds
            try:
                if not grammars.ready:  # the model's tokenizer, once: not this request's cost
                    await asyncio.to_thread(grammars.prepare)
                await asyncio.wait_for(asyncio.to_thread(self._compile, request, row.settings), seconds)
            except asyncio.TimeoutError:
                over = f"compiling it took more than {seconds:g} s (over the grammar budget: grammar_budget.seconds " \
                       f"is {seconds:g})"
                if row.settings.get("structured_outputs") is None:
                    raise Refused(over, "tools") from None
                raise Refused(over, request_field(request, "structured_outputs")) from None
        return self._queued(request, row), row.prompt

    def _compile(self, request: EngineRequest, settings: dict) -> None:
        try:
            self.inputs.compile_constraints(request, settings)
        except Refused:
            raise
        except ValueError as e:  # the model's folder has no tokenizer.json for llguidance
            raise refused(e, request_field(request, getattr(e, "setting", None))) from None

    def _queued(self, request: EngineRequest, row: Row):
        """The row into the batcher (its settings checked there); its Request."""
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        try:
            return self.batcher.submit(row.prompt, seed=seed, settings=row.settings, encoder=row.encoder,
                                       prompt_logprobs=request.prompt_logprobs, priority=request.priority,
                                       logprobs=request.logprobs is not None)
        except QueueFull as e:
            raise Overloaded(str(e)) from None
        except ValueError as e:
            raise refused(e, request_field(request, getattr(e, "setting", None))) from None

    async def decoded(self, prompt: list[int], seed: int, settings: dict, encoder=None, timestamps: bool = False,
                      untempered: bool = False):
        """A row of given prompt ids through the batcher, once it ended (its batcher Request: the
        Completion and the scheduler's Job); cancelled when the caller is."""
        try:
            handle = self.batcher.submit(prompt, seed=seed, settings=settings, encoder=encoder, timestamps=timestamps,
                                         untempered=untempered)
        except QueueFull as e:
            raise Overloaded(str(e)) from None
        try:
            async for _ in handle.abatches():
                pass
        except (asyncio.CancelledError, GeneratorExit):
            handle.cancel()
            raise
        completion = handle.result(timeout=5)
        if completion.finish_reason == "error":
            raise RuntimeError(f"generation failed: {completion.error}")
        return handle

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str | None, messages: list[dict] | None, add_special_tokens: bool | None,
                 add_generation_prompt: bool, variables: dict | None) -> list[int]:
        """A prompt's token ids, or messages' through the chat template (as a chat renders them;
        `variables` the template's, a chat's tools among them); add_special_tokens defaults to
        true for a prompt, false for messages."""
        if (text is None) == (messages is None):
            raise Refused("give exactly one of prompt and messages", "prompt", message="give exactly one of prompt "
                                                                                  "and messages")
        if messages is not None:
            if self.inputs.takes_images and any(isinstance(m.get("content"), list) and any(
                    p.get("type") in ("image_url", "video_url", "video") for p in m["content"]) for m in messages):
                raise Refused("/tokenize takes text messages only (an image's or video's tokens depend on its size)",
                              "messages")
            from generation.text.chat import ChatTemplateError
            from generation.text.tool_calls import ToolError, template_messages

            from .prompts import template_message

            try:  # as a chat renders them (an assistant turn's tool calls, tool results)
                plain = template_messages([template_message(m, i) for i, m in enumerate(messages)])
            except ToolError as e:
                raise Refused(str(e), e.field, message=str(e)) from None
            try:
                text = self.inputs.render(plain, add_generation_prompt, variables)
            except ChatTemplateError as e:
                raise Refused(str(e), "messages", message=str(e)) from None
            add_special_tokens = bool(add_special_tokens)
        elif add_special_tokens is None:
            add_special_tokens = True
        self.inputs.check_text_length(text, "messages" if messages is not None else "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def detokenize(self, ids: list[int]) -> str:
        return detokenized(self.tokenizer, self.vocab_size, ids)


def detokenized(tokenizer, vocab: int, ids: list[int]) -> str:
    """The text of token ids (special tokens kept, as vLLM's /detokenize); an id outside the
    vocabulary is the request's fault, naming it."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise Refused(f"{ids[bad]} is not a token id of this model (0 to {vocab - 1})", f"tokens.{bad}")
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def _placed(options: EngineOptions) -> tuple[int, ...] | None:
    """The engine process's cores (None: shared with this process, nothing pinned); this process
    moves onto the others (runtime.cores)."""
    from generation.runtime import cores

    engine = options.engine_cores
    # named cores may lie outside this process's own (`raymuter serve` moved its Ray onto the others)
    place = cores.placement(options.reserve_cores, engine, cores=None if engine is None else
                            cores.allowed() + tuple(engine))
    logger.info("cores: %s", place.words(options.threads))
    if place.shared:
        return None
    cores.pin(place.service)
    return place.engine


def _engine_process(source, options: EngineOptions, settings: dict):
    """An EngineProcess: this process checks requests against the model's context, the child runs it."""
    from generation import families

    from generation.engine.process import EngineProcess, parent_context

    model = load_model(source, options, parent=True)
    kind = families.family(model).KIND
    if kind != "text":
        raise ValueError(f"engine_process: runs decoder-only text models (this is a {kind} model)")
    ctx = model_context(model, options, settings)
    model.session = None  # never run here: its weights go (the child loads its own)
    # the child's batcher_from_model's arguments (the parent's own queue bounds its requests)
    load = {**settings, "source": str(source), "options": options, "cores": _placed(options)}
    return EngineProcess(parent_context(ctx, warm_rows(options.slots)), options, load, loader=batcher_from_model)
