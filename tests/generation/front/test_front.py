"""The engine front (generation/front/): one door from a server to the engine. A request goes in,
events come out; the front's events equal the engine's own generation, stop strings are applied
once (held back while they may begin, cut where one ends), and every refusal names the request's
field as data."""

from __future__ import annotations

import asyncio
import inspect

import pytest

import generation
from generation.front import (Delta, Echo, EngineFront, EngineOptions, EngineRequest, Finish, Generation, Refused,
                              rejected)
from generation.engine.batching import ContinuousBatcher
from generation.front.output import TextDeltas
from generation.front.errors import refused, request_field
from generation.params.checks import SettingError


class Chars:
    """One token per character (its code point)."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def events_of(front: EngineFront, request: EngineRequest) -> list:
    async def run():
        return [event async for event in front.stream(request)]
    return asyncio.run(run())


def test_text_deltas_never_show_a_stop_strings_start():
    deltas = TextDeltas(Chars(), stop_strings=["cde"])
    shown = [deltas.add([ord(c)]) for c in "abcdefg"]
    rest = deltas.finish()
    assert "".join(shown) + rest == "ab" and deltas.visible == "ab"
    assert shown[:2] == ["", ""]  # the last len("cde") - 1 characters wait: they may begin "cde"
    assert all("c" not in "".join(shown[:k]) for k in range(len(shown) + 1))


def test_text_deltas_without_stops_go_out_at_once():
    deltas = TextDeltas(Chars())
    assert [deltas.add([ord(c)]) for c in "abc"] == ["a", "b", "c"] and deltas.finish() == ""


def test_text_deltas_hold_everything_for_tool_calls():
    deltas = TextDeltas(Chars(), hold_all=True)
    assert [deltas.add([ord(c)]) for c in "abc"] == ["", "", ""] and deltas.finish() == "abc"


@pytest.mark.parametrize("setting, message, request_, field, spoken", [
    ("top_k", "top_k: must be a non-negative integer", EngineRequest(prompt="a"), "settings.top_k",
     "top_k: must be a non-negative integer"),
    # the request named the setting otherwise: its field is the sentence's subject
    ("eos_token_id", "eos_token_id names token id 99, outside", EngineRequest(prompt="a", stop_token_ids=[99]),
     "stop_token_ids", "stop_token_ids names token id 99, outside"),
    ("prompt", "prompt is empty", EngineRequest(messages=[]), "messages", "messages is empty"),
    ("seed", "seeds[0] = -1 must be an integer", EngineRequest(prompt="a"), "seed", "seeds[0] = -1 must be an integer"),
])
def test_an_engine_error_names_the_requests_field(setting, message, request_, field, spoken):
    error = refused(SettingError(setting, message), request_field(request_, setting))
    assert (error.field, str(error)) == (field, spoken)


@pytest.fixture(scope="module")
def front(test_models):
    front = EngineFront.from_model(test_models["llama-genai"], EngineOptions(slots=2, threads=1, max_logprobs=3),
                                   max_new_tokens=8)
    yield front
    front.close()


def test_the_fronts_events_are_the_engines_generation(front, test_models, load_model):
    model = load_model(test_models["llama-genai"])
    prompt = front.tokenizer.encode("Once upon", add_special_tokens=True).ids
    expected = generation.generate(generation.context(model, max_new_tokens=8), [prompt], seeds=[0])[0]  # its new tokens
    events = events_of(front, EngineRequest(prompt="Once upon", seed=0, logprobs=2, echo=True))
    assert isinstance(events[0], Echo) and events[0].prompt_text == "Once upon"
    deltas = [e for e in events if isinstance(e, Delta)]
    finish = events[-1]
    assert isinstance(finish, Finish) and finish.prompt_tokens == len(prompt)
    tokens = [t.id for d in deltas for t in d.tokens]
    assert tokens == list(expected) and finish.completion_tokens == len(tokens)
    text = "".join(d.text for d in deltas) + finish.text
    assert text == front.tokenizer.decode(tokens, skip_special_tokens=True)
    assert all(len(t.top) == 2 for d in deltas for t in d.logprobs)


def test_a_generation_is_its_events_joined_and_crosses_a_process_as_it_is(front):
    """Generation.of: the Deltas' text, ids and log-probabilities joined with the Finish's text,
    the Echo kept, the Finish's fields read on it; it and the events pickle as they are (the Ray
    hop carries them so)."""
    import pickle

    events = events_of(front, EngineRequest(prompt="Once upon", seed=0, logprobs=1, echo=True))
    whole = Generation.of(events, logprobs=True, reasoning=False)
    deltas = [e for e in events if isinstance(e, Delta)]
    assert whole.text == "".join(d.text for d in deltas) + events[-1].text
    assert whole.token_ids == [i for d in deltas for i in d.token_ids] and len(whole.logprobs) == len(whole.token_ids)
    assert whole.prompt_text == "Once upon" and whole.reasoning is None
    assert (whole.finish_reason, whole.completion_tokens) == (events[-1].finish_reason, len(whole.token_ids))
    assert Generation.of(events, logprobs=False, reasoning=True).logprobs is None
    with pytest.raises(AttributeError, match="no attribute 'tokens'"):
        whole.tokens  # noqa: B018 - only the Finish's fields read through
    again = pickle.loads(pickle.dumps(whole))
    assert again == whole and again.finish_reason == whole.finish_reason
    assert pickle.loads(pickle.dumps(events)) == events
    refused = Generation.refused(rejected("busy", 503))
    assert (refused.finish_reason, refused.status, refused.text, refused.token_ids) == ("rejected", 503, "", [])


def test_a_stop_string_ends_the_text_once(front):
    whole = events_of(front, EngineRequest(prompt="Once upon", seed=0))
    text = "".join(e.text for e in whole if isinstance(e, (Delta, Finish)))
    stop = text[3:5]
    events = events_of(front, EngineRequest(prompt="Once upon", seed=0, settings={"stop_strings": [stop]}))
    cut = "".join(e.text for e in events if isinstance(e, (Delta, Finish)))
    assert cut == text[:text.index(stop)] and events[-1].finish_reason == "stop"


@pytest.mark.parametrize("request_, field", [
    (EngineRequest(prompt=""), "prompt"),
    (EngineRequest(prompt="a", settings={"top_k": -1}), "settings.top_k"),
    (EngineRequest(prompt="a", logprobs=9), "logprobs"),
    (EngineRequest(prompt="a", stop_token_ids=[10**6]), "stop_token_ids"),
    (EngineRequest(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0"),
])
def test_refusals_carry_the_requests_field(front, request_, field):
    with pytest.raises(Refused) as info:
        events_of(front, request_)
    assert info.value.field == field and str(info.value).startswith(field.removeprefix("settings.").split(".")[0])


def test_options_and_settings_are_told_apart():
    options, settings = EngineOptions.split({"slots": 4, "threads": 1, "max_new_tokens": 64, "top_k": 5})
    assert (options.slots, options.threads, options.max_logprobs) == (4, 1, 20)
    assert settings == {"max_new_tokens": 64, "top_k": 5}
    loop = options.loop_arguments()  # what the batching loop takes of them: its own parameters, as given
    assert set(loop) <= set(inspect.signature(ContinuousBatcher).parameters) and loop["slots"] == 4
