"""The OpenAI request shapes and their mapping onto generation settings (deployments/openai_api.py).

Invariants: OpenAI fields map onto transformers' settings (temperature 0 is greedy), Raymuter's
own fields pass through, and every bad body is an ApiError whose OpenAI-shaped body names the
field; the settings a request yields are accepted by the engine.
"""

from __future__ import annotations

import pytest

import generation
from deployments.openai_api import (
    ApiError, ChatCompletionRequest, CompletionRequest, completion_response, parse, settings_of, wants_logprobs)


def test_openai_fields_map_onto_settings():
    request = parse(CompletionRequest, dict(model="m", prompt="hi", max_tokens=12, temperature=0.7, top_p=0.9,
                                            stop=["\n"], seed=3, repetition_penalty=1.2, num_beams=1, top_k=5,
                                            sequence_bias=[[[5, 6], -1.0]]))
    assert settings_of(request) == dict(max_new_tokens=12, do_sample=True, temperature=0.7, top_p=0.9,
                                        stop_strings=["\n"], repetition_penalty=1.2, num_beams=1, top_k=5,
                                        sequence_bias=[[[5, 6], -1.0]])
    assert settings_of(parse(CompletionRequest, dict(model="m", prompt=[1, 2], temperature=0))) == dict(do_sample=False)


def test_the_settings_are_the_engines(test_models, load_model):
    ctx = generation.context(load_model(test_models["llama-optimum"]), max_new_tokens=4)
    request = parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "hi"}],
                                                temperature=0.5, top_p=0.8, no_repeat_ngram_size=2, stop="x"))
    settings = ctx.with_settings(**settings_of(request))
    assert settings.do_sample and settings.top_p == 0.8 and settings.stop_strings == ("x",)


@pytest.mark.parametrize("body, field, message", [
    (dict(prompt="hi"), "model", "Field required"),
    (dict(model="m", prompt="hi", max_tokens=0), "max_tokens", "greater than or equal to 1"),
    (dict(model="m", prompt="hi", temperature=3), "temperature", "less than or equal to 2"),
    (dict(model="m", prompt="hi", top_p=0), "top_p", "greater than 0"),
    (dict(model="m", prompt="hi", n=17), "n", "less than or equal to 16"),
    (dict(model="m", prompt="hi", presence_penalty=0.5), "presence_penalty", "has no transformers processor"),
    (dict(model="m", prompt="hi", frobnicate=1), "frobnicate", "unknown field 'frobnicate'"),
    (dict(model="m", prompt="hi", top_logprobs=50), "top_logprobs", "less than or equal to 20"),
])
def test_bad_bodies_name_the_field(body, field, message):
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, body)
    error = caught.value
    assert error.status == 400 and error.param == field and message in error.message
    assert error.body()["error"]["param"] == field and error.body()["error"]["type"] == "invalid_request_error"


def test_context_and_logprobs_checks():
    request = parse(CompletionRequest, dict(model="m", prompt="hi", max_tokens=100))
    with pytest.raises(ApiError, match="max_tokens: 100 new tokens after a prompt of 30 exceed the model's context of 64"):
        settings_of(request, context_length=64, prompt_length=30)
    assert wants_logprobs(parse(ChatCompletionRequest, dict(model="m", messages=[{"role": "user", "content": "a"}],
                                                            logprobs=True, top_logprobs=3))) == 3
    assert wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a", logprobs=2))) == 2
    assert wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a"))) is None
    with pytest.raises(ApiError, match="top_logprobs: needs logprobs set"):
        wants_logprobs(parse(CompletionRequest, dict(model="m", prompt="a", top_logprobs=2)))


def test_response_shapes():
    body = completion_response("cmpl-1", "m", "hello", "length", 3, 5)
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "hello"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    chat = completion_response("chat-1", "m", "hi", "stop", 2, 1, chat=True)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_raymuter_fields_for_prompt_lookup_ignore_eos_and_logit_bias():
    request = parse(CompletionRequest, dict(model="m", prompt="a", prompt_lookup_num_tokens=4, max_matching_ngram_size=3,
                                            ignore_eos=True, logit_bias={"7": -5.0}))
    assert settings_of(request) == dict(prompt_lookup_num_tokens=4, max_matching_ngram_size=3, eos_token_id=[],
                                        sequence_bias=[[[7], -5.0]])
    with pytest.raises(ApiError, match="logit_bias: keys must be token ids"):
        settings_of(parse(CompletionRequest, dict(model="m", prompt="a", logit_bias={"x": 1.0})))
