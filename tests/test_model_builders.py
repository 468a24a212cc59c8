"""The test models are what they claim: layouts (inputs/outputs), files, and numerics against
the transformers model they were exported from.  Plain onnxruntime only (no ``generation``)."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from model_builders import common, text

PROMPT = [1, 17, 345, 9, 88, 512, 3]  # 7 tokens
FP32_TOL = 1e-4
FP16_TOL = 0.25  # measured max |diff|: 0.055 on PROMPT, 0.13 over 4 prompts (logits ~9)
GREEDY_STEPS = 12

# (key, onnx file relative to the folder, hf oracle name)
ONNX_MODELS = [
    ("llama-optimum", "model.onnx", "llama"),
    ("qwen2-optimum", "model.onnx", "qwen2"),
    ("gpt2-optimum", "model.onnx", "gpt2"),
    ("gpt2-grow", "model.onnx", "gpt2"),
    ("llama-merged", "onnx/decoder_model_merged.onnx", "llama"),
    ("llama-merged", "onnx/decoder_model_merged_quantized.onnx", "llama"),
    ("llama-merged", "onnx/decoder_model_merged_fp16.onnx", "llama"),
    ("llama-genai", "model.onnx", "llama"),
    ("qwen2-genai", "model.onnx", "qwen2"),
]
FP32_MODELS = [m for m in ONNX_MODELS if "quantized" not in m[1] and "fp16" not in m[1]]
_ids = [f"{k}/{f}" for k, f, _ in ONNX_MODELS]

KV_HEADS = {"llama": 2, "qwen2": 2, "gpt2": 4}
HEAD_DIM = 16
N_LAYERS = 2
VOCAB = 1000


def _onnx():
    return pytest.importorskip("onnx")


def _ort():
    return pytest.importorskip("onnxruntime")


_sessions = {}


def session(path):
    ort = _ort()
    path = str(path)
    if path not in _sessions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.log_severity_level = 3
        _sessions[path] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return _sessions[path]


def io(path):
    """{name: (elem_type, dims)} of graph inputs and outputs, read with onnx (no weights)."""
    onnx = _onnx()
    m = onnx.load(str(path), load_external_data=False)

    def d(v):
        return (v.type.tensor_type.elem_type,
                [x.dim_param or x.dim_value for x in v.type.tensor_type.shape.dim])

    return ({i.name: d(i) for i in m.graph.input}, {o.name: d(o) for o in m.graph.output}, m)


def past_names(n_layers=N_LAYERS):
    return [f"past_key_values.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def present_names(n_layers=N_LAYERS):
    return [f"present.{i}.{kv}" for i in range(n_layers) for kv in ("key", "value")]


def feed(sess, ids, past, past_len, first):
    """Feed by NAME for any of the decoder layouts, batch 1, no padding."""
    f = {}
    total = past_len + len(ids)
    for i in sess.get_inputs():
        n = i.name
        if n == "input_ids":
            f[n] = np.array([ids], np.int64)
        elif n == "attention_mask":
            f[n] = np.ones((1, total), np.int64)
        elif n == "position_ids":
            f[n] = np.arange(past_len, total, dtype=np.int64)[None]
        elif n == "use_cache_branch":
            f[n] = np.array([not first])
        elif n in past:
            f[n] = past[n]
        else:
            raise KeyError(f"unexpected input {n}")
    return f


def empty_past(sess, kv):
    dt = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
    return {i.name: np.zeros((1, kv, 0, HEAD_DIM), dt[i.type])
            for i in sess.get_inputs() if i.name.startswith("past_key_values.")}


def forward(path, name, ids):
    sess = session(path)
    past = empty_past(sess, KV_HEADS[name])
    out = sess.run(None, feed(sess, ids, past, 0, True))
    return dict(zip([o.name for o in sess.get_outputs()], out))


def onnx_greedy(path, name, prompt, steps, eos=common.EOS_ID):
    """Append-mode greedy loop with a growing KV cache (present -> past)."""
    sess = session(path)
    past = empty_past(sess, KV_HEADS[name])
    ids, past_len, toks = list(prompt), 0, []
    for step in range(steps):
        out = dict(zip([o.name for o in sess.get_outputs()],
                       sess.run(None, feed(sess, ids, past, past_len, step == 0))))
        nxt = int(out["logits"][0, -1].astype(np.float32).argmax())
        if nxt == eos:
            break
        toks.append(nxt)
        past_len += len(ids)
        past = {n: out[n.replace("past_key_values", "present")] for n in past}
        assert all(v.shape[2] == past_len for v in past.values())
        ids = [nxt]
    return toks


# ------------------------------------------------------------------------------------------
# files and configs
# ------------------------------------------------------------------------------------------
def test_all_keys_present(test_models):
    assert set(test_models) == set(text.MODEL_DIRS)
    for k, p in test_models.items():
        assert p.is_dir(), k


@pytest.mark.parametrize("key", [k for k in text.MODEL_DIRS if not k.endswith("-genai")])
def test_hf_layout_files(test_models, key):
    d = test_models[key]
    for f in ("config.json", "generation_config.json") + common.TOKENIZER_FILES:
        assert (d / f).is_file(), f"{key}: missing {f}"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == VOCAB
    assert (cfg["pad_token_id"], cfg["bos_token_id"], cfg["eos_token_id"]) == (0, 1, 2)
    gen = json.loads((d / "generation_config.json").read_text())
    assert (gen["pad_token_id"], gen["bos_token_id"], gen["eos_token_id"]) == (0, 1, 2)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_hf_models(test_models, oracle, name):
    d = test_models[f"hf/{name}"]
    assert (d / "model.safetensors").is_file()
    cfg = oracle.config(name)
    hidden = getattr(cfg, "hidden_size", None) or cfg.n_embd
    assert hidden == 64 and cfg.num_hidden_layers == N_LAYERS and cfg.num_attention_heads == 4
    if name != "gpt2":
        assert cfg.num_key_value_heads == 2 and cfg.tie_word_embeddings is False
    assert cfg.initializer_range == common.INIT_RANGE
    # the N(0, 0.1) perturbation: no parameter is all zeros or all ones
    for pname, p in oracle.model(name).named_parameters():
        assert not ((p == 0).all() or (p == 1).all()), pname


@pytest.mark.parametrize("key", list(text.MODEL_DIRS))
def test_tokenizer(test_models, key):
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(test_models[key] / "tokenizer.json"))
    assert tok.get_vocab_size() == VOCAB
    assert [tok.token_to_id(t) for t in ("<pad>", "<s>", "</s>")] == [0, 1, 2]
    ids = tok.encode("kalomi shita").ids
    assert ids[0] == 1 and all(3 <= i < VOCAB for i in ids[1:])
    assert tok.decode(ids, skip_special_tokens=True) == "kalomi shita"


def test_genai_files(test_models):
    for key in ("llama-genai", "qwen2-genai"):
        d = test_models[key]
        for f in ("model.onnx", "model.onnx.data", "genai_config.json") + common.TOKENIZER_FILES:
            assert (d / f).is_file(), f"{key}: missing {f}"
        assert not (d / "config.json").exists()  # as the genai builder writes it
        gc = json.loads((d / "genai_config.json").read_text())
        assert gc["search"]["past_present_share_buffer"] is True
        dec = gc["model"]["decoder"]
        assert (dec["num_key_value_heads"], dec["head_size"], dec["num_hidden_layers"]) == (2, 16, 2)
        assert gc["model"]["eos_token_id"] == 2 and gc["model"]["vocab_size"] == VOCAB


def test_ir_versions(test_models):
    onnx = _onnx()
    root = test_models["hf/llama"].parent.parent
    files = sorted(root.rglob("*.onnx"))
    assert len(files) == 9
    for f in files:
        assert onnx.load(str(f), load_external_data=False).ir_version <= common.MAX_IR_VERSION, f


# ------------------------------------------------------------------------------------------
# graph inputs / outputs
# ------------------------------------------------------------------------------------------
F32, F16, I64, BOOL = 1, 10, 7, 9


@pytest.mark.parametrize("key", ["llama-optimum", "qwen2-optimum", "gpt2-optimum"])
def test_optimum_io(test_models, key):
    ins, outs, _ = io(test_models[key] / "model.onnx")
    assert set(ins) == {"input_ids", "attention_mask", "position_ids", *past_names()}
    assert set(outs) == {"logits", *present_names()}
    assert ins["position_ids"][0] == I64 and outs["logits"][0] == F32


def test_grow_io(test_models):
    ins, outs, _ = io(test_models["gpt2-grow"] / "model.onnx")
    assert set(ins) == {"input_ids", "attention_mask", *past_names()}  # NO position_ids
    assert set(outs) == {"logits", *present_names()}
    assert ins["past_key_values.0.key"][1][1] == KV_HEADS["gpt2"]


@pytest.mark.parametrize("variant", ["", "_quantized", "_fp16"])
def test_merged_io(test_models, variant):
    d = test_models["llama-merged"]
    assert not (d / "model.onnx").exists()
    ins, outs, m = io(d / "onnx" / f"decoder_model_merged{variant}.onnx")
    assert set(ins) == {"input_ids", "attention_mask", "position_ids", "use_cache_branch",
                        *past_names()}
    assert set(outs) == {"logits", *present_names()}
    assert ins["use_cache_branch"] == (BOOL, [1])
    assert ins["input_ids"][0] == I64 and ins["attention_mask"][0] == I64
    ifs = [n for n in m.graph.node if n.op_type == "If"]
    assert len(ifs) == 1 and ifs[0].input[0] == "use_cache_branch"
    fdt = F16 if variant == "_fp16" else F32
    for n in past_names():
        assert ins[n] == (fdt, ["batch_size", 2, "past_sequence_length", 16]), n
    for n in ["logits", *present_names()]:
        assert outs[n][0] == fdt, n
    branches = [a.g for a in ifs[0].attribute]
    ops = [{n.op_type for n in g.node} for g in branches]
    if variant == "_quantized":
        assert all("MatMulInteger" in o and "DynamicQuantizeLinear" in o for o in ops)
        for g in branches:
            assert any(t.data_type == 3 for t in g.initializer)  # int8 weights
    else:
        assert all("MatMulInteger" not in o for o in ops)
    if variant == "_fp16":
        for g in branches:
            big = [t for t in g.initializer if len(t.dims) == 2]
            assert big and all(t.data_type == F16 for t in big)


@pytest.mark.parametrize("key", ["llama-genai", "qwen2-genai"])
def test_genai_io(test_models, key):
    ins, outs, m = io(test_models[key] / "model.onnx")
    assert set(ins) == {"input_ids", "attention_mask", *past_names()}  # NO position_ids
    assert set(outs) == {"logits", *present_names()}
    gqa = [n for n in m.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == N_LAYERS and all(n.domain == "com.microsoft" for n in gqa)
    assert any(t.data_location == 1 for t in m.graph.initializer)  # external data file


# ------------------------------------------------------------------------------------------
# numerics: ONNX vs transformers
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key,file,name", ONNX_MODELS, ids=_ids)
def test_prompt_logits(test_models, oracle, key, file, name):
    ref = oracle.logits(name, PROMPT)
    out = forward(test_models[key] / file, name, PROMPT)
    lg = out["logits"]
    assert lg.shape == (1, len(PROMPT), VOCAB)
    for n in present_names():
        assert out[n].shape == (1, KV_HEADS[name], len(PROMPT), HEAD_DIM), n
    lg = lg[0].astype(np.float32)
    diff = float(np.abs(lg - ref).max())
    agree = float((lg.argmax(-1) == ref.argmax(-1)).mean())
    if "fp16" in file:
        assert out["logits"].dtype == np.float16
        assert out["present.0.key"].dtype == np.float16
        assert diff < FP16_TOL, diff
        assert agree >= 6 / 7, agree
    elif "quantized" in file:
        # int8 weights: clearly not the fp32 graph, still the same model
        assert 1e-3 < diff < 3.0, diff
        rel = np.linalg.norm(lg - ref) / np.linalg.norm(ref)
        assert rel < 0.15, rel
        assert agree >= 4 / 7, agree
    else:
        assert diff < FP32_TOL, diff


@pytest.mark.parametrize("key,file,name", FP32_MODELS, ids=[f"{k}/{f}" for k, f, _ in FP32_MODELS])
def test_greedy_matches_transformers(test_models, oracle, key, file, name):
    """A KV-cache greedy loop (past fed back as present) reproduces ``generate``."""
    ref = oracle.greedy(name, PROMPT, GREEDY_STEPS)
    assert len(ref) == GREEDY_STEPS  # no early eos: the comparison covers every step
    assert onnx_greedy(test_models[key] / file, name, PROMPT, GREEDY_STEPS) == ref


def test_fp16_greedy_close(test_models, oracle):
    ref = oracle.greedy("llama", PROMPT, GREEDY_STEPS)
    got = onnx_greedy(test_models["llama-merged"] / "onnx/decoder_model_merged_fp16.onnx",
                      "llama", PROMPT, GREEDY_STEPS)
    prefix = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
    assert prefix >= GREEDY_STEPS // 2, (got, ref)


@pytest.mark.parametrize("key,name", [("llama-genai", "llama"), ("qwen2-genai", "qwen2")])
def test_genai_generator(test_models, oracle, key, name):
    og = pytest.importorskip("onnxruntime_genai")
    model = og.Model(str(test_models[key]))
    params = og.GeneratorParams(model)
    params.set_search_options(do_sample=False, max_length=len(PROMPT) + GREEDY_STEPS)
    gen = og.Generator(model, params)
    gen.append_tokens(np.array([PROMPT], np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    got = list(gen.get_sequence(0))[len(PROMPT):]
    if got and got[-1] == common.EOS_ID:
        got = got[:-1]
    assert got == oracle.greedy(name, PROMPT, GREEDY_STEPS)


# ------------------------------------------------------------------------------------------
# cache
# ------------------------------------------------------------------------------------------
def test_cache_is_warm_and_stable(test_models):
    t0 = time.time()
    again = text.ensure_test_models()
    assert time.time() - t0 < 5
    assert again == test_models
    assert text.cache_key() == test_models["hf/llama"].parent.parent.name
    manifest = json.loads((test_models["hf/llama"].parent.parent / "manifest.json").read_text())
    assert manifest["models"] == text.MODEL_DIRS
    assert manifest["versions"] == common.package_versions()
