"""The decoder replica's work, free of Ray: the engine front's events, timed and paced.

`TextGenerator` holds a model's `generation.front.EngineFront` (input processing, the batching
loop, output processing) and adds what serving adds: the decoder's metrics, a stream's pacing,
and a refusal as a RequestError naming the request's field; the events go out as the front made
them (Echo, Delta, Finish; a whole one: Generation). The Ray deployment (`deployments.app.Decoder`)
is a thin shell around it, and tests drive it directly, with the real engine or with
`deployments.fake`.

    generator = TextGenerator.from_model("folder", slots=8)
    async for event in generator.stream(GenerateRequest(prompt="Once", settings={"max_new_tokens": 8})):
        ...
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

from generation.front import (
    Delta,
    EngineFront,
    EngineOptions,
    Finish,
    Generation,
    Refused,
    transcribe,
)

from ..errors import NotFound, Overloaded, RequestError
from ..metrics import DecoderMetrics
from ..schema import (
    GenerateRequest,
    ModelCard,
    Segment,
    Tokenized,
    Transcription,
    TranscriptionRequest,
)

# Streamed chunks a replica sends a second, about, when many rows run (TextGenerator._interval):
# bench/serve.py on 2 cores measured HTTP/direct 0.68 / 0.56 at concurrency 8 / 32 with a chunk
# every 10 ms per stream and 0.78-0.79 / 0.72-0.73 with one every 25-100 ms; one row alone keeps
# stream_interval_ms.
CHUNKS_PER_SECOND = 200.0
MAX_INTERVAL = 0.1


def fingerprint(*configuration) -> str:
    """OpenAI's system_fingerprint: Raymuter's version and what the model runs with, hashed."""
    import hashlib
    import json

    from generation.cli import version

    digest = hashlib.sha256(json.dumps([version(), *configuration], default=str).encode()).hexdigest()
    return f"fp_{digest[:12]}"


def request_error(error: Refused | Overloaded):
    """The serving layer's error of a front's refusal (its field and reason kept as data); a full
    queue's Overloaded as it is."""
    if isinstance(error, Overloaded):
        return error
    return RequestError(str(error), error.field, error.predicate)


class TextGenerator:
    """A model's generation service: the engine front, metrics and pacing.

    `front`: an EngineFront (or anything with its stream/submit/tokenize/detokenize and batcher)."""

    def __init__(self, name: str, front: EngineFront, kind: str = "decoder", stream_interval: float = 0.0):
        self.name, self.front, self.kind = name, front, kind
        self.stream_interval = stream_interval  # seconds between a stream's chunks (the first goes at once)
        self.chunks_per_second = CHUNKS_PER_SECOND  # all streams' chunks a second while many rows run
        self.metrics = DecoderMetrics(name, front.batcher)
        self.fingerprint = fingerprint(name, front.context_length, kind)
        self._adapter_lock = threading.Lock()

    @classmethod
    def from_model(cls, source: str | Path, name: str | None = None, stream_interval: float = 0.0,
                   options: EngineOptions | None = None, **values) -> "TextGenerator":
        """Load `source` (folder or hub id) into an EngineFront and serve it as `name` (default:
        the folder's name). `options` (or `values` named as generation.front.EngineOptions'
        fields: slots, threads, max_logprobs, ...): how the engine runs; the rest of `values`
        generation settings every request starts from."""
        engine, settings = EngineOptions.split(values)
        if options is not None:
            engine = replace(options, **{k: v for k, v in values.items() if k not in settings})
        front = EngineFront.from_model(source, engine, **settings)
        name = name or (Path(source).name if Path(source).is_dir() else str(source))
        generator = cls(name, front, "encoder-decoder" if front.kind == "encoder-decoder" else "decoder",
                        stream_interval)
        generator.fingerprint = fingerprint(name, front.context_length, engine.slots, front.defaults,
                                            *front.configuration())
        return generator

    @property
    def batcher(self):
        return self.front.batcher

    @property
    def family(self) -> str:
        return self.front.family

    @property
    def context_length(self) -> int | None:
        return self.front.context_length

    @property
    def takes_images(self) -> bool:
        return self.front.inputs.takes_images

    @property
    def is_seq2seq(self) -> bool:
        return self.kind == "encoder-decoder"

    def card(self) -> ModelCard:
        names = getattr(self.batcher, "adapter_names", None)
        return ModelCard(id=self.name, context_length=self.context_length, slots=self.batcher.slots, kind=self.kind,
                         has_chat_template=self.front.inputs.template is not None, fingerprint=self.fingerprint,
                         adapters=names() if names else [])

    # -- LoRA adapters (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----------------
    def load_adapter(self, name: str, path: str) -> None:
        """Know adapter `name` at `path` from now on, read anew where it was known (its first request
        loads it into a place); RequestError naming lora_name or lora_path (the adapter's own
        setting in the message)."""
        self._know_adapter(name, path, True, lambda e: "lora_name" if str(e).startswith(("lora_name", "max_loras"))
                           else "lora_path")

    def know_adapter(self, name: str, path: str) -> None:
        """Know adapter `name` at `path`, as the ingress's shared names say (a request's
        adapter_path: loaded through another replica, or changed since); read here at its first
        request. RequestError naming model where this replica cannot read it."""
        self._know_adapter(name, path, False, lambda e: "model")

    def knows_adapter(self, name: str, path: str) -> bool:
        """Whether this replica knows adapter `name` at `path` already (no read needed)."""
        knows = getattr(self.batcher, "knows_adapter", None)
        return knows is not None and knows(name, path)

    def _know_adapter(self, name: str, path: str, again: bool, field) -> None:
        know = getattr(self.batcher, "know_adapter", None)
        if know is None:
            message = "max_loras: this engine takes no LoRA adapters"
            raise RequestError(message, field(message))
        with self._adapter_lock:  # two requests of a new adapter read it once
            try:
                read = know(name, path, again)
            except (ValueError, OSError) as e:
                where = "" if again else f"the LoRA adapter '{name!s:.200}' could not be read on this replica: "
                raise RequestError(f"{where}{e}", field(e)) from None
        if read:
            self.metrics.adapter_loads.inc()

    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name` (rows running with it finish); NotFound naming lora_name."""
        unload = getattr(self.batcher, "unload_adapter", None)
        if unload is None:
            raise NotFound(f"lora_name: '{name!s:.200}' is not loaded (this engine takes no LoRA adapters)", "lora_name")
        try:
            unload(name)
        except KeyError:
            raise NotFound(f"lora_name: '{name!s:.200}' is not loaded", "lora_name") from None
        except ValueError as e:
            raise RequestError(str(e), "lora_name") from None

    def close(self) -> None:
        self.front.close()

    # -- a request ---------------------------------------------------------------------------
    def submit(self, request: GenerateRequest, encoder=None, images=()):
        """Check and queue a request: (batcher request, prompt ids); RequestError naming the
        request's field, Overloaded for a full queue."""
        try:
            return self.front.submit(request, encoder, images)
        except (Refused, Overloaded) as e:
            raise self._refusal(e) from None

    def _refusal(self, error: Refused | Overloaded):
        """A generation's refusal as the serving layer's error; a full queue counted as rejected."""
        if isinstance(error, Overloaded):
            self.metrics.rejected.inc()
        return request_error(error)

    def _interval(self) -> float:
        """Seconds a stream waits after a chunk: stream_interval, or longer while many rows run,
        so that their streams together send about CHUNKS_PER_SECOND (a chunk costs the replica's
        event loop and the network the same whatever it carries), at most MAX_INTERVAL. 0 stays
        0: a chunk per token."""
        if self.stream_interval <= 0:
            return 0.0
        return max(self.stream_interval, min(self.batcher.running / self.chunks_per_second, MAX_INTERVAL))

    async def stream(self, request: GenerateRequest, encoder=None, images=()):
        """The front's events as the tokens come (Echo first where echo asked, Deltas, one
        Finish), timed into the decoder's metrics. A consumer that stops early (a client that
        went away) cancels the request."""
        arrived, first, last = time.perf_counter(), None, None
        events = self.front.stream(request, encoder, images, self._interval)
        try:
            async for event in events:
                if isinstance(event, Delta):
                    for token in event.tokens:
                        if last is None:
                            first = token.at
                            self.metrics.first_token(token.at - arrived)
                        else:
                            self.metrics.next_token(token.at - last)
                        last = token.at
                elif isinstance(event, Finish):
                    self.metrics.finished(event.completion, event.prompt_tokens, time.perf_counter() - arrived,
                                          None if first is None else last - first, request.settings.get("adapter"))
                yield event
        except (Refused, Overloaded) as e:
            raise self._refusal(e) from None
        finally:
            await events.aclose()

    async def generate(self, request: GenerateRequest, encoder=None, images=()) -> Generation:
        """The whole generation at once."""
        events = [event async for event in self.stream(request, encoder, images)]
        return Generation.of(events, request.logprobs is not None, self.front.reasoning is not None)

    # -- tokens ------------------------------------------------------------------------------
    def tokenize(self, text: str | None, messages: list[dict] | None, add_special_tokens: bool | None,
                 add_generation_prompt: bool, variables: dict | None, token_strs: bool) -> Tokenized:
        """/tokenize: a prompt's token ids, or messages' through the chat template."""
        try:
            ids = self.front.tokenize(text, messages, add_special_tokens, add_generation_prompt, variables)
        except Refused as e:
            raise request_error(e) from None
        return Tokenized(tokens=ids, token_strs=[self.front.tokens.text(i) for i in ids] if token_strs else None)

    def detokenize(self, ids: list[int]) -> str:
        try:
            return self.front.detokenize(ids)
        except Refused as e:
            raise request_error(e) from None

    @property
    def vocab_size(self) -> int:
        return self.front.vocab_size

    # -- audio -------------------------------------------------------------------------------
    async def transcribe(self, samples, request: TranscriptionRequest, encode, aencode=None) -> Transcription:
        """Whisper over one clip (16 kHz samples) through the front (generation.front.speech);
        `encode` runs the encoder (the encoder deployment; `aencode` awaits it)."""
        if self.family != "whisper":
            raise RequestError(f"model: '{self.name}' does not take audio (a {self.family} model)", "model")
        started = time.perf_counter()
        try:
            result = await transcribe(self.front, samples, request, encode, aencode)
        except (Refused, Overloaded) as e:
            raise request_error(e) from None
        for seconds in result.queued:
            self.metrics.queue.observe(seconds)
        self.metrics.e2e.observe(time.perf_counter() - started)
        self.metrics.generation_tokens.inc(len(result.tokens))
        self.metrics.success.labels(model_name=self.name, finished_reason="stop").inc()
        segments = None if result.segments is None else [
            Segment(id=i, start=s.start, end=s.end, text=s.text, tokens=s.tokens) for i, s in enumerate(result.segments)]
        return Transcription(text=result.text, tokens=result.tokens, segments=segments, duration=result.duration,
                             language=result.language)

