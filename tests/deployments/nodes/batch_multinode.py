"""`raymuter batch --address` on a Ray cluster of three nodes on this machine
(ray.cluster_utils.Cluster, one CPU each): two engine actors of the fake engine, on two nodes (an
actor takes a node's CPU), answer a batch file; the command is killed midway and run again against
the same cluster. Run by tests/deployments/nodes/test_multinode.py in a process of its own (a
process joins one Ray cluster, and the test session has its own); prints one JSON line of what it saw.

    python tests/deployments/nodes/batch_multinode.py FOLDER
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

LINES = 120
TOKENS = 60  # 60 steps of 5 ms a line (the fake engine's), 2 slots an actor: 9 s of steps in all


def batch_lines() -> list[dict]:
    return [{"custom_id": f"c{k}", "method": "POST", "url": "/v1/completions",
             "body": {"model": "fake", "prompt": f"line {k} says", "max_tokens": TOKENS}} for k in range(LINES)]


def main(folder: Path) -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    import ray
    from ray._private import state
    from ray.cluster_utils import Cluster

    from deployments.fake import fake_tokens

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                            "object_store_memory": 80 * 2**20})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    source, output = folder / "in.jsonl", folder / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in batch_lines()))
    command = [sys.executable, "-m", "deployments.cli", "batch", str(source), str(output), "--engine", "fake",
               "--name", "fake", "--slots", "2", "--replicas", "2",
               "--cpus-per-replica", "1", "--address", cluster.address, "--quiet"]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    report = {}
    first = subprocess.Popen(command, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and first.poll() is None and \
            (not output.exists() or len(output.read_text().splitlines()) < 8):
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    report["kept_after_kill"] = len(output.read_text().splitlines()) if output.exists() else 0
    again = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    report["rerun_rc"] = again.returncode
    report["rerun_stderr"] = again.stderr[-1500:]
    ray.init(address=cluster.address, log_to_driver=False)
    report["engine_actor_nodes"] = len({info["Address"]["NodeID"] for info in state.actors().values()
                                        if "MapWorker" in info.get("ActorClassName", "")})
    ids, equal = [], 0
    for text in output.read_text().splitlines():
        line = json.loads(text)
        ids.append(line["custom_id"])
        k = int(line["custom_id"][1:])
        want = "".join(chr(t) for t in fake_tokens([ord(c) for c in f"line {k} says"], 0,
                                                    {"max_new_tokens": TOKENS}))
        body = (line.get("response") or {}).get("body") or {}
        equal += line["error"] is None and body.get("choices", [{}])[0].get("text") == want
    report["lines"] = len(ids)
    report["distinct"] = len(set(ids))
    report["equal"] = equal
    print(json.dumps(report), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
