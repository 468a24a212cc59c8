"""One refusal type crosses the Ray hop from the decoder: whatever the verb (generate, stream,
embed, transcribe, tokenize, detokenize), a request it refuses comes back as the engine front's
"rejected" Finish, naming the request's field, and deployments/http/decoder_calls.py's `refused`
is the one place it becomes OpenAI's error."""

from __future__ import annotations

import asyncio

import pytest

from deployments.http.decoder_calls import refused
from deployments.http.openai import ApiError
from deployments.schema import EmbedRequest, GenerateRequest, TranscriptionRequest
from generation.front import Finish


@pytest.fixture(scope="module")
def decoder():
    from deployments.app import Decoder

    decoder = Decoder.func_or_class({"engine": "fake", "slots": 2})
    yield decoder
    decoder.__del__()


async def last_event(stream):
    return [event async for event in stream][-1]


@pytest.mark.parametrize("verb, call, field", [
    ("generate", lambda d: d.generate(GenerateRequest(prompt="a", logprobs=9)), "logprobs"),  # the fake gives 5
    ("stream", lambda d: last_event(d.stream(GenerateRequest(prompt="a", stop_token_ids=[10**6]))), "stop_token_ids"),
    ("embed", lambda d: d.embed(EmbedRequest(inputs=["a"])), "model"),
    ("transcribe", lambda d: d.transcribe([0.0] * 16, TranscriptionRequest()), "model"),
    ("tokenize", lambda d: d.tokenize(None, [{"role": "user", "content": [{"type": "image_url"}]}], None, True, None,
                                      False), "messages.0.content.0"),
    ("tokenize a text past the context", lambda d: d.tokenize("a" * 50_000, None, None, True, None, False), "prompt"),
    ("tokenize neither a prompt nor messages", lambda d: d.tokenize(None, None, None, True, None, False), "prompt"),
    ("tokenize both", lambda d: d.tokenize("a", [{"role": "user", "content": "a"}], None, True, None, False), "prompt"),
])
def test_every_verb_answers_its_refusal_as_the_front_s_rejected_finish(decoder, verb, call, field):
    answer = asyncio.run(call(decoder))
    finish = getattr(answer, "finish", answer)  # a Generation holds its Finish
    assert isinstance(finish, Finish) and finish.finish_reason == "rejected", (verb, answer)
    assert finish.status == 400 and (finish.field or "").startswith(field), (verb, finish)
    error = refused(answer, "req-1")
    assert isinstance(error, ApiError) and error.status == 400 and error.param == finish.field
    assert error.body()["error"]["message"] == finish.error


def test_an_answer_that_is_no_refusal_is_no_error(decoder):
    assert refused(asyncio.run(decoder.tokenize("ab", None, None, True, None, False)), "req-1") is None
    assert refused(asyncio.run(decoder.generate(GenerateRequest(prompt="ab"))), "req-1") is None
