"""What the test-model builders share: the tiny models' ids and init, the tokenizer, a
random-weight Hugging Face model, file copies, the ONNX IR cap, optimum's export, the offline
environment, and the cache: its folder, its keys (hashes of the builders' source and the package
versions) and the worker subprocess a build runs in.

No import-time side effects; torch / transformers / onnx are imported lazily.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent  # tests/model_builders
REPO = HERE.parent.parent
#: the merged-graph builder of the default model, which builds the ``llama-merged`` and
#: ``gpt2-grow`` fixtures too (part of their cache key)
DEFAULT_MODEL_EXPORT = REPO / "generation" / "default_model" / "export.py"

SEED = 0
INIT_RANGE = 0.3
PERTURB = 0.1
TINY_VOCAB = 1000
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_IR_VERSION = 10  # onnx 1.23 writes IR 14 by default; onnxruntime reads at most ~13

#: packages whose versions are part of the cache key
VERSIONED_PACKAGES = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime",
                      "onnxruntime-genai", "tokenizers", "onnxscript")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
META_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES + ("chat_template.jinja",)

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


# ----------
# tokenizer
# --------------------------------------------------------------------------------------------
def tiny_corpus(n=20000, seed=0):
    import random

    rnd = random.Random(seed)
    syl = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "an", "el", "or", "is", "qu", "ve",
           "the", "and", "ing", "ion", "er", "st", "th", "ou", "in", "re"]
    words = ["".join(rnd.choice(syl) for _ in range(rnd.randint(1, 4))) for _ in range(3000)]
    for _ in range(n // 20):
        yield (" ".join(rnd.choice(words) for _ in range(20)) + rnd.choice([".", "!", "?", ","])
               + f" {rnd.randint(0, 999)}")


def build_tokenizer(vocab_size: int = TINY_VOCAB, corpus=None):
    """Deterministic byte-level BPE trained locally, as a ``PreTrainedTokenizerFast``.

    ids: ``<pad>`` = 0, ``<s>`` = 1, ``</s>`` = 2; the post-processor prepends ``<s>``.
    If the corpus cannot fill ``vocab_size``, filler tokens ``<extra_N>`` pad it exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus if corpus is not None else tiny_corpus(), trainer=trainer)
    n = tok.get_vocab_size()
    if n < vocab_size:
        tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - n)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", BOS_ID)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    assert fast.convert_tokens_to_ids(["<pad>", "<s>", "</s>"]) == [PAD_ID, BOS_ID, EOS_ID]
    assert len(fast) == vocab_size, (len(fast), vocab_size)
    return fast


# --------------------------------------------------------------------------------------------
# HF models
# --------------------------------------------------------------------------------------------
def build_hf_model(model_cls, config, out, tokenizer, *, init_range=None, perturb=None,
                   seed=SEED) -> int:
    """Random-weight model from ``config`` -> ``save_pretrained(out)`` with ``tokenizer``.

    ``init_range`` overrides ``config.initializer_range``; ``perturb`` adds N(0, perturb) to
    every parameter (HF inits biases to 0 and norms to 1, which would hide bias/norm bugs).
    Returns the parameter count.
    """
    import torch
    from transformers import GenerationConfig

    torch.manual_seed(seed)
    if init_range is not None:
        config.initializer_range = init_range
    model = model_cls(config).eval()
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * perturb)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id,
                                               eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())



def copy_meta(src, dst):
    """Copy config / generation config / tokenizer files of an HF folder into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in META_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


def copy_hf_files(src, dst):
    """Copy every file of an HF folder but the weights (config, generation config, tokenizer,
    preprocessor config) into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and f.suffix not in (".safetensors", ".bin"):
            shutil.copy2(f, dst / f.name)


# --------------------------------------------------------------------------------------------
# ONNX helpers
# --------------------------------------------------------------------------------------------
def cap_ir_version(path, max_ir=MAX_IR_VERSION):
    """Rewrite ``path`` with ``ir_version = max_ir`` if it was saved with a newer IR version."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    if m.ir_version > max_ir:
        m.ir_version = max_ir
        onnx.save(m, str(path))


def export_optimum(hf_dir, out, task="text-generation-with-past"):
    """``optimum-cli export onnx --task text-generation-with-past`` through the Python API."""
    from optimum.exporters.onnx import main_export

    main_export(str(hf_dir), output=str(out), task=task, library_name="transformers",
                local_files_only=True)


def run_logged(cmd, log_path, env=None):
    """Run ``cmd`` with stdout/stderr into ``log_path``; raise with the log tail on failure."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env if env is not None else offline_env()).returncode
    if rc != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise RuntimeError(f"command failed (rc={rc}): {' '.join(cmd)}\n--- {log_path} ---\n{tail}")


def offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env



@contextlib.contextmanager
def offline_environ():
    """This process's environment offline (no hub) for a build run in it, restored after."""
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def locked_build(final: Path, build, progress) -> None:
    """Run `build(tmp)` into a temporary sibling of `final` and rename it into place, once:
    under an ``fcntl`` lock, so concurrent processes build once; `final/manifest.json` marks a
    complete build (a failed one leaves nothing)."""
    import fcntl
    import time

    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if (final / "manifest.json").is_file():
                return
            shutil.rmtree(final, ignore_errors=True)
            tmp = final.parent / f".{final.name}.building-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            started = time.time()
            progress(f"[test-models] building {final.name}")
            try:
                build(tmp)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
            os.rename(tmp, final)
            progress(f"[test-models] {final.name} built in {time.time() - started:.1f}s")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cache_root() -> Path:
    env = os.environ.get("RAYMUTER_TEST_MODELS")
    return (Path(env).expanduser().absolute() if env
            else Path.home() / ".cache" / "raymuter" / "test-models")


def source_key(files, *extra: str) -> str:
    """16 hex digits of a SHA-256 over the bytes of ``files`` (what builds a set of models) and
    the strings ``extra`` (another key, package versions): a cache folder's name."""
    h = hashlib.sha256()
    for f in files:
        h.update(Path(f).read_bytes())
    for s in extra:
        h.update(s.encode())
    return h.hexdigest()[:16]


def versions_text() -> str:
    """The package versions and the Python version, as part of a key."""
    return (json.dumps(package_versions(), sort_keys=True)
            + f"python {sys.version_info[0]}.{sys.version_info[1]}")


def worker_command(module: str, tmp: Path) -> list[str]:
    """``python -m model_builders.<module> --build-into TMP``: a build in its own process (torch and
    the exporters' imports stay out of the test session); run it with :func:`worker_env`."""
    return [sys.executable, "-m", f"model_builders.{module}", "--build-into", str(tmp)]


def worker_env() -> dict[str, str]:
    """:func:`offline_env` with the project and tests/ on ``PYTHONPATH``: the worker imports
    ``generation`` (the default model's exporter) and ``model_builders``."""
    env = offline_env()
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE.parent)] + ([path] if path else []))
    return env
