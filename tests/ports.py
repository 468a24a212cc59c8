"""A free TCP port for a test's server, where Ray's own processes do not take ports: above Ray's
worker ports (10002-19999), below the replicas' (30000-31000, 40000-41000) and the kernel's
ephemeral range (32768 on), where Ray's gRPC servers land. A port bound to 0 comes from that
ephemeral range, and CI saw Ray take one between the test's pick and the server's bind. The same
range and choice as the ports `raymuter serve` picks for itself (deployments/instance.py)."""

from __future__ import annotations


def quiet_port() -> int:
    from deployments.instance import free_port

    return free_port()
