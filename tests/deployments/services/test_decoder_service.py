"""The decoder's TextGenerator without Ray: prompts, chat templates, streamed text around stop
strings, log-probabilities, refusals naming the field (deployments/services/generator.py, generation/text/chat.py)."""

from __future__ import annotations

import asyncio

import pytest

from deployments.services.generator import TextGenerator
from deployments.errors import Overloaded, RequestError
from deployments.fake import fake_generator, fake_tokens
from deployments.schema import GenerateRequest
from generation.front import Delta, EngineOptions, Finish, Refused
from generation.text.chat import ChatTemplateError, chat_template, render_chat, special_tokens


def collect(generator, **request):
    async def run():
        return [chunk async for chunk in generator.stream(GenerateRequest(**request))]
    return asyncio.run(run())


def ids_of(events) -> list[int]:
    """The token ids of a stream's Deltas, in order."""
    return [i for e in events if isinstance(e, Delta) for i in e.token_ids]


@pytest.fixture
def fake():
    generator = fake_generator(EngineOptions(slots=2, max_waiting=3), step_seconds=0.001)
    yield generator
    generator.close()


def test_streamed_text_never_passes_a_stop_string(fake):
    # the fake gives the prompt reversed: "abcdefgh" -> "hgfedcba"
    chunks = collect(fake, prompt="abcdefgh", settings={"stop_strings": ["edc"]})
    pieces = [c.text for c in chunks]
    assert "".join(pieces) == "hgf"
    # the hold-back: no chunk ever showed a character of the stop string
    shown = ""
    for piece in pieces:
        shown += piece
        assert "e" not in shown
    assert chunks[-1].finish_reason == "length"  # the fake ignores stops; the engine ends the row at one


def test_text_without_stops_streams_as_the_tokens_come(fake):
    chunks = collect(fake, prompt="abc", settings={"max_new_tokens": 5})
    assert "".join(c.text for c in chunks) == "cbacb"
    assert all(len(c.text) == len(c.token_ids) for c in chunks[:-1])  # a Delta holds the tokens made since the last
    assert all(isinstance(c, Delta) for c in chunks[:-1]) and isinstance(chunks[-1], Finish)
    assert len(chunks) > 2  # not all at the end
    assert chunks[-1].completion_tokens == 5 and chunks[-1].prompt_tokens == 3


def test_chat_prompt_and_logprobs(fake):
    chunks = collect(fake, messages=[{"role": "user", "content": "hi"}], logprobs=1,
                     settings={"max_new_tokens": 3})
    prompt = "user: hi\nassistant: "
    assert "".join(c.text for c in chunks) == "".join(map(chr, fake_tokens([ord(c) for c in prompt], 0,
                                                                           {"max_new_tokens": 3})))
    assert all(c.logprobs[0].logprob == -0.5 and len(c.logprobs[0].top) == 1 for c in chunks[:-1])


@pytest.mark.parametrize("request_, field, message", [
    (dict(prompt=""), "prompt", "prompt is empty"),
    (dict(prompt=[10**6]), "prompt", "not a token id"),
    (dict(prompt="a", logprobs=9), "logprobs", "at most 5 alternatives"),
    (dict(prompt="a", settings={"max_new_tokens": 5000}), "settings.max_new_tokens", "exceed the context of 4096"),
    # the prompt alone past the context: its own field, whatever max_tokens (it named max_tokens)
    (dict(prompt="a" * 4096, settings={"max_new_tokens": 1}), "prompt", "the prompt is 4096 tokens; the model's "
                                                                        "context holds 4096, a new token included"),
    (dict(messages=[{"role": "user", "content": "a" * 4078}], settings={"max_new_tokens": 1}), "messages",
     "the prompt is 4096 tokens"),
    (dict(prompt="a", settings={"temperature": -1}), "settings.temperature", "temperature must be a positive number"),
    (dict(prompt="a", stop_token_ids=[10**6]), "stop_token_ids", "stop_token_ids names token id"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages.0.content.0", "text parts only"),
])
def test_refusals_name_the_generate_requests_field(fake, request_, field, message):
    with pytest.raises(RequestError, match=message) as info:
        collect(fake, **request_)
    assert info.value.field == field


def test_a_full_queue_is_overloaded():
    generator = fake_generator(EngineOptions(slots=1, max_waiting=1), step_seconds=0.05)
    try:
        request = GenerateRequest(prompt="abc", settings={"max_new_tokens": 50})
        generator.submit(request)  # the queue was empty
        with pytest.raises(Overloaded, match="1 requests are waiting already"):
            for _ in range(4):
                generator.submit(request)
    finally:
        generator.close()


def test_stopping_early_cancels_the_request(fake):
    async def run():
        stream = fake.stream(GenerateRequest(prompt="ab", settings={"max_new_tokens": 4000}))
        await stream.__anext__()
        await stream.aclose()
    asyncio.run(run())
    handle = fake.batcher.submit([97], settings={"max_new_tokens": 1})
    assert handle.result(timeout=10).tokens == [97]  # a slot came free
    assert fake.batcher.steps < 1000


def test_unknown_request_fields_are_refused():
    with pytest.raises(ValueError, match="exactly one of prompt and messages"):
        GenerateRequest(prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(TypeError, match="temperature"):
        GenerateRequest(prompt="a", temperature=1)
    with pytest.raises(Refused) as refused:  # a handle caller's dict
        GenerateRequest.checked({"prompt": "a", "temperature": 1})
    assert refused.value.field == "temperature"


@pytest.mark.parametrize("fields, field", [
    ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": "a", "seed": 2**63}, "seed"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"), ({"prompt": "a", "prompt_logprobs": True}, "prompt_logprobs"),
    ({"prompt": "a", "priority": 1_000_001}, "priority"), ({"prompt": "a", "affinity": "x" * 129}, "affinity"),
    ({"prompt": [1, "2"]}, "prompt"), ({"prompt": "a", "settings": None}, "settings"),
    ({"prompt": "a", "stop_token_ids": [1.5]}, "stop_token_ids"), ({"prompt": "a", "echo": "yes"}, "echo"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages.0.content"), ({"messages": ["hi"]}, "messages.0"),
    ({"prompt": "a", "tools": [1]}, "tools"), ({"prompt": "a", "request_id": 7}, "request_id"),
])
def test_a_malformed_request_is_refused_by_its_field_when_made(fields, field):
    """The front's request checks itself (the handle API's request is the same class): a bad field
    is refused by name wherever the request was built, before it crosses a process."""
    with pytest.raises(Refused) as refused:
        GenerateRequest(**fields)
    assert refused.value.field == field and str(refused.value).startswith(f"{field}: must be")
    assert GenerateRequest(prompt=[1, 2], seed=2**63 - 1, logprobs=20, priority=1_000_000, affinity="x" * 128)


@pytest.mark.parametrize("fields, field", [
    ({"task": "summarize"}, "task"), ({"temperature": [0.0] * 17}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"language": "x" * 65}, "language"), ({"no_speech_threshold": 1.5}, "no_speech_threshold"),
    ({"logprob_threshold": 1.0}, "logprob_threshold"), ({"seed": -1}, "seed"), ({"timestamps": None}, "timestamps"),
])
def test_a_malformed_transcription_request_is_refused_by_its_field_when_made(fields, field):
    from deployments.schema import TranscriptionRequest

    with pytest.raises(Refused) as refused:
        TranscriptionRequest(**fields)
    assert refused.value.field == field
    with pytest.raises(Refused) as refused:
        TranscriptionRequest.checked({"language": "en", "beam": 2})
    assert refused.value.field == "beam"
    assert TranscriptionRequest(temperature=[0.0, 0.4], task="translate", logprob_threshold=-1.0).task == "translate"


# -- chat templates ----------------------------------------------------------------------------
def test_chat_template_equals_transformers(test_models):
    from transformers import AutoTokenizer

    folder = test_models["llama-genai"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a list?"},
                {"role": "assistant", "content": "A sequence."}, {"role": "user", "content": "And a tuple?"}]
    ours = render_chat(chat_template(folder), messages, special_tokens(folder))
    assert ours == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def test_the_default_models_template_is_found():
    from generation.default_model import default_model_path

    folder = default_model_path()
    text = render_chat(chat_template(folder), [{"role": "user", "content": "hi"}], special_tokens(folder))
    assert text.endswith("user: hi\nassistant:")


def test_missing_or_failing_templates_say_so(tmp_path):
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(chat_template(tmp_path), [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="refused the messages: only users"):
        render_chat("{{ raise_exception('only users') }}", [])
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for %}", [])


def test_real_engine_generator_matches_generate(test_models, load_model):
    import generation
    from generation.text.tokenizer import model_tokenizer

    generator = TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, max_new_tokens=10)
    try:
        chunks = collect(generator, prompt="The list", seed=4, settings={"do_sample": True, "top_k": 10})
        model = load_model(test_models["llama-genai"])
        ids = model_tokenizer(model).encode("The list").ids
        expected = generation.generate(generation.context(model, max_new_tokens=10, do_sample=True, top_k=10),
                                       [ids], seeds=[4])[0]
        assert ids_of(chunks) == expected
        assert "".join(c.text for c in chunks) == model_tokenizer(model).decode(expected)
        assert generator.card().id == "llama-genai" and generator.card().has_chat_template
    finally:
        generator.close()


def test_a_generator_with_a_draft_model(test_models, load_model):
    """`raymuter serve --draft` reaches the batcher's context: the same greedy text, from the
    draft's proposals (this draft holds the model's weights: everything is kept)."""
    import argparse

    import generation
    from deployments.cli.serve import add_arguments, app_config
    from generation.text.tokenizer import model_tokenizer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = app_config(parser.parse_args(["--model", str(test_models["llama-genai"]), "--draft",
                                         str(test_models["llama-optimum"]), "--set", "num_assistant_tokens=3"]))
    assert args["draft"] == str(test_models["llama-optimum"])
    generator = TextGenerator.from_model(args["model"], slots=2, threads=1, draft=args["draft"], max_new_tokens=12,
                                         **args["settings"])
    try:
        assert generator.batcher.ctx.draft is not None and generator.batcher.scheduler.assistant.num_tokens == 3
        chunks = collect(generator, prompt="The list")
        model = load_model(test_models["llama-genai"])
        ids = model_tokenizer(model).encode("The list").ids
        expected = generation.generate(generation.context(model, max_new_tokens=12), [ids], seeds=[0])[0]
        assert ids_of(chunks) == expected
        assert generator.batcher.steps <= 12 // 3 + 1
    finally:
        generator.close()


def test_no_spin_reaches_the_decoders_session(test_models, load_model):
    """`raymuter serve --no-spin` (AppConfig.spin): the decoder's onnxruntime threads sleep
    between runs, in this process and in the engine process; the tokens are the same."""
    import argparse

    import generation
    from deployments.app import AppConfig
    from deployments.cli.serve import add_arguments, app_config
    from generation.text.tokenizer import model_tokenizer

    folder = test_models["llama-genai"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = app_config(parser.parse_args(["--model", str(folder), "--no-spin"]))
    assert args["spin"] is False and AppConfig(**args).spin is False
    assert app_config(parser.parse_args(["--model", str(folder)]))["spin"] is True and AppConfig().spin is True
    model = load_model(folder)
    expected = generation.generate(generation.context(model, max_new_tokens=10),
                                   [model_tokenizer(model).encode("The list").ids], seeds=[0])[0]
    for engine_process in (False, True):
        generator = TextGenerator.from_model(folder, slots=2, threads=2, spin=args["spin"], max_new_tokens=10,
                                             engine_process=engine_process)
        try:
            if engine_process:  # the child loads the model from these arguments
                assert generator.batcher.load["options"].spin is False
            else:
                options = generator.batcher.ctx.model.session.get_session_options()
                assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
            assert ids_of(collect(generator, prompt="The list")) == expected
        finally:
            generator.close()


def test_many_running_rows_stretch_the_stream_interval():
    """The interval grows with the rows running (about CHUNKS_PER_SECOND chunks in all), within
    MAX_INTERVAL; a row alone keeps stream_interval, and 0 keeps a chunk per token."""
    from deployments.services.generator import CHUNKS_PER_SECOND, MAX_INTERVAL

    generator = fake_generator(EngineOptions(slots=64, max_waiting=64), step_seconds=0.001)
    try:
        generator.stream_interval = 0.01
        for running, expected in [(0, 0.01), (1, 0.01), (8, max(0.01, 8 / CHUNKS_PER_SECOND)),
                                  (64, MAX_INTERVAL)]:
            generator.batcher.running = running
            assert generator._interval() == pytest.approx(expected), running
        generator.stream_interval = 0.0
        assert generator._interval() == 0.0
        generator.stream_interval = 0.5  # a longer one asked for stays
        assert generator._interval() == 0.5
        generator.stream_interval, generator.chunks_per_second = 0.01, 800.0  # the app's stream_chunks_per_second
        generator.batcher.running = 32
        assert generator._interval() == pytest.approx(32 / 800)
    finally:
        generator.close()


def test_the_app_s_stream_pacing_reaches_the_decoder_s_service():
    from deployments.app import AppConfig
    from deployments.cli.serve import app_config
    from deployments.services.loading import decoder_service

    cfg = AppConfig(engine="fake", stream_interval_ms=25, stream_chunks_per_second=60)
    service = decoder_service(cfg, "fake")
    try:
        assert service.stream_interval == 0.025 and service.chunks_per_second == 60
    finally:
        service.close()
    import argparse

    from deployments.cli.serve import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--stream-interval-ms", "0", "--stream-chunks-per-second", "1000"])
    config = app_config(args)
    assert config["stream_interval_ms"] == 0 and config["stream_chunks_per_second"] == 1000


def test_concurrent_streams_send_fewer_chunks_per_token_than_one_alone():
    generator = fake_generator(EngineOptions(slots=16, max_waiting=64), step_seconds=0.002)
    generator.stream_interval = 0.005
    try:
        alone = collect(generator, prompt="abcd", settings={"max_new_tokens": 100})

        async def together():
            async def one(i):
                return [c async for c in generator.stream(GenerateRequest(prompt="abcd", seed=i,
                                                                          settings={"max_new_tokens": 100}))]
            return await asyncio.gather(*(one(i) for i in range(16)))

        streams = asyncio.run(together())
        assert all("".join(c.text for c in s) == "".join(c.text for c in alone) for s in streams)
        per_chunk = sum(len(ids_of(s)) for s in streams) / sum(len(s) for s in streams)
        assert per_chunk > 1.5 * len(ids_of(alone)) / len(alone), per_chunk
    finally:
        generator.close()


def test_a_stream_interval_sends_fewer_larger_chunks():
    generator = fake_generator(EngineOptions(slots=2, max_waiting=64), step_seconds=0.001)
    try:
        per_token = collect(generator, prompt="abcd", settings={"max_new_tokens": 60})
        generator.stream_interval = 0.02
        grouped = collect(generator, prompt="abcd", settings={"max_new_tokens": 60})
        assert "".join(c.text for c in grouped) == "".join(c.text for c in per_token)
        assert len(grouped[0].token_ids) == 1  # the first token goes at once
        assert len(grouped) < len(per_token) / 3
    finally:
        generator.close()


def test_every_metric_is_also_under_vllms_name(fake):
    """vLLM's dashboards read `vllm:` names: each `raymuter:` family is also there, same samples."""
    from prometheus_client.parser import text_string_to_metric_families

    collect(fake, prompt="abc", settings={"max_new_tokens": 3})
    families = {f.name: f for f in text_string_to_metric_families(fake.metrics.text())}
    ours = [name for name in families if name.startswith("raymuter:")]
    assert "raymuter:time_to_first_token_seconds" in ours and len(ours) >= 10
    for name in ours:
        twin = families["vllm:" + name.removeprefix("raymuter:")]
        assert [(s.name.removeprefix("vllm:"), s.labels, s.value) for s in twin.samples] == \
            [(s.name.removeprefix("raymuter:"), s.labels, s.value) for s in families[name].samples]
    assert families["vllm:generation_tokens"].samples[0].value == 3
