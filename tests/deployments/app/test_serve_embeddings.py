"""/v1/embeddings and the handle's embed, served by a decoder replica that holds an embedding
model (the session's `embed` app: the tiny Qwen2's feature-extraction export, last token,
normalized).

Invariants: the vectors are the engine's for the same inputs (texts or token ids, one or a
list), in order, as floats or as OpenAI's base64 (float32 little-endian), `dimensions` the
first ones normalized again, usage the tokens read; the openai client reads them unchanged; bad
input is a 400 naming its field; an embedding model refuses generation and a generation model
refuses embeddings, each naming `model`.
"""

from __future__ import annotations

import base64
import struct

import httpx
import numpy as np
import pytest

from deployments.schema import EmbedRequest

TEXTS = ["hello world", "the tuple type is an immutable sequence", "a"]


@pytest.fixture(scope="module")
def reference(serve_apps):
    from generation.core.embed import embed, load_embedder
    from generation.text.tokenizer import model_tokenizer

    embedder = load_embedder(serve_apps.embedding_models["qwen2-embed"], threads=1)
    tokenizer = model_tokenizer(embedder)
    return lambda texts, dimensions=None: embed(embedder, [tokenizer.encode(t).ids for t in texts], dimensions)


def post(serve_apps, body, app="embed", model="embed"):
    return httpx.post(getattr(serve_apps, app) + "/v1/embeddings", json={"model": model, **body}, timeout=60)


def test_texts_give_the_engines_vectors_in_order_as_floats_or_base64(serve_apps, reference):
    out = post(serve_apps, {"input": TEXTS})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["object"] == "list" and body["model"] == "embed" and [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["embedding"] for d in body["data"]], reference(TEXTS), atol=1e-5)
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > len(TEXTS)
    packed = post(serve_apps, {"input": TEXTS[1], "encoding_format": "base64", "dimensions": 16}).json()
    raw = base64.b64decode(packed["data"][0]["embedding"])
    vector = struct.unpack(f"<{len(raw) // 4}f", raw)
    assert len(vector) == 16
    np.testing.assert_allclose(vector, reference([TEXTS[1]], 16)[0], atol=1e-5)
    assert abs(np.linalg.norm(vector) - 1) < 1e-5


def test_token_ids_and_the_openai_client(serve_apps, reference):
    import openai

    ids = [[5, 6, 7, 8], [9, 10]]
    one = post(serve_apps, {"input": ids[0]}).json()
    both = post(serve_apps, {"input": ids}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], both["data"][0]["embedding"], atol=1e-5)
    client = openai.OpenAI(base_url=serve_apps.embed + "/v1", api_key="none")
    got = client.embeddings.create(model="embed", input=TEXTS)  # the client asks base64 and decodes it
    np.testing.assert_allclose([d.embedding for d in got.data], reference(TEXTS), atol=1e-5)


def test_the_handle_api(serve_apps, reference):
    from ray import serve

    serve_apps.app("embed")
    handle = serve.get_app_handle("embed")
    out = handle.embed.remote(EmbedRequest(inputs=TEXTS[:2], dimensions=8)).result(timeout_s=60)
    np.testing.assert_allclose(out.embeddings, reference(TEXTS[:2], 8), atol=1e-5)
    refused = handle.embed.remote({"inputs": [[10**6]]}).result(timeout_s=60)
    assert refused.status == 400 and refused.field == "input.0" and "not a token id" in refused.error


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a"], "dimensions": 0}, "dimensions"),
    ({"input": ["a"], "dimensions": 100000}, "dimensions"),
    ({"input": ["a"], "encoding_format": "int8"}, "encoding_format"),
    ({"input": [[5, 10**6]]}, "input.0"),
    ({"input": "a", "extra": 1}, "extra"),
])
def test_bad_input_is_a_400_naming_its_field(serve_apps, body, param):
    out = post(serve_apps, body)
    assert out.status_code == 400, out.text
    assert out.json()["error"]["param"] == param, out.json()


def test_each_kind_of_model_refuses_the_others_route(serve_apps):
    out = post(serve_apps, {"input": "a"}, app="real", model="tiny")
    assert out.status_code == 400 and out.json()["error"]["param"] == "model"
    assert "gives no embeddings" in out.json()["error"]["message"]
    out = httpx.post(serve_apps.embed + "/v1/completions", json={"model": "embed", "prompt": "a"}, timeout=60)
    assert out.status_code == 400 and out.json()["error"]["param"] == "model"
    assert "embedding model" in out.json()["error"]["message"]
    card = httpx.get(serve_apps.embed + "/v1/models", timeout=30).json()["data"][0]
    assert card["id"] == "embed"
