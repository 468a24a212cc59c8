"""Shared pytest fixtures: the tiny test models and a transformers oracle.

* ``test_models`` (session): ``dict[str, Path]`` from :func:`model_builders.text.ensure_test_models`
  (built once into ``$RAYMUTER_TEST_MODELS`` or ``~/.cache/raymuter/test-models``).
* ``oracle`` (session): :class:`Oracle` -- greedy tokens and logits from ``transformers`` for the
  ``hf/<name>`` models.
* ``load_model`` (session): ``load_model(path)`` -> ``generation.load(path, threads=1)``, once
  per path for the whole session.
* ``prompts_of`` (session): ``prompts_of(lengths, seed)`` -> random prompts of those lengths.

Nothing here imports the ``generation`` package, torch or transformers at import time.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
# Byte-code caches for this process and every one the suite starts (Ray's workers, `raymuter serve`,
# the packaging test's venvs): where the environment turns them off (PYTHONDONTWRITEBYTECODE), each
# process compiled what it imports anew, ~0.4 s of a core a Ray worker, ~30 s a fresh venv's server.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# tests/ (the `model_builders` package) and every test folder on the import path, whatever pytest
# collects: tests share helpers by module name (`from test_assisted import grounded` in
# tests/generation/front/test_batching.py).
_FOLDERS = [_HERE] + [d for d in sorted(_HERE.rglob("*")) if d.is_dir() and any(d.glob("test_*.py"))]
sys.path[:0] = [str(d) for d in _FOLDERS if str(d) not in sys.path]

from model_builders.embedding import ensure_embedding_models  # noqa: E402  (after the path above)
from model_builders.text import ensure_test_models  # noqa: E402


class Oracle:
    """transformers reference for the ``hf/<name>`` test models (fp32, eval, cached).

    ``greedy(name, prompt, max_new_tokens, **generate_kwargs) -> list[int]``: the new tokens of
    ``model.generate`` (``do_sample=False``) for ONE prompt alone, without a trailing eos.
    ``logits(name, prompt) -> np.ndarray [len(prompt), vocab]``: one forward pass.
    ``eager``: names loaded with eager attention (transformers' default is sdpa, which ignores
    Gemma 2's cap on the scores: a model exported from eager attention is compared with eager).
    """

    def __init__(self, models: dict[str, Path], eager=()):
        self._paths = models
        self._eager = {self._key(name) for name in eager}
        self._models = {}
        self._greedy = {}
        self._logits = {}
        self._torch_ready = False

    @staticmethod
    def _key(name: str) -> str:
        return name if name.startswith("hf/") else f"hf/{name}"

    def hf_dir(self, name: str) -> Path:
        return self._paths[self._key(name)]

    def model(self, name: str):
        key = self.hf_dir(name)
        if key not in self._models:
            import torch
            import transformers

            if not self._torch_ready:
                torch.set_num_threads(2)
                self._torch_ready = True
            eager = {"attn_implementation": "eager"} if self._key(name) in self._eager else {}
            m = transformers.AutoModelForCausalLM.from_pretrained(key, dtype=torch.float32, **eager)
            self._models[key] = m.eval()
        return self._models[key]

    def config(self, name: str):
        return self.model(name).config

    def greedy(self, name: str, prompt, max_new_tokens: int, **generate_kwargs) -> list[int]:
        prompt = [int(t) for t in prompt]
        key = (str(self.hf_dir(name)), tuple(prompt), int(max_new_tokens),
               repr(sorted(generate_kwargs.items())))
        if key not in self._greedy:
            import torch

            model = self.model(name)
            ids = torch.tensor([prompt], dtype=torch.long)
            kw = dict(do_sample=False, max_new_tokens=max_new_tokens,
                      pad_token_id=model.config.pad_token_id)
            kw.update(generate_kwargs)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
            new = out[0, len(prompt):].tolist()
            eos = kw.get("eos_token_id", model.generation_config.eos_token_id)
            eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
            if new and new[-1] in eos:
                new = new[:-1]
            self._greedy[key] = new
        return list(self._greedy[key])

    def logits(self, name: str, prompt):
        prompt = [int(t) for t in prompt]
        key = (str(self.hf_dir(name)), tuple(prompt))
        if key not in self._logits:
            import torch

            model = self.model(name)
            ids = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            self._logits[key] = out[0].float().numpy()
        return self._logits[key].copy()


# The session's Ray apps (serve_apps below): each app is ~4 replicas (~3.4 core-seconds each to
# start) that idle at ~1% of a core apiece, Serve's controller more for each. Their modules run
# first, ordered so that each app's tests sit together (app_order); an app stops after the last
# test that names it, and the whole Ray after the last that uses it, instead of slowing every test
# after (the engine's, the CLI's, other Rays'). A test that names an app that has stopped (a use
# this scan missed) deploys it again: slower, never wrong. A module's own apps are deleted without
# waiting for their replicas to stop (`serve.delete(name, _blocking=False)`): no later test deploys
# the same name.
SESSION_RAY = "serve_apps"
_LAST_RAY_USER = pytest.StashKey[object]()
_LAST_APP_USERS = pytest.StashKey[dict]()
_APPS_NAMED = pytest.StashKey[set]()  # each Ray test's session_apps_of, read once at collection
# Where an app is named: `serve_apps.real`, `serve_apps.app("real")`, a parameter "real".
_APP_NAMED = re.compile(r"""serve_apps\.app\(["'](\w+)["']\)|serve_apps\.(\w+)\b""")
# A module that deploys apps of its own counts as this many tests when app_order weighs it.
_OWN_APPS_WEIGHT = 20


def session_apps_of(item) -> set[str]:
    """The session apps a test names in its own source, in its module's fixtures that it asks for,
    or as a parameter."""
    import inspect

    sources = [item.function]
    for name in item.fixturenames:
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            if getattr(definition.func, "__module__", None) == item.module.__name__:
                sources.append(definition.func)
    named = set()
    for source in sources:
        with contextlib.suppress(OSError, TypeError):
            named.update(a or b for a, b in _APP_NAMED.findall(inspect.getsource(source)))
    params = getattr(item, "callspec", None)
    named.update(v for v in (params.params.values() if params else ()) if isinstance(v, str))
    return named & set(ServeApps.CONFIGS)


def app_order(modules: dict, weights: dict) -> list:
    """`modules` ({module: [the set of apps each test names, in order]}) in the order that keeps
    the sum of the apps' lifetimes (first test that names one to the last) small, each module
    weighing `weights[module]` tests: a local search from the given order, moving one module at a
    time while that shortens it."""
    def lifetimes(order) -> float:
        clock, first, last = 0.0, {}, {}
        for module in order:
            step = weights[module] / max(len(modules[module]), 1)
            for apps in modules[module]:
                for app in apps:
                    first.setdefault(app, clock)
                    last[app] = clock + step
                clock += step
        return sum(last[app] - first[app] for app in first)

    order, best = list(modules), lifetimes(list(modules))
    improved = True
    while improved:
        improved = False
        for i in range(len(order)):
            for j in range(len(order)):
                moved = order[:i] + order[i + 1:]
                moved.insert(j, order[i])
                cost = lifetimes(moved)
                if cost < best - 1e-9:
                    order, best, improved = moved, cost, True
    return order


def pytest_collection_modifyitems(items):
    """The modules with a test that uses the session's Ray apps first, each whole and in its
    order (a module's own fixtures are set up once), in app_order's order; then the rest in theirs."""
    users = {item.path for item in items if SESSION_RAY in item.fixturenames}
    named = {}
    for item in items:
        if item.path in users:
            item.stash[_APPS_NAMED] = session_apps_of(item)
            named.setdefault(item.path, []).append(item.stash[_APPS_NAMED])
    weights = {path: len(apps) + (_OWN_APPS_WEIGHT if "serve.run(" in path.read_text() else 0)
               for path, apps in named.items()}
    rank = {path: i for i, path in enumerate(app_order(named, weights))}
    items.sort(key=lambda item: rank.get(item.path, len(rank)))  # stable: each module keeps its order


def pytest_collection_finish(session):
    users = [item for item in session.items if SESSION_RAY in item.fixturenames]
    session.config.stash[_LAST_RAY_USER] = users[-1] if users else None
    last = {}
    for item in users:
        for app in item.stash[_APPS_NAMED]:
            last[app] = item
    session.config.stash[_LAST_APP_USERS] = last


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that names a session app, that app stops; after the last test that uses
    the session's Ray apps, their fixture's own teardown (a later test that asked for them again
    would start them anew)."""
    result = yield
    stash = item.config.stash
    apps = item.funcargs.get(SESSION_RAY) if hasattr(item, "funcargs") else None
    if apps is not None:
        for app, last in stash.get(_LAST_APP_USERS, {}).items():
            if last is item:
                apps.retire(app)
    if item is stash.get(_LAST_RAY_USER, None):
        item._fixtureinfo.name2fixturedefs[SESSION_RAY][-1].finish(item._request)
    return result


@pytest.fixture(scope="session")
def test_models(pytestconfig) -> dict[str, Path]:
    # show the build's progress lines (stderr) even though pytest captures output
    capman = pytestconfig.pluginmanager.getplugin("capturemanager")
    disabled = getattr(capman, "global_and_fixture_disabled", None)
    with disabled() if disabled is not None else contextlib.nullcontext():
        return ensure_test_models()


@pytest.fixture(scope="session")
def oracle(test_models) -> Oracle:
    return Oracle(test_models)


@pytest.fixture(scope="session")
def s2s(test_models) -> dict[str, Path]:
    """The encoder-decoder fixtures beside the decoder-only ones (``ensure_test_models(seq2seq=True)``)."""
    return ensure_test_models(seq2seq=True)


@pytest.fixture(scope="session")
def embedding_models(test_models) -> dict[str, Path]:
    """The embedding fixtures (model_builders.embedding: feature-extraction exports of the tiny Qwen2
    and Llama with sentence-transformers configs), built on demand."""
    return ensure_embedding_models(test_models)


@pytest.fixture(scope="session")
def vision_paths() -> dict[str, Path]:
    """The vision-language fixtures (built on demand: ``ensure_test_models(vision=True)``)."""
    return ensure_test_models(vision=True)


def _hf_vision(path, model_class: str, processor_class: str):
    import torch
    import transformers as tf

    torch.set_num_threads(2)
    model = getattr(tf, model_class).from_pretrained(path, dtype=torch.float32).eval()
    return model, getattr(tf, processor_class).from_pretrained(path)


@pytest.fixture(scope="session")
def whisper_hf(s2s):
    """(transformers Whisper model, its feature extractor) of the tiny fixture, once per session."""
    import torch
    import transformers

    torch.set_num_threads(1)
    return (transformers.WhisperForConditionalGeneration.from_pretrained(s2s["hf/whisper"]).eval(),
            transformers.WhisperFeatureExtractor.from_pretrained(s2s["hf/whisper"]))


@pytest.fixture(scope="session")
def qwen2vl_hf(vision_paths):
    """(transformers Qwen2-VL model, its image processor) of the tiny fixture, once per session."""
    return _hf_vision(vision_paths["hf/qwen2vl"], "Qwen2VLForConditionalGeneration", "Qwen2VLImageProcessor")


@pytest.fixture(scope="session")
def idefics3_hf(vision_paths):
    """(transformers Idefics3 model, its processor) of the tiny fixture, once per session."""
    return _hf_vision(vision_paths["hf/idefics3"], "Idefics3ForConditionalGeneration", "AutoProcessor")


@pytest.fixture(scope="session")
def prompts_of():
    """``prompts_of(lengths, seed)`` -> ``list[list[int]]``: random prompts of token ids 3-999 (no
    pad, bos or eos), one of each length, drawn from ``numpy.random.default_rng(seed)``.
    ``lengths`` may be a count instead: that many prompts of 1 to 19 tokens, each length drawn
    from the same generator just before the prompt's ids."""
    import numpy as np

    def prompts_of(lengths, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        if isinstance(lengths, int):
            return [rng.integers(3, 1000, int(rng.integers(1, 20))).tolist() for _ in range(lengths)]
        return [rng.integers(3, 1000, n).tolist() for n in lengths]
    return prompts_of


@pytest.fixture(scope="session")
def load_model():
    import generation

    loaded = {}

    def get(path, fuse: bool = False):
        """The fixture as exported (fuse=False: each layout's own cache mode is what a test
        exercises; tests/generation/runtime/test_fusion.py loads the fused rewrites)."""
        key = (str(path), fuse)
        if key not in loaded:
            loaded[key] = generation.load(path, threads=1, fuse=fuse)
        return loaded[key]
    return get


class ServeApps:
    """The test session's Ray Serve and its applications, each deployed on first use (an app
    idles at a share of a core until the session's Ray stops, so none starts before a test needs
    it): a real-engine app at `real` (the tiny llama-genai model), fake-engine apps
    (deployments.fake, outputs known) at `fake` and `guarded` (an API key, a small queue and body
    limit), encoder-decoder apps at `translate` (tiny Marian) and `speech` (tiny Whisper: 2 s
    windows), each with an Encoder deployment, vision-language apps at `vision` (tiny Qwen2-VL)
    and `smolvlm` (tiny Idefics3), each with a Vision deployment, and an embedding app at `embed`
    (the tiny Qwen2's feature-extraction export, last-token pooling, normalized). Each attribute
    of an app's name is its URL; `app(name)` deploys it for a test that calls its handle."""

    REAL = dict(name="tiny", slots=4, threads=1, settings={"max_new_tokens": 16})
    FAKE = dict(engine="fake", name="fake", slots=4, step_seconds=0.005)
    GUARDED = dict(engine="fake", name="fake", slots=1, max_waiting=2, step_seconds=0.02, api_key="sesame",
                   max_body_bytes=4096)
    CONFIGS = ("real", "fake", "guarded", "translate", "speech", "vision", "smolvlm", "embed")  # the apps' names

    def __init__(self, port: int, real_model: Path, s2s: dict, vl: dict, embedding_models: dict):
        self.port, self.real_model = port, real_model
        self.s2s, self.vl, self.embedding_models = s2s, vl, embedding_models
        self.url = f"http://127.0.0.1:{port}"
        self._configs = {
            "real": {**self.REAL, "model": str(real_model)},
            "fake": self.FAKE,
            "guarded": self.GUARDED,
            "translate": dict(model=str(s2s["marian-optimum"]), name="marian", slots=4, threads=1,
                              settings={"max_new_tokens": 12}),
            "speech": dict(model=str(s2s["whisper-optimum"]), name="whisper", slots=4, threads=1),
            "vision": dict(model=str(vl["qwen2vl-onnx"]), name="qwen", slots=4, threads=1,
                           settings={"max_new_tokens": 10}),
            "smolvlm": dict(model=str(vl["idefics3-onnx"]), name="smol", slots=4, threads=1,
                            settings={"max_new_tokens": 10}),
            "embed": dict(model=str(embedding_models["qwen2-embed"]), name="embed", threads=1),
        }
        assert set(self._configs) == set(self.CONFIGS)
        self._deployed, self._retired = set(), set()
        self.stopped = False  # the session's Serve has stopped (the fixture's teardown)

    def app(self, name: str) -> str:
        """The URL of the session's application `name`, deployed now if it is not yet."""
        if name not in self._deployed:
            from ray import serve

            from deployments.app import build

            if name in self._retired:  # named again after its last test as the scan saw it
                serve.delete(name)  # its stop finished first
                self._retired.discard(name)
            serve.run(build(self._configs[name]), name=name, route_prefix="/" + name)
            self._deployed.add(name)
        return f"{self.url}/{name}"

    def retire(self, name: str) -> None:
        """Stop the application `name` (no later test names it), not waiting for its replicas."""
        if name in self._deployed and not self.stopped:
            from ray import serve

            serve.delete(name, _blocking=False)
            self._deployed.discard(name)
            self._retired.add(name)

    real = property(lambda self: self.app("real"))
    fake = property(lambda self: self.app("fake"))
    guarded = property(lambda self: self.app("guarded"))
    translate = property(lambda self: self.app("translate"))
    speech = property(lambda self: self.app("speech"))
    vision = property(lambda self: self.app("vision"))
    smolvlm = property(lambda self: self.app("smolvlm"))
    embed = property(lambda self: self.app("embed"))


@pytest.fixture(scope="session")
def engine(serve_apps, load_model):
    """(model, tokenizer) of the real app's model, loaded here: the engine alone, to compare with."""
    from generation.text.tokenizer import model_tokenizer

    model = load_model(serve_apps.real_model)
    return model, model_tokenizer(model)


@pytest.fixture(scope="session")
def serve_apps(test_models):
    """One Ray instance for the session's Ray tests (RAY.md: ~9 s to start) and its applications,
    each deployed when a test first asks for it (ServeApps)."""
    import os

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Behind HAProxy an ingress replica that stops stays reachable this long before it drains, so a
    # load balancer can drop it (Ray's default 30 s: every serve.delete of a module's app waited it
    # out, ~6 minutes a session). HAProxy here learns of it within a second and retries refused
    # connections; tests/deployments/app/test_drain.py still checks a redeploy under load.
    os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
    from deployments.cli.environment import use_serving_environment

    use_serving_environment(os.environ.get("RAYMUTER_TEST_PROXY", "haproxy"))  # what `raymuter serve` runs
    import ray
    from ray import serve

    root = str(_HERE.parent)
    path = os.environ.get("PYTHONPATH")
    # 16 logical CPUs: the session's apps ask about 9, and a module's own app (test_serve_routing's
    # 2 decoder replicas) more; with too few, serve.run waits forever for room
    ray.init(num_cpus=16, include_dashboard=False, object_store_memory=100 * 2**20, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": root + (os.pathsep + path if path else "")}})
    from ports import quiet_port

    port = quiet_port()
    apps = ServeApps(port, test_models["llama-genai"], ensure_test_models(seq2seq=True),
                     ensure_test_models(vision=True), ensure_embedding_models(test_models))
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield apps
    apps.stopped = True
    # Serve's own shutdown first: it stops the handles' routers in this process, whose metrics
    # pushers (an autoscaled deployment's) went on after ray.shutdown alone, logging a traceback a
    # second for the rest of the session (and Python 3.11's traceback carets call ast.parse, which
    # is not safe beside another thread's: a test of the import graph failed on it).
    serve.shutdown()
    ray.shutdown()
