"""The decoder's batching loop in a child process (generation/engine/process.py):
what it streams equals the loop in process, its requests are checked here, cancels and ends
reach it, and its death answers every request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import asdict

import pytest

from deployments.errors import RequestError
from deployments.schema import GenerateRequest
from deployments.services.generator import TextGenerator
from generation.front import Delta, Echo

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
    echoes, deltas = [c for c in chunks if isinstance(c, Echo)], [c for c in chunks if isinstance(c, Delta)]
    return dict(tokens=[i for c in deltas for i in c.token_ids], text="".join(c.text for c in deltas + [end]),
                logprobs=[asdict(lp) for c in deltas for lp in (c.logprobs or [])],
                prompt=[c.prompt_text for c in echoes],
                prompt_logprobs=[[asdict(lp) for lp in c.prompt_logprobs] for c in echoes if c.prompt_logprobs],
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
    from generation.engine.batcher import Batcher

    assert isinstance(child.batcher, Batcher) and isinstance(local.batcher, Batcher)  # the loops' contract
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


def test_the_child_recomputes_a_finished_answer_while_idle_for_the_next_turn(test_models):
    """int8 (quantized activations, generation/core/keep.py): a turn's answer is run again as a
    prompt while the child's loop idles, so the next turn finds the prompt and answer cached (but
    the last token, never fed) and gets the tokens of a loop without a cache."""
    model, settings = test_models["llama-genai"], {"max_new_tokens": 40, "min_new_tokens": 40}
    child = TextGenerator.from_model(model, slots=4, threads=1, precision="int8", engine_process=True,
                                     prefix_cache_bytes=1 << 22)
    cold = TextGenerator.from_model(model, slots=4, threads=1, precision="int8")
    try:
        prompt, turns = list(range(5, 48)), []
        for message in ([], [31, 32, 33, 34, 35]):
            prompt = prompt + (turns[-1][0]["tokens"] if turns else []) + message
            warm, = asyncio.run(streamed(child, [dict(prompt=prompt, settings=settings)]))
            expected, = asyncio.run(streamed(cold, [dict(prompt=prompt, settings=settings)]))
            assert flat(warm) == flat(expected)
            turns.append((flat(warm), warm[-1].cached_tokens, len(prompt)))
            time.sleep(0.5)  # the child idles: its loop recomputes the answer (a few ms here)
        assert turns[1][1] == (turns[0][2] + 40 - 1) // 16 * 16 == 80
    finally:
        child.close()
        cold.close()


def test_batch_rows_do_not_count_against_max_waiting(generators, monkeypatch):
    """As the loop in process: a batch's lines (priority 1) in flight beyond max_waiting are
    taken, and beside them interactive requests are taken up to max_waiting waiting, then refused."""
    from generation.engine.batching import QueueFull

    _, child = generators
    monkeypatch.setattr(child.batcher, "max_waiting", 2)
    long = dict(max_new_tokens=200, eos_token_id=[])
    taken = []
    try:
        taken += [child.batcher.submit([5, 6], settings=long, priority=1) for _ in range(12)]  # 4 slots, 8 waiting
        taken += [child.batcher.submit([7, 8], settings=long) for _ in range(2)]
        with pytest.raises(QueueFull):
            for _ in range(20):  # as the child seats them (their rows preempt the lines'), more are taken
                taken.append(child.batcher.submit([7, 8], settings=long))
    finally:
        for request in taken:
            request.cancel()
    assert all(r.result(timeout=30).finish_reason == "cancelled" for r in taken)
    assert child.batcher._interactive == 0 and not child.batcher._requests


def test_the_childs_death_ends_its_requests_with_503_and_a_new_child_serves(test_models):
    """A child killed mid-stream: its request ends with 503 (the client may retry), a submit while
    the next child starts is refused with 503 (EngineRestarting, a QueueFull: Overloaded), the
    batcher stays alive (the health check passes), and once the new child is up the same request
    gives the same tokens as before."""
    from generation.engine.batching import QueueFull
    from generation.engine.process import EngineRestarting

    generator = TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, engine_process=True)
    request = dict(prompt="The list", settings={"max_new_tokens": 12})
    try:
        before = asyncio.run(streamed(generator, [request]))[0]

        async def killed():
            stream = generator.stream(GenerateRequest(prompt="The list", settings={"max_new_tokens": 200}))
            await stream.__anext__()
            os.kill(generator.batcher.process.pid, signal.SIGKILL)
            return [chunk async for chunk in stream]
        chunks = asyncio.run(killed())
        assert chunks[-1].finish_reason == "error" and chunks[-1].status == 503, chunks[-1]
        assert "engine process exited with code -9" in chunks[-1].error
        refused = []
        deadline = time.time() + 120
        while generator.batcher.restarts == 0 and time.time() < deadline:
            assert generator.batcher.alive  # what Decoder.check_health reads: the replica stays
            try:
                generator.batcher.submit([1, 2, 3]).cancel()
            except EngineRestarting as e:
                refused.append(e)
            time.sleep(0.05)
        assert generator.batcher.restarts == 1 and refused  # the new child loads for a while: submits refused meanwhile
        assert isinstance(refused[0], QueueFull)  # TextGenerator raises Overloaded for it: 503 with Retry-After
        after = asyncio.run(streamed(generator, [request]))[0]
        assert flat(after) == flat(before)
        assert generator.batcher.alive
    finally:
        generator.close()


def test_a_child_dying_again_and_again_stops_the_batcher(test_models, monkeypatch):
    """RESTARTS deaths within RESTART_WINDOW: no new child; the batcher is no longer alive (the
    health check fails and Serve replaces the replica), and submits say why."""
    from generation.engine import process as engine_process

    monkeypatch.setattr(engine_process, "RESTARTS", 2)
    generator = TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, engine_process=True)
    try:
        batcher = generator.batcher
        for death in range(2):
            os.kill(batcher.process.pid, signal.SIGKILL)
            deadline = time.time() + 120
            while batcher.restarts == death and batcher.alive and time.time() < deadline:
                time.sleep(0.05)
        batcher._thread.join(timeout=10)
        assert batcher.restarts == 1 and not batcher.alive
        with pytest.raises(RuntimeError, match="2 times within 300 s"):
            batcher.submit([1, 2, 3])
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
    from deployments.cli.serve import add_arguments, app_config

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


def test_the_replica_side_holds_nothing_per_request(generators):
    """What serves a request in the replica (TextGenerator over the engine process: its request
    table, streams, metrics) keeps nothing once it is answered: the Python heap traced over 2,000
    whole and streamed requests (after 200 to warm up) grows by less than 64 KiB in one of two
    such rounds (a leak of one small object per request would be more in each; what is made once,
    as a busy machine's extra worker thread or the reader's last message, grows one round only).
    bench/soak.py measures the whole replica's memory."""
    import gc
    import tracemalloc

    _, child = generators

    async def load(count, clients=8):  # `clients` at a time, each one request after another
        async def client(first):
            for i in range(first, count, clients):
                request = GenerateRequest(prompt="The list", seed=i, logprobs=1 if i % 4 == 0 else None,
                                          settings={"max_new_tokens": 3})
                if i % 2:
                    await child.generate(request)
                else:
                    async for _ in child.stream(request):
                        pass
        await asyncio.gather(*(client(k) for k in range(clients)))

    # what other threads of this process allocate meanwhile (a Ray handle's router logging) is
    # none of the replica side's
    others = [tracemalloc.Filter(False, pattern) for pattern in
              ("*/ray/*", "*/logging/*", "*/traceback.py", "*/linecache.py", "*/ast.py", tracemalloc.__file__)]

    def heap() -> int:
        gc.collect()
        return sum(s.size for s in tracemalloc.take_snapshot().filter_traces(others).statistics("filename"))

    asyncio.run(load(200))
    tracemalloc.start()
    grown = []
    try:
        for _ in range(2):
            before = heap()
            asyncio.run(load(2000))
            grown.append(heap() - before)
    finally:
        tracemalloc.stop()
    assert min(grown) < 64 * 1024, f"{grown} bytes more after each 2,000 requests"


def test_preemptions_under_the_kv_budget_are_counted_from_the_child(test_models, load_model):
    """A child whose KV budget holds 2 rows of the whole capacity, 6 long requests at once: rows
    are preempted there (and resumed exactly: each stream equals the loop in this process), and
    the count reaches the replica's side (its metrics)."""
    import generation
    from generation.engine.scheduler import Scheduler

    model = test_models["llama-genai"]
    budget = Scheduler(generation.context(load_model(model)), 8, 128).state.cache.footprint(2, 128)
    local = TextGenerator.from_model(model, slots=8, capacity=128, threads=1)
    child = TextGenerator.from_model(model, slots=8, capacity=128, threads=1, engine_process=True,
                                     kv_cache_bytes=budget)
    try:
        requests = [dict(prompt=f"{k} the list type", seed=k, settings={"max_new_tokens": 90, "eos_token_id": []})
                    for k in range(6)]
        there = [flat(c) for c in asyncio.run(streamed(child, requests))]
        assert there == [flat(c) for c in asyncio.run(streamed(local, requests))]
        assert child.batcher.preemptions > 0
    finally:
        local.close()
        child.close()


def test_the_engine_process_computes_on_its_cores_and_this_process_on_the_others(generators, test_models):
    """reserve_cores=1: the child (every thread of it, onnxruntime's too) runs on all cores but the
    first, this process (the replica: its routes, its reader thread) on the first; what it streams
    is unchanged. generation/runtime/cores.py; docs/serving.md, Cores."""
    from generation.runtime import cores

    local, _ = generators
    before, affinity = cores.allowed(), os.sched_getaffinity(0)
    if len(before) < 2:
        pytest.skip("one core: nothing to place apart")
    generator = TextGenerator.from_model(test_models["llama-genai"], slots=4, threads=1, max_logprobs=5,
                                         engine_process=True, reserve_cores=1)
    try:
        pid = generator.batcher.process.pid
        child = {_mask(f"/proc/{pid}/task/{tid}/status") for tid in os.listdir(f"/proc/{pid}/task")}
        here = {_mask(f"/proc/self/task/{tid}/status") for tid in os.listdir("/proc/self/task")}
        assert child == {cores.span(before[1:])} and here == {cores.span(before[:1])}
        expected = asyncio.run(streamed(local, REQUESTS))
        assert [flat(c) for c in asyncio.run(streamed(generator, REQUESTS))] == [flat(c) for c in expected]
    finally:
        generator.close()
        cores.pin(affinity)
    with pytest.raises(ValueError, match=r"engine_cores and reserve_cores place the batching loop's child process"):
        TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1, reserve_cores=1)


def _mask(status: str) -> str:
    with open(status) as f:
        return next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))


def test_the_cli_places_the_engine_process_and_names_its_flags(test_models, s2s):
    import argparse

    from deployments.app import AppConfig
    from deployments.cli.serve import add_arguments, app_config, place_cores
    from generation.runtime import cores

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    text, allowed = test_models["llama-genai"], cores.allowed()

    def placed(*argv):
        config = app_config(parser.parse_args(list(map(str, argv))))
        place = place_cores(config)
        AppConfig(**config)
        return place, config["engine_cores"], config["reserve_cores"]

    place, engine, reserve = placed("--model", text)  # the machine size's default
    assert place == cores.placement(cores=allowed)
    assert (engine, reserve) == ((None, 0) if place.shared else (list(place.engine), None))
    if len(allowed) >= 2:
        assert placed("--model", text, "--reserve-cores", 1) == (cores.Placement(allowed[1:], allowed[:1]),
                                                                 list(allowed[1:]), None)
        assert placed("--model", text, "--engine-cores", allowed[-1])[1] == [allowed[-1]]
    assert placed("--model", text, "--reserve-cores", 0) == (cores.Placement(allowed, allowed), None, 0)
    assert placed("--model", s2s["marian-optimum"]) == (None, None, None)  # no engine process: nothing placed
    for argv, message in [(("--reserve-cores", len(allowed)), f"--reserve-cores: {len(allowed)} of this machine's"),
                          (("--engine-cores", "x"), "--engine-cores: core numbers and ranges"),
                          (("--engine-cores", 4096), "--engine-cores: 4096 not among the cores"),
                          (("--engine-cores", allowed[0], "--reserve-cores", 0), "--engine-cores and --reserve-cores: "
                                                                                  "give one")]:
        with pytest.raises(ValueError, match=message):
            placed("--model", text, *argv)
    with pytest.raises(ValueError, match="--engine-cores and --reserve-cores place the batching loop's child"):
        placed("--model", s2s["marian-optimum"], "--reserve-cores", 1)
    with pytest.raises(ValueError, match="they need engine_process"):  # a Serve config's
        AppConfig(reserve_cores=1)
    with pytest.raises(ValueError, match="engine_cores and reserve_cores: give one"):
        AppConfig(engine_process=True, reserve_cores=1, engine_cores=[0])
