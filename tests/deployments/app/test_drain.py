"""Drains: a redeploy under load cuts no stream.

Invariant: while streams run, the application is redeployed with other arguments (every
replica, ingress and decoder, is replaced); each stream that had started gets its whole answer
(the text the fake engine gives, then [DONE]), the replicas that held them finish them before
they stop (graceful_shutdown_timeout_s = DRAIN_SECONDS; the streams outlast Serve's default
20 s), and a request after the redeploy is served by the new replicas.
"""

from __future__ import annotations

import concurrent.futures
import time

import httpx
from multinode import stream  # tests/deployments/nodes/multinode.py: a client's view of one stream

from deployments.fake import fake_tokens

STREAMS = 6
TOKENS = 500  # 500 steps of 50 ms: each stream lasts 25 s, past Serve's default drain (20 s)


def _replica_actors(app: str) -> set[str]:
    """The named actors of the app's replicas (Serve names each SERVE_REPLICA::app#Deployment#id)."""
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {n for n in names if n.startswith(f"SERVE_REPLICA::{app}#")}


def test_a_redeploy_under_load_cuts_no_stream(serve_apps):
    from ray import serve

    from deployments.app import DRAIN_SECONDS, build

    assert DRAIN_SECONDS >= 60
    args = dict(engine="fake", name="fake", slots=4, step_seconds=0.05, gpu="no")
    serve.run(build(args), name="drain", route_prefix="/drain")
    url = serve_apps.url + "/drain"
    try:
        before = _replica_actors("drain")
        assert len(before) == 3, before  # the ingress, the decoder and the records (responses, files, batches)
        prompts, started = [f"drain stream {i}" for i in range(STREAMS)], {}
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            futures = [pool.submit(stream, url, p, started, TOKENS, 120) for p in prompts]
            deadline = time.time() + 30
            while len(started) < STREAMS and time.time() < deadline:
                time.sleep(0.02)
            assert len(started) == STREAMS  # every stream is under way before the redeploy
            serve.run(build({**args, "step_seconds": 0.02}), name="drain", route_prefix="/drain")
            results = [f.result() for f in futures]
        for prompt, got in zip(prompts, results):
            want = "".join(chr(t) for t in fake_tokens([ord(c) for c in prompt], 0, {"max_new_tokens": TOKENS}))
            assert (got["status"], got["text"], got["finish"], got["error"]) == (200, want, "length", None), prompt
        after = httpx.post(url + "/v1/completions", json=dict(model="fake", prompt="after", max_tokens=5), timeout=30)
        assert after.status_code == 200 and after.json()["choices"][0]["text"] == "retfa"
        assert not _replica_actors("drain") & before  # the replicas the streams ran on were all replaced
    finally:
        serve.delete("drain", _blocking=False)
