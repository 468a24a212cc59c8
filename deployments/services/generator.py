"""The decoder replica's work, free of Ray: requests in, text chunks out.

`TextGenerator` owns a model's continuous batcher, its tokenizer and chat template, and the
decoder's metrics. It turns a `GenerateRequest` into the prompt's token ids and the engine's
settings, submits it, and turns the tokens that come back into text pieces (held back while
they might be the start of a stop string, cut before the stop string when one ends the text).
The Ray deployment (`deployments.app.Decoder`) is a thin shell around it, and tests drive it
directly, with the real engine or with `deployments.fake`.

    generator = TextGenerator.from_model("folder", slots=8)
    async for chunk in generator.stream(GenerateRequest(prompt="Once", settings={"max_new_tokens": 8})):
        ...
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
import time
from pathlib import Path

from generation.core.stops import cut_at_stop
from generation.text.tokenizer import Detokenizer

from ..errors import Overloaded, RequestError
from ..metrics import DecoderMetrics
from ..schema import (
    GenerateChunk,
    GenerateRequest,
    GenerateResponse,
    ModelCard,
    Segment,
    Tokenized,
    TokenLogprob,
    Transcription,
    TranscriptionRequest,
)
from .batching import ContinuousBatcher, QueueFull

# Streamed chunks a replica sends a second, about, when many rows run (TextGenerator._interval):
# bench/serve.py on 2 cores measured HTTP/direct 0.68 / 0.56 at concurrency 8 / 32 with a chunk
# every 10 ms per stream and 0.78-0.79 / 0.72-0.73 with one every 25-100 ms; one row alone keeps
# stream_interval_ms.
CHUNKS_PER_SECOND = 200.0
MAX_INTERVAL = 0.1

logger = logging.getLogger("ray.serve")  # into the replica's log, with Serve's request id


def refusal(error: ValueError, request: GenerateRequest) -> RequestError:
    """The RequestError of an engine error, naming the request's field (and speaking of it: a
    stop_token_ids refusal does not say eos_token_id)."""
    setting = getattr(error, "setting", None)
    field = request_field(request, setting)
    message = str(error)
    if setting and field and not field.endswith(setting):  # the engine's "prompts[0]" is this request's field
        message = re.sub(rf"\b{re.escape(setting)}(s\[\d+\])?", field.removeprefix("settings."), message)
    return RequestError(message, field)


def detokenized(tokenizer, vocab: int, ids: list[int]) -> str:
    """/detokenize: the text of token ids (special tokens kept, as vLLM's); an id outside the
    vocabulary is the request's fault, naming it."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"tokens.{bad}: {ids[bad]} is not a token id of this model (0 to {vocab - 1})",
                           f"tokens.{bad}")
    return tokenizer.decode(list(ids), skip_special_tokens=False)


def fingerprint(*configuration) -> str:
    """OpenAI's system_fingerprint: Raymuter's version and what the model runs with, hashed."""
    import hashlib
    import json

    from generation.cli import version

    digest = hashlib.sha256(json.dumps([version(), *configuration], default=str).encode()).hexdigest()
    return f"fp_{digest[:12]}"


def request_field(request: GenerateRequest, setting: str | None) -> str | None:
    """The GenerateRequest field an engine error about `setting` (a SettingError's) is about."""
    if setting is None:
        return None
    if setting == "prompt":
        return "messages" if request.messages is not None else "prompt"
    if setting in ("seed", "logprobs", "prompt_logprobs"):
        return setting
    if setting == "eos_token_id" and request.stop_token_ids and "eos_token_id" not in request.settings:
        return "stop_token_ids"
    return f"settings.{setting}"


class TextGenerator:
    """A model's generation service: tokenizer in front of a ContinuousBatcher.

    `batcher`: ContinuousBatcher-like (submit -> Request). `tokenizer`: a `tokenizers.Tokenizer`
    or anything with encode(text, add_special_tokens).ids / decode(ids, skip_special_tokens).
    `max_logprobs`: the most alternatives a request may ask per token (the batcher's context
    computes that many for every row)."""

    def __init__(self, name: str, batcher, tokenizer, context_length: int | None, chat_template: str | None = None,
                 special_tokens: dict | None = None, max_logprobs: int = 0, kind: str = "decoder",
                 stream_interval: float = 0.0):
        self.name, self.batcher, self.tokenizer = name, batcher, tokenizer
        self.context_length, self.template, self.special_tokens = context_length, chat_template, special_tokens or {}
        self.max_logprobs, self.kind = max_logprobs, kind
        self.stream_interval = stream_interval  # seconds between a stream's chunks (the first goes at once)
        self.metrics = DecoderMetrics(name, batcher)
        self.fingerprint = fingerprint(name, context_length, kind)

    @classmethod
    def from_model(cls, source: str | Path, name: str | None = None, slots: int = 8, capacity: int | None = None,
                   max_waiting: int = 256, max_logprobs: int = 20, threads: int | None = None,
                   provider: str | None = None, variant: str | None = None, cache_mode: str | None = None,
                   stream_interval: float = 0.0, draft: str | Path | None = None, prefix_cache_bytes: int = 0,
                   fuse: bool = True, engine_process: bool = False, spin: bool = True, grammar_budget=None,
                   **settings) -> "TextGenerator":
        """Load `source` (folder or hub id) and start its batcher. `settings`: defaults over the
        model's generation_config.json for every request (max_new_tokens, ...). `draft`: a small
        model with the same tokenizer (folder or hub id) whose proposals every step verifies
        (num_assistant_tokens and its schedule from `settings`). `prefix_cache_bytes`: prompt
        prefixes kept for reuse (0: none). `fuse`: generation.load's (False: the decoder file as exported).
        `spin`: onnxruntime's idle threads spin between the model's runs (generation.load's spin_wait;
        False frees the cores between runs for the HTTP stack and the loop's own Python).
        `engine_process`: the batching loop in a child process (engine_process.EngineProcess;
        decoder-only text models). `grammar_budget`: what a request's constraint may cost to
        compile and run (generation.logits.constraints.GrammarBudget, or a dict of its fields)."""
        import generation
        from generation import families
        from generation.runtime.model import config_texts
        from generation.text.chat import chat_template, special_tokens
        from generation.text.tokenizer import model_tokenizer

        if engine_process:  # this process checks requests against the model's context, the child runs it
            from .engine_process import EngineProcess, parent_context

            model = generation.load(source, variant=variant, provider="cpu", threads=1, spin_wait=False, fuse=fuse)
            kind = families.family(model).KIND
            if kind != "text":
                raise ValueError(f"engine_process: runs decoder-only text models (this is a {kind} model)")
            ctx = generation.context(model, cache_mode=cache_mode, token_logprobs=max_logprobs >= 0,
                                     top_logprobs=max(0, max_logprobs), grammar_budget=grammar_budget, **settings)
            model.session = None  # never run here: its weights go (the child loads its own)
            load = dict(source=str(source), variant=variant, provider=provider, threads=threads, cache_mode=cache_mode,
                        max_logprobs=max_logprobs, draft=None if draft is None else str(draft), fuse=fuse, spin=spin,
                        grammar_budget=ctx.grammar_budget, **settings)
            batcher = EngineProcess(parent_context(ctx, slots), load, slots=slots, capacity=capacity,
                                    max_waiting=max_waiting, prefix_cache_bytes=prefix_cache_bytes)
        else:
            batcher = ContinuousBatcher.from_model(source, slots=slots, capacity=capacity, max_waiting=max_waiting,
                                                   prefix_cache_bytes=prefix_cache_bytes, max_logprobs=max_logprobs,
                                                   threads=threads, provider=provider, variant=variant,
                                                   cache_mode=cache_mode, draft=draft, fuse=fuse, spin=spin,
                                                   grammar_budget=grammar_budget, **settings)
            model = batcher.ctx.model
            kind = families.family(model).KIND
        name = name or (Path(source).name if Path(source).is_dir() else str(source))
        generator = cls(name, batcher, model_tokenizer(model), batcher.capacity, chat_template(model.folder),
                        special_tokens(model.folder), max_logprobs,
                        "encoder-decoder" if kind == "encoder-decoder" else "decoder", stream_interval)
        generator.defaults = dict(settings)
        generator.family = model.family
        generator.takes_images = kind == "vision"
        generator.fingerprint = fingerprint(name, batcher.capacity, slots, dict(settings), *config_texts(model))
        return generator

    takes_images = False
    family = "text"  # generation.families: the model's

    defaults: dict = {}

    @property
    def is_seq2seq(self) -> bool:
        return self.kind == "encoder-decoder"

    def card(self) -> ModelCard:
        return ModelCard(id=self.name, context_length=self.context_length, slots=self.batcher.slots, kind=self.kind,
                         has_chat_template=self.template is not None, fingerprint=self.fingerprint)

    def close(self) -> None:
        self.batcher.close()

    # -- a request ---------------------------------------------------------------------------
    def prompt_ids(self, request: GenerateRequest, images=()):
        """The prompt's token ids: ids as given, text tokenized, messages through the template.
        With `images` (the features of the messages' image parts, in order), the ids and the
        PromptImages that place the features."""
        if request.messages is not None:
            from generation.text.chat import ChatTemplateError, render_chat
            from generation.text.tools import ToolError, template_messages

            messages = [_plain(m.model_dump(exclude_none=True), i, self.takes_images)
                        for i, m in enumerate(request.messages)]
            try:
                messages = template_messages(messages)
            except ToolError as e:
                raise RequestError(str(e), e.field) from None
            variables = request.chat_template_kwargs
            if self._calls_tools(request):  # as transformers' apply_chat_template(tools=...)
                variables = {**(variables or {}), "tools": request.tools}
            if self.takes_images:
                from .vision import prompt_images

                try:
                    return prompt_images(self.batcher.ctx.model, messages, list(images), request.add_generation_prompt,
                                         variables)
                except ChatTemplateError as e:
                    raise RequestError(str(e), "messages") from None
            try:
                text = render_chat(self.template, messages, self.special_tokens, request.add_generation_prompt,
                                   variables)
            except ChatTemplateError as e:
                raise RequestError(str(e), "messages") from None
            self._check_text_length(text, "messages")
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        if isinstance(request.prompt, str):
            if not request.prompt:
                raise RequestError("prompt is empty", "prompt")
            self._check_text_length(request.prompt, "prompt")
            return self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens).ids
        return list(request.prompt)

    def _check_text_length(self, text: str, field: str) -> None:
        """A text too long to fit the context whatever it tokenizes to is refused before the
        tokenizer spends seconds on it: no token is longer than the vocabulary's longest."""
        if self.context_length and len(text) > self.context_length * self.longest_token:
            raise RequestError(f"{field}: {len(text)} characters cannot fit the context of {self.context_length} "
                               f"tokens (a token here is at most {self.longest_token} characters)", field)

    @property
    def longest_token(self) -> int:
        if self._longest_token is None:
            vocab = self.tokenizer.get_vocab() if hasattr(self.tokenizer, "get_vocab") else {}
            self._longest_token = max(map(len, vocab), default=1)
        return self._longest_token

    _longest_token: int | None = None

    def submit(self, request: GenerateRequest, encoder=None, images=()):
        """Check and queue a request: (batcher request, prompt ids). Bad input raises
        RequestError naming the request's field; a full queue raises Overloaded. An
        encoder-decoder model's request comes with its source's encoder outputs (`encoder`); its
        decoder prompt is the decoder start token. Its constraints compile here, on the caller's
        thread (`stream` compiles them on a worker thread)."""
        prompt, settings, encoder = self._prepared(request, encoder, images)
        self._compile_constraints(request, settings)
        return self._queued(request, prompt, settings, encoder), prompt

    async def _submitted_checked(self, request: GenerateRequest, encoder=None, images=()):
        """`submit`, its constraints compiled on a worker thread within the grammar budget's
        seconds first: the replica's event loop serves the other streams and the batching loop
        steps meanwhile, and the engine then finds the compiled grammar in its cache
        (constraints.Grammars) when the row starts."""
        prompt, settings, encoder = self._prepared(request, encoder, images)
        grammars = self._grammars if (settings.get("structured_outputs") is not None or request.tools) else None
        if grammars is not None:
            seconds = grammars.budget.seconds
            try:
                if not grammars.ready:  # the model's tokenizer, once: not this request's cost
                    await asyncio.to_thread(grammars.prepare)
                await asyncio.wait_for(asyncio.to_thread(self._compile_constraints, request, settings), seconds)
            except RequestError:
                raise
            except ValueError as e:  # the model's folder has no tokenizer.json for llguidance
                raise refusal(e, request) from None
            except asyncio.TimeoutError:
                from generation.core.settings import SettingError

                over = f"compiling it took more than {seconds:g} s (over the grammar budget: grammar_budget.seconds " \
                       f"is {seconds:g})"
                if settings.get("structured_outputs") is None:
                    raise RequestError(f"tools: {over}", "tools") from None
                raise refusal(SettingError("structured_outputs", f"structured_outputs: {over}"), request) from None
        return self._queued(request, prompt, settings, encoder), prompt

    @property
    def _grammars(self):
        """The engine's grammar compiler (constraints.Grammars; None for the fake engine)."""
        ctx = getattr(self.batcher, "ctx", None)
        if ctx is None:
            return None
        from generation.logits.constraints import Grammars

        return Grammars.of(ctx)

    def _compile_constraints(self, request: GenerateRequest, settings: dict) -> None:
        """The request's tools (each one's parameters a JSON schema, whatever the tool_choice) and
        its constraint compiled within the grammar budget (cached: the engine reuses it);
        RequestError naming the field otherwise."""
        grammars = self._grammars
        if grammars is None:
            return
        if request.tools:
            from generation.text.tools import ToolError, check_tool_schemas, check_tools

            try:
                check_tool_schemas(check_tools(request.tools), grammars.budget)
            except ToolError as e:
                raise RequestError(str(e), e.field) from None
        constraint = settings.get("structured_outputs")
        if constraint is not None:
            try:
                grammars.check(self.batcher.ctx.with_settings(structured_outputs=constraint).structured_outputs)
            except ValueError as e:
                raise refusal(e, request) from None

    def _prepared(self, request: GenerateRequest, encoder=None, images=()):
        """A request's prompt ids, its engine settings and its encoder outputs (or images),
        checked as far as the serving layer checks them (RequestError naming the field)."""
        if self.is_seq2seq:
            if encoder is None:
                raise RequestError("this encoder-decoder model needs the encoder's outputs of the prompt", "prompt")
            from generation.families.seq2seq import decoder_start

            prompt = [decoder_start(self.batcher.ctx)]
        else:
            prompt = self.prompt_ids(request, images)
            if isinstance(prompt, tuple):  # a vision-language chat: its images go where an encoder's outputs go
                prompt, encoder = prompt
        if not prompt:
            raise RequestError("the prompt has no tokens", request_field(request, "prompt"))
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(request, name)
            if asked is not None and asked > self.max_logprobs:
                raise RequestError(f"{name}: this server gives at most {self.max_logprobs} alternatives per token "
                                   f"(asked {asked})" if self.max_logprobs >= 0 else
                                   f"{name}: this server runs without log-probabilities", name)
        settings = dict(request.settings)
        if self._calls_tools(request) and request.tool_choice != "auto":  # required, or a named function
            from generation.text.tools import ToolError, tool_format, tool_grammar

            name = request.tool_choice["function"]["name"] if isinstance(request.tool_choice, dict) else None
            try:
                grammar = tool_grammar(tool_format(self.template), request.tools, name, request.parallel_tool_calls)
            except ToolError as e:
                raise RequestError(str(e), e.field) from None
            settings["structured_outputs"] = {"grammar": grammar}
        if request.stop_token_ids:
            settings["eos_token_id"] = [*self._eos(settings), *request.stop_token_ids]
        budget = settings.get("max_new_tokens")
        room = self.context_length and self.context_length - (0 if budget == 0 else 1)  # a new token's place
        if room and len(prompt) > room:  # the prompt alone is too long, whatever max_tokens says
            field = "messages" if request.messages is not None else "prompt"
            raise RequestError(f"{field}: the prompt is {len(prompt)} tokens; the model's context holds "
                               f"{self.context_length}" + (", a new token included" if budget != 0 else ""), field)
        if isinstance(budget, int) and self.context_length and len(prompt) + budget > self.context_length:
            raise RequestError(f"max_tokens: {budget} new tokens after a prompt of {len(prompt)} "
                               f"exceed the context of {self.context_length} tokens", "settings.max_new_tokens")
        return prompt, settings, encoder

    def _queued(self, request: GenerateRequest, prompt: list[int], settings: dict, encoder=None):
        """The prepared request into the batcher (its settings checked there); its Request."""
        seed = request.seed if request.seed is not None else secrets.randbits(63)
        try:
            handle = self.batcher.submit(prompt, seed=seed, settings=settings, encoder=encoder,
                                         prompt_logprobs=request.prompt_logprobs)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise Overloaded(str(e)) from None
        except ValueError as e:
            raise refusal(e, request) from None
        return handle

    @staticmethod
    def _calls_tools(request: GenerateRequest) -> bool:
        return bool(request.messages is not None and request.tools and request.tool_choice != "none")

    def _tool_calls(self, request: GenerateRequest, text: str) -> tuple[str, list[dict] | None]:
        """The output's text outside its tool calls and the calls as OpenAI gives them (ids
        call_<request>_<k>), read in the template family's format; (text, None) without calls."""
        from generation.text.tools import parse_calls, tool_format

        names = [t["function"]["name"] for t in request.tools]
        parsed = parse_calls(tool_format(self.template), text, names)
        if not parsed.calls:
            return text, None
        base = (request.request_id or secrets.token_hex(8)).replace("-", "")[:24]
        calls = [{"id": f"call_{base}_{k}", "type": "function",
                  "function": {"name": c.name, "arguments": c.arguments}} for k, c in enumerate(parsed.calls)]
        return parsed.content or "", calls

    def _eos(self, settings: dict) -> tuple:
        """The eos tokens a request's settings leave (ignore_eos gives none)."""
        if "eos_token_id" in settings:
            eos = settings["eos_token_id"]
            return tuple(eos) if isinstance(eos, (list, tuple)) else () if eos is None else (eos,)
        ctx = getattr(self.batcher, "ctx", None)
        return tuple(ctx.settings.eos_token_id) if ctx is not None else ()

    def _interval(self) -> float:
        """Seconds a stream waits after a chunk: stream_interval, or longer while many rows run,
        so that their streams together send about CHUNKS_PER_SECOND (a chunk costs the replica's
        event loop and the network the same whatever it carries), at most MAX_INTERVAL. 0 stays
        0: a chunk per token."""
        if self.stream_interval <= 0:
            return 0.0
        return max(self.stream_interval, min(self.batcher.running / CHUNKS_PER_SECOND, MAX_INTERVAL))

    async def stream(self, request: GenerateRequest, encoder=None, images=()):
        """GenerateChunks as the tokens come; the last one carries finish_reason and counts. A
        consumer that stops early (a client that went away) cancels the request."""
        handle, prompt = await self._submitted_checked(request, encoder, images)
        arrived = time.perf_counter()
        stops = list(request.settings.get("stop_strings") or [])
        if isinstance(request.settings.get("stop_strings"), str):
            stops = [request.settings["stop_strings"]]
        hold = max((len(s) for s in stops), default=1) - 1
        tools = self._calls_tools(request)  # the text waits for the end, where its calls are read out
        detok = Detokenizer(self.tokenizer)
        text, sent, last = "", 0, None
        echo = request.echo  # the prompt first (once the batcher has admitted it, with its log-probabilities)
        try:
            # the tokens made within stream_interval of a chunk go together in the next one
            async for tokens in handle.abatches(self._interval):
                if echo:
                    yield self._echo(request, handle, prompt)
                    echo = False
                for token in tokens:
                    if last is None:
                        self.metrics.first_token(token.at - arrived)
                    else:
                        self.metrics.inter_token.observe(token.at - last)
                    last = token.at
                    text += detok.add(token.id)
                visible = cut_at_stop(text, stops)
                end = len(visible) if len(visible) < len(text) else max(sent, len(visible) - hold)
                if tools:
                    end = sent
                piece, sent = visible[sent:end], max(sent, end)
                yield GenerateChunk(text=piece, token_ids=[t.id for t in tokens],
                                    logprobs=None if request.logprobs is None else
                                    [self._logprob(t, request.logprobs) for t in tokens])
            completion = handle.result(timeout=5)
        except (asyncio.CancelledError, GeneratorExit):
            handle.cancel()
            raise
        text += detok.flush()
        visible = cut_at_stop(text, stops)
        self.metrics.finished(handle, completion, len(prompt), time.perf_counter() - arrived)
        status, field, error = None, None, completion.error
        if completion.finish_reason == "error":
            status = getattr(completion, "status", None) or 500
            field = request_field(request, getattr(completion, "field", None)) if status < 500 else None
            if status >= 500:
                logger.error("request %s failed in the batch: %s", request.request_id, error)
        else:
            if error:  # a stop its constraint made (it left no token): the client sees "stop"
                logger.warning("request %s ended early: %s", request.request_id, error)
            if echo:
                yield self._echo(request, handle, prompt)
        rest, calls, reason = visible[sent:], None, completion.finish_reason
        if tools and reason != "error":
            rest, calls = self._tool_calls(request, visible)
            reason = "tool_calls" if calls and reason == "stop" else reason  # cut short: "length", as OpenAI
        yield GenerateChunk(text=rest, finish_reason=reason, error=error, status=status, tool_calls=calls,
                            field=field, prompt_tokens=len(prompt), completion_tokens=len(completion.tokens),
                            cached_tokens=getattr(completion, "cached_tokens", 0))

    async def generate(self, request: GenerateRequest, encoder=None, images=()) -> GenerateResponse:
        """The whole generation at once."""
        text, ids, logprobs, last, echoed = [], [], [], None, None
        async for chunk in self.stream(request, encoder, images):
            if chunk.prompt_text is not None:
                echoed = chunk
            text.append(chunk.text)
            ids += chunk.token_ids
            logprobs += chunk.logprobs or []
            last = chunk
        return GenerateResponse(text="".join(text), token_ids=ids, finish_reason=last.finish_reason,
                                prompt_tokens=last.prompt_tokens, completion_tokens=last.completion_tokens,
                                cached_tokens=last.cached_tokens or 0, logprobs=logprobs if request.logprobs is not None else None, error=last.error,
                                status=last.status, field=last.field,
                                prompt_text=None if echoed is None else echoed.prompt_text,
                                prompt_logprobs=None if echoed is None else echoed.prompt_logprobs,
                                tool_calls=last.tool_calls)

    def _prompt_text(self, request: GenerateRequest, prompt: list[int]) -> str:
        """The prompt as text, as echo gives it back: the text sent, or the ids decoded."""
        if isinstance(request.prompt, str):
            return request.prompt
        return self.tokenizer.decode(list(prompt), skip_special_tokens=False)

    def _echo(self, request: GenerateRequest, handle, prompt: list[int]) -> GenerateChunk:
        return GenerateChunk(prompt_text=self._prompt_text(request, prompt),
                             prompt_logprobs=self._prompt_logprobs(handle, prompt, request.prompt_logprobs))

    def _prompt_logprobs(self, handle, prompt: list[int], top: int | None):
        """Each prompt token's TokenLogprob (the first one's logprob None: nothing comes before
        it), from the batcher's prompt pass at admission; None when not asked."""
        found = getattr(handle, "prompt_logprobs", None)
        if top is None or found is None:
            return None
        out = [TokenLogprob(id=prompt[0], text=self._text(prompt[0]), logprob=None)]
        for i, token in enumerate(prompt[1:]):
            alternatives = None
            if top and found.top is not None:
                alternatives = [(int(t), self._text(int(t)), float(lp)) for t, lp in
                                zip(found.top_ids[i][:top], found.top[i][:top])]
            out.append(TokenLogprob(id=token, text=self._text(token), logprob=float(found.logprob[i]), top=alternatives))
        return out

    def tokenize(self, text: str | None, messages: list[dict] | None, add_special_tokens: bool | None,
                 add_generation_prompt: bool, variables: dict | None, token_strs: bool) -> Tokenized:
        """/tokenize: a prompt's token ids, or messages' through the chat template (as the chat
        route renders them); add_special_tokens defaults to true for a prompt, false for messages."""
        if messages is not None:
            if self.takes_images and any(isinstance(m.get("content"), list) and any(
                    p.get("type") in ("image_url", "video_url", "video") for p in m["content"]) for m in messages):
                raise RequestError("messages: /tokenize takes text messages only (an image's or video's tokens "
                                   "depend on its size)", "messages")
            from generation.text.chat import ChatTemplateError, render_chat

            plain = [_plain(m, i) for i, m in enumerate(messages)]
            try:
                text = render_chat(self.template, plain, self.special_tokens, add_generation_prompt, variables)
            except ChatTemplateError as e:
                raise RequestError(str(e), "messages") from None
            add_special_tokens = bool(add_special_tokens)
        elif add_special_tokens is None:
            add_special_tokens = True
        self._check_text_length(text, "messages" if messages is not None else "prompt")
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return Tokenized(tokens=ids, token_strs=[self._text(i) for i in ids] if token_strs else None)

    def detokenize(self, ids: list[int]) -> str:
        return detokenized(self.tokenizer, self.vocab_size, ids)

    @property
    def vocab_size(self) -> int:
        ctx = getattr(self.batcher, "ctx", None)
        if ctx is not None:
            return ctx.model.vocab_size
        return getattr(self.batcher, "vocab_size", 2**31)

    async def transcribe(self, samples, request: "TranscriptionRequest", encode) -> "Transcription":
        """Whisper over one clip (16 kHz samples), with the request's language, task, timestamps
        and settings; `encode` runs the encoder (the encoder deployment). The clip is prepared as
        `generation.tasks.speech_to_text` prepares it (on a worker thread: features, the first
        window through the encoder, the prompt) and decoded in the continuous batch: one row, or
        with timestamps (or a clip longer than a window) a row per window."""
        import generation
        from generation.core.settings import SettingError
        from generation.families.whisper.audio import HOP_LENGTH, SAMPLING_RATE
        from generation.families.whisper.languages import LANGUAGES
        from generation.families.whisper.longform import window_frames
        from generation.families.whisper.prompt import detected_language, prompt_ids
        from generation.families.whisper.speech import prepare_speech

        if self.family != "whisper":
            raise RequestError(f"model: '{self.name}' does not take audio (a {self.family} model)", "model")
        settings = {**self.defaults, **request.settings}
        fallback = isinstance(request.temperature, list)
        if request.temperature and not fallback:
            settings.update(do_sample=True, temperature=request.temperature)
        try:
            ctx = generation.context(self.batcher.ctx.model, **settings)
        except ValueError as e:
            raise RequestError(str(e), _transcription_field(e)) from None
        long_form = len(samples) > window_frames(ctx) * HOP_LENGTH  # needs timestamps, whatever the format
        timestamps = request.timestamps or long_form or bool(ctx.model.generation_config.get("return_timestamps"))
        options = dict(compression_ratio_threshold=request.compression_ratio_threshold,
                       logprob_threshold=request.logprob_threshold, no_speech_threshold=request.no_speech_threshold,
                       condition_on_prev_tokens=request.condition_on_prev_tokens,
                       temperature=tuple(request.temperature) if fallback else None)
        started = time.perf_counter()
        try:
            if request.prompt is not None:
                options["prompt_ids"] = prompt_ids(ctx.model, request.prompt)
            speech = await asyncio.to_thread(prepare_speech, ctx, [samples], language=request.language,
                                             task=request.task, seeds=[request.seed or 0],
                                             return_timestamps=bool(timestamps), encode=encode, **options)
            if speech.options.logprob_threshold is not None and not self.batcher.ctx.token_logprobs:
                raise SettingError("logprob_threshold", "logprob_threshold: this server runs without log-probabilities "
                                                        "(max_logprobs -1), which the fallback rates windows by")
            if speech.windowed:
                result = await self._windowed_transcription(ctx, speech, settings)
            else:
                result = await self._batched_transcription(ctx, speech, settings)
        except ValueError as e:
            raise RequestError(str(e), _transcription_field(e)) from None
        self.metrics.e2e.observe(time.perf_counter() - started)
        self.metrics.generation_tokens.inc(len(result.tokens))
        self.metrics.success.labels(model_name=self.name, finished_reason="stop").inc()
        segments = None if result.segments is None else [
            Segment(id=i, start=s.start, end=s.end, text=s.text, tokens=s.tokens) for i, s in enumerate(result.segments)]
        code = detected_language(ctx.model.generation_config, speech.prompts[0])
        return Transcription(text=result.text, tokens=result.tokens, segments=segments,
                             duration=len(samples) / SAMPLING_RATE,
                             language=LANGUAGES.get(code, code) if code else request.language)

    async def _windowed_transcription(self, ctx, speech, settings):
        """Timestamps, or a clip longer than a window: each window is a row of the batch beside
        every other request; the clip's next window goes in once its row ended (the seek rule
        between, as `generation.families.whisper.longform.decode_windows`)."""
        from dataclasses import replace

        from generation.families.whisper.longform import check_decoder_length
        from generation.tasks import timestamped

        clip = speech.windows(ctx)[0]
        rated = speech.options.logprob_threshold is not None
        while not clip.done:
            encoder = await asyncio.to_thread(clip.next_encoder, speech.encode, speech.encoder)
            await asyncio.to_thread(clip.rate_silence, ctx.model, encoder)
            settled = False
            while not settled:  # a window that needs the temperature fallback is decoded again
                prompt, attempt = clip.decoder_prompt(), {**settings, **clip.setting_changes()}
                check_decoder_length(ctx, len(prompt), ctx.with_settings(**attempt))
                handle = await self._submitted(prompt, clip.window_seed, attempt, encoder, speech.timestamps, rated)
                settled = clip.take_job(handle.job, ctx.model.vocab_size)
        result = timestamped(ctx, clip.segments)
        return result if speech.timestamps else replace(result, segments=None)

    async def _batched_transcription(self, ctx, speech, settings):
        """One window without timestamps: a row of the batch."""
        from generation.tasks import TaskResult

        completion = await self._decoded(speech.prompts[0], speech.seeds[0], settings, speech.encoder)
        return TaskResult(self.tokenizer.decode(completion.tokens, skip_special_tokens=True), completion.tokens)

    async def _decoded(self, prompt, seed, settings, encoder, timestamps: bool = False):
        """A row's Completion through the batcher (cancelled when the client leaves)."""
        return (await self._submitted(prompt, seed, settings, encoder, timestamps)).result(timeout=5)

    async def _submitted(self, prompt, seed, settings, encoder, timestamps: bool = False, untempered: bool = False):
        """A row through the batcher, once it ended (its Request: the Completion and the
        scheduler's Job); cancelled when the client leaves."""
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
        self.metrics.queue.observe(completion.queued_seconds)
        if completion.finish_reason == "error":
            raise RuntimeError(f"generation failed: {completion.error}")
        return handle

    def _logprob(self, token, top: int) -> TokenLogprob:
        alternatives = None
        if top and token.top is not None:
            alternatives = [(i, self._text(i), lp) for i, lp in token.top[:top]]
        return TokenLogprob(id=token.id, text=self._text(token.id), logprob=token.logprob, top=alternatives)

    def _text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


def _plain(message: dict, index: int, takes_images: bool = False) -> dict:
    """A message for the template. A text-only model's list content joins its text parts (an
    image part is refused by name); a vision-language model's keeps its parts, each image_url
    part as {"type": "image"} and each video_url or video part as {"type": "video"} (their
    features come from the Vision deployment), as transformers' processors hand them to the
    template."""
    content = message.get("content")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url" and takes_images:
                parts.append({"type": "image"})
            elif kind in ("video_url", "video") and takes_images:
                parts.append({"type": "video"})
            else:
                allowed = "text, image_url, video_url and video" if takes_images else "text"
                raise RequestError(f"messages[{index}].content[{j}]: this model takes {allowed} parts only, "
                                   f"not {kind!r}", f"messages.{index}.content.{j}")
        message = {**message, "content": parts if takes_images else "".join(p["text"] for p in parts)}
    return message


def _transcription_field(error: ValueError) -> str:
    """The transcription request's field an engine error is about: its language, task or
    temperature, another setting, else the file."""
    setting = getattr(error, "setting", None)
    if setting in ("language", "task", "prompt", "compression_ratio_threshold", "logprob_threshold",
                   "no_speech_threshold", "condition_on_prev_tokens"):
        return setting
    if setting in ("temperature", "do_sample"):
        return "temperature"
    return f"settings.{setting}" if setting else "file"
