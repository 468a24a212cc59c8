"""Prefix caching through the server: on by default (AppConfig.prefix_cache_bytes).

Invariants: requests that share a prompt prefix give what the engine gives alone (no cache), and
the decoder's /metrics count the prompt tokens looked up and found (vLLM's prefix_cache_queries
and prefix_cache_hits) and the bytes the store holds.
"""

from __future__ import annotations

import httpx

from test_serve import alone, metric

SHARED = "The list type is a mutable sequence, and the tuple type is an immutable one. " * 2


def test_shared_prefixes_are_found_and_change_nothing(serve_apps, engine):
    text = httpx.get(serve_apps.real + "/metrics", timeout=10).text
    queries = metric(text, "raymuter:prefix_cache_queries_total")
    hits = metric(text, "raymuter:prefix_cache_hits_total")
    outs = []
    for question in ("What is a list?", "What is a tuple?", "What is a list?"):
        body = dict(model="tiny", prompt=SHARED + question, max_tokens=8, seed=1, temperature=0.8)
        outs.append(httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
    for question, out in zip(("What is a list?", "What is a tuple?", "What is a list?"), outs):
        assert out == alone(engine, SHARED + question, 1, max_new_tokens=8, do_sample=True, temperature=0.8)
    text = httpx.get(serve_apps.real + "/metrics", timeout=10).text
    model, tokenizer = engine
    shared_blocks = len(tokenizer.encode(SHARED).ids) // 16 * 16
    assert metric(text, "raymuter:prefix_cache_queries_total") - queries >= 3 * shared_blocks
    assert metric(text, "raymuter:prefix_cache_hits_total") - hits >= 2 * shared_blocks - 16  # the 2nd and 3rd
    assert metric(text, "raymuter:prefix_cache_bytes") > 0
