"""`raymuter batch` as a user runs it on a host it shares: a subprocess on a local Ray of its own,
watched from outside while it runs (its process tree's sockets, command lines and environments).

Invariants: nothing of it listens beyond loopback, and its Prometheus ports (Ray's autoscaler's and
dashboard's) are chosen free, not Ray's fixed defaults that a second run on the host would share;
nothing of it stays in the temporary folder; a CSV table runs its column as Ray Data reads CSV,
and a table of a format it does not read is one line before Ray starts; it prints no Ray error
line or Python warning of its own making; --help shows each default as a value; a run killed
midway and run again writes every line once. The one watched run (~15 s on 2 cores, the fake
engine) serves every test that needs one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from processes import ROOT, environment, error_lines, is_loopback, listening, process_tree, short_temporary_folder
from test_batch_run import write_lines

from deployments.fake import fake_tokens

PROMPTS = {"a": "The list", "b": "A dict", "c": "Why, then"}  # c: a quoted cell with a comma
# Ray's Prometheus servers' ports by the variable Ray reads, with Ray's fixed default
METRIC_PORTS = {"AUTOSCALER_METRIC_PORT": 44217, "DASHBOARD_METRIC_PORT": 44227}


@dataclass
class Run:
    returncode: int
    stderr: str
    output: Path
    temporary: Path
    sockets: set = field(default_factory=set)  # (address, port, process name), all seen while it ran
    commands: dict = field(default_factory=dict)  # pid -> (name, command line, environment)
    processes: list = field(default_factory=list)  # psutil.Process of each (kill() checks it is the same one)


def raymuter(*args, env=None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deployments.cli", *map(str, args)], cwd=ROOT,
                          env=env or environment(), capture_output=True, text=True, timeout=timeout)


def watch(process, run: Run, timeout: float = 240) -> None:
    """Read the process tree every 0.2 s until `process` ends."""
    deadline = time.monotonic() + timeout
    while process.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.Error):
            tree = process_tree(process.pid)
            run.sockets.update(listening(tree))
            for p in tree:
                if p.pid not in run.commands:
                    with contextlib.suppress(psutil.Error):
                        seen = (p.name(), p.cmdline(), p.environ())
                        # in the middle of an exec the new name shows before its command line and
                        # environment do (the kernel fills them last): read it again next time
                        if seen[1] and seen[2]:
                            run.commands[p.pid] = seen
                            run.processes.append(p)
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """`raymuter batch prompts.csv out.jsonl --prompt-column text ...` on the fake engine, with its
    own temporary folder (short enough for Ray's sockets under it)."""
    folder = tmp_path_factory.mktemp("batch-cli")
    with short_temporary_folder("b") as temporary:
        yield from _watched_run(folder, temporary)


def _watched_run(folder: Path, temporary: Path):
    source, output, stderr = folder / "prompts.csv", folder / "out.jsonl", folder / "stderr"
    source.write_text("id,text\n" + "".join(f'{k},"{p}"\n' for k, p in PROMPTS.items()))
    command = [sys.executable, "-m", "deployments.cli", "batch", source, output, "--prompt-column", "text",
               "--id-column", "id", "--max-tokens", "4", "--engine", "fake", "--name", "fake",
               "--cpus-per-replica", "1", "--quiet"]
    with stderr.open("w") as err:
        process = subprocess.Popen([str(c) for c in command], cwd=ROOT, env={**environment(), "TMPDIR": str(temporary)},
                                   stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
        run = Run(0, "", output, temporary)
        try:
            watch(process, run)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            run.returncode = process.wait()
    run.stderr = stderr.read_text()
    yield run
    for p in run.processes:  # whatever of its tree outlived it
        with contextlib.suppress(psutil.Error):
            p.kill()


def test_a_csv_table_runs_its_column_as_completions(run):
    assert run.returncode == 0, run.stderr
    lines = {json.loads(t)["custom_id"]: json.loads(t) for t in run.output.read_text().splitlines()}
    assert set(lines) == set(PROMPTS)
    for custom_id, prompt in PROMPTS.items():
        want = "".join(chr(t) for t in fake_tokens([ord(c) for c in prompt], 0, {"max_new_tokens": 4}))
        assert lines[custom_id]["response"]["status_code"] == 200, lines[custom_id]
        assert lines[custom_id]["response"]["body"]["choices"][0]["text"] == want


def test_nothing_of_it_listens_beyond_loopback(run):
    names = {name for _, _, name in run.sockets}
    assert {"gcs_server", "raylet"} <= names, names  # guard: Ray's own servers were read
    assert [s for s in run.sockets if not is_loopback(s[0])] == []


def test_its_prometheus_ports_are_its_own(run):
    """Chosen free for this run (a second run on the host takes others), and listening on loopback."""
    (gcs_environment,) = [env for name, _, env in run.commands.values() if name == "gcs_server"]
    for variable, default in METRIC_PORTS.items():
        port = int(gcs_environment.get(variable, default))
        assert port != default, f"{variable}: Ray's fixed default"
        assert {ip for ip, p, _ in run.sockets if p == port} == {"127.0.0.1"}, (variable, run.sockets)


def test_nothing_of_it_stays_in_the_temporary_folder(run):
    sessions = {found for _, command, _ in run.commands.values() for arg in command
                for found in re.findall(r"/\S*?/session_\d{4}-[\d_-]+", arg)}
    assert sessions, "no Ray session seen"  # guard: the sessions below were read
    assert all(Path(session).is_relative_to(run.temporary) for session in sessions), sessions
    assert [s for s in sessions if Path(s).exists()] == []
    assert list(run.temporary.iterdir()) == []


def test_it_prints_no_ray_error_line_or_warning(run):
    """Ray's `constructor arguments in the object store` error line (Ray Data's actor restarts)
    and the warnings of Ray Data's calls came on every run (a batch file's run too:
    the killed run's below)."""
    assert run.returncode == 0, run.stderr
    assert error_lines(run.stderr) == [], run.stderr


def test_a_run_whose_every_line_failed_for_a_server_error_exits_1(tmp_path):
    """A broken server (a missing module, an engine that fails every row) is not a job done: the
    fake engine fails a prompt holding token 1 inside its loop, a 500 for each line."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps({"custom_id": f"l{k}", "method": "POST", "url": "/v1/completions",
                                          "body": {"model": "fake", "prompt": "\x01x", "max_tokens": 2}}) + "\n"
                              for k in range(2)))
    with short_temporary_folder("f") as temporary:
        done = raymuter("batch", source, output, "--engine", "fake", "--name", "fake", "--cpus-per-replica", "1",
                        "--quiet", env={**environment(), "TMPDIR": str(temporary)}, timeout=240)
    assert done.returncode == 1, done.stderr
    assert "every line answered failed for a server error" in done.stderr.splitlines()[-1], done.stderr
    lines = [json.loads(t) for t in output.read_text().splitlines()]
    assert [line["response"]["status_code"] for line in lines] == [500, 500]


def test_a_table_of_a_format_it_does_not_read_is_one_line_before_ray_starts(tmp_path):
    source = tmp_path / "prompts.tsv"
    source.write_text("text\nThe list\n")
    done = raymuter("batch", source, tmp_path / "out.jsonl", "--prompt-column", "text", "--engine", "fake")
    assert done.returncode == 2
    assert done.stderr == f"raymuter: error: {source}: a table is a .parquet, .csv or .jsonl file (JSON lines), " \
                          "not .tsv\n"


def test_help_shows_each_default_as_a_value():
    from generation.engine.admission import IDLE_PREFILL_FACTOR
    from generation.engine.batching import DEFAULT_PREFILL_CHUNK_TOKENS

    chunks = {"serve": f"(default: {DEFAULT_PREFILL_CHUNK_TOKENS}, {IDLE_PREFILL_FACTOR}x that while no row runs; "
                       "0: every prompt whole at once)",
              "batch": "(default: 0: every prompt whole at once", "generate": ""}
    for command, shown in chunks.items():
        text = " ".join(raymuter(command, "--help").stdout.split())  # argparse wraps lines
        assert shown in text, command
        defaults = re.findall(r"\(default: ([^;)]*)", text)
        assert defaults, command
        assert [d for d in defaults if re.search(r"\b[a-z_]+(\.[a-z_]+)+\.[A-Z][A-Z_]*\b", d)] == [], command


def test_a_killed_run_resumes_where_it_stopped(tmp_path):
    """The command itself, on a Ray of its own: killed midway, run again: every line once, and no
    Ray error line (Ray Data's actor restarts: `constructor arguments in the object store`)."""
    with short_temporary_folder("k") as temporary:  # the killed run's Ray session stays there
        killed_and_resumed(tmp_path, temporary)


def killed_and_resumed(tmp_path, temporary):
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [{"custom_id": f"c{k}", "url": "/v1/completions",
              "body": {"model": "fake", "prompt": f"p{k}", "max_tokens": 40}} for k in range(40)]
    write_lines(source, lines)
    command = [sys.executable, "-m", "deployments.cli", "batch", str(source), str(output), "--engine", "fake",
               "--name", "fake", "--slots", "2", "--quiet"]
    env = {**environment(), "TMPDIR": str(temporary)}  # a Ray of its own, not the session's (nor its ports)
    first = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not output.exists() or len(output.read_text().splitlines()) < 4):
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = len(output.read_text().splitlines())
    assert 4 <= kept < len(lines) + 1, "the run was not killed midway"
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    ids = [json.loads(t)["custom_id"] for t in output.read_text().splitlines()]
    assert sorted(i for i in ids if i is not None) == sorted(line["custom_id"] for line in lines)  # each once
    assert None in ids  # the line that is not JSON: an error line (it has no custom_id to skip it by)
    assert f"already in {output}" in again.stderr
    assert error_lines(again.stderr) == [], again.stderr
