"""Prefix caching through the server: on by default (AppConfig.prefix_cache_bytes).

Invariants: requests that share a prompt prefix give what the engine gives alone (no cache), and
the decoder's /metrics count the prompt tokens looked up and found (vLLM's prefix_cache_queries
and prefix_cache_hits) and the bytes the store holds; each response's usage says how many of its
prompt tokens the cache held (prompt_tokens_details.cached_tokens, as OpenAI's).
"""

from __future__ import annotations

import json

import httpx
import numpy as np

import generation

from test_serve import alone, metric

SHARED = "The list type is a mutable sequence, and the tuple type is an immutable one. " * 2


def test_shared_prefixes_are_found_and_change_nothing(serve_apps, engine):
    text = httpx.get(serve_apps.real + "/metrics", timeout=10).text
    queries = metric(text, "raymuter:prefix_cache_queries_total")
    hits = metric(text, "raymuter:prefix_cache_hits_total")
    outs, usages = [], []
    for question in ("What is a list?", "What is a tuple?", "What is a list?"):
        body = dict(model="tiny", prompt=SHARED + question, max_tokens=8, seed=1, temperature=0.8)
        out = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=60).json()
        outs.append(out["choices"][0]["text"])
        usages.append(out["usage"])
    for question, out in zip(("What is a list?", "What is a tuple?", "What is a list?"), outs):
        assert out == alone(engine, SHARED + question, 1, max_new_tokens=8, do_sample=True, temperature=0.8)
    text = httpx.get(serve_apps.real + "/metrics", timeout=10).text
    model, tokenizer = engine
    shared_blocks = len(tokenizer.encode(SHARED).ids) // 16 * 16
    assert metric(text, "raymuter:prefix_cache_queries_total") - queries >= 3 * shared_blocks
    assert metric(text, "raymuter:prefix_cache_hits_total") - hits >= 2 * shared_blocks - 16  # the 2nd and 3rd
    assert metric(text, "raymuter:prefix_cache_bytes") > 0
    # each response says how much of its prompt the cache held (OpenAI's usage.prompt_tokens_details)
    found = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert all(c % 16 == 0 and c < u["prompt_tokens"] for c, u in zip(found, usages))
    assert found[1] >= shared_blocks - 16 and found[2] >= shared_blocks
    assert metric(text, "raymuter:prefix_cache_hits_total") - hits == sum(found)


def test_a_stream_reports_its_cached_tokens_in_its_usage(serve_apps):
    body = dict(model="tiny", prompt=SHARED + "Which one?", max_tokens=4, stream=True,
                stream_options={"include_usage": True})
    for _ in range(2):
        with httpx.stream("POST", serve_apps.real + "/v1/completions", json=body, timeout=60) as response:
            events = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    usage = json.loads(events[-2])["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_max_tokens_0_warms_the_cache_and_scores_the_prompt(serve_apps, engine):
    """A prompt-only pass (max_tokens 0): no completion, the prompt's log-probabilities with echo
    and logprobs (as the engine's), and a later request that starts with the prompt finds it."""
    from generation.logits.prompt_logprobs import prompt_logprobs

    model, tokenizer = engine
    system = "Warm me: the dict type maps hashable keys to values, and the set type holds keys. " * 2
    warm = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt=system, max_tokens=0,
                                                                      echo=True, logprobs=0), timeout=60).json()
    (choice,) = warm["choices"]
    assert choice["text"] == system and choice["finish_reason"] == "length"
    assert warm["usage"]["completion_tokens"] == 0
    ids = tokenizer.encode(system).ids
    expected = prompt_logprobs(generation.context(model), ids).logprob
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:], expected, atol=1e-4)
    chat = httpx.post(serve_apps.real + "/v1/chat/completions", timeout=60, json=dict(
        model="tiny", messages=[{"role": "user", "content": system}], max_completion_tokens=0)).json()
    assert chat["choices"][0]["message"]["content"] == "" and chat["usage"]["completion_tokens"] == 0
    later = httpx.post(serve_apps.real + "/v1/completions", json=dict(model="tiny", prompt=system + "And a list?",
                                                                       max_tokens=4), timeout=60).json()
    assert later["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) // 16 * 16 - 16
