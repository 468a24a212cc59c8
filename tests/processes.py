"""A `raymuter` command run as a user runs it, seen from outside: the environment it starts with
(this checkout first on the import path, none of the test session's Ray settings), its process tree
(Ray's processes are its children and theirs), the TCP sockets that tree listens on, and the error
lines it prints."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import shutil
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent


def environment() -> dict[str, str]:
    """This checkout first on the import path; not the session Ray's address, ports, HAProxy files
    or wrapper, nor a temporary folder of Ray's own."""
    from deployments import instance

    own = {*instance.PORT_VARIABLES, *instance.NO_SHARED_PORTS, "RAY_ADDRESS", "RAY_TMPDIR"}
    inherited = {k: v for k, v in os.environ.items()
                 if not k.startswith(("RAY_SERVE_", "RAYMUTER_HAPROXY_")) and k not in own}
    return {**inherited, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def listening(processes) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of `processes`."""
    found = []
    for p in processes:
        try:
            name = p.name()
            found += [(c.laddr.ip, c.laddr.port, name) for c in p.net_connections(kind="tcp")
                      if c.status == psutil.CONN_LISTEN]
        except psutil.Error:  # ended meanwhile
            pass
    return found


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 too


def error_lines(stderr: str) -> list[str]:
    """Ray's error log lines (`[time E pid tid] file.cc:line: ...`) and Python warnings in `stderr`."""
    return [line for line in stderr.splitlines()
            if re.match(r"\[[\d-]+ [\d:,]+ E \d+ \d+\]", line) or re.search(r"\w+Warning: ", line)]


@contextlib.contextmanager
def short_temporary_folder(prefix: str):
    """A folder for a command's TMPDIR, short enough for the Unix sockets Ray makes under it (a
    pytest tmp_path is not), removed after with whatever a killed command left there."""
    folder = Path(f"/tmp/{prefix}{os.getpid() % 100000}")
    folder.mkdir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
