"""The package installs whole: the wheel that `pip install .` builds (the cluster image's install)
and the wheel built from the sdist (what `pip install 'raymuter[cpu]'` gets from an index) hold
every file of generation/, deployments/ and cluster/ in the checkout but cluster/Dockerfile (so the
default model's files and cluster's yaml and md too), and nothing of tests/ or bench/.

Each artefact is built from a copy of the checkout with the pins of constraints.txt, installed into
a fresh venv with the extras a user installs (EXTRAS: the sdist's wheel with `cpu`, no torch and no
Ray; the wheel with `cpu,serve`, Ray but no torch), and run from an empty folder with PYTHONPATH
unset: `import deployments, generation, generation.runtime.fusion` and `raymuter generate` on the
default model, every module and the model read from the venv; in the `serve` one, `raymuter batch`
and a batch through `raymuter serve`'s /v1/batches too, so a runtime dependency that only the `test`
extra brings fails here. Every other test runs against the editable install, which reads the
checkout and so never misses a file the packaging leaves out, and has the `test` extra.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "constraints.txt"
PACKAGES = ("generation", "deployments", "cluster")
NOT_SHIPPED = {"cluster/Dockerfile"}  # the image's recipe, read from the checkout by `docker build`
INSTALL_TIMEOUT_S = 600
# Each venv's artefact and the extras it is installed with (each test runs in both unless it names one).
EXTRAS = {"wheel": "cpu,serve", "sdist-wheel": "cpu"}

# What the installed package reports about itself, printed as JSON by the venv's python.
IMPORTS = """
import importlib.util, json, sys
import deployments, generation, generation.runtime.fusion, generation.default_model
print(json.dumps({
    "prefix": sys.prefix,
    "modules": {m.__name__: m.__file__ for m in (deployments, generation, generation.runtime.fusion)},
    "model": str(generation.default_model.default_model_path()),
    "absent": [name for name in ("torch", "ray") if importlib.util.find_spec(name) is None],
}))
"""
# The installed distribution's files (its RECORD), relative to site-packages; nothing imported.
FILES = "import importlib.metadata, json; print(json.dumps([str(f) for f in importlib.metadata.files('raymuter')]))"


def pinned(constraints) -> list[str]:
    """pip's flags for an install under the project's pins, build dependencies too (the Makefile's PIP)."""
    return ["-c", str(constraints), "--build-constraint", str(constraints)]


def clean_env() -> dict[str, str]:
    """This process's environment without anything that would put the checkout or another
    environment on a child's import path, nor the test session's Ray settings (its address, ports,
    HAProxy's files): a user's."""
    from deployments import instance

    own = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", *instance.PORT_VARIABLES, *instance.NO_SHARED_PORTS}
    env = {k: v for k, v in os.environ.items() if k not in own and not k.startswith(("RAY_", "RAYMUTER_"))}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def run(args, cwd: Path, timeout: float = INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=clean_env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, args))}: exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out


def checkout_files() -> list[str]:
    """The checkout's files as a clone with its uncommitted work holds them (tracked and untracked,
    less what .gitignore names: the venv, build outputs), relative to ROOT."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True)
    return sorted(p for p in out.stdout.decode().split("\0") if p and (ROOT / p).is_file())


@pytest.fixture(scope="module")
def artefacts(tmp_path_factory):
    """{"wheel": built from the checkout's copy, "sdist": its sdist, "sdist-wheel": the wheel built
    from that sdist}. The copy keeps build/ and *.egg-info out of the checkout that others share."""
    source = tmp_path_factory.mktemp("source")
    for name in checkout_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    dist = tmp_path_factory.mktemp("dist")
    # The sdist through setuptools' PEP 517 hook (pip builds no sdists), with this venv's setuptools
    # (pinned by constraints.txt like everything here).
    run([sys.executable, "-c", "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])",
         dist], cwd=source)
    (sdist,) = dist.glob("*.tar.gz")
    # The wheels as pip builds them for an install (isolated, pinned build dependencies); the
    # sdist's wheel not into pip's cache, which would keep one per run (its path changes).
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *pinned(CONSTRAINTS), "-w", dist, "."], cwd=source)
    (wheel,) = dist.glob("*.whl")
    from_sdist = tmp_path_factory.mktemp("sdist-wheel")
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-cache-dir", *pinned(CONSTRAINTS),
         "-w", from_sdist, sdist], cwd=from_sdist)
    (sdist_wheel,) = from_sdist.glob("*.whl")
    yield {"wheel": wheel, "sdist": sdist, "sdist-wheel": sdist_wheel}
    for folder in (source, dist, from_sdist):
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def venvs(artefacts, tmp_path_factory):
    """{artefact: a fresh venv holding it with its EXTRAS}, installed as the Makefile installs (pip
    itself first: --build-constraint is newer than the pip that venv bundles), less byte-compiling;
    the two at once (pip mostly waits on one core). Removed after the module: 300 MB (`cpu`) to
    1 GB (`cpu,serve`), and pytest keeps its last three runs' folders."""
    from concurrent.futures import ThreadPoolExecutor

    def install(name: str) -> Path:
        venv = tmp_path_factory.mktemp(f"venv-{name}")
        cwd = tmp_path_factory.mktemp("cwd")
        run([sys.executable, "-m", "venv", venv], cwd=cwd)
        python = venv / "bin" / "python"
        run([python, "-m", "pip", "install", "-q", "-c", CONSTRAINTS, "pip"], cwd=cwd)
        # --no-compile: byte-compiling every installed module (Ray's thousands) took 16 of the `serve`
        # install's 38 s; what the tests import compiles as it is imported
        run([python, "-m", "pip", "install", "-q", "--no-compile", *pinned(CONSTRAINTS),
             f"{artefacts[name]}[{EXTRAS[name]}]"], cwd=cwd)
        return venv

    with ThreadPoolExecutor(len(EXTRAS)) as pool:
        venvs = dict(zip(EXTRAS, pool.map(install, EXTRAS)))
    yield venvs
    for venv in venvs.values():
        shutil.rmtree(venv, ignore_errors=True)


@pytest.fixture(scope="module", params=list(EXTRAS))
def venv(request, venvs):
    """The venv of one artefact (each test runs in both unless it names one)."""
    return venvs[request.param]


def probe(venv: Path, script: str, cwd: Path):
    return json.loads(run([venv / "bin" / "python", "-c", script], cwd=cwd, timeout=120).stdout)


def inside(path: str, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def test_imports_come_from_the_venv_without_torch_and_ray_only_with_serve(venv, tmp_path, request):
    """`import deployments` needs no Ray: a `pip install 'raymuter[cpu]'` user runs the engine and
    `raymuter generate` without the serving extra. No extra but `test` and `train` brings torch."""
    found = probe(venv, IMPORTS, tmp_path)
    assert inside(found["prefix"], venv)
    for module, file in found["modules"].items():
        assert inside(file, venv), f"{module} from {file}"
    assert inside(found["model"], venv), found["model"]
    serve = "serve" in EXTRAS[request.node.callspec.params["venv"]]
    assert found["absent"] == (["torch"] if serve else ["torch", "ray"]), "torch, or ray without serve, installed"


def test_every_file_of_the_packages_is_installed_and_nothing_else(venv, tmp_path):
    installed = {f for f in probe(venv, FILES, tmp_path) if "__pycache__" not in f}
    shipped = {f for f in checkout_files() if f.split("/")[0] in PACKAGES and f not in NOT_SHIPPED}
    assert not shipped - installed, f"missing from the install: {sorted(shipped - installed)}"
    tops = {f.split("/")[0] for f in installed if not f.startswith("..") and ".dist-info/" not in f}
    assert tops == set(PACKAGES), f"installed beside the packages: {sorted(tops - set(PACKAGES))}"


def test_raymuter_generate_runs_the_installed_default_model(venv, tmp_path):
    out = run([venv / "bin" / "raymuter", "generate", "--max-new-tokens", "8", "The list type"], cwd=tmp_path,
              timeout=120)
    assert out.stdout.strip(), out.stderr
    (folder,) = re.findall(r"using the default model in (\S+)", out.stderr)
    assert inside(folder, venv), out.stderr


def batch_file(model: str) -> str:
    """Three completion lines of OpenAI's batch format, a few greedy tokens each."""
    return "".join(json.dumps({"custom_id": f"c{k}", "method": "POST", "url": "/v1/completions",
                               "body": {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0}}) + "\n"
                   for k, prompt in enumerate(["The list type", "A dict", "Tuples are"]))


def assert_every_line_answered(output: str) -> None:
    lines = [json.loads(text) for text in output.splitlines()]
    assert sorted(line["custom_id"] for line in lines) == ["c0", "c1", "c2"], output
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200, line
        assert line["response"]["body"]["choices"][0]["text"], line


@pytest.mark.parametrize("venv", ["wheel"], indirect=True)
def test_raymuter_batch_runs_from_the_serve_install(venv, tmp_path):
    """Every line answered 200 (httpx, which the lines go through, was in no extra but `test`:
    each failed with ModuleNotFoundError, or the command with a Ray Data traceback)."""
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(batch_file("raymuter-default"))
    run([venv / "bin" / "raymuter", "batch", source, output, "--slots", "4", "--quiet"], cwd=tmp_path, timeout=300)
    assert_every_line_answered(output.read_text())


@pytest.mark.parametrize("venv", ["wheel"], indirect=True)
def test_a_batch_through_raymuter_serve_runs_from_the_serve_install(venv, tmp_path):
    """Upload, create, poll to completed, every output line 200; SIGINT stops the server."""
    from ports import quiet_port

    port = quiet_port()
    server = subprocess.Popen([str(venv / "bin" / "raymuter"), "serve", "--port", str(port)], cwd=tmp_path,
                              env={**clean_env(), "TMPDIR": str(tmp_path)},  # its batches' files: not left in /tmp
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        url = served_url(server)
        upload = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, timeout=30,
                            files={"file": ("in.jsonl", batch_file("raymuter-default"), "application/jsonl")})
        assert upload.status_code == 200, upload.text
        batch = httpx.post(f"{url}/v1/batches", timeout=30, json={
            "input_file_id": upload.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}).json()
        deadline = time.monotonic() + 180
        while batch["status"] not in ("completed", "failed", "cancelled") and time.monotonic() < deadline:
            time.sleep(0.5)
            batch = httpx.get(f"{url}/v1/batches/{batch['id']}", timeout=30).json()
        assert batch["status"] == "completed", batch
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}, batch
        assert_every_line_answered(httpx.get(f"{url}/v1/files/{batch['output_file_id']}/content", timeout=30).text)
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.communicate()


def served_url(server: subprocess.Popen, timeout: float = 240) -> str:
    """The URL `raymuter serve` prints once it serves (AssertionError with what it printed, if none)."""
    printed, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        printed.append(line)
        found = re.search(r"serving '.+' at (http://\S+)/v1", line)
        if found:
            return found.group(1)
        if not line and server.poll() is not None:
            break
    raise AssertionError("no URL printed:\n" + "".join(printed))


def sdist_entries(sdist: Path) -> set[str]:
    """The sdist's top-level files and folders (below its `raymuter-0.1.0/`)."""
    with tarfile.open(sdist) as tar:
        return {name.split("/")[1] for name in tar.getnames() if name.count("/") >= 1}


def test_the_sdist_holds_no_tests_or_benchmarks(artefacts):
    entries = sdist_entries(artefacts["sdist"])
    assert not entries & {"tests", "bench", "helm"}, f"the sdist holds {', '.join(sorted(entries))}"


def test_the_image_copies_what_the_build_reads_and_installs_with_the_pins(artefacts):
    """cluster/Dockerfile installs as the venvs above do (non-editable, under constraints.txt) and
    copies every source the sdist holds, and constraints.txt."""
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text().replace("\\\n", " ")
    copied = {source for line in re.findall(r"^COPY\s+(.*)$", dockerfile, re.M)
              for source in [w for w in line.split() if not w.startswith("--")][:-1]}
    made = {"PKG-INFO", "setup.cfg", "raymuter.egg-info"}  # written by the build
    needed = (sdist_entries(artefacts["sdist"]) - made) | {"constraints.txt"}
    assert needed <= copied, f"not copied: {sorted(needed - copied)}"
    (install,) = re.findall(r"pip install [^&]*'\.\[[^']*\]'", dockerfile)
    assert " ".join(pinned("constraints.txt")) in install and " -e " not in install, install
