"""The systems bench/decode.py times: how each one is loaded and how it makes its tokens.

Each loader takes (dirs, threads, new, tmp, shared) once per model (dirs: the model's 'hf',
'optimum' and 'genai' folders; tmp: a scratch folder; shared: a dict per model) and returns
prepare(prompts) -> run, where run() makes the tokens of one generate call, [batch, new].
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

import generation
import models as bench_models  # bench/models.py

# key -> row label; the order is the round-robin order and the table's
SYSTEMS = {
    "in_place": "raymuter in_place, genai build (whole prompt)",
    "in_place_pieces": "raymuter in_place, genai build (pieces)",
    "in_place_grow": "raymuter grow, genai build",
    "in_place_device": "raymuter in_place, genai build, device-owned buffers (OrtValues on the session's device)",
    "append": "raymuter append, Optimum export (whole prompt)",
    "append_pieces": "raymuter append, Optimum export (pieces)",
    "append_grow": "raymuter grow, Optimum export",
    "fused": "raymuter in_place, Optimum export rewritten at load (fusion)",
    "fused_q4": "raymuter in_place, Optimum export 4-bit (q4, MatMulNBits) rewritten at load",
    "append_q4": "raymuter append, Optimum export 4-bit (q4, MatMulNBits) as exported",
    "genai": "onnxruntime-genai og.Generator",
    "numpy": "plain numpy loop, Optimum export",
    "transformers": "transformers generate (torch eager, sdpa)",
    # the real model's (bench/real_models.py): 4-bit builds and llama.cpp
    "in_place_int4": "raymuter in_place, genai int4 build",
    "genai_int4": "onnxruntime-genai og.Generator, int4 build",
    "llamacpp": "llama.cpp (llama-cpp-python), F32 GGUF",
    "llamacpp_q4": "llama.cpp (llama-cpp-python), Q4_0 GGUF",
    "llamacpp_fa": "llama.cpp, F32 GGUF, flash attention",
    "llamacpp_q4_fa": "llama.cpp, Q4_0 GGUF, flash attention",
}
DEFAULT = ["in_place", "in_place_pieces", "in_place_grow", "fused", "append", "append_pieces", "append_grow", "genai", "numpy",
           "transformers"]
# the system whose tokens a system's are checked against (default genai)
REFERENCE = {"in_place_int4": "genai_int4", "genai_int4": "genai_int4", "fused_q4": "append_q4", "append_q4": "append_q4", "llamacpp_q4": "llamacpp_q4",
             "llamacpp_q4_fa": "llamacpp_q4"}
RAYMUTER = {  # key -> (layout, cache_mode, prompt_steps, fuse, variant); Optimum exports run as exported unless fused
    "in_place": ("genai", None, "whole", False, None), "in_place_pieces": ("genai", None, "pieces", False, None),
    "in_place_grow": ("genai", "grow", "whole", False, None), "append": ("optimum", None, "whole", False, None),
    "in_place_device": ("genai", "in_place", "whole", False, None),
    "append_pieces": ("optimum", None, "pieces", False, None), "append_grow": ("optimum", "grow", "whole", False, None),
    "fused": ("optimum", None, "whole", True, None), "in_place_int4": ("genai_int4", None, "whole", False, None),
    "fused_q4": ("optimum_q4", None, "whole", True, "q4"), "append_q4": ("optimum_q4", None, "whole", False, "q4"),
}
BUFFERS = {"in_place_device": "device"}  # key -> where its cache lives (default: the context's default, host on a CPU)
SLOW = {"small": {"transformers"}}  # systems that run --slow-repeats times on that model


def model_dirs(name: str) -> dict[str, Path]:
    """{'hf', 'optimum', 'genai'} folders of model `name`, built (and cached) when missing."""
    if name == "tiny":
        paths = bench_models.builders().text.ensure_test_models()
        return {"hf": paths["hf/llama"], "optimum": paths["llama-optimum"], "genai": paths["llama-genai"]}
    root = Path(os.environ.get("RAYMUTER_BENCH_MODELS") or Path.home() / ".cache" / "raymuter" / "bench-models")
    if name == "small":
        return bench_models.build_small(root.expanduser())
    if name == "real":
        import real_models  # bench/real_models.py

        return real_models.build_real(root.expanduser())
    raise SystemExit(f"unknown model {name!r} (tiny, small or real)")


def load_raymuter(key):
    layout, mode, steps, fuse, variant = RAYMUTER[key]

    def loader(dirs, threads, new, tmp, shared):
        if layout not in dirs:
            raise RuntimeError(f"this model has no {layout} build")
        if (layout, fuse) not in shared:  # one session per layout, shared by its modes
            shared[layout, fuse] = generation.load(dirs[layout], threads=threads, provider="cpu", fuse=fuse,
                                                   variant=variant)
            if fuse and shared[layout, fuse].fused_from is None:
                raise RuntimeError(f"the {layout} build was not rewritten (see the log)")
        model = shared[layout, fuse]

        def prepare(prompts):
            ctx = generation.context(model, cache_mode=mode, prompt_steps=steps, max_new_tokens=new,
                                     eos_token_id=[], do_sample=False, buffers=BUFFERS.get(key))
            ctx = generation.compile(ctx, batch_size=len(prompts))
            rows, seeds = prompts.tolist(), [0] * len(prompts)
            return lambda: np.array(generation.generate(ctx, rows, seeds=seeds))
        return prepare
    return loader


def load_genai(dirs, threads, new, tmp, shared, kind: str = "genai"):
    import onnxruntime_genai as og

    if kind not in dirs:
        raise RuntimeError(f"this model has no {kind} build")
    folder = Path(tmp) / kind  # a copy of the folder (links) whose config sets the threads
    folder.mkdir()
    for f in dirs[kind].iterdir():
        if f.name != "genai_config.json":
            (folder / f.name).symlink_to(f.resolve())
    config = json.loads((dirs[kind] / "genai_config.json").read_text())
    options = config["model"]["decoder"].setdefault("session_options", {})
    options.update(intra_op_num_threads=threads, inter_op_num_threads=1)
    (folder / "genai_config.json").write_text(json.dumps(config, indent=1))
    model = og.Model(str(folder))

    def prepare(prompts):
        batch, length = prompts.shape
        ids = prompts.astype(np.int32)

        def run():
            params = og.GeneratorParams(model)
            params.set_search_options(batch_size=batch, do_sample=False, max_length=length + new,
                                      min_length=length + new)
            gen = og.Generator(model, params)
            gen.append_tokens(ids)
            while not gen.is_done():
                gen.generate_next_token()
            return np.stack([np.asarray(gen.get_sequence(i))[length:] for i in range(batch)])
        return run
    return prepare


def load_numpy(dirs, threads, new, tmp, shared):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3
    sess = ort.InferenceSession(str(dirs["optimum"] / "model.onnx"), options, providers=["CPUExecutionProvider"])
    past = [i for i in sess.get_inputs() if i.name.startswith("past_key_values.")]
    outputs = [o.name for o in sess.get_outputs()]
    present = [outputs.index(p.name.replace("past_key_values", "present")) for p in past]

    def prepare(prompts):
        batch, length = prompts.shape

        def run():
            feed = {p.name: np.zeros((batch, p.shape[1], 0, p.shape[3]), np.float32) for p in past}
            feed.update(input_ids=prompts, position_ids=np.tile(np.arange(length), (batch, 1)),
                        attention_mask=np.ones((batch, length), np.int64))
            tokens = np.empty((batch, new), np.int64)
            for t in range(new):
                res = sess.run(None, feed)
                tokens[:, t] = res[0][:, -1].argmax(-1)
                if t + 1 == new:
                    break
                seen = length + t  # tokens in the cache after this step
                feed.update({p.name: res[i] for p, i in zip(past, present)})
                feed.update(input_ids=tokens[:, t:t + 1].copy(), position_ids=np.full((batch, 1), seen),
                            attention_mask=np.ones((batch, seen + 1), np.int64))
            return tokens
        return run
    return prepare


def load_transformers(dirs, threads, new, tmp, shared):
    import torch
    import transformers

    torch.set_num_threads(threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["hf"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly `new` tokens

    def prepare(prompts):
        ids = torch.from_numpy(prompts)
        mask = torch.ones_like(ids)

        def run():
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                     pad_token_id=0)
            return out[:, ids.shape[1]:].numpy()
        return run
    return prepare


class BatchedLlama:
    """llama.cpp's batched greedy decode through its llama_batch API (one sequence per row, a
    unified KV cache), on the model of a high-level `llama_cpp.Llama`."""

    def __init__(self, llm, threads, rows, length, flash=False):
        import llama_cpp as lc

        self.lc, self.llm = lc, llm
        params = lc.llama_context_default_params()
        params.n_ctx = rows * length + 64
        params.n_batch = max(512, rows * length)
        params.n_ubatch = params.n_batch
        params.n_seq_max = rows
        params.n_threads = params.n_threads_batch = threads
        params.kv_unified = True
        params.flash_attn_type = 1 if flash else 0  # enabled / disabled (the default is auto)
        self.ctx = lc.llama_init_from_model(self.llm._model.model, params)
        self.vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.llm._model.model))
        self.batch = lc.llama_batch_init(params.n_batch, 0, rows)
        self.rows = rows

    def _fill(self, entries):
        lc, b = self.lc, self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        if lc.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def generate(self, prompts, new):
        lc = self.lc
        lc.llama_memory_clear(lc.llama_get_memory(self.ctx), True)
        rows, length = prompts.shape
        entries = [(int(prompts[r, p]), p, r, p == length - 1) for r in range(rows) for p in range(length)]
        self._fill(entries)
        last = [r * length + length - 1 for r in range(rows)]  # batch index of each row's logits
        out = np.empty((rows, new), np.int64)
        for t in range(new):
            for r in range(rows):
                logits = np.ctypeslib.as_array(lc.llama_get_logits_ith(self.ctx, last[r]), shape=(self.vocab,))
                out[r, t] = int(logits.argmax())
            if t + 1 == new:
                break
            self._fill([(int(out[r, t]), length + t, r, True) for r in range(rows)])
            last = list(range(rows))
        return out


def load_llamacpp(quantized: bool, flash: bool = False):
    """llama.cpp through llama-cpp-python (built from source: pip install llama-cpp-python==0.3.36,
    about 10 minutes here) on the model's F32 GGUF (converted from the hf folder with the
    convert_hf_to_gguf.py its sdist vendors) or its Q4_0 quantization of it: batch 1 through
    `Llama.generate`, larger batches through its batched API (BatchedLlama)."""
    def loader(dirs, threads, new, tmp, shared):
        import llama_cpp

        import real_models  # bench/real_models.py

        path = real_models.llamacpp_gguf(dirs, "q4_0" if quantized else "f32")
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, flash_attn=flash, verbose=False)

        def prepare(prompts):
            if len(prompts) > 1:
                batched = BatchedLlama(llm, threads, len(prompts), prompts.shape[1] + new, flash)
                return lambda: batched.generate(prompts, new)
            row = prompts[0].tolist()

            def run():
                llm.reset()
                tokens = []
                for token in llm.generate(row, top_k=1, temp=0.0, reset=True):
                    tokens.append(token)
                    if len(tokens) == new:
                        break
                return np.array([tokens])
            return run
        return prepare
    return loader


LOADERS = {**{k: load_raymuter(k) for k in RAYMUTER}, "genai": load_genai, "numpy": load_numpy,
           "transformers": load_transformers,
           "genai_int4": lambda *a: load_genai(*a, kind="genai_int4"),
           "llamacpp": load_llamacpp(False), "llamacpp_q4": load_llamacpp(True),
           "llamacpp_fa": load_llamacpp(False, True), "llamacpp_q4_fa": load_llamacpp(True, True)}
