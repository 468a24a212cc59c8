"""A schema fuzz of the served OpenAPI document (schemathesis): whatever a client sends that the
document allows (positive) or nearly allows (negative), the server answers without a 5xx and
within a time limit, its answers match the document's response schemas, and every JSON answer
and streamed event is JSON a strict parser reads (no -Infinity, no NaN); sampled requests asking
for log-probabilities (drawn top_k, top_p, min_p: the filters that leave alternatives at -inf)
likewise. Bounded examples per route and mode, so it fits the CI budget; `bench/fuzz.py` runs a
longer fuzz (every phase, every check) against any running server.

The real app (the tiny llama-genai model, 4 slots) takes the JSON routes; /v1/embeddings goes to
the embedding app (the tiny Qwen2's feature-extraction export). The cases come from
schemathesis' strategies and run under hypothesis directly: its pytest plugin reads node
internals that pytest 9.2 no longer has.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from app_routes import events, strict_json
from hypothesis import HealthCheck, given, settings, strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

EXAMPLES = 25  # per route, method and mode
TIMEOUT = 30  # seconds an answer may take


@pytest.fixture(scope="module")
def operations(serve_apps):
    document = httpx.get(serve_apps.real + "/openapi.json", timeout=30).json()
    # the one model this server serves, so that valid bodies get past the model check and run
    for name in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest", "ResponseRequest"):
        document["components"]["schemas"][name]["properties"]["model"] = {"const": "tiny"}
    # embeddings go to the session's embedding app (the real app refuses them)
    document["components"]["schemas"]["EmbeddingRequest"]["properties"]["model"] = {"const": "embed"}
    # /tokenize takes exactly one of prompt and messages, which the document cannot say: with both
    # optional, few drawn bodies are valid (3 of 25 on one run, none on another)
    document["components"]["schemas"]["TokenizeRequest"].setdefault("required", []).append("prompt")
    schema = schemathesis.openapi.from_dict(document)
    found = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path.startswith("/v1/audio"):
            continue  # multipart: the speech app's, fuzzed by bench/fuzz.py
        found[f"{operation.method.upper()} {operation.path}"] = operation
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize", "POST /v1/embeddings",
            "GET /v1/models", "GET /v1/models/{model_id}", "GET /health", "GET /version", "GET /metrics",
            "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content",
            "DELETE /v1/files/{file_id}", "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
            "POST /v1/batches/{batch_id}/cancel"} <= set(found)
    return found


# (route, mode); a path parameter is any text, so that route has no negative cases to draw
CASES = [(route, mode) for route in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                                     "POST /detokenize", "POST /v1/embeddings", "POST /v1/responses", "POST /v1/files",
                                     "POST /v1/batches", "GET /v1/files", "GET /v1/batches")
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
CASES += [(route, GenerationMode.POSITIVE) for route in (
    "GET /v1/models/{model_id}", "GET /v1/responses/{response_id}", "GET /v1/responses/{response_id}/input_items",
    "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content", "DELETE /v1/files/{file_id}",
    "GET /v1/batches/{batch_id}", "POST /v1/batches/{batch_id}/cancel")]
# routes whose every case names an id (any text: unknown), so none is answered 200
NAMING_AN_ID = {"POST /v1/batches", "DELETE /v1/files/{file_id}", "POST /v1/batches/{batch_id}/cancel"}


def strict_json_bodies(ctx, response, case):
    """A JSON answer, and each event of a stream, reads with a strict JSON parser."""
    kind = (response.headers.get("content-type") or [""])[0]
    if "text/event-stream" in kind:
        events(response.text)
    elif "json" in kind:
        strict_json(response.text)
    return True


@pytest.mark.parametrize("route, mode", CASES, ids=[f"{r}-{m.value}" for r, m in CASES])
def test_no_request_near_the_document_gets_a_server_error(operations, serve_apps, route, mode):
    operation = operations[route]
    seen = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=serve_apps.embed if route == "POST /v1/embeddings" else serve_apps.real,
                             timeout=TIMEOUT)
        seen.append(response.status_code)
        case.validate_response(response, checks=[not_a_server_error, response_schema_conformance,
                                                 content_type_conformance, strict_json_bodies])

    check()
    assert seen and all(status < 500 for status in seen)
    if mode == GenerationMode.POSITIVE and not route.startswith("GET /v1/") and route not in NAMING_AN_ID:
        assert any(status == 200 for status in seen) or route == "POST /detokenize", seen


SAMPLING = st.fixed_dictionaries({"temperature": st.sampled_from([0.3, 1.0, 1.5]), "seed": st.integers(0, 2**31)},
                                 optional={"top_k": st.sampled_from([1, 3, 40]), "top_p": st.sampled_from([0.1, 0.9]),
                                           "min_p": st.sampled_from([0.05, 0.3])})


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_sampled_requests_with_log_probabilities_answer_strict_json(serve_apps, route):
    @given(sampling=SAMPLING, top=st.integers(0, 5), budget=st.integers(1, 8), stream=st.booleans())
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(sampling, top, budget, stream):
        body = {"model": "tiny", "stream": stream, **sampling}
        if route == "/v1/chat/completions":
            body.update(messages=[{"role": "user", "content": "Hi"}], max_tokens=budget, logprobs=True,
                        top_logprobs=top)
        elif route == "/v1/completions":
            body.update(prompt="Once upon", max_tokens=budget, logprobs=top, echo=top % 2 == 1)
        else:
            body.update(input="Hi", max_output_tokens=budget, top_logprobs=top)
        response = httpx.post(serve_apps.real + route, json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text[:300]
        answers = events(response.text) if stream else [strict_json(response.text)]
        assert answers

    check()
