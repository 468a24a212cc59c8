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
    "append": "raymuter append, Optimum export (whole prompt)",
    "append_pieces": "raymuter append, Optimum export (pieces)",
    "append_grow": "raymuter grow, Optimum export",
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
DEFAULT = ["in_place", "in_place_pieces", "in_place_grow", "append", "append_pieces", "append_grow", "genai", "numpy",
           "transformers"]
# the system whose tokens a system's are checked against (default genai)
REFERENCE = {"in_place_int4": "genai_int4", "genai_int4": "genai_int4", "llamacpp_q4": "llamacpp_q4",
             "llamacpp_q4_fa": "llamacpp_q4"}
RAYMUTER = {  # key -> (layout, cache_mode, prompt_steps)
    "in_place": ("genai", None, "whole"), "in_place_pieces": ("genai", None, "pieces"),
    "in_place_grow": ("genai", "grow", "whole"), "append": ("optimum", None, "whole"),
    "append_pieces": ("optimum", None, "pieces"), "append_grow": ("optimum", "grow", "whole"),
    "in_place_int4": ("genai_int4", None, "whole"),
}
SLOW = {"small": {"transformers"}}  # systems that run --slow-repeats times on that model


def model_dirs(name: str) -> dict[str, Path]:
    """{'hf', 'optimum', 'genai'} folders of model `name`, built (and cached) when missing."""
    if name == "tiny":
        paths = bench_models._model_builders().ensure_test_models()
        return {"hf": paths["hf/llama"], "optimum": paths["llama-optimum"], "genai": paths["llama-genai"]}
    root = Path(os.environ.get("RAYMUTER_BENCH_MODELS") or Path.home() / ".cache" / "raymuter" / "bench-models")
    if name == "small":
        return bench_models.build_small(root.expanduser())
    if name == "real":
        import real_models  # bench/real_models.py

        return real_models.build_real(root.expanduser())
    raise SystemExit(f"unknown model {name!r} (tiny, small or real)")


def load_raymuter(key):
    layout, mode, steps = RAYMUTER[key]

    def loader(dirs, threads, new, tmp, shared):
        if layout not in dirs:
            raise RuntimeError(f"this model has no {layout} build")
        if layout not in shared:  # one session per layout, shared by its modes
            shared[layout] = generation.load(dirs[layout], threads=threads, provider="cpu")
        model = shared[layout]

        def prepare(prompts):
            ctx = generation.context(model, cache_mode=mode, prompt_steps=steps, max_new_tokens=new,
                                     eos_token_id=[], do_sample=False)
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


def load_llamacpp(quantized: bool, flash: bool = False):
    """llama.cpp through llama-cpp-python (built from source: pip install llama-cpp-python==0.3.36,
    about 10 minutes here) on the model's F32 GGUF (converted from the hf folder with the
    convert_hf_to_gguf.py its sdist vendors) or its Q4_0 quantization of it; batch 1 only."""
    def loader(dirs, threads, new, tmp, shared):
        import llama_cpp

        import real_models  # bench/real_models.py

        path = real_models.llamacpp_gguf(dirs, "q4_0" if quantized else "f32")
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_batch=512, n_threads=threads,
                              n_threads_batch=threads, flash_attn=flash, verbose=False)

        def prepare(prompts):
            if len(prompts) != 1:
                raise RuntimeError("llama.cpp runs batch 1 here (its batched API is not wired in)")
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
