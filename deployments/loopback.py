"""A local Ray that listens on loopback only, for `raymuter serve --host 127.0.0.1` and `raymuter batch`.

Ray binds its servers (the GCS, the raylet's node and object managers, every worker's gRPC
server, the dashboard agent, the metrics export) on 127.0.0.1 when the node's IP is 127.0.0.1,
and on every interface otherwise. `ray.init(_node_ip_address="127.0.0.1")` does not get there:
Ray turns a loopback address back into the machine's (services.resolve_ip_for_localhost). With
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, Ray's single-machine mode (its default on macOS and
Windows), the node's IP is 127.0.0.1; Ray reads it when `ray` is imported, so ENVIRONMENT goes
into os.environ before that. One server ignores the node's IP: each Serve replica's
inter-deployment gRPC server binds [::]:0 (ray/serve/_private/replica.py `_on_initialized`);
SETUP_HOOK, run in every Ray worker before any actor, binds it on 127.0.0.1 instead, where the
other replicas reach it (they call the node's IP).
"""

from __future__ import annotations

import ipaddress
import socket

ENVIRONMENT = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
SETUP_HOOK = "deployments.loopback.keep_replica_grpc_on_loopback"


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (127.0.0.1, ::1, localhost)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def keep_replica_grpc_on_loopback() -> None:
    """Ray's worker_process_setup_hook: a Serve replica's gRPC server binds 127.0.0.1:0, not
    [::]:0. replica.py imports `add_port_to_grpc_server` by name when a replica's worker first
    loads it, after this hook has run, so it binds the wrapped function; other addresses pass
    through unchanged."""
    from ray._common import tls_utils

    original = tls_utils.add_port_to_grpc_server
    if getattr(original, "raymuter_loopback", False):
        return

    def add_port_to_grpc_server(server, address):
        return original(server, "127.0.0.1:0" if address == "[::]:0" else address)

    add_port_to_grpc_server.raymuter_loopback = True
    tls_utils.add_port_to_grpc_server = add_port_to_grpc_server
