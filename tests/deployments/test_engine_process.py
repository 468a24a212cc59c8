"""The decoder's batching loop in a child process (deployments/services/engine_process.py):
what it streams equals the loop in process, its requests are checked here, cancels and ends
reach it, and its death answers every request."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from deployments.errors import RequestError
from deployments.schema import GenerateRequest
from deployments.services.generator import TextGenerator

REQUESTS = [
    dict(prompt="The list", seed=1, settings={"max_new_tokens": 12}),
    dict(prompt="A class defines", seed=2, logprobs=3, settings={"max_new_tokens": 10, "do_sample": True, "top_k": 20}),
    dict(prompt="A class", seed=3, settings={"max_new_tokens": 8, "num_beams": 2}),
    dict(prompt="Strings are", seed=4, echo=True, prompt_logprobs=2, logprobs=1, settings={"max_new_tokens": 6}),
    dict(prompt="The with", seed=5, settings={"max_new_tokens": 0}, echo=True, prompt_logprobs=1),
]


async def streamed(generator, requests):
    async def one(request):
        return [chunk async for chunk in generator.stream(GenerateRequest(**request))]
    return await asyncio.gather(*(one(r) for r in requests))


def flat(chunks):
    """What a stream carried, whatever its chunking: tokens, text, log-probabilities, its end."""
    end = chunks[-1]
    return dict(tokens=sum((c.token_ids for c in chunks), []), text="".join(c.text for c in chunks),
                logprobs=[lp.model_dump() for c in chunks for lp in (c.logprobs or [])],
                prompt=[c.prompt_text for c in chunks if c.prompt_text is not None],
                prompt_logprobs=[[lp.model_dump() for lp in c.prompt_logprobs] for c in chunks if c.prompt_logprobs],
                end=(end.finish_reason, end.prompt_tokens, end.completion_tokens, end.error))


@pytest.fixture(scope="module")
def generators(test_models):
    model = test_models["llama-genai"]
    local = TextGenerator.from_model(model, slots=4, threads=1, max_logprobs=5)
    child = TextGenerator.from_model(model, slots=4, threads=1, max_logprobs=5, engine_process=True,
                                     prefix_cache_bytes=1 << 20)
    yield local, child
    local.close()
    child.close()


def test_streams_equal_the_loop_in_process(generators):
    local, child = generators
    expected = asyncio.run(streamed(local, REQUESTS))
    got = asyncio.run(streamed(child, REQUESTS))
    assert child.batcher.process.pid != os.getpid() and child.batcher.process.is_alive()
    assert [flat(c) for c in got] == [flat(c) for c in expected]
    assert flat(got[3])["prompt_logprobs"] and flat(got[4])["prompt_logprobs"]  # forwarded, not left behind
    # this process reads the graph and keeps no session: the weights live in the child only
    assert local.batcher.ctx.model.session is not None and child.batcher.ctx.model.session is None
    assert len(flat(got[0])["tokens"]) == 12 and flat(got[1])["logprobs"]


def test_a_bad_setting_is_refused_here_naming_it(generators):
    _, child = generators
    with pytest.raises(RequestError) as refused:
        asyncio.run(streamed(child, [dict(prompt="x", settings={"temperature": -1, "do_sample": True})]))
    assert refused.value.field == "settings.temperature"
    with pytest.raises(RequestError) as refused:
        asyncio.run(streamed(child, [dict(prompt="x", settings={"num_beams": 9})]))
    assert refused.value.field == "settings.num_beams"
    assert child.batcher.process.is_alive()


def test_a_cancelled_stream_frees_the_childs_slot(generators):
    _, child = generators

    before = child.batcher.steps

    async def leave_early():
        stream = child.stream(GenerateRequest(prompt="The list", settings={"max_new_tokens": 200}))
        await stream.__anext__()
        assert child.batcher.running == 1
        await stream.aclose()  # a client gone: the request is cancelled
    asyncio.run(leave_early())
    deadline = time.time() + 10
    while child.batcher.running and time.time() < deadline:
        time.sleep(0.01)
    assert child.batcher.running == 0 and child.batcher.steps - before < 150  # not its 200 tokens


def test_the_prefix_caches_counters_come_from_the_child(generators):
    _, child = generators
    prompt = "The list type is a sequence of items that can be changed, and a tuple is one that cannot. " * 2
    for _ in range(2):  # one after the other: the second finds the first's prefix
        asyncio.run(streamed(child, [dict(prompt=prompt, settings={"max_new_tokens": 2})]))
    assert child.batcher.prefix.queries > 0 and child.batcher.prefix.hits > 0


def test_the_childs_death_ends_every_request_with_an_error(test_models):
    generator = TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, engine_process=True)
    try:
        async def run():
            stream = generator.stream(GenerateRequest(prompt="The list", settings={"max_new_tokens": 200}))
            await stream.__anext__()
            os.kill(generator.batcher.process.pid, signal.SIGKILL)
            return [chunk async for chunk in stream]
        chunks = asyncio.run(run())
        assert chunks[-1].finish_reason == "error" and chunks[-1].status == 500
        assert "engine process exited" in chunks[-1].error
        generator.batcher._thread.join(timeout=5)  # it ends right after answering them
        assert not generator.batcher._thread.is_alive()  # what Decoder.check_health reads: the replica restarts
        with pytest.raises(RuntimeError, match="engine process exited"):
            generator.batcher.submit([1, 2, 3])
    finally:
        generator.close()


def test_a_child_that_cannot_load_says_why(test_models, tmp_path):
    # the draft is the child's alone (this process checks requests against the model only)
    with pytest.raises(RuntimeError, match="the engine process could not load the model: .*no-draft-here"):
        TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, engine_process=True,
                                 draft=tmp_path / "no-draft-here")


def test_other_models_are_refused_naming_the_setting(s2s):
    with pytest.raises(ValueError, match="engine_process: runs decoder-only text models"):
        TextGenerator.from_model(s2s["marian-optimum"], slots=2, threads=1, engine_process=True)


def test_the_cli_and_app_config_carry_it(test_models, s2s):
    import argparse

    from deployments.app import AppConfig
    from deployments.cli import add_arguments, app_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def layout(*argv):
        args = app_config(parser.parse_args(list(map(str, argv))))
        AppConfig(**args)
        return args["colocate"], args["engine_process"]

    text = test_models["llama-genai"]
    assert layout("--model", text, "--engine-process") == (False, True)
    assert AppConfig().engine_process is False and AppConfig().colocate is False  # a Serve config's, the chart's
    # raymuter serve's default: a decoder-only text model colocated with its loop in a child process
    assert layout("--model", text) == (True, True) and layout() == (True, True)  # () : the default model
    assert layout("--model", text, "--split") == (False, False)
    assert layout("--model", text, "--colocate") == (True, False)
    assert layout("--model", text, "--autoscale", "ingress=1:2") == (False, False)  # routes scaled apart
    assert layout("--model", s2s["marian-optimum"]) == (False, False)  # an encoder-decoder: two deployments
    assert layout("--engine", "fake") == (False, False)
    with pytest.raises(ValueError, match="--split .* takes neither --colocate nor --engine-process"):
        layout("--model", text, "--split", "--colocate")
