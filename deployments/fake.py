"""A small fake engine whose outputs are known, for testing the serving layer alone.

`FakeBatcher` has ContinuousBatcher's interface (submit -> Request, close, the counters) and
runs a loop thread that steps every admitted request each `step_seconds`; `CharTokenizer` maps
each character to its code point. A request's new tokens are its prompt's ids reversed, repeated
to max_new_tokens (default 8), shifted by its seed when it samples: so a test knows the text
each request must get, whatever else runs. The token "." (46) is the eos token; a prompt with token 1 ("\x01") fails in
the loop, as an engine bug would.

    generator = fake_generator(EngineOptions(slots=4), step_seconds=0.01)
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

from generation import SettingError

from generation.front import FIXED_SLOTS, EngineOptions, QueueFull, Request

EOS = ord(".")
FAIL = 1  # a prompt holding this token fails inside the loop, as an engine bug would (a 500)
VOCAB = 0x250  # code points up to here
FAKE_OPTIONS = EngineOptions(slots=4, max_waiting=64)  # a small queue: tests fill it
CAPACITY = 4096  # a slot's tokens, where the options give none
TOP_LOGPROBS = 5  # the alternatives per token the fake gives at most, whatever the options say


def fake_count(settings: dict) -> int:
    """The new tokens asked: max_new_tokens (0: a prompt-only pass), 8 by default."""
    return 8 if settings.get("max_new_tokens") is None else int(settings["max_new_tokens"])


def fake_tokens(prompt: list[int], seed: int, settings: dict) -> list[int]:
    """The new tokens the fake engine gives (the eos token, when reached, is left out)."""
    count = fake_count(settings)
    shift = seed % 7 if settings.get("do_sample") else 0
    source = [t for t in reversed(prompt)] or [ord("x")]
    out = []
    for i in range(count):
        token = (source[i % len(source)] - ord("a") + shift) % 26 + ord("a") if chr(source[i % len(source)]).isalpha() \
            else source[i % len(source)]
        if token == EOS:
            break
        out.append(token)
    return out


class _Encoded:
    def __init__(self, ids):
        self.ids = ids


class CharTokenizer:
    """One token per character (its code point)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> _Encoded:
        return _Encoded([ord(c) for c in text])

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class _Settings:
    """The fake's resolved settings: the request's dict, checked like the engine checks (its
    errors name the setting, as generation's SettingError)."""

    def __init__(self, settings: dict):
        for name, value in settings.items():
            if name == "temperature" and not (isinstance(value, (int, float)) and value > 0):
                raise SettingError("temperature", f"temperature must be a positive number, not {value!r}")
            if name == "max_new_tokens" and not (isinstance(value, int) and value >= 0):
                raise SettingError("max_new_tokens", f"max_new_tokens must be an integer >= 0, not {value!r}")
            if name == "structured_outputs" and value is not None:
                raise SettingError(name, "structured_outputs: the fake engine's output (its prompt reversed) "
                                         "follows no constraint")
            if name == "eos_token_id":
                bad = [t for t in value if not 0 <= t < VOCAB]
                if bad:
                    raise SettingError(name, f"eos_token_id names token id {bad[0]}, outside this model's "
                                             f"vocabulary (0 to {VOCAB - 1})")
        self.raw = settings
        self.num_beams = int(settings.get("num_beams") or 1)


class FakeBatcher:
    """ContinuousBatcher's interface over `fake_tokens`: the options' slots requests step together,
    one token each per step; later ones wait for a free slot (at most the options' max_waiting
    interactive ones). A step sleeps `step_seconds` plus
    `step_seconds_per_row` for each row in it (a real engine's step cost, measured: bench/fleet.py)."""

    def __init__(self, options: EngineOptions = FAKE_OPTIONS, step_seconds: float = 0.005,
                 step_seconds_per_row: float = 0.0):
        self.slots, self.max_waiting, self.step_seconds = options.slots or FIXED_SLOTS, options.max_waiting, step_seconds
        self.capacity = options.capacity or CAPACITY
        self.step_seconds_per_row = step_seconds_per_row
        self.running = self.waiting = self.occupied = 0
        self.steps = 0
        # (priority, arrival, request): lower priorities first, as the scheduler seats them (no preemption here)
        self._waiting: queue.PriorityQueue = queue.PriorityQueue()
        # the waiting requests of priority 0: max_waiting bounds them only, as ContinuousBatcher's
        self._interactive_waiting, self._count_lock = 0, threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="raymuter-fake-batcher", daemon=True)
        self._thread.start()

    def submit(self, prompt: list[int], seed: int = 0, settings: dict | None = None, encoder=None,
               prompt_logprobs: int | None = None, priority: int = 0, logprobs: bool = True) -> Request:
        if priority <= 0 and self._interactive_waiting >= self.max_waiting:
            raise QueueFull(f"{self.max_waiting} requests are waiting already")
        for i, t in enumerate(prompt):
            if not 0 <= t < VOCAB:
                raise SettingError("prompt", f"prompts[0][{i}] = {t} is not a token id of this model (vocabulary {VOCAB})")
        resolved = _Settings(settings or {})
        if len(prompt) >= self.capacity:
            raise SettingError("prompt", f"the prompt has {len(prompt)} tokens; a slot holds {self.capacity}")
        request = Request(next(self._ids), list(prompt), seed, resolved, fake_count(resolved.raw))
        request.planned = fake_tokens(prompt, seed, resolved.raw)
        if prompt_logprobs is not None:  # each prompt token after the first at -0.5, its own best alternative
            from generation.front import prompt_logprobs_from_lists as from_lists

            rest = list(prompt[1:])
            request.prompt_top = prompt_logprobs
            request.prompt_logprobs = from_lists([-0.5] * len(rest), [[t] for t in rest], [[-0.5]] * len(rest))
        with self._count_lock:
            self._interactive_waiting += priority <= 0
        self._waiting.put((priority, request.id, request))
        self.waiting = self._waiting.qsize()
        return request

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        live: list[Request] = []
        started: dict[int, float] = {}
        while not self._stop.is_set():
            while len(live) < self.slots:
                try:
                    priority, _, request = self._waiting.get_nowait()
                except queue.Empty:
                    break
                with self._count_lock:
                    self._interactive_waiting -= priority <= 0
                live.append(request)
                started[request.id] = time.perf_counter()
            self.running = self.occupied = len(live)
            self.waiting = self._waiting.qsize()
            if not live:
                time.sleep(self.step_seconds / 2)
                continue
            time.sleep(self.step_seconds + self.step_seconds_per_row * len(live))
            self.steps += 1
            for request in list(live):
                if request.cancelled:
                    request.finish(request.emitted, "cancelled", started=started.pop(request.id))
                    live.remove(request)
                    continue
                if FAIL in request.prompt:
                    request.finish(request.emitted, "error", "RuntimeError: the fake engine failed on purpose "
                                    "(token 1 in the prompt)", started=started.pop(request.id))
                    live.remove(request)
                    continue
                done = len(request.emitted)
                if done < len(request.planned):
                    request.emit(request.planned[done], -0.5, [(request.planned[done], -0.5)])
                if len(request.emitted) == len(request.planned):
                    reason = "length" if len(request.planned) >= request.max_new else "stop"
                    request.finish(request.emitted, reason, started=started.pop(request.id))
                    live.remove(request)
        for request in live:
            request.finish(request.emitted, "cancelled", "the batcher closed")


def fake_generator(options: EngineOptions = FAKE_OPTIONS, step_seconds: float = 0.005, name: str = "fake",
                   step_seconds_per_row: float = 0.0):
    """A TextGenerator over the fake engine (with a chat template: 'role: content' lines, then
    the template variable `prefix` where a request gives it in chat_template_kwargs)."""
    from generation.front import EngineFront

    from .services.generator import TextGenerator

    template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}{{ prefix | default('') }}")
    batcher = FakeBatcher(options, step_seconds, step_seconds_per_row)
    return TextGenerator(name, EngineFront.over(batcher, CharTokenizer(), template, batcher.capacity, TOP_LOGPROBS))
