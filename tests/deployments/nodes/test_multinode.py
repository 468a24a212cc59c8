"""Several nodes: a Ray cluster of four nodes started on this machine (tests/deployments/nodes/multinode.py,
in a process of its own: the session's Ray is another cluster).

Invariants: two decoder replicas land on two different worker nodes (max_replicas_per_node=1);
when one of those nodes is lost under load (every process on it killed), every stream under way
either completes whole or ends with a clear error event naming the lost replica (none is cut
silently), the requests still waiting for a slot move to the surviving replica and complete
whole, and new requests are served afterwards. `raymuter batch --address` on a cluster of three
nodes (batch_multinode.py) runs its engine actors on more than one node, answers every line once
with the engine's answer, and a run killed midway resumes against the same cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ports import quiet_port

SCRIPT = Path(__file__).with_name("multinode.py")
BATCH_SCRIPT = Path(__file__).with_name("batch_multinode.py")


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    """Both clusters' scripts, started together: each mostly waits (on its nodes' start, a lost
    node's detection, a killed run), one core between them, so the module takes the longer one's
    time, not the sum. {name: a function that waits for the script and gives its report}."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_AUTH_MODE="disabled")
    # Serve's Python proxy on the head only: on one machine every node's proxy would share the port
    runs = {"lost_node": ([SCRIPT, quiet_port()], {**env, "RAY_SERVE_ENABLE_HA_PROXY": "0"}, 400),
            "batch": ([BATCH_SCRIPT, tmp_path_factory.mktemp("batch")], env, 500)}
    started = {name: (subprocess.Popen([sys.executable, *map(str, args)], stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, env=run_env), timeout)
               for name, (args, run_env, timeout) in runs.items()}

    def report(name: str) -> dict:
        process, timeout = started[name]
        out, err = process.communicate(timeout=timeout)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        assert process.returncode == 0 and lines, err[-3000:]
        return json.loads(lines[-1])

    yield report
    for process, _ in started.values():
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_a_lost_node_under_load_loses_no_request_silently(clusters):
    report = clusters("lost_node")
    streams = 12
    assert len(set(report["decoder_nodes"])) == 2 and -1 not in report["decoder_nodes"], report  # spread
    # every slot ran at the kill; the rest waited (or, on a slow start, had run and ended)
    assert report["under_way"] == 8 and report["killed_processes"] >= 2, report
    assert report["queued"] + report["under_way"] + report["ended_before_kill"] == streams, report
    assert report["queued"] >= 1 and report["queued_whole"] == report["queued"], report  # the waiting ones moved
    assert report["silent"] == 0, report
    assert report["whole"] + report["failed_clearly"] == streams, report
    assert report["failed_clearly"] >= 1, report  # the lost node held some of them
    assert all("decoder replica serving this request failed" in e for e in report["errors"]), report
    assert report["after_whole"] == 4, report


def test_raymuter_batch_on_a_cluster_spreads_its_engines_and_resumes_after_a_kill(clusters):
    report = clusters("batch")
    assert 8 <= report["kept_after_kill"] < 120, report  # killed midway, its whole lines kept
    assert report["rerun_rc"] == 0, report
    assert f"{report['kept_after_kill']} already in" in report["rerun_stderr"], report  # the rerun skipped them
    assert report["engine_actor_nodes"] >= 2, report  # the engine actors ran on more than one node
    assert report["lines"] == report["distinct"] == 120, report  # every line once
    assert report["equal"] == 120, report  # each the fake engine's answer to its prompt
