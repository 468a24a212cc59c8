"""A Ray cluster of four nodes on this machine (ray.cluster_utils.Cluster): the fake-engine
application with two decoder replicas on two of the three worker nodes (one per node); streams
under way (8 running, 4 waiting for a slot) when a node holding a decoder replica is lost. Run by tests/deployments/nodes/test_multinode.py in a process of its own (a process
joins one Ray cluster, and the test session has its own); prints one JSON line of what it saw.

    python tests/deployments/nodes/multinode.py PORT
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

STREAMS = 12  # two replicas of 4 slots: 8 run, 4 wait for a slot
RUNNING = 8
TOKENS = 250  # 250 steps of 40 ms: 10 s a stream, so none ends before the kill on a loaded machine


def stream(url: str, prompt: str, started: dict, tokens: int = TOKENS, timeout: float = 60,
           ended: dict | None = None) -> dict:
    """One streamed completion of the fake app at `url`, as a client sees it: its text, finish
    reason, error event (or exception), status and `ended` (time.time() when its stream
    closed); `started[prompt]` is set at its first chunk, `ended[prompt]` when it closes."""
    import httpx

    body = dict(model="fake", prompt=prompt, max_tokens=tokens, stream=True)
    text, finish, error, status = [], None, None, None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as response:
            status = response.status_code
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"].get("message")
                    continue
                choice = event["choices"][0]
                text.append(choice["text"])
                finish = choice.get("finish_reason") or finish
                started.setdefault(prompt, time.time())
    except Exception as e:  # noqa: BLE001 - what a client sees, reported
        error = f"{type(e).__name__}: {e}"
    if ended is not None:
        ended[prompt] = time.time()
    return {"prompt": prompt, "text": "".join(text), "finish": finish, "error": error, "status": status,
            "ended": time.time()}


def replica_nodes(ray, app: str, deployment: str) -> dict[str, str]:
    """Replica actor name -> the node id it runs on (from the GCS: no dashboard here)."""
    from ray._private import state

    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")}
    out = {}
    for info in state.actors().values():
        if info.get("Name") in names and info.get("State") == "ALIVE":
            out[info["Name"]] = info["Address"]["NodeID"]
    return out


def kill_node(cluster, node) -> int:
    """SIGKILL the node's raylet and every process under it (its workers: the replicas), then
    remove it from the cluster; the number of processes killed."""
    import psutil

    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    doomed = raylet.children(recursive=True) + [raylet]
    for process in doomed:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    cluster.remove_node(node, allow_graceful=False)
    return len(doomed)


def main(port: int) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from deployments.app import Decoder, Ingress, AppConfig
    from deployments.fake import fake_tokens

    # the head holds Serve's controller, proxy and the ingress ("front"); each worker one decoder
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"front": 1},
                                                            "include_dashboard": False,
                                                            "object_store_memory": 80 * 2**20})
    workers = [cluster.add_node(num_cpus=1, resources={"decoder": 1}, object_store_memory=80 * 2**20)
               for _ in range(3)]
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    # one HTTP proxy, on the head: on one machine every node's proxy would share the port
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    cfg = AppConfig(engine="fake", name="fake", slots=4, step_seconds=0.04, gpu="no")
    config = cfg.model_dump()
    # one decoder replica per worker node (the head keeps the ingress): spread by the
    # placement rule a fleet uses, max_replicas_per_node
    decoder = Decoder.options(num_replicas=2, max_replicas_per_node=1,
                              ray_actor_options={"num_cpus": 0.5, "resources": {"decoder": 0.01}})
    ingress = Ingress.options(ray_actor_options={"num_cpus": 0.25, "resources": {"front": 0.01}})
    serve.run(ingress.bind(decoder.bind(config), config),
              name="multi", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    nodes_before = replica_nodes(ray, "multi", "Decoder")
    worker_ids = {w.node_id: i for i, w in enumerate(workers)}
    report = {"decoder_nodes": sorted(worker_ids.get(n, -1) for n in nodes_before.values())}

    prompts, started, ended = [f"{chr(97 + i)} stream" for i in range(STREAMS)], {}, {}  # no shared prefix: spread
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        # the first RUNNING one at a time, each sent once the one before has started: the router
        # then knows each replica's load and fills both replicas' slots (12 sent at once could go
        # 9/3 on stale queue lengths: 7 running, and the kill came after most had ended)
        futures, deadline = [], time.time() + 30
        for p in prompts[:RUNNING]:
            futures.append(pool.submit(stream, url, p, started, ended=ended))
            while p not in started and p not in ended and time.time() < deadline:
                time.sleep(0.02)
        futures += [pool.submit(stream, url, p, started, ended=ended) for p in prompts[RUNNING:]]
        # every slot running at once (a slow start can let the first streams end before the last
        # replica starts: their slots then go to the waiting ones)
        while len(set(started) - set(ended)) < RUNNING and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the 4 others reach their replicas' queues
        at_kill = set(started)
        kill_at = time.time()
        victim = next(w for w in workers if w.node_id in nodes_before.values())
        lost = kill_node(cluster, victim)  # the node is gone, as a lost machine: every process on it
        removed_at = time.time()
        results = [f.result() for f in futures]
    # a loaded machine may take longer than a stream to start the first 8: count what ran at the
    # kill (started, not ended) apart from what had ended (its slot then went to a waiting one)
    ended_before = {r["prompt"] for r in results if r["prompt"] in at_kill and r["ended"] < kill_at}
    report["ended_before_kill"] = len(ended_before)
    report["under_way"] = len(at_kill - ended_before)
    report["removed_after_s"] = round(time.time() - removed_at, 2)
    report["killed_processes"] = lost
    whole = 0
    for r in results:
        want = "".join(chr(t) for t in fake_tokens([ord(c) for c in r["prompt"]], 0, {"max_new_tokens": TOKENS}))
        r["whole"] = r["text"] == want and r["finish"] == "length"
        whole += r["whole"]
    report["whole"] = whole
    queued = [r for r in results if r["prompt"] not in at_kill]
    report["queued"] = len(queued)
    report["queued_whole"] = sum(r["whole"] for r in queued)  # moved to the surviving replica
    report["failed_clearly"] = sum(1 for r in results if not r["whole"] and r["error"])
    report["silent"] = sum(1 for r in results if not r["whole"] and not r["error"])
    report["errors"] = sorted({r["error"][:200] for r in results if r["error"]})
    # afterwards: new requests are served (by the surviving replica, then by the one Serve restarts)
    after = [stream(url, f"after {i}", {}, tokens=60) for i in range(4)]
    report["after_whole"] = sum(1 for r in after if r["finish"] == "length" and not r["error"])
    print(json.dumps(report), flush=True)
    serve.shutdown()
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]))
