"""A free TCP port for a test's server, where Ray's own processes do not take ports: above Ray's
worker ports (10002-19999), below the replicas' (30000-31000, 40000-41000) and the kernel's
ephemeral range (32768 on), where Ray's gRPC servers land. A port bound to 0 comes from that
ephemeral range, and CI saw Ray take one between the test's pick and the server's bind."""

from __future__ import annotations

import random
import socket

RANGE = (20000, 29999)


def quiet_port() -> int:
    rng = random.Random()
    for _ in range(500):
        port = rng.randint(*RANGE)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {RANGE[0]}-{RANGE[1]}")
