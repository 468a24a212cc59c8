"""Build the project's test models: tiny random-weight Hugging Face models and their ONNX
exports in every layout the engine must serve.  Nothing is downloaded; everything is built
from a ``transformers`` config with random weights.

Layouts (keys of :data:`MODEL_DIRS`, relative folders under the cache folder):

``hf/llama``, ``hf/qwen2``, ``hf/gpt2``
    torch models (``save_pretrained``) + tokenizer: the oracle.
``llama-optimum``, ``qwen2-optimum``, ``gpt2-optimum``
    ``optimum`` ``text-generation-with-past`` export: root ``model.onnx`` with ``position_ids``.
``gpt2-grow``
    root ``model.onnx`` WITHOUT ``position_ids`` (positions come from the cache length).
``llama-merged``
    transformers.js / onnx-community layout: ``onnx/decoder_model_merged.onnx``
    (``use_cache_branch`` bool[1] + one If node), ``onnx/decoder_model_merged_quantized.onnx``
    (int8 dynamic quantization) and ``onnx/decoder_model_merged_fp16.onnx`` (float16 weights
    and float16 past / present / logits).
``llama-genai``, ``qwen2-genai``
    ``onnxruntime_genai.models.builder -p fp32 -e cpu``: ``model.onnx`` + ``model.onnx.data`` +
    ``genai_config.json`` + tokenizer files, exactly as the builder writes them (no config.json).

Entry points:

* :func:`ensure_test_models` -> ``dict[str, Path]``: cached build (see its docstring).
* :func:`build_all` builds everything into a folder, in this process (heavy imports).
* ``python tests/model_builders.py [--root DIR]``: ensure the cache, print the paths as JSON.

This module has no import-time side effects and imports torch / transformers / onnx lazily.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

SEED = 0
INIT_RANGE = 0.3
PERTURB = 0.1
TINY_VOCAB = 1000
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
MAX_IR_VERSION = 10  # onnx 1.23 writes IR 14 by default; onnxruntime reads at most ~13

#: key -> folder relative to the cache folder
MODEL_DIRS = {
    "hf/llama": "hf/llama",
    "hf/qwen2": "hf/qwen2",
    "hf/gpt2": "hf/gpt2",
    "llama-optimum": "llama-optimum",
    "qwen2-optimum": "qwen2-optimum",
    "gpt2-optimum": "gpt2-optimum",
    "gpt2-grow": "gpt2-grow",
    "llama-merged": "llama-merged",
    "llama-genai": "llama-genai",
    "qwen2-genai": "qwen2-genai",
}

#: packages whose versions are part of the cache key
VERSIONED_PACKAGES = ("torch", "transformers", "optimum", "optimum-onnx", "onnx", "onnxruntime",
                      "onnxruntime-genai", "tokenizers", "onnxscript")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
META_FILES = ("config.json", "generation_config.json") + TOKENIZER_FILES + ("chat_template.jinja",)

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant:{% endif %}")


# --------------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------------
def tiny_config(kind: str):
    """transformers config of the tiny ``kind`` model (llama, qwen2, gpt2) and its model class."""
    import transformers as tf

    common = dict(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if kind == "llama":
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, initializer_range=INIT_RANGE, **common)
    if kind == "qwen2":
        return tf.Qwen2ForCausalLM, tf.Qwen2Config(
            vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False, max_window_layers=2, use_sliding_window=False,
            initializer_range=INIT_RANGE, **common)
    if kind == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=TINY_VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=256,
            initializer_range=INIT_RANGE, **common)
    raise ValueError(f"unknown tiny model kind {kind!r}")


# --------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------
def _tiny_corpus(n=20000, seed=0):
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
    tok.train_from_iterator(corpus if corpus is not None else _tiny_corpus(), trainer=trainer)
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


def build_tiny_hf(kind, out, tokenizer) -> int:
    cls, cfg = tiny_config(kind)
    return build_hf_model(cls, cfg, out, tokenizer, init_range=INIT_RANGE, perturb=PERTURB)


def copy_meta(src, dst):
    """Copy config / generation config / tokenizer files of an HF folder into ``dst``."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in META_FILES:
        if (Path(src) / name).exists():
            shutil.copy2(Path(src) / name, dst / name)


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


def export_decoder_dynamo(hf_dir, out, *, position_ids=True, past=True):
    """``torch.onnx.export(dynamo=True)`` of a decoder-only model, optimum naming.

    inputs: input_ids, attention_mask, [position_ids], [past_key_values.N.key/.value]
    outputs: logits, present.N.key/.value.  ``past=False`` gives the first-step graph (no
    past inputs, still outputs present.*), for :func:`merge_decoders`.  ``position_ids=False``
    gives the "grow" layout (positions derived from the past length).
    (TorchScript export dies on transformers 4.57's vmap masks; dynamo works.)
    """
    import torch
    import transformers as tf
    from transformers import DynamicCache

    class Wrapper(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model
            self.n = model.config.num_hidden_layers

        def forward(self, input_ids, attention_mask, *rest):
            if position_ids:
                pos, pkv = rest[0], rest[1:]
            else:
                pos, pkv = None, rest
            cache = DynamicCache()
            if past:
                for i in range(self.n):
                    cache.update(pkv[2 * i], pkv[2 * i + 1], i)
            o = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                           past_key_values=cache, use_cache=True)
            res = [o.logits]
            for i in range(self.n):
                res += [o.past_key_values.layers[i].keys, o.past_key_values.layers[i].values]
            return tuple(res)

    model = tf.AutoModelForCausalLM.from_pretrained(str(hf_dir)).eval()
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    B, T, P = 2, 4, (3 if past else 0)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    am = torch.ones(B, P + T, dtype=torch.long)
    pos = torch.arange(P, P + T).expand(B, T)
    pkv = [torch.randn(B, n_kv, P, hd, generator=g) for _ in range(2 * n_layers)] if past else []
    in_names = ["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
    out_names = ["logits"]
    for i in range(n_layers):
        for kv in ("key", "value"):
            if past:
                in_names.append(f"past_key_values.{i}.{kv}")
            out_names.append(f"present.{i}.{kv}")
    bs = torch.export.Dim("batch_size", min=1, max=64)
    sl = torch.export.Dim("sequence_length", min=1, max=1024)
    pl = torch.export.Dim("past_sequence_length", min=0, max=1024)
    tl = torch.export.Dim("total_sequence_length", min=1, max=2048)
    rest = ([{0: bs, 1: sl}] if position_ids else []) + [{0: bs, 2: pl}] * len(pkv)
    args = (ids, am) + ((pos,) if position_ids else ()) + tuple(pkv)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        prog = torch.onnx.export(Wrapper(model), args, None, dynamo=True, input_names=in_names,
                                 output_names=out_names,
                                 dynamic_shapes=({0: bs, 1: sl}, {0: bs, 1: tl}, tuple(rest)),
                                 opset_version=18, optimize=True, verbose=False)
    prog.save(str(out), external_data=False)
    cap_ir_version(out)


def merge_decoders(no_past_path, with_past_path, out_path):
    """Merge a no-past and a with-past decoder into ONE graph with ``use_cache_branch`` bool[1]
    and an If node (then = with-past, else = no-past): the optimum / transformers.js
    ``decoder_model_merged.onnx`` layout.  Weights are stored once per branch (tiny models).
    (optimum.onnx.merge_decoders refuses torch.onnx.export graphs: present.* dim names differ.)
    """
    import onnx
    from onnx import helper

    m1, m2 = onnx.load(str(no_past_path)), onnx.load(str(with_past_path))
    names1 = [o.name for o in m1.graph.output]
    names2 = [o.name for o in m2.graph.output]
    assert names1 == names2, (names1, names2)
    outer_inputs = [i.name for i in m2.graph.input]
    assert {i.name for i in m1.graph.input} <= set(outer_inputs)

    def branch(model, prefix):
        g = onnx.GraphProto()
        g.CopyFrom(model.graph)
        keep = set(outer_inputs)

        def rn(name):
            return name if (not name or name in keep) else prefix + name

        for n in g.node:
            n.name = prefix + n.name
            n.input[:] = [rn(x) for x in n.input]
            n.output[:] = [rn(x) for x in n.output]
        for init in g.initializer:
            init.name = rn(init.name)
        for vi in g.value_info:
            vi.name = rn(vi.name)
        outs = []
        for o in g.output:
            o2 = onnx.ValueInfoProto()
            o2.CopyFrom(o)
            o2.name = rn(o.name)
            outs.append(o2)
        del g.output[:]
        g.output.extend(outs)
        del g.input[:]
        g.name = prefix.strip("_/") or "branch"
        return g

    then_g = branch(m2, "with_past/")
    else_g = branch(m1, "no_past/")
    outer_outs = []
    for o in m2.graph.output:
        v = onnx.ValueInfoProto()
        v.CopyFrom(o)
        if o.name.startswith("present"):
            v.type.tensor_type.shape.dim[2].dim_param = "total_sequence_length"
        outer_outs.append(v)
    if_node = helper.make_node("If", ["use_cache_branch"], names2, name="optimum::if",
                               then_branch=then_g, else_branch=else_g)
    ucb = helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1])
    graph = helper.make_graph([if_node], "merged", list(m2.graph.input) + [ucb], outer_outs)
    opsets = {o.domain: o.version for o in list(m1.opset_import) + list(m2.opset_import)}
    model = helper.make_model(graph, producer_name="raymuter-tests",
                              opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    model.ir_version = min(max(m1.ir_version, m2.ir_version), MAX_IR_VERSION)
    onnx.checker.check_model(model)
    onnx.save(model, str(out_path))


def quantize_int8(src, dst):
    """int8 dynamic quantization of the weights (MatMulInteger), If subgraphs included."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8,
                     extra_options={"EnableSubgraph": True})
    cap_ir_version(dst)


def convert_fp16(src, dst):
    """float16 weights AND float16 graph inputs/outputs (past, present, logits), as in
    transformers.js ``*_fp16.onnx`` exports; integer / bool inputs are unchanged."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    m = onnx.load(str(src))
    m16 = convert_float_to_float16(m, keep_io_types=False)
    m16.ir_version = min(m.ir_version, MAX_IR_VERSION)
    onnx.save(m16, str(dst))


def genai_command(hf_dir, out, cache_dir):
    return [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir),
            "-o", str(out), "-p", "fp32", "-e", "cpu", "-c", str(cache_dir)]


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


def build_genai(hf_dir, out, work_dir):
    """``python -m onnxruntime_genai.models.builder -i HF -o OUT -p fp32 -e cpu -c CACHE``."""
    work_dir = Path(work_dir)
    cache = work_dir / f"genai-cache-{Path(out).name}"
    try:
        run_logged(genai_command(hf_dir, out, cache), work_dir / f"{Path(out).name}.log")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def offline_env():
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


# --------------------------------------------------------------------------------------------
# whole build
# --------------------------------------------------------------------------------------------
def _stderr_progress(msg):
    print(msg, file=sys.stderr, flush=True)


def build_all(root, progress=_stderr_progress) -> dict[str, Path]:
    """Build every test model into ``root`` (not atomic; see :func:`ensure_test_models`).

    Runs in this process (imports torch, transformers, optimum, onnx); the two genai builds
    run as subprocesses in parallel with the torch exports.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    logs = root / "logs"
    logs.mkdir(exist_ok=True)
    for k, v in offline_env().items():
        os.environ.setdefault(k, v)
    lock = threading.Lock()

    def report(key, t0, extra=""):
        with lock:
            progress(f"[test-models] {key:<14} {time.time() - t0:6.1f}s{extra}")

    @contextlib.contextmanager
    def step(key, extra=""):
        t0 = time.time()
        yield
        report(key, t0, extra)

    t0 = time.time()
    import torch  # noqa: F401  (timed here: the import dominates the first step)

    tok = build_tokenizer(TINY_VOCAB)
    for kind in ("llama", "qwen2", "gpt2"):
        n = build_tiny_hf(kind, root / "hf" / kind, tok)
        report(f"hf/{kind}", t0, f"  ({n} params)")
        t0 = time.time()

    # genai builds: subprocesses (own torch import), one after the other, in a thread, so
    # they overlap with the single-threaded torch exports below.
    genai_errors = []

    def genai_thread():
        for kind in ("llama", "qwen2"):
            t1 = time.time()
            try:
                build_genai(root / "hf" / kind, root / f"{kind}-genai", logs)
            except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
                genai_errors.append(e)
                return
            report(f"{kind}-genai", t1)

    th = threading.Thread(target=genai_thread, name="genai-builder", daemon=True)
    th.start()
    try:
        for kind in ("llama", "qwen2", "gpt2"):
            with step(f"{kind}-optimum"):
                export_optimum(root / "hf" / kind, root / f"{kind}-optimum")

        with step("gpt2-grow"):
            export_decoder_dynamo(root / "hf" / "gpt2", root / "gpt2-grow" / "model.onnx",
                                  position_ids=False)
            copy_meta(root / "hf" / "gpt2", root / "gpt2-grow")

        with step("llama-merged"):
            d = root / "llama-merged"
            onnx_dir = d / "onnx"
            tmp = root / "tmp-merged"
            export_decoder_dynamo(root / "hf" / "llama", tmp / "decoder_model.onnx", past=False)
            export_decoder_dynamo(root / "hf" / "llama", tmp / "decoder_with_past_model.onnx")
            onnx_dir.mkdir(parents=True, exist_ok=True)
            merged = onnx_dir / "decoder_model_merged.onnx"
            merge_decoders(tmp / "decoder_model.onnx", tmp / "decoder_with_past_model.onnx", merged)
            shutil.rmtree(tmp)
            quantize_int8(merged, onnx_dir / "decoder_model_merged_quantized.onnx")
            convert_fp16(merged, onnx_dir / "decoder_model_merged_fp16.onnx")
            copy_meta(root / "hf" / "llama", d)
    finally:
        th.join()
    if genai_errors:
        raise genai_errors[0]

    paths = {k: root / v for k, v in MODEL_DIRS.items()}
    missing = [k for k, p in paths.items() if not p.is_dir()]
    if missing:
        raise RuntimeError(f"build finished without {missing}")
    for f in root.rglob("*.onnx"):
        cap_ir_version(f)
    return paths


# --------------------------------------------------------------------------------------------
# cache
# --------------------------------------------------------------------------------------------
def package_versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def cache_key() -> str:
    """Hash of this file's source text and the versions of the packages that build the models."""
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(json.dumps(package_versions(), sort_keys=True).encode())
    h.update(f"python {sys.version_info[0]}.{sys.version_info[1]}".encode())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    env = os.environ.get("RAYMUTER_TEST_MODELS")
    return (Path(env).expanduser().absolute() if env
            else Path.home() / ".cache" / "raymuter" / "test-models")


def _complete(folder: Path) -> bool:
    return (folder / "manifest.json").is_file() and all(
        (folder / v).is_dir() for v in MODEL_DIRS.values())


def ensure_test_models(root=None, *, progress=_stderr_progress) -> dict[str, Path]:
    """Paths of all test models (keys of :data:`MODEL_DIRS`), building them only when missing.

    Cache folder: ``$RAYMUTER_TEST_MODELS`` (else ``~/.cache/raymuter/test-models``) /
    :func:`cache_key`.  The build runs in ONE worker subprocess (``python model_builders.py
    --build-into TMP``) into a temporary sibling folder that is renamed into place when
    complete, under an ``fcntl`` lock so concurrent processes build once.  A failed build
    leaves its log at ``<cache root>/<key>.failed.log`` and raises ``RuntimeError``.
    """
    import fcntl

    base = Path(root).expanduser().absolute() if root is not None else cache_root()
    key = cache_key()
    final = base / key
    paths = {k: final / v for k, v in MODEL_DIRS.items()}
    if _complete(final):
        return paths
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f".{key}.lock", "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        try:
            if _complete(final):  # built by another process while we waited
                return paths
            # we hold the lock: any leftover temp folder of this key is from a dead build
            for stale in base.glob(f".{key}.building-*"):
                shutil.rmtree(stale, ignore_errors=True)
            if final.exists():  # incomplete (files deleted by hand?): rebuild
                shutil.rmtree(final)
            tmp = base / f".{key}.building-{os.getpid()}"
            tmp.mkdir()
            t0 = time.time()
            progress(f"[test-models] building into {final} (cache miss)")
            proc = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "--build-into", str(tmp)],
                stdin=subprocess.DEVNULL, env=offline_env(), timeout=1800)
            if proc.returncode != 0 or not _complete(tmp):
                failed_log = base / f"{key}.failed.log"
                log = tmp / "logs" / "build.log"
                if log.exists():
                    shutil.copy2(log, failed_log)
                shutil.rmtree(tmp, ignore_errors=True)
                raise RuntimeError(f"test model build failed (rc={proc.returncode}); "
                                   f"log: {failed_log}")
            os.rename(tmp, final)
            progress(f"[test-models] all built in {time.time() - t0:.1f}s -> {final}")
        finally:
            fcntl.flock(lockf, fcntl.LOCK_UN)
    return paths


def _worker(tmp: Path) -> int:
    """Subprocess body: build into ``tmp``; library noise goes to ``tmp/logs/build.log``,
    progress lines to the original stderr."""
    import traceback

    t0 = time.time()
    (tmp / "logs").mkdir(parents=True, exist_ok=True)
    progress_fd = os.dup(2)
    progress_out = os.fdopen(progress_fd, "w", buffering=1)
    log = open(tmp / "logs" / "build.log", "w", buffering=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)

    def progress(msg):
        progress_out.write(msg + "\n")
        print(msg, flush=True)  # into the log too

    try:
        paths = build_all(tmp, progress=progress)
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        sys.stderr.flush()
        progress_out.write("[test-models] BUILD FAILED:\n"
                           + "".join(traceback.format_exc()[-3000:]) + "\n")
        return 1
    manifest = {
        "models": {k: str(p.relative_to(tmp)) for k, p in paths.items()},
        "versions": package_versions(),
        "cache_key": cache_key(),
        "build_seconds": round(time.time() - t0, 1),
        "files": sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*")
                        if f.is_file() and f.parts[len(tmp.parts)] != "logs"),
    }
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return 0


def main(argv=None):
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", help="cache root (default $RAYMUTER_TEST_MODELS or "
                                   "~/.cache/raymuter/test-models)")
    ap.add_argument("--key", choices=sorted(MODEL_DIRS), help="print only this model's folder")
    ap.add_argument("--build-into", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.build_into:
        return _worker(Path(a.build_into))
    paths = ensure_test_models(a.root)
    if a.key:
        print(paths[a.key])
    else:
        print(json.dumps({k: str(v) for k, v in paths.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
