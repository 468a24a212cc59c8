"""Constraints bounded at the boundary: every grammar, regex, schema and tool schema compiles
within the grammar budget (generation.logits.constraints.GrammarBudget; AppConfig.grammar_budget,
`raymuter serve --grammar-budget`) before the request is queued, off the batch's thread.

Invariants, in every layout (--split, --colocate, --colocate --engine-process) and through the
Python handle: a grammar that does not parse, a constraint over the budget (x{1000000}, a rule
of 6000 alternatives) and a tool whose parameters are no JSON schema (whatever the tool_choice)
are a 400 naming the request's field, at once; 600 alternatives are within it; the operator sets
the budget. A compile holds neither the replica's event loop nor the batching loop (in process
or in the engine process). A constraint that leaves its row no token ends that row alone with
finish_reason "stop" (why: in the handle's `error` and the replica's log), the others as alone.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import pytest

from test_serve import alone

LAYOUTS = ["split", "colocated", "colocated-engine"]
MESSAGES = [{"role": "user", "content": "Oslo?"}]


def alternatives(count: int, gbnf: bool = False) -> str:
    return ("root ::= " if gbnf else "start: ") + " | ".join(f'"w{i}"' for i in range(count))


@pytest.fixture(scope="module")
def apps(serve_apps):
    """The tiny model in each layout (the session's `real` app is the split one), and one with a
    small budget of the operator's."""
    from ray import serve

    from conftest import ServeApps
    from deployments.app import build

    base = {**ServeApps.REAL, "model": str(serve_apps.real_model)}
    names = {"colocated": dict(colocate=True), "colocated-engine": dict(colocate=True, engine_process=True),
             "small": dict(colocate=True, grammar_budget={"max_grammar_size": 500, "seconds": 5})}
    for name, layout in names.items():
        serve.run(build({**base, **layout}), name=f"budget-{name}", route_prefix=f"/budget-{name}")
    urls = {"split": serve_apps.real, **{name: f"{serve_apps.url}/budget-{name}" for name in names}}
    yield urls
    for name in names:
        serve.delete(f"budget-{name}", _blocking=False)


def post(url: str, route: str = "/v1/completions", **body):
    started = time.perf_counter()
    out = httpx.post(url + route, json={"model": "tiny", "max_tokens": 8, **body}, timeout=60)
    return out, time.perf_counter() - started


def refused(out, param: str) -> str:
    assert out.status_code == 400, out.text
    error = out.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    return error["message"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grammar", ["root ::= (", "root ::= [a-", "root ::= foo"])
@pytest.mark.parametrize("field", ["guided_grammar", "structured_outputs"])
def test_a_grammar_that_does_not_parse_is_a_400_naming_its_field(apps, layout, grammar, field):
    given = {field: grammar} if field == "guided_grammar" else {field: {"grammar": grammar}}
    out, _ = post(apps[layout], prompt="The", **given)
    assert "the GBNF grammar does not parse" in refused(out, field)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("field, value, limit", [
    ("guided_regex", "x{1000000}", "initial_lexer_fuel"),
    ("guided_regex", "(x{1000}){1000}", "initial_lexer_fuel"),
    ("guided_grammar", alternatives(6000), "max_grammar_size"),
    ("guided_grammar", alternatives(6000, gbnf=True), "max_grammar_size"),
], ids=["x1000000", "x1000x1000", "lark-6000", "gbnf-6000"])
def test_a_constraint_over_the_budget_is_a_400_at_once(apps, layout, field, value, limit):
    out, seconds = post(apps[layout], prompt="The", **{field: value})
    assert "over the grammar budget" in refused(out, field) and f"grammar_budget.{limit} is" in out.text
    assert seconds < 2  # before: a 500 after 5 s (x{1000000}), while every other stream slowed


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gbnf", [False, True], ids=["lark", "gbnf"])
def test_600_alternatives_are_within_the_budget(apps, layout, gbnf):
    out, _ = post(apps[layout], prompt="The", guided_grammar=alternatives(600, gbnf))
    assert out.status_code == 200, out.text
    text = out.json()["choices"][0]["text"]
    assert re.fullmatch(r"w\d+", text) and int(text[1:]) < 600, text


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("choice", [None, "auto", "none"])
@pytest.mark.parametrize("parameters, why", [({"type": "nonsense"}, "Invalid type"),
                                             ({"type": "object", "properties": 5}, "properties must be an object")])
def test_a_tool_whose_parameters_are_no_schema_is_a_400_whatever_the_tool_choice(apps, layout, choice, parameters,
                                                                                  why):
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    out, _ = post(apps[layout], "/v1/chat/completions", messages=MESSAGES, tools=tools,
                  **({} if choice is None else {"tool_choice": choice}))
    assert why in refused(out, "tools.0.function.parameters")


def test_keywords_llguidance_does_not_enforce_still_pass_with_auto(apps):
    """auto and none check a tool's schema, they do not enforce it: keywords llguidance does not
    implement (if/then, an unknown format) pass there, as they did."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}},
        "if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["a"]}}}}]
    out, _ = post(apps["split"], "/v1/chat/completions", messages=MESSAGES, tools=tools, tool_choice="auto")
    assert out.status_code == 200, out.text


@pytest.mark.parametrize("app", ["real", "budget-colocated-engine"])
def test_the_python_handle_is_refused_the_same(apps, app):
    from ray import serve

    from deployments.http.openai import ApiError
    from deployments.schema import GenerateRequest

    handle = serve.get_app_handle(app)
    with pytest.raises(ApiError) as e:
        handle.generate.remote(GenerateRequest(prompt="The", settings={
            "structured_outputs": {"regex": "x{1000000}"}})).result()
    assert e.value.status == 400 and e.value.param == "settings.structured_outputs"
    assert "over the grammar budget" in e.value.message
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    with pytest.raises(ApiError) as e:
        handle.generate.remote(GenerateRequest(messages=MESSAGES, tools=tools)).result()
    assert e.value.status == 400 and e.value.param == "tools.0.function.parameters"


def test_the_budget_is_the_operators(apps, capsys):
    out, _ = post(apps["small"], prompt="The", guided_grammar=alternatives(600))
    assert "grammar_budget.max_grammar_size is 500" in refused(out, "guided_grammar")
    from deployments import cli
    from deployments.cli import serve as serving
    from deployments.app import AppConfig

    args = cli.parser().parse_args(["serve", "--grammar-budget", "seconds=2.5,max_grammar_size=8192",
                                    "--grammar-budget", "initial_lexer_fuel=100000"])
    assert AppConfig(**serving.app_config(args)).grammar_budget == {"seconds": 2.5, "max_grammar_size": 8192,
                                                                 "initial_lexer_fuel": 100000}
    for bad, says in (("fuel=1", "grammar_budget.fuel is not a budget field"),
                      ("seconds=soon", "takes FIELD=VALUE (VALUE a number), not 'seconds=soon'")):
        with pytest.raises(SystemExit) as e:  # argparse's usage error, before anything starts
            cli.parser().parse_args(["serve", "--grammar-budget", bad])
        assert e.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_constraint_that_leaves_no_token_ends_its_row_alone_with_stop(apps, engine, layout):
    """A complete choice with min_tokens left: only eos may follow, which min_tokens forbids (before:
    token 0 repeated to max_tokens, or a 500 when sampling); a plain request beside it as alone."""
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(post, apps[layout], prompt="The", guided_choice=["yes"], min_tokens=6, temperature=0.9,
                            seed=1, max_tokens=12)
        plain = pool.submit(post, apps[layout], prompt="The list", seed=2, temperature=0.9, max_tokens=12)
        stuck, plain = stuck.result()[0], plain.result()[0]
    assert stuck.status_code == 200, stuck.text
    assert stuck.json()["choices"][0]["text"] == "yes" and stuck.json()["choices"][0]["finish_reason"] == "stop"
    assert plain.json()["choices"][0]["text"] == alone(engine, "The list", 2, max_new_tokens=12, do_sample=True,
                                                       temperature=0.9)


def test_the_handle_says_why_a_constraint_stopped(apps):
    from ray import serve

    from deployments.schema import GenerateRequest

    out = serve.get_app_handle("budget-colocated-engine").generate.remote(GenerateRequest(prompt="The", settings={
        "structured_outputs": {"choice": ["yes"]}, "min_new_tokens": 6, "max_new_tokens": 12})).result()
    assert out.text == "yes" and out.finish_reason == "stop" and "only eos may follow" in out.error


# -- off the batch's thread (the engine, no Ray) -------------------------------------------------------
def slow_grammar(monkeypatch, seconds: float):
    """constraints.grammar (what every compile starts with) taking `seconds` longer; the names of the
    threads it ran on."""
    from generation.logits import constraints

    threads, original = [], constraints.grammar

    def slow(constraint):
        threads.append(threading.current_thread().name)
        time.sleep(seconds)  # a compile releases the GIL (llguidance's builds do, in Rust)
        return original(constraint)

    monkeypatch.setattr(constraints, "grammar", slow)
    return threads


def test_a_slow_compile_holds_neither_the_event_loop_nor_the_batching_loop(test_models, monkeypatch):
    """Before: the request's check compiled on the replica's event loop, which served no other
    stream meanwhile."""
    from deployments.schema import GenerateRequest
    from deployments.services.generator import TextGenerator

    generator = TextGenerator.from_model(test_models["llama-genai"], slots=4, threads=1)
    threads = slow_grammar(monkeypatch, 0.6)

    async def run():
        ticks, stop = [], asyncio.Event()

        async def tick():
            while not stop.is_set():
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.01)

        ticker = asyncio.ensure_future(tick())
        await asyncio.sleep(0.05)
        steps = generator.batcher.steps
        plain = [c async for c in generator.stream(GenerateRequest(prompt="The list", settings={"max_new_tokens": 12}))]
        constrained = asyncio.ensure_future(_collect(generator, GenerateRequest(
            prompt="The", settings={"structured_outputs": {"regex": "[a-c]{3}"}, "max_new_tokens": 8})))
        during = [c async for c in generator.stream(GenerateRequest(prompt="A class", settings={"max_new_tokens": 30}))]
        done = await constrained
        stop.set()
        await ticker
        return ticks, plain, during, done, steps

    try:
        ticks, plain, during, done, steps = asyncio.run(run())
    finally:
        generator.close()
    assert threads and all(t not in ("MainThread", "raymuter-batcher") for t in threads), threads
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.3  # the event loop went on through the 0.6 s compile
    assert re.fullmatch("[a-c]{3}", "".join(c.text for c in done))
    assert during[-1].finish_reason == "length" and len([i for c in during[:-1] for i in c.token_ids]) == 30


def test_a_compile_past_the_budgets_seconds_is_a_400_naming_the_field(test_models, monkeypatch):
    from deployments.errors import RequestError
    from deployments.schema import GenerateRequest
    from deployments.services.generator import TextGenerator

    generator = TextGenerator.from_model(test_models["llama-genai"], slots=2, threads=1,
                                         grammar_budget={"seconds": 0.2})
    slow_grammar(monkeypatch, 1.0)

    async def refused():
        started = time.perf_counter()
        with pytest.raises(RequestError) as e:
            await _collect(generator, GenerateRequest(prompt="The", settings={
                "structured_outputs": {"regex": "[a-c]{3}"}}))
        return e.value, time.perf_counter() - started  # the answer does not wait for the compile's end

    try:
        error, seconds = asyncio.run(refused())
    finally:
        generator.close()
    assert error.field == "settings.structured_outputs" and seconds < 0.9
    assert "took more than 0.2 s (over the grammar budget: grammar_budget.seconds is 0.2)" in str(error)


async def _collect(generator, request):
    return [c async for c in generator.stream(request)]


def test_the_engine_process_compiles_a_new_constraint_off_its_loop(test_models, monkeypatch):
    """The child's loop (engine_process._ForwardingBatcher, driven here in process over a pipe) gets
    a constraint its own process never compiled (the parent checked it in its): a worker thread
    compiles it while the loop steps the other row on. Before: the loop compiled it at admission."""
    import multiprocessing

    import generation
    from generation.engine import batching
    from generation.engine import process as engine_process
    from generation.engine.scheduler import Scheduler

    folder = test_models["llama-genai"]
    parent = generation.context(generation.load(folder, threads=1), max_new_tokens=8)
    checks = Scheduler(parent, 2, 64, state=False)
    plain = checks.job([5, 6, 7], 0, {"max_new_tokens": 40, "eos_token_id": []})
    constrained = checks.job([5, 6, 8], 0, {"structured_outputs": {"regex": "[a-c]{3}"}})  # compiled here only
    here, there = multiprocessing.Pipe()
    monkeypatch.setattr(engine_process._ForwardingBatcher, "conn", there)
    monkeypatch.setattr(engine_process._ForwardingBatcher, "requests", {})
    monkeypatch.setattr(engine_process._Forwarded, "outbox", [])
    monkeypatch.setattr(batching, "Request", engine_process._Forwarded)
    child = engine_process._ForwardingBatcher(generation.context(generation.load(folder, threads=1)), slots=2,
                                              capacity=64)
    threads = slow_grammar(monkeypatch, 0.6)
    try:
        here.send(("submit", 1, plain))
        here.send(("submit", 2, constrained))
        sent, tokens, ends = time.perf_counter(), {1: [], 2: []}, {}
        while len(ends) < 2 and time.perf_counter() - sent < 30:
            if not here.poll(1):
                continue
            for kind, rid, payload in here.recv()[0]:
                if kind == engine_process._TOKEN:
                    tokens[rid].append(time.perf_counter() - sent)
                elif kind == engine_process._END:
                    ends[rid] = payload
    finally:
        here.send(("close",))
        child._thread.join(timeout=10)
    assert threads and all(t.startswith("raymuter-grammar") for t in threads), threads
    assert ends[1].finish_reason == "length" and len(ends[1].tokens) == 40
    assert ends[2].finish_reason == "stop" and len(ends[2].tokens) >= 1
    assert sum(t < 0.5 for t in tokens[1]) >= 10  # the plain row stepped on while the other compiled
    assert min(tokens[2]) > 0.6  # the constrained row joined once its grammar was compiled
