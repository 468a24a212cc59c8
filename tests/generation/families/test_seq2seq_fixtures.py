"""The tiny encoder-decoder test models (Marian, T5, BART, Whisper) are what they claim: files,
graph inputs/outputs, the ONNX encoder against torch, and a plain onnxruntime greedy loop
against transformers ``generate()``.  Plain onnxruntime + transformers (no ``generation``).

:func:`onnx_greedy` is the decoding protocol of the optimum encoder-decoder layout, written out
for the engine author:

1. encoder once: ``last_hidden_state = encoder(input_ids, attention_mask)`` (Whisper:
   ``encoder(input_features)``, no mask).
2. decoder step 0: ``input_ids`` = the decoder prompt (``decoder_start_token_id``; Whisper
   ``<|startoftranscript|> <|lang|> <|task|> <|notimestamps|>``), ``use_cache_branch=[False]``,
   every ``past_key_values.N.*`` zero-length ``(B, heads, 0, head_dim)``,
   ``encoder_hidden_states``, ``encoder_attention_mask`` (= the encoder's attention_mask; not
   Whisper).
3. steps > 0: ``input_ids`` = the last token ``(B, 1)``, ``use_cache_branch=[True]``,
   ``past_key_values.N.decoder.*`` = the previous step's ``present.N.decoder.*`` (grows by one
   position a step), ``past_key_values.N.encoder.*`` = the STEP-0 ``present.N.encoder.*``
   (cross-attention K/V, computed once; later steps return ``(0, heads, 1, head_dim)``
   dummies for them).
4. logits processors as ``generate`` builds them from the generation config: Marian / BART
   ``forced_eos_token_id`` (the last allowed token is eos); Whisper ``suppress_tokens`` always
   and ``begin_suppress_tokens`` on the first generated token.  Finished rows emit pad.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from model_builders import seq2seq as mb
from model_builders.common import TINY_VOCAB
from model_builders.text import ensure_test_models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")


SOURCES = ["kalomi the ruta 42!", "shi po anel orisque, the veta ingion 7. tashi ne ru mi lo ka"]
N_NEW = 20
ENC_TOL = 1e-4
N_LAYERS, HEADS, HEAD_DIM, D_MODEL = 2, 4, 16, 64

MERGED = ("encoder_model.onnx", "decoder_model_merged.onnx")
UNMERGED = ("encoder_model.onnx", "decoder_model.onnx", "decoder_with_past_model.onnx")
# key -> (hf oracle, onnx files relative to the folder)
LAYOUTS = {
    "marian-optimum": ("marian", MERGED),
    "t5-optimum": ("t5", MERGED),
    "bart-optimum": ("bart", MERGED),
    "whisper-optimum": ("whisper", MERGED),
    "marian-js": ("marian", tuple(f"onnx/{f}" for f in MERGED)),
    "marian-unmerged": ("marian", UNMERGED),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="session")
def s2s_models(test_models) -> dict:
    """The encoder-decoder models (:data:`model_builders.seq2seq.SEQ2SEQ_DIRS`): made by the same cached
    build as ``test_models``, in the sibling ``<cache key>-seq2seq`` folder."""
    paths = ensure_test_models(seq2seq=True)
    assert {k: paths[k] for k in test_models} == test_models
    return {k: paths[k] for k in mb.SEQ2SEQ_DIRS}


def past_names(kinds=("decoder", "encoder")):
    return [f"past_key_values.{i}.{k}.{kv}" for i in range(N_LAYERS) for k in kinds
            for kv in ("key", "value")]


def present_names(kinds=("decoder", "encoder")):
    return [n.replace("past_key_values", "present") for n in past_names(kinds)]


_sessions = {}


def session(path):
    path = str(path)
    if path not in _sessions:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        _sessions[path] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return _sessions[path]


_models = {}


def hf_model(models, kind):
    if kind not in _models:
        # one thread: tiny models, and a 2-thread OpenMP pool on a busy 2-core machine makes
        # every op wait for a time slice (generate 0.02 s -> 5 s)
        torch.set_num_threads(1)
        cls = (transformers.WhisperForConditionalGeneration if kind == "whisper"
               else transformers.AutoModelForSeq2SeqLM)
        _models[kind] = cls.from_pretrained(models[f"hf/{kind}"]).eval()
    return _models[kind]


def text_inputs(models, kind):
    """Two sources of different lengths, right-padded by the model's own tokenizer."""
    tok = transformers.AutoTokenizer.from_pretrained(models[f"hf/{kind}"])
    enc = tok(SOURCES, padding=True, return_tensors="np")
    assert set(enc) == {"input_ids", "attention_mask"}  # no token_type_ids
    assert enc["attention_mask"][0].sum() < enc["attention_mask"][1].sum()
    return {"input_ids": enc["input_ids"].astype(np.int64),
            "attention_mask": enc["attention_mask"].astype(np.int64)}


def whisper_inputs(models):
    """Log-mel features of two synthetic clips (2.0 s and 0.8 s, padded to the 2 s window) from
    the tiny feature extractor: ``[2, 80, 200]`` (a real Whisper: ``[B, 80, 3000]``)."""
    fe = transformers.WhisperFeatureExtractor.from_pretrained(models["hf/whisper"])
    sr = fe.sampling_rate
    t1 = np.arange(int(2.0 * sr)) / sr
    t2 = np.arange(int(0.8 * sr)) / sr
    a1 = 0.5 * np.sin(2 * np.pi * 440 * t1) * (1 + np.sin(2 * np.pi * 2 * t1)) / 2
    a2 = 0.3 * np.sin(2 * np.pi * (200 + 400 * t2) * t2)
    feats = fe([a1.astype(np.float32), a2.astype(np.float32)], sampling_rate=sr,
               return_tensors="np")["input_features"].astype(np.float32)
    assert feats.shape == (2, 80, mb.WHISPER_FRAMES)
    return {"input_features": feats}


def onnx_greedy(enc_sess, dec_first, dec_next, enc_feed, prompt, n_new, *, eos, pad,
                forced_eos=None, suppress=(), begin_suppress=()):
    """Greedy decoding with onnxruntime only (see the module docstring for the protocol).

    ``dec_first`` runs step 0 and ``dec_next`` the later steps: the same merged session (it
    takes ``use_cache_branch``), or ``decoder_model.onnx`` / ``decoder_with_past_model.onnx``
    of the unmerged layout (no ``use_cache_branch``; the with-past graph takes no
    ``encoder_hidden_states`` and returns decoder presents only).
    Returns ``(tokens [B, len(prompt) + generated], logits of each step)``.
    """
    encoder_hidden_states = enc_sess.run(["last_hidden_state"], enc_feed)[0]
    batch = encoder_hidden_states.shape[0]
    tokens = np.array([prompt] * batch, dtype=np.int64)
    max_length = tokens.shape[1] + n_new
    past = {n: np.zeros((batch, HEADS, 0, HEAD_DIM), np.float32) for n in past_names()}
    cur = tokens
    done = np.zeros(batch, bool)
    step_logits = []
    for step in range(n_new):
        sess = dec_first if step == 0 else dec_next
        wanted = {i.name for i in sess.get_inputs()}
        feed = {"input_ids": cur, "encoder_hidden_states": encoder_hidden_states,
                "use_cache_branch": np.array([step > 0])}
        if "attention_mask" in enc_feed:
            feed["encoder_attention_mask"] = enc_feed["attention_mask"]
        feed.update(past)
        feed = {k: v for k, v in feed.items() if k in wanted}
        assert set(feed) == wanted, wanted - set(feed)
        out = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed)))

        logits = out["logits"][:, -1, :].copy()
        step_logits.append(out["logits"][:, -1, :].copy())
        if suppress:
            logits[:, list(suppress)] = -np.inf
        if begin_suppress and step == 0:
            logits[:, list(begin_suppress)] = -np.inf
        if forced_eos is not None and tokens.shape[1] == max_length - 1:
            logits[:, [t for t in range(logits.shape[1]) if t != forced_eos]] = -np.inf
        nxt = logits.argmax(-1)
        nxt = np.where(done, pad, nxt)
        done |= nxt == eos
        tokens = np.concatenate([tokens, nxt[:, None]], 1)
        if done.all():
            break

        for name in past:
            present = name.replace("past_key_values", "present")
            if ".decoder." in name:
                past[name] = out[present]
                assert past[name].shape[2] == tokens.shape[1] - 1  # all but the new token
            elif step == 0:  # cross-attention K/V: from step 0 on, kept for every later step
                past[name] = out[present]
                assert past[name].shape[2] == encoder_hidden_states.shape[1]
        cur = nxt[:, None].astype(np.int64)
    return tokens, step_logits


def generate_kwargs_and_prompt(models, kind):
    """(encoder feed, decoder prompt, onnx_greedy kwargs, generate kwargs) of ``kind``."""
    model = hf_model(models, kind)
    gc = model.generation_config
    if kind == "whisper":
        w = mb.WHISPER_IDS
        prompt = [gc.decoder_start_token_id, w["langs"]["<|en|>"], w["transcribe"],
                  w["notimestamps"]]
        proc = dict(suppress=gc.suppress_tokens, begin_suppress=gc.begin_suppress_tokens)
        return (whisper_inputs(models), prompt, proc,
                dict(language="en", task="transcribe"))
    proc = dict(forced_eos=getattr(gc, "forced_eos_token_id", None))
    return text_inputs(models, kind), [gc.decoder_start_token_id], proc, {}


# ------------------------------------------------------------------------------------------
# files and graph names
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", mb.SEQ2SEQ_KINDS)
def test_hf_folder(s2s_models, kind):
    d = s2s_models[f"hf/{kind}"]
    for f in ("config.json", "generation_config.json", "model.safetensors", *TOKENIZER_FILES):
        assert (d / f).is_file(), f
    gc = json.loads((d / "generation_config.json").read_text())
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == TINY_VOCAB
    assert gc["decoder_start_token_id"] == cfg["decoder_start_token_id"]
    assert gc["eos_token_id"] == cfg["eos_token_id"] and gc["pad_token_id"] == cfg["pad_token_id"]
    if kind in ("marian", "bart"):
        assert gc["forced_eos_token_id"] == cfg["eos_token_id"]
    if kind == "whisper":
        assert (d / "preprocessor_config.json").is_file()
        for k in ("forced_decoder_ids", "is_multilingual", "lang_to_id", "task_to_id",
                  "no_timestamps_token_id", "suppress_tokens", "begin_suppress_tokens"):
            assert k in gc, k
        pre = json.loads((d / "preprocessor_config.json").read_text())
        assert pre["nb_max_frames"] == mb.WHISPER_FRAMES and pre["feature_size"] == 80
    # saved weights reload as they are: no missing key re-initialised at random on load
    cls = (transformers.WhisperForConditionalGeneration if kind == "whisper"
           else transformers.AutoModelForSeq2SeqLM)
    _, info = cls.from_pretrained(d, output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_onnx_folder(s2s_models, key):
    d = s2s_models[key]
    kind, files = LAYOUTS[key]
    for f in files + ("config.json", "generation_config.json") + TOKENIZER_FILES:
        assert (d / f).is_file(), f
    onnx_files = sorted(str(p.relative_to(d)) for p in d.rglob("*.onnx"))
    assert onnx_files == sorted(files)  # one layout per folder
    assert (d / "generation_config.json").read_text() == \
        (s2s_models[f"hf/{kind}"] / "generation_config.json").read_text()


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_graph_names(s2s_models, key):
    d = s2s_models[key]
    kind, files = LAYOUTS[key]
    enc = session(d / files[0])
    enc_in = {i.name: i.shape for i in enc.get_inputs()}
    if kind == "whisper":
        assert enc_in == {"input_features": ["batch_size", 80, mb.WHISPER_FRAMES]}
    else:
        assert set(enc_in) == {"input_ids", "attention_mask"}
    assert [o.name for o in enc.get_outputs()] == ["last_hidden_state"]

    mask = [] if kind == "whisper" else ["encoder_attention_mask"]
    for f in files[1:]:
        dec = session(d / f)
        ins = [i.name for i in dec.get_inputs()]
        outs = [o.name for o in dec.get_outputs()]
        if f.endswith("decoder_model_merged.onnx"):
            assert ins == mask + ["input_ids", "encoder_hidden_states", *past_names(),
                                  "use_cache_branch"]
            assert outs == ["logits", *present_names()]
        elif f.endswith("decoder_with_past_model.onnx"):
            assert ins == mask + ["input_ids", *past_names()]
            assert outs == ["logits", *present_names(("decoder",))]
        else:
            assert ins == mask + ["input_ids", "encoder_hidden_states"]
            assert outs == ["logits", *present_names()]


# ------------------------------------------------------------------------------------------
# numerics
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", mb.SEQ2SEQ_KINDS)
def test_encoder_matches_torch(s2s_models, kind):
    feed = whisper_inputs(s2s_models) if kind == "whisper" else text_inputs(s2s_models, kind)
    got = session(s2s_models[f"{kind}-optimum"] / "encoder_model.onnx").run(None, feed)[0]
    with torch.no_grad():
        ref = hf_model(s2s_models, kind).get_encoder()(
            **{k: torch.from_numpy(v) for k, v in feed.items()}).last_hidden_state.numpy()
    assert got.shape == ref.shape == (2, ref.shape[1], D_MODEL)
    if kind == "whisper":
        assert ref.shape[1] == mb.WHISPER_FRAMES // 2
    # every position, the padded ones of the shorter source too
    diff = float(np.abs(got - ref).max())
    assert diff < ENC_TOL, diff


@pytest.mark.parametrize("key", sorted(LAYOUTS))
def test_greedy_loop_matches_generate(s2s_models, key):
    kind, files = LAYOUTS[key]
    d = s2s_models[key]
    model = hf_model(s2s_models, kind)
    gc = model.generation_config
    feed, prompt, proc, gen_kw = generate_kwargs_and_prompt(s2s_models, kind)
    enc = session(d / files[0])
    first, nxt = (session(d / files[1]), session(d / files[-1]))
    tokens, logits = onnx_greedy(enc, first, nxt, feed, prompt, N_NEW, eos=gc.eos_token_id,
                                 pad=gc.pad_token_id, **proc)

    with torch.no_grad():
        ref = model.generate(**{k: torch.from_numpy(v) for k, v in feed.items()},
                             do_sample=False, num_beams=1, max_new_tokens=N_NEW,
                             **gen_kw).numpy()
    if kind == "whisper":
        # generate() returns the generated tokens only: the whole decoder prompt (start,
        # language, task, notimestamps) is dropped; finished rows are padded with eot
        ref_new = ref
    else:
        assert (ref[:, 0] == prompt[0]).all()  # decoder_start_token_id, then the new tokens
        ref_new = ref[:, len(prompt):]
    got_new = tokens[:, len(prompt):]
    gaps = [float(np.ptp(np.sort(lg, -1)[:, -2:], -1).min()) for lg in logits]
    assert got_new.tolist() == ref_new.tolist(), f"min top1-top2 gaps {gaps}"
    # the fixture is informative: the two sources decode differently, to several tokens
    assert got_new[0].tolist() != got_new[1].tolist()
    assert min(len(set(r)) for r in got_new.tolist()) >= 5, got_new.tolist()
    if kind == "whisper":
        assert (got_new < mb.WHISPER_IDS["timestamp_begin"]).all()  # no timestamp tokens


def test_marian_merged_layouts_are_one_export(s2s_models):
    for f in MERGED:
        a = (s2s_models["marian-optimum"] / f).read_bytes()
        assert a == (s2s_models["marian-js"] / "onnx" / f).read_bytes()
    assert (s2s_models["marian-optimum"] / "encoder_model.onnx").read_bytes() == \
        (s2s_models["marian-unmerged"] / "encoder_model.onnx").read_bytes()


def test_merged_decoder_encoder_presents_after_step0(s2s_models):
    """With ``use_cache_branch=[True]`` the merged decoder returns DUMMY
    ``present.N.encoder.*``: the caller keeps the step-0 cross-attention cache."""
    d = s2s_models["bart-optimum"]
    feed = text_inputs(s2s_models, "bart")
    ehs = session(d / "encoder_model.onnx").run(None, feed)[0]
    dec = session(d / "decoder_model_merged.onnx")
    names = [o.name for o in dec.get_outputs()]
    base = {"encoder_attention_mask": feed["attention_mask"], "encoder_hidden_states": ehs}
    zero = {n: np.zeros((2, HEADS, 0, HEAD_DIM), np.float32) for n in past_names()}
    out0 = dict(zip(names, dec.run(None, {**base, **zero, "input_ids": np.full((2, 1), 2),
                                          "use_cache_branch": np.array([False])})))
    past = {n: out0[n.replace("past_key_values", "present")] for n in past_names()}
    out1 = dict(zip(names, dec.run(None, {**base, **past, "input_ids": np.full((2, 1), 5),
                                          "use_cache_branch": np.array([True])})))
    assert out0["present.0.encoder.key"].shape == (2, HEADS, ehs.shape[1], HEAD_DIM)
    assert out1["present.0.decoder.key"].shape == (2, HEADS, 2, HEAD_DIM)
    for n in present_names(("encoder",)):
        assert out1[n].shape == (0, HEADS, 1, HEAD_DIM), (n, out1[n].shape)


# ------------------------------------------------------------------------------------------
# Whisper generate() options on the tiny model (offline)
# ------------------------------------------------------------------------------------------
def test_whisper_generate_options(s2s_models):
    model = hf_model(s2s_models, "whisper")
    tok = transformers.AutoTokenizer.from_pretrained(s2s_models["hf/whisper"])
    assert type(tok).__name__ == "WhisperTokenizerFast"
    w = mb.WHISPER_IDS
    x = torch.from_numpy(whisper_inputs(s2s_models)["input_features"])
    with torch.no_grad():
        # plain generate(): forced_decoder_ids [[1, None], [2, transcribe]] -> detect language
        detected = model.detect_language(x).tolist()
        assert all(t in w["langs"].values() for t in detected)
        default = model.generate(x, max_new_tokens=8)
        detect = model.generate(x, max_new_tokens=8, task="transcribe")
        de = model.generate(x, max_new_tokens=8, language="de", task="translate",
                            return_dict_in_generate=True, output_scores=True)
        ts = model.generate(x, max_new_tokens=12, language="en", return_timestamps=True)
    assert default.shape[0] == 2
    # same prompt: [sot, detected language, transcribe, notimestamps]
    assert default.tolist() == detect.tolist()
    # return_dict_in_generate: the ModelOutput of the one generate call, decoder prompt INCLUDED
    assert de.sequences.shape == (2, 4 + 8)
    assert (de.sequences[:, :4] == torch.tensor(
        [w["sot"], w["langs"]["<|de|>"], w["translate"], w["notimestamps"]])).all()
    # timestamps: the first generated token is a timestamp, within max_initial_timestamp_index.
    # (After a timestamp pair generate() decodes the rest of the window again, so the output
    # can be longer than max_new_tokens.)
    first = ts[:, 0]
    assert ((first >= w["timestamp_begin"]) & (first <= w["timestamp_begin"] + 50)).all()
    text = tok.decode(ts[0].tolist(), skip_special_tokens=True)
    offsets = tok.decode(ts[0].tolist(), output_offsets=True)["offsets"]
    assert isinstance(text, str) and offsets and "timestamp" in offsets[0]
    # the tokenizer's prefix tokens are generate's decoder prompt
    tok_de = transformers.AutoTokenizer.from_pretrained(s2s_models["hf/whisper"],
                                                        language="german", task="translate")
    assert tok_de.prefix_tokens == [w["sot"], w["langs"]["<|de|>"], w["translate"],
                                    w["notimestamps"]]


def test_whisper_language_detection_onnx(s2s_models):
    """Language detection = one decoder step on ``[<|startoftranscript|>]``, argmax over the
    language tokens: the ONNX merged decoder agrees with ``detect_language``."""
    d = s2s_models["whisper-optimum"]
    feed = whisper_inputs(s2s_models)
    ehs = session(d / "encoder_model.onnx").run(None, feed)[0]
    dec = session(d / "decoder_model_merged.onnx")
    zero = {n: np.zeros((2, HEADS, 0, HEAD_DIM), np.float32) for n in past_names()}
    logits = dec.run(["logits"], {"input_ids": np.full((2, 1), mb.WHISPER_IDS["sot"]),
                                  "encoder_hidden_states": ehs, **zero,
                                  "use_cache_branch": np.array([False])})[0][:, -1]
    lang_ids = np.array(sorted(mb.WHISPER_IDS["langs"].values()))
    got = lang_ids[logits[:, lang_ids].argmax(-1)]
    model = hf_model(s2s_models, "whisper")
    with torch.no_grad():
        ref = model.detect_language(torch.from_numpy(feed["input_features"])).tolist()
    assert got.tolist() == ref
