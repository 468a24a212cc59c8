"""`raymuter serve` as a user and an operator run it: a subprocess that starts its own local Ray
and the application, prints the URL and serves.

Invariants: a bad model (a folder that is none too), a batch folder that cannot be made or a port
in use is one line and exit code 2 before Ray starts; a deployment that fails says its replica's
own error; the Files and Batches API's default folder goes with the server at stop; SIGINT
and SIGTERM stop it however it was launched (here with SIGINT ignored, as nohup and `&` in a
script launch it), with exit code 0 and nothing left listening; served on 127.0.0.1, nothing of it
listens on another interface, and HAProxy's admin socket is private to the user. Each serve start
costs 10-15 s on 2 cores: the two below check everything that needs a running server.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from processes import environment, is_loopback, listening, process_tree

ROOT = Path(__file__).resolve().parents[3]


def free_port() -> int:
    from ports import quiet_port

    return quiet_port()


def raymuter(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *map(str, args)], cwd=cwd, env=env or environment(),
                          capture_output=True, text=True, timeout=120)


def ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@contextlib.contextmanager
def serving(*args, engine: str = "fake", launch_only: bool = False, env: dict | None = None):
    """`raymuter serve --engine ENGINE --num-cpus 4 ARGS`, launched with SIGINT ignored (and `env`
    over the test's environment); yields the process and its URL once it prints it (`launch_only`:
    the process at once; wait_for_url waits). What it printed until then is its `printed`.
    Whatever of its process tree is left at the end is killed."""
    process = subprocess.Popen([sys.executable, "-m", "deployments.cli", "serve", "--engine", engine, "--num-cpus", "4",
                                *map(str, args)], cwd=ROOT, env={**environment(), **(env or {})}, stderr=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, text=True, start_new_session=True, preexec_fn=ignore_sigint)
    seen = set()
    try:
        if launch_only:
            yield process
        else:
            url = wait_for_url(process)
            seen.update(process_tree(process.pid))
            yield process, url
    finally:
        if process.poll() is None:
            with contextlib.suppress(psutil.Error):
                seen.update(process_tree(process.pid))  # HAProxy's reloads since
            process.terminate()  # its own stop removes its run folder
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=30)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        for p in seen:  # Ray's processes that left the group
            try:
                p.kill()
            except psutil.Error:
                pass


def wait_for_url(process, timeout: float = 180) -> str:
    """The URL `raymuter serve` prints once it serves; what it printed until then: process.printed."""
    url, deadline, lines = None, time.time() + timeout, []
    while url is None and time.time() < deadline:
        line = process.stderr.readline()
        lines.append(line)
        if not line and process.poll() is not None:
            break
        found = re.search(r"serving '(.+)' at (http://\S+)/v1", line)
        if found:
            url = found.group(2)
    lines.append(process.stderr.readline())  # the curl line
    process.printed = "".join(lines)
    assert url is not None, "no URL printed:\n" + process.printed
    return url


def settled_sockets(process, port: int, timeout: float = 15) -> tuple[list[psutil.Process], list[tuple[str, int, str]]]:
    """The process tree and its listening sockets once HAProxy's API port is among them. Serve
    reloads HAProxy when its targets change (a new process takes the port, the old one leaves), so
    one read can fall between the two and see neither."""
    deadline = time.time() + timeout
    while True:
        tree = process_tree(process.pid)
        sockets = listening(tree)
        if any(p == port for _, p, _ in sockets) or time.time() > deadline:
            return tree, sockets
        time.sleep(0.2)


def assert_stops(process, signum, url) -> None:
    """`signum` ends the server: exit code 0, "stopping" and no traceback; soon no process of its
    tree listens (30 s: a loaded 2-core machine once took over 10 for the last of Ray's) and the
    URL does not answer."""
    tree = process_tree(process.pid)
    process.send_signal(signum)
    assert process.wait(timeout=60) == 0
    rest = process.stderr.read()
    assert "stopping" in rest and "Traceback" not in rest, rest
    deadline = time.time() + 30
    while listening(tree) and time.time() < deadline:
        time.sleep(0.2)
    assert listening(tree) == []
    try:
        httpx.get(url + "/health", timeout=2)
        raise AssertionError(f"still serving after {signal.Signals(signum).name}")
    except httpx.HTTPError:
        pass


@pytest.fixture(scope="module")
def pair():
    """Two `raymuter serve` of the fake engine started at once on one host, each with its own key
    and its own temporary folder (short enough for the run folder's sockets), both launched with
    SIGINT ignored (as nohup and `&` in a script leave it): {name: (process, url, key, folder)}.
    The module's tests read them in order; its last two stop them (SIGINT, SIGTERM), so one
    start serves the checks that need a running server and those of its stop."""
    keys = {"a": "key-a", "b": "key-b"}
    folders = {name: Path(f"/tmp/{name}{os.getpid() % 100000}") for name in keys}
    with contextlib.ExitStack() as stack:
        for folder in folders.values():
            folder.mkdir()
            stack.callback(subprocess.run, ["rm", "-rf", str(folder)])
        ports = {name: free_port() for name in keys}
        launched = {name: stack.enter_context(serving("--host", "127.0.0.1", "--port", ports[name], "--api-key",
                                                      keys[name], launch_only=True, env={"TMPDIR": str(folders[name])}))
                    for name in keys}
        urls = {name: wait_for_url(process) for name, process in launched.items()}
        yield {name: (launched[name], urls[name], keys[name], folders[name]) for name in keys}


def test_on_loopback_nothing_listens_beyond_it(pair):
    process, url, key, _ = pair["a"]
    port = int(url.rpartition(":")[2])
    assert url == f"http://127.0.0.1:{port}"
    out = httpx.post(url + "/v1/completions", json=dict(model="raymuter-default", prompt="abc", max_tokens=3),
                     headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert out.status_code == 200, out.text
    assert out.json()["choices"][0]["text"] == "cba"  # ingress -> decoder over gRPC, on loopback too
    tree, sockets = settled_sockets(process, port)
    assert {(ip, p) for ip, p, _ in sockets if p == port} == {("127.0.0.1", port)}, sockets  # HAProxy's API port
    names = {name for _, _, name in sockets}
    assert {"gcs_server", "raylet", "haproxy"} <= names, names  # guard: Ray's own servers were read
    assert [s for s in sockets if not is_loopback(s[0])] == []

    haproxy = [p for p in tree if p.name() == "haproxy"]
    assert haproxy, "no HAProxy in the process tree"
    command = haproxy[0].cmdline()
    config_path = Path(command[command.index("-f") + 1])
    config = config_path.read_text()
    admin = Path(re.search(r"^\s*stats socket (\S+)", config, re.M).group(1))
    assert stat.S_IMODE(admin.stat().st_mode) == 0o600
    assert stat.S_IMODE(admin.parent.stat().st_mode) == 0o700  # Ray's metrics socket beside it is 666
    stats_port = int(re.search(r"^listen stats\n\s*bind 127\.0\.0\.1:(\d+)$", config, re.M).group(1))
    assert httpx.get(f"http://127.0.0.1:{stats_port}/stats", timeout=10).status_code == 200
    run_folder = config_path.parents[1]  # the instance's own: HAProxy's files (under the node's id), Ray's session
    assert run_folder.name.startswith("raymuter-") and (run_folder / "ray").is_dir()
    assert run_folder.parent == pair["a"][3]  # in its temporary folder: the stop test checks it is gone


def test_the_uploads_land_in_the_server_s_run_folder(pair):
    """The Files and Batches API's default folder is in the server's run folder (0700): an upload
    lands there, nothing of it beside (the stop test: nothing is left at stop)."""
    process, url, key, temporary = pair["b"]
    upload = httpx.post(url + "/v1/files", files={"file": ("r.jsonl", b"{}\n")}, data={"purpose": "batch"},
                        headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert upload.status_code == 200, upload.text
    kept = list(temporary.glob(f"raymuter-*/batches/files/{upload.json()['id']}.data"))
    assert len(kept) == 1 and not list(temporary.glob("raymuter-batches-*")), list(temporary.iterdir())
    assert stat.S_IMODE(kept[0].parents[2].stat().st_mode) == 0o700


def answers(url: str, key: str) -> int | str:
    """The status of GET url/v1/models with `key` where the application answered (OpenAI's model
    list or error body), else what answered: "not the application" (a metrics or stats page) or
    the kind of failure (not HTTP, no answer)."""
    try:
        out = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    except httpx.HTTPError as e:
        return type(e).__name__
    try:
        body = out.json()
    except ValueError:
        return "not the application"
    return out.status_code if isinstance(body, dict) and ("data" in body or "error" in body) else "not the application"


def test_two_instances_share_no_port_and_each_answers_only_its_own_key(pair):
    """Two `raymuter serve` started at once on one host with different keys: no port of one's
    process tree is one of the other's (Serve's fallback proxy once bound 127.0.0.1:8500 in both,
    with SO_REUSEPORT, and the kernel split one's clients between the two applications); on every
    port of each, the other's key never gets the model list. Then one's ingress replica is
    killed: while it restarts its port answers its own key 503 (Retry-After) or 200, never the
    other's 200, and the other instance goes on."""
    keys = {name: pair[name][2] for name in pair}
    launched = {name: pair[name][0] for name in pair}
    urls = {name: pair[name][1] for name in pair}
    ports = {name: int(url.rpartition(":")[2]) for name, url in urls.items()}
    sockets = {name: settled_sockets(launched[name], ports[name])[1] for name in keys}
    numbers = {name: {port for _, port, _ in found} for name, found in sockets.items()}
    assert numbers["a"] and numbers["b"] and not numbers["a"] & numbers["b"], (sockets["a"], sockets["b"])
    for own, other in (("a", "b"), ("b", "a")):
        serving_ports = []
        for port in sorted(numbers[own]):
            address = f"http://127.0.0.1:{port}"
            assert answers(address, keys[other]) != 200, (own, port)  # never the other's clients
            if answers(address, keys[own]) == 200:
                serving_ports.append(port)
                assert answers(address, keys[other]) == 401
        assert ports[own] in serving_ports  # guard: the probe reached the application

    ingress = [p for p in process_tree(launched["a"].pid) if "ServeReplica:raymuter:Ingress" in p.name()]
    assert ingress, "no ingress replica in a's tree"
    ingress[0].kill()
    seen, deadline = [], time.time() + 60
    while time.time() < deadline:
        with_other = answers(urls["a"], keys["b"])
        assert with_other in (401, 503), with_other
        got = httpx.get(urls["a"] + "/v1/models", headers={"Authorization": f"Bearer {keys['a']}"}, timeout=15)
        seen.append(got.status_code)
        assert got.status_code in (200, 503), got.text
        if got.status_code == 503:
            assert got.headers["retry-after"] == "1" and got.json()["error"]["type"] == "server_overloaded"
        if seen[-3:] == [200, 200, 200] and 503 in seen:
            break
        assert answers(urls["b"], keys["b"]) == 200  # the other instance is untouched
        time.sleep(0.1)
    assert 503 in seen and seen[-1] == 200, seen  # answered while down, and serves again


def test_sigint_stops_it_though_ignored_and_leaves_nothing_in_tmp(pair):
    process, url, _, temporary = pair["a"]
    assert_stops(process, signal.SIGINT, url)
    assert list(temporary.iterdir()) == []  # its run folder (Ray's session, HAProxy's files) went with it


def test_sigterm_stops_it_and_the_uploads_go_with_it(pair):
    process, url, key, temporary = pair["b"]
    upload = httpx.post(url + "/v1/files", files={"file": ("s.jsonl", b"{}\n")}, data={"purpose": "batch"},
                        headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert upload.status_code == 200 and list(temporary.glob("raymuter-*/batches/files/*.data")), upload.text
    assert_stops(process, signal.SIGTERM, url)
    assert list(temporary.iterdir()) == []


def test_a_sigint_before_ray_started_stops_it_though_ignored():
    """Launched with SIGINT ignored, a Ctrl-C that comes at its first printed line (before Ray
    starts) stops it: exit code 0, "stopping", no traceback, its run folder gone (it went on to
    serve, the signal lost)."""
    temporary = Path(f"/tmp/e{os.getpid() % 100000}")  # short enough for the run folder's sockets
    temporary.mkdir()
    try:
        with serving("--port", free_port(), launch_only=True, env={"TMPDIR": str(temporary)}) as process:
            first = process.stderr.readline()
            assert first.startswith("[raymuter]"), first
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=60) == 0
            rest = process.stderr.read()
            assert "stopping" in rest and "Traceback" not in rest and "serving '" not in rest, first + rest
        assert list(temporary.iterdir()) == []
    finally:
        subprocess.run(["rm", "-rf", str(temporary)])


def test_the_default_layout_frees_slots_left_whole_and_answers_503_while_its_engine_restarts():
    """`raymuter serve` on the default model as a user starts it (the routes and the decoder in
    one replica, the batching loop in a child process): whole answers whose client's timeout
    closed them free their slots at once; the engine process killed under load answers its held
    requests and every new one 503 with Retry-After until a new one serves, and so does the
    replica itself killed; the printed curl line carries the key by name."""
    from test_serve import check_abandoned_whole_answers_free_slots

    port, key = free_port(), "key-a"
    with serving("--port", port, "--api-key", key, engine="onnx") as (process, url):
        assert f'-H "Authorization: Bearer $RAYMUTER_API_KEY"' in process.printed
        # the default model's weights are float16: auto runs it as exported, and says so before Ray starts
        assert ("[raymuter] precision on this machine: as exported (auto asked): the decoder has no float32 MatMul "
                "weights") in process.printed
        check_a_quiet_tree(process)
        headers = {"Authorization": f"Bearer {key}"}
        check_abandoned_whole_answers_free_slots(url, "raymuter-default", count=8, leave_after=0.5,
                                                 prompt="The list type", max_tokens=480, ignore_eos=True,
                                                 headers=headers)
        tree = process_tree(process.pid)
        engine = [p for p in tree if "spawn_main" in " ".join(p.cmdline())]
        server = [p for p in tree if "ServeReplica:raymuter:Server" in p.name()]
        assert len(engine) == 1 and len(server) == 1, [p.name() for p in tree]
        for victim in (engine[0], server[0]):
            assert_answers_503_until_it_serves(url, headers, victim)


def check_a_quiet_tree(process, seconds: float = 10.0, most: float = 0.25) -> None:
    """With no request, the whole process tree takes at most `most` of a core (docs/serving.md "A
    quiet server": 0.05 on the real 135M model over 30 s in bench/peers.py; here a margin for a
    busy CI machine): no Records replica (the Server holds the records), no idle Ray worker started
    ahead of need, no log monitor."""
    time.sleep(3)  # the start-up's last work settles
    tree = process_tree(process.pid)
    names = [" ".join(p.cmdline()) for p in tree]
    assert not [n for n in names if "Records" in n or "ray::IDLE" in n or "log_monitor.py" in n], names

    def cpu() -> float:
        total = 0.0
        for p in tree:
            with contextlib.suppress(psutil.Error):
                times = p.cpu_times()
                total += times.user + times.system
        return total

    before = cpu()
    time.sleep(seconds)
    used = (cpu() - before) / seconds
    assert used <= most, f"the idle server took {used:.3f} of a core over {seconds:.0f} s"


def test_behind_serve_s_own_proxy_clients_that_leave_whole_answers_free_their_slots():
    """`--proxy ray` (Serve's Python proxy in front, actor calls behind): as through HAProxy."""
    from test_serve import check_abandoned_whole_answers_free_slots

    with serving("--port", free_port(), "--proxy", "ray") as (process, url):
        assert not [p for p in process_tree(process.pid) if p.name() == "haproxy"]
        check_abandoned_whole_answers_free_slots(url, "raymuter-default")


def assert_answers_503_until_it_serves(url: str, headers: dict, victim: psutil.Process) -> None:
    """Requests held when `victim` dies and every one sent until it serves again: 503 with
    Retry-After in OpenAI's error shape, never a 500 and never silence (each within 10 s)."""
    import threading

    body = dict(model="raymuter-default", prompt="The list type", max_tokens=400, ignore_eos=True)
    held = []

    def hold():
        held.append(httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=30))

    holders = [threading.Thread(target=hold) for _ in range(4)]
    for thread in holders:
        thread.start()
    time.sleep(0.3)
    victim.kill()
    seen, deadline = [], time.time() + 90
    while time.time() < deadline:
        out = httpx.post(url + "/v1/completions", json=dict(body, max_tokens=4), headers=headers, timeout=10)
        seen.append(out.status_code)
        assert out.status_code in (200, 503), out.text
        if out.status_code == 503:
            assert out.headers["retry-after"] == "1" and out.json()["error"]["type"] == "server_overloaded"
        elif 503 in seen or len(seen) > 20:
            break
        time.sleep(0.1)
    for thread in holders:
        thread.join(timeout=60)
    assert [r.status_code for r in held if r.status_code != 200] and \
        all(r.status_code == 503 and r.headers["retry-after"] == "1" for r in held if r.status_code != 200), \
        [(r.status_code, r.text[:200]) for r in held]
    assert seen[-1] == 200, seen


def test_a_start_that_cannot_finish_is_one_line_exit_1_and_leaves_nothing_in_tmp(tmp_path):
    """--start-timeout too short for the application: one line naming what it waited for and
    where Ray's logs were kept, exit code 1, no traceback, and the run folder (Ray's session,
    HAProxy's files) removed."""
    temporary = Path(f"/tmp/t{os.getpid() % 100000}")  # short enough for the run folder's sockets
    temporary.mkdir()
    try:
        env = {**environment(), "TMPDIR": str(temporary), "XDG_CACHE_HOME": str(tmp_path / "cache")}
        done = subprocess.run([sys.executable, "-m", "deployments.cli", "serve", "--engine", "fake", "--num-cpus", "4",
                               "--port", str(free_port()), "--start-timeout", "1"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 1, done.stderr
        errors = [line for line in done.stderr.splitlines() if line.startswith("raymuter: error:")]
        assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
        found = re.fullmatch(r"raymuter: error: start-up failed: not running after \d+ s \(--start-timeout\): "
                             r"waiting for .+ \(Ray's logs: (\S+)\)", errors[0])
        assert found, errors[0]
        logs = Path(found.group(1))
        assert logs.is_relative_to(tmp_path / "cache" / "raymuter" / "logs") and any(logs.iterdir())
        assert list(temporary.iterdir()) == []  # the run folder is gone
    finally:
        subprocess.run(["rm", "-rf", str(temporary)])


def test_start_up_progress_names_what_it_waits_for(monkeypatch, capsys):
    """wait_running over Serve's status: a line every PROGRESS_SECONDS naming the deployments
    not running yet; a failed deployment or the deadline is StartFailed naming it."""
    from types import SimpleNamespace as N

    from ray.serve._private.common import DeploymentStatus, ReplicaState
    from ray.serve.schema import ApplicationStatus, ProxyStatus

    from deployments.cli import startup as cli

    monkeypatch.setattr(cli, "PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)
    starting = N(status=ApplicationStatus.DEPLOYING, message="", deployments={
        "Decoder": N(status=DeploymentStatus.UPDATING, replica_states={ReplicaState.STARTING: 1}),
        "Ingress": N(status=DeploymentStatus.HEALTHY, replica_states={ReplicaState.RUNNING: 1})})
    states = iter([N(proxies={}, applications={"raymuter": starting})] * 2 +
                  [N(proxies={}, applications={"raymuter": N(status=ApplicationStatus.RUNNING)})])
    cli.wait_running("raymuter", time.monotonic() + 60, time.monotonic(), status=lambda: next(states))
    said = capsys.readouterr().err
    assert "[raymuter] still starting" in said and "waiting for Decoder (1 starting)\n" in said, said
    failed = N(proxies={}, applications={"raymuter": N(status=ApplicationStatus.DEPLOY_FAILED,
                                                       message="Traceback ...\nValueError: model folder 'x' has no onnx")})
    try:
        cli.wait_running("raymuter", time.monotonic() + 60, time.monotonic(), status=lambda: failed)
        raise AssertionError("no StartFailed")
    except cli.StartFailed as e:
        assert str(e) == "the application failed to deploy: ValueError: model folder 'x' has no onnx"
    replica_failed = N(proxies={}, applications={"raymuter": N(  # the replica's own error, not Serve's summary
        status=ApplicationStatus.DEPLOY_FAILED, message="Failed to update the deployments ['Server'].", deployments={
            "Records": N(status=DeploymentStatus.HEALTHY, message="", replica_states={ReplicaState.RUNNING: 1}),
            "Server": N(status=DeploymentStatus.DEPLOY_FAILED, replica_states={}, message=(
                "The deployment failed to start 3 times in a row. This may be due to a problem with its "
                "constructor or initial health check failing. See controller logs for details. Error:\n"
                "ray::ServeReplica:raymuter:Server.initialize_and_get_metadata() (pid=1, ip=127.0.0.1)\n"
                '  File "/x/generation/runtime/model.py", line 144, in read_json\n'
                "    raise ModelError(f\"{path.name} is missing from {path.parent}\")\n"
                "generation.runtime.errors.ModelError: tokenizer.json is missing from /m"))})})
    try:
        cli.wait_running("raymuter", time.monotonic() + 60, time.monotonic(), status=lambda: replica_failed)
        raise AssertionError("no StartFailed")
    except cli.StartFailed as e:
        assert str(e) == "the application failed to deploy: Server: ModelError: tokenizer.json is missing from /m"
    try:
        cli.wait_running("raymuter", time.monotonic() - 1, time.monotonic() - 5, status=lambda: N(
            proxies={"n": ProxyStatus.STARTING}, applications={"raymuter": starting}))
        raise AssertionError("no StartFailed")
    except cli.StartFailed as e:
        assert str(e) == ("not running after 5 s (--start-timeout): waiting for Decoder (1 starting); "
                          "the HTTP proxy (starting)")


def test_a_missing_model_is_generate_s_error_before_ray_starts(tmp_path):
    missing = tmp_path / "no-such-model"
    started = time.perf_counter()
    served = raymuter("serve", "--model", missing, "--port", free_port())
    assert time.perf_counter() - started < 10
    generated = raymuter("generate", "--model", missing, "hello")
    assert served.returncode == generated.returncode == 2
    assert served.stderr == generated.stderr == f"raymuter: error: model folder '{missing}' does not exist\n"


def test_a_folder_that_is_no_model_is_generate_s_error_before_ray_starts(tmp_path):
    """A folder without config.json, or with no decoder file: the words `raymuter generate` says,
    exit code 2, before Ray starts (it once started Ray and failed 45 s later in a replica)."""
    empty, no_onnx = tmp_path / "empty", tmp_path / "no-onnx"
    empty.mkdir()
    no_onnx.mkdir()
    (no_onnx / "config.json").write_text('{"model_type": "llama"}')
    for folder, words in ((empty, f"config.json is missing from {empty}"), (no_onnx, f"no ONNX decoder in {no_onnx}")):
        started = time.perf_counter()
        served = raymuter("serve", "--model", folder, "--port", free_port())
        assert time.perf_counter() - started < 10
        generated = raymuter("generate", "--model", folder, "hello")
        assert served.returncode == generated.returncode == 2, served.stderr
        assert served.stderr == generated.stderr and served.stderr.startswith(f"raymuter: error: {words}"), \
            (served.stderr, generated.stderr)


def test_a_batch_folder_that_cannot_be_made_is_one_line_before_ray_starts(tmp_path):
    (tmp_path / "a-file").write_text("")
    started = time.perf_counter()
    done = raymuter("serve", "--engine", "fake", "--port", free_port(), "--batch-folder", tmp_path / "a-file" / "b")
    assert time.perf_counter() - started < 10 and done.returncode == 2
    assert done.stderr == f"raymuter: error: --batch-folder: cannot keep files in {tmp_path}/a-file/b (Not a directory)\n"


def test_a_port_in_use_is_one_line_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.perf_counter()
        done = raymuter("serve", "--engine", "fake", "--port", port)
    assert time.perf_counter() - started < 10  # before Ray starts
    assert done.returncode == 2
    assert done.stderr == f"raymuter: error: port {port} on 127.0.0.1 is in use (--port to choose another)\n"
    bad = raymuter("serve", "--port", 70000)
    assert bad.returncode == 2 and "--port: a port is an integer in 1-65535, not '70000'" in bad.stderr


def test_help_shows_the_defaults_and_no_secret():
    serve = raymuter("serve", "--help", env={**environment(), "RAYMUTER_API_KEY": "sk-secret"})
    assert serve.returncode == 0
    text = " ".join(serve.stdout.split())  # argparse wraps lines
    for shown in ("port of the HTTP API (default: 8000)", "(default: 127.0.0.1)", "at least 32) (default: 0)", "(default: 256)",
                  "(default: haproxy)", "(default: $RAYMUTER_API_KEY, else none)"):
        assert shown in text
    assert "sk-secret" not in text and "(default: None)" not in text and "--engine " not in text  # hidden (--engine-process is not)
    assert "--engine-process" in text
    generate = raymuter("generate", "--help")
    text = " ".join(generate.stdout.split())
    assert "prompt i gets seed + i (default: 0)" in text and "(default: whole)" in text
    assert "(default: None)" not in text and "(default: True)" not in text and "(default: [])" not in text


def test_version_is_the_distribution_s_or_the_checkout_s(monkeypatch):
    import tomllib
    from importlib import metadata

    from generation import cli

    done = raymuter("--version")
    assert done.returncode == 0 and done.stdout == f"raymuter {metadata.version('raymuter')}\n"

    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    checkout = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert cli.version() == f"{checkout} (not installed)"


def test_the_url_is_printed_only_once_every_connection_for_a_while_is_routed():
    """A stand-in proxy that routes /health on some connections only (as a displaced HAProxy process
    with the config from before the application does, right after a reload): wait_routed returns
    only after a second of consecutive answers, not at the first one."""
    import http.server
    import threading

    from deployments.cli.startup import wait_routed

    answers = iter([200, 404, 200, 200, 404] + [200] * 1000)
    served = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status = next(answers)
            served.append((time.monotonic(), status))
            self.send_response(status)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Proxy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        wait_routed(f"http://127.0.0.1:{server.server_address[1]}", timeout=20, settle=1.0)
    finally:
        server.shutdown()
    last_refusal = max(t for t, status in served if status != 200)
    assert [status for _, status in served[:5]] == [200, 404, 200, 200, 404]
    assert served[-1][0] - last_refusal >= 1.0
