"""Prefix-aware routing to decoder replicas (deployments.services.routing, AppConfig.router).

Invariants: a prompt is named by a hash chain over its text's blocks, a conversation extended by a
message keeps the chain of the shorter one; a request goes to the replica that got its deepest
known block, unless that covers too little of it or that replica's queue is too much longer
than the shortest, and a prefix never seen goes to the least loaded replica, the one holding the
fewest blocks first. With 2 decoder replicas on the session's Ray, every request after the first
of its prefix finds the prefix in its replica's cache (random routing would miss half of them).
"""

from __future__ import annotations

import pytest

from deployments.schema import GenerateRequest
from deployments.services.routing import block_chain, prompt_text, ranked


def chat(*contents, tools=None):
    return GenerateRequest(messages=[dict(role="user" if i % 2 == 0 else "assistant", content=c)
                                     for i, c in enumerate(contents)], tools=tools)


def test_a_longer_conversation_extends_the_chain_of_a_shorter_one():
    short, longer = chat("x" * 150), chat("x" * 150, "y" * 100, "z" * 30)
    a, b = block_chain(prompt_text(short), 64, 256), block_chain(prompt_text(longer), 64, 256)
    assert len(a) == 2 and len(b) == 4 and b[:2] == a
    assert block_chain(prompt_text(chat("w" + "x" * 150)), 64, 256)[0] != a[0]  # a different start: a new chain
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert block_chain(prompt_text(chat("x" * 150, tools=tools)), 64, 256)[0] != a[0]  # tools come first
    assert prompt_text(GenerateRequest(prompt=[1, 2, 3])) == "1 2 3"
    assert prompt_text(GenerateRequest(prompt="abc")) == "abc" and prompt_text(object()) is None
    assert len(block_chain("a" * 10_000, 64, 8)) == 8  # the first blocks only
    # a LoRA adapter's rows are its own prefixes: the same text under another adapter is a new chain
    adapted = [block_chain(prompt_text(GenerateRequest(prompt="x" * 150, settings={"adapter": a})), 64, 256)
               for a in ("sql", "sql", "chat")]
    assert adapted[0] == adapted[1] and adapted[0][0] != adapted[2][0] != a[0]


CHAIN = [b"a", b"b", b"c", b"d"]


@pytest.mark.parametrize("owners, queues, held, expected, affine", [
    ({b"c": "r2"}, {}, {}, ["r2", "r1", "r3"], True),                              # the deepest known block's replica
    ({b"a": "r1", b"c": "r3"}, {}, {}, ["r3", "r1", "r2"], True),
    ({b"c": "gone"}, {}, {"r1": 5, "r2": 1, "r3": 3}, ["r2", "r3", "r1"], False),  # not a candidate: fewest blocks
    ({}, {"r1": 2, "r2": 0, "r3": 1}, {"r2": 9}, ["r2", "r3", "r1"], False),         # unseen: least loaded first
    ({b"c": "r1"}, {"r1": 20, "r2": 3, "r3": 4}, {}, ["r2", "r3", "r1"], False),   # its owner is far behind
    ({b"c": "r1"}, {"r1": 10, "r2": 3, "r3": 5}, {}, ["r1", "r2", "r3"], True),     # ... or not that far
    ({b"a": "r1"}, {}, {"r1": 1}, ["r2", "r3", "r1"], False),                      # 1 of 4 blocks: below match_rate
])
def test_a_request_goes_to_its_prefix_owner_or_the_least_loaded(owners, queues, held, expected, affine):
    order, found = ranked(CHAIN, owners, ["r1", "r2", "r3"], queues, held, match_rate=0.5, imbalanced_requests=8)
    assert (order, found) == (expected, affine)


def test_a_request_naming_a_replica_goes_there_unless_it_is_far_busier():
    """GenerateRequest.affinity (a stored response's next turn) beats the prefix's owner."""
    assert ranked(CHAIN, {b"d": "r1"}, ["r1", "r2", "r3"], {}, {}, 0.5, 8, affinity="r3") == (["r3", "r1", "r2"], True)
    busy = {"r3": 20, "r1": 0, "r2": 1}
    assert ranked(CHAIN, {b"d": "r1"}, ["r1", "r2", "r3"], busy, {}, 0.5, 8, affinity="r3")[0][0] == "r1"
    assert ranked(CHAIN, {}, ["r1", "r2"], {}, {}, 0.5, 8, affinity="gone")[0] == ["r1", "r2"]


SYSTEMS = [f"{name}: you are an assistant. " + "Answer briefly and cite the docs. " * 3
           for name in ("Alpha", "Bravo", "Charlie")]  # nothing shared: each prefix's first request finds nothing


@pytest.fixture(scope="module")
def routed(serve_apps):
    """The tiny real app with 2 decoder replicas and the prefix router, through its handle (the
    two replicas only while it is built: a session app deployed later keeps its one)."""
    from ray import serve

    import deployments.app as app

    cfg = app.AppConfig(**{**serve_apps.REAL, "model": str(serve_apps.real_model)})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(app, "Decoder", app.Decoder.options(num_replicas=2))
        handle = serve.run(app.application(cfg, "text"), name="routed", route_prefix="/routed")
    yield handle
    serve.delete("routed", _blocking=False)


def test_with_two_decoder_replicas_every_repeat_of_a_prefix_finds_it_cached(routed, engine):
    _, tokenizer = engine
    cached, blocks = [], []
    for question in ("What is a list?", "What is a tuple?", "Why?"):
        for system in SYSTEMS:  # interleaved: consecutive requests never share a prefix
            out = routed.generate.remote(GenerateRequest(prompt=system + question, settings={"max_new_tokens": 2})).result(timeout_s=60)
            assert out.finish_reason in ("stop", "length"), out.error
            cached.append(out.cached_tokens)
            blocks.append(len(tokenizer.encode(system).ids) // 16 * 16)
    assert cached[:3] == [0, 0, 0]  # each prefix's first request: nothing to find
    for found, shared in zip(cached[3:], blocks[3:]):
        assert found >= shared - 16, cached  # the replica that ran the prefix got it again


def test_the_calls_one_request_fans_out_each_reach_a_replica(serve_apps):
    """A list of prompts with n choices each: 6 decoder calls that share the ingress request's
    id; each must be given the replica chosen for it (Serve's own matching by that id found only
    the first, and the rest waited forever)."""
    import httpx

    body = dict(model="tiny", prompt=["abc", "def", "ghi"], n=2, max_tokens=3)
    out = httpx.post(serve_apps.real + "/v1/completions", json=body, timeout=30)
    assert out.status_code == 200, out.text
    assert sorted(c["index"] for c in out.json()["choices"]) == list(range(6))
