"""Several nodes: a Ray cluster of four nodes started on this machine (tests/deployments/nodes/multinode.py,
in a process of its own: the session's Ray is another cluster).

Invariants: two decoder replicas land on two different worker nodes (max_replicas_per_node=1);
when one of those nodes is lost under load (every process on it killed), every stream under way
either completes whole or ends with a clear error event naming the lost replica (none is cut
silently), the requests still waiting for a slot move to the surviving replica and complete
whole, and new requests are served afterwards.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ports import quiet_port

SCRIPT = Path(__file__).with_name("multinode.py")


def test_a_lost_node_under_load_loses_no_request_silently():
    # Serve's Python proxy on the head only: on one machine every node's proxy would share the port
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(RAY_SERVE_ENABLE_HA_PROXY="0", RAY_AUTH_MODE="disabled")
    done = subprocess.run([sys.executable, str(SCRIPT), str(quiet_port())], capture_output=True, text=True,
                          timeout=400, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    report = json.loads(lines[-1])
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
