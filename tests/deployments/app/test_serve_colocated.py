"""The colocated server (AppConfig.colocate, `raymuter serve --colocate`): the HTTP routes and the
decoder in one Server deployment, answering as the two-deployment application does (the same
engine outputs, streams, handles, metrics, errors, cancellation), and an encoder-decoder model's
Encoder still a deployment of its own. Apps on the session's Ray (conftest.serve_apps)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from deployments.local_handle import LocalHandle
from test_serve import alone, check_abandoned_whole_answers_free_slots, check_client_gone_frees_slots, check_handles, metric, sse

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def colocated(serve_apps):
    from ray import serve

    from conftest import ServeApps
    from deployments.app import build

    serve.run(build({**ServeApps.REAL, "model": str(serve_apps.real_model), "colocate": True}),
              name="colocated", route_prefix="/colocated")
    serve.run(build({**ServeApps.REAL, "model": str(serve_apps.real_model), "colocate": True, "engine_process": True}),
              name="colocated-engine", route_prefix="/colocated-engine")
    serve.run(build({**ServeApps.FAKE, "colocate": True}), name="colocated-fake", route_prefix="/colocated-fake")
    serve.run(build(dict(model=str(serve_apps.s2s["marian-optimum"]), name="marian", slots=4, threads=1,
                         settings={"max_new_tokens": 12}, colocate=True)),
              name="colocated-translate", route_prefix="/colocated-translate")
    urls = {name: serve_apps.url + "/" + name
            for name in ("colocated", "colocated-engine", "colocated-fake", "colocated-translate")}
    yield urls
    for name in urls:
        serve.delete(name, _blocking=False)


def test_the_application_is_one_server_deployment_and_an_encoder_where_the_model_has_one(colocated):
    from ray import serve

    status = serve.status().applications
    assert set(status["colocated"].deployments) == {"Server", "Records"}  # and the shared records
    assert set(status["colocated-translate"].deployments) == {"Server", "Encoder", "Records"}


@pytest.mark.parametrize("app", ["colocated", "colocated-engine"])  # the batching loop in the replica, or its child
def test_completions_whole_and_streamed_equal_the_engine_alone(colocated, serve_apps, engine, app):
    body = dict(model="tiny", prompt="The list", max_tokens=12, seed=3, temperature=0.8, top_k=20)
    expected = alone(engine, "The list", 3, max_new_tokens=12, do_sample=True, temperature=0.8, top_k=20)
    with httpx.Client(timeout=60) as client:
        whole = client.post(colocated[app] + "/v1/completions", json=body).json()
        separate = client.post(serve_apps.real + "/v1/completions", json=body).json()
        events = sse(client.post(colocated[app] + "/v1/completions", json={**body, "stream": True}).text)
    assert whole["choices"][0]["text"] == expected == separate["choices"][0]["text"]
    assert "".join(e["choices"][0]["text"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


@pytest.mark.parametrize("app", ["colocated", "colocated-engine"])
def test_concurrent_chat_requests_each_equal_the_two_deployment_apps(colocated, serve_apps, app):
    bodies = [dict(model="tiny", messages=[{"role": "user", "content": f"Tell me about {w}"}], max_tokens=8,
                   seed=i, temperature=0.9, logprobs=True, top_logprobs=2) for i, w in enumerate(["lists", "sets", "x"] * 4)]

    async def run(url):
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/v1/chat/completions", json=b) for b in bodies))

    ours, theirs = asyncio.run(run(colocated[app])), asyncio.run(run(serve_apps.real))
    for a, b in zip(ours, theirs):
        assert a.status_code == b.status_code == 200
        ca, cb = a.json()["choices"][0], b.json()["choices"][0]
        assert ca["message"] == cb["message"] and ca["logprobs"] == cb["logprobs"]


def test_python_handles_typed_and_streaming(colocated):
    check_handles("colocated-fake")


def test_bad_requests_get_their_4xx_naming_the_field(colocated):
    url = colocated["colocated-fake"] + "/v1/completions"
    with httpx.Client(timeout=30) as client:
        for body, status, param in [(dict(model="nope", prompt="a"), 404, "model"),
                                    (dict(model="fake", prompt="a", temperature=3), 400, "temperature"),
                                    (dict(model="fake", prompt="a", max_tokens=10**6), 400, "max_tokens")]:
            out = client.post(url, json=body)
            assert out.status_code == status and out.json()["error"]["param"] == param, out.text
        streamed = client.post(url, json=dict(model="fake", prompt="a", max_tokens=-1, stream=True))
        assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "max_tokens"


def test_a_client_that_goes_away_frees_its_slot(colocated):
    assert check_client_gone_frees_slots(colocated["colocated-fake"])["choices"][0]["text"] == "ko"
    check_abandoned_whole_answers_free_slots(colocated["colocated-fake"])


def test_metrics_has_the_routes_and_the_decoders(colocated):
    url = colocated["colocated-fake"]
    with httpx.Client(timeout=30) as client:
        before = client.get(url + "/metrics").text
        for _ in range(3):
            sse(client.post(url + "/v1/completions", json=dict(model="fake", prompt="abc", max_tokens=4, stream=True)).text)
        after = client.get(url + "/metrics").text
    assert metric(after, "raymuter:time_to_first_token_seconds_count") - \
        metric(before, "raymuter:time_to_first_token_seconds_count") == 3
    assert "raymuter:http_requests_total" in after and "decoder metrics unavailable" not in after


def test_an_encoder_decoder_model_translates_as_the_two_deployment_app(colocated, serve_apps):
    body = dict(model="marian", prompt="the cat sat on the mat", max_tokens=10)
    ours = httpx.post(colocated["colocated-translate"] + "/v1/completions", json=body, timeout=60).json()
    theirs = httpx.post(serve_apps.translate + "/v1/completions", json=body, timeout=60).json()
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"] and ours["usage"] == theirs["usage"]


def test_autoscaling_the_ingress_of_a_colocated_app_is_refused():
    from deployments.app import AppConfig, application

    with pytest.raises(ValueError, match="autoscaling.decoder, not autoscaling.ingress"):
        application(AppConfig(engine="fake", colocate=True,
                              autoscaling={"ingress": {"min_replicas": 1, "max_replicas": 2}}), "text")


# -- LocalHandle: Serve's handle calls on an object in this process ----------------------------
class Target:
    def __init__(self):
        self.closed, self.cancelled = [], []

    def card(self):
        return "card"

    async def generate(self, x):
        try:
            await asyncio.sleep(x)
            return x
        except asyncio.CancelledError:
            self.cancelled.append(x)
            raise

    async def stream(self, n):
        try:
            for i in range(n):
                await asyncio.sleep(0)
                yield i
        finally:
            self.closed.append(n)


def test_local_handle_calls_cancels_and_closes_as_serve_handles_do():
    async def run():
        target = Target()
        handle = LocalHandle(target)
        assert await handle.card.remote() == "card" and await handle.generate.remote(0) == 0
        slow = handle.generate.remote(30)
        await asyncio.sleep(0.01)
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        assert [i async for i in handle.options(stream=True).stream.remote(3)] == [0, 1, 2]
        stream = handle.options(stream=True).stream.remote(100)
        assert [await stream.__anext__(), await stream.__anext__()] == [0, 1]
        stream.cancel()  # a client gone mid-stream: the generator's cleanup runs
        await asyncio.sleep(0.01)
        return target

    target = asyncio.run(run())
    assert target.cancelled == [30] and target.closed == [3, 100]


def test_a_client_gone_frees_the_engine_processs_slot(colocated):
    """The slot count the metrics give is the child's (its last step message); the cancel itself
    reaching the child: test_engine_process."""
    answer = check_client_gone_frees_slots(colocated["colocated-engine"], "tiny", streams=1, prompt="The list",
                                           max_tokens=200, ignore_eos=True)
    assert answer["usage"]["completion_tokens"] == 2
