"""Log-probabilities are JSON, whatever the sampling filters removed: a top_k or top_p sample's
alternatives past what the filter kept have log-probability -inf, which no JSON parser reads
(the whole answer was a 500, the stream sent `-Infinity`). Every answer of chat, completions
(echo's prompt log-probabilities too) and responses, whole and streamed, reads with a strict
JSON parser; a filtered alternative is left out, and no value is below vLLM's floor (-9999.0).

The tiny llama model (vocabulary 1000) behind the app's routes in this process."""

from __future__ import annotations

import asyncio

import pytest
from app_routes import app_routes, events, strict_json

FLOOR = -9999.0
FILTERS = [dict(top_k=3), dict(top_p=0.3)]  # the engine's two ways of cutting the candidates


@pytest.fixture(scope="module")
def client(test_models):
    with app_routes({"model": str(test_models["llama-optimum"]), "name": "tiny", "slots": 4, "threads": 1}) as (
            client, _):
        yield client


def bodies(route: str, sampling: dict, seed: int) -> list[dict]:
    common = dict(model="tiny", temperature=1.0, seed=seed, **sampling)
    if route == "/v1/chat/completions":
        body = dict(messages=[{"role": "user", "content": "hello there"}], max_tokens=6, logprobs=True,
                    top_logprobs=5)
    elif route == "/v1/completions":
        body = dict(prompt="hello there", max_tokens=6, logprobs=5, echo=True)
    else:
        body = dict(input="hello there", max_output_tokens=6, top_logprobs=5)
    return [{**common, **body}, {**common, **body, "stream": True}]


def steps(answer) -> list[list[float]]:
    """Each step's alternatives' log-probabilities, in every answer shape: chat's and responses'
    top_logprobs [{token, logprob, bytes}] a token, completions' [{token: logprob}, ...] (None for
    the first prompt token)."""
    out = []
    if isinstance(answer, list):
        for item in answer:
            out += steps(item)
    elif isinstance(answer, dict):
        for key, value in answer.items():
            if key != "top_logprobs" or not isinstance(value, list):
                out += steps(value)
            elif all(isinstance(v, dict) and "logprob" in v for v in value):
                out.append([v["logprob"] for v in value])
            else:
                out += [list(v.values()) for v in value if v is not None]
    return out


def own(answer) -> list[float]:
    """The chosen tokens' log-probabilities: chat's and responses' `logprob`, completions' `token_logprobs`."""
    if isinstance(answer, list):
        return [v for item in answer for v in own(item)]
    if not isinstance(answer, dict):
        return []
    out = [answer["logprob"]] if isinstance(answer.get("logprob"), float) else []
    out += [v for v in answer.get("token_logprobs") or [] if v is not None]
    return out + [v for key, value in answer.items() if key != "top_logprobs" for v in own(value)]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
@pytest.mark.parametrize("sampling", FILTERS, ids=["top_k", "top_p"])
def test_every_answer_with_log_probabilities_is_strict_json(client, route, sampling):
    async def go():
        async with client() as http:
            for seed in (0, 1):
                for body in bodies(route, sampling, seed):
                    response = await http.post(route, json=body)
                    assert response.status_code == 200, response.text[:300]
                    answers = events(response.text) if body.get("stream") else [strict_json(response.text)]
                    alternatives = steps(answers)
                    assert alternatives and all(len(step) <= 5 for step in alternatives)
                    assert any(len(step) < 5 for step in alternatives), "no step had its alternatives filtered"
                    values = own(answers) + [v for step in alternatives for v in step]
                    assert own(answers) and all(FLOOR <= v <= 0 for v in values), values

    asyncio.run(go())
