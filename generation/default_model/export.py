"""Export the default model's checkpoint to the two ONNX layouts the engine serves.

- `onnx/decoder_model_merged.onnx`: the transformers.js layout (`use_cache_branch` and one If
  node over a no-past and a with-past graph, `torch.onnx.export(dynamo=True)`); the
  `llama-merged` and `gpt2-grow` test fixtures are made by the same code (tests/model_builders/text.py).
- `genai/`: an onnxruntime-genai build (`onnxruntime_genai.models.builder -p fp32 -e cpu`,
  GroupQueryAttention, the `in_place` cache mode), with the tokenizer and configs beside it.

Both compute in float32 on the checkpoint's float16 weights: `compact` stores each weight once,
as float16 (exact: the checkpoint is float16), behind a Cast (and a Transpose for a transposed
copy) that onnxruntime folds into a float32 initializer when the session loads. The graphs are
half the size of a float32 export, and their weights are exactly those transformers computes
with after `from_pretrained(folder, dtype=torch.float32)`.

Needs the `train` extra (torch, transformers, onnx, onnxscript, onnxruntime-genai).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

MAX_IR_VERSION = 10  # onnx 1.23 writes IR 14 by default; onnxruntime reads at most ~13
GENAI_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
               "config.json", "generation_config.json")


def export_decoder(model, path: Path, *, past: bool, position_ids: bool = True) -> None:
    """`torch.onnx.export(dynamo=True)` of a decoder-only model (a Llama; GPT-2 for a test
    fixture), Optimum names: input_ids, attention_mask, [position_ids],
    [past_key_values.N.key/.value] -> logits, present.N.key/.value.
    `past=False` gives the first-step graph (no past inputs) of the merged decoder;
    `position_ids=False` a graph whose positions follow from the past length (the `gpt2-grow`
    test fixture)."""
    import torch
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, position_ids, *pkv):
            cache = DynamicCache()
            for i in range(n_layers if past else 0):
                cache.update(pkv[2 * i], pkv[2 * i + 1], i)
            o = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=cache, use_cache=True)
            layers = o.past_key_values.layers
            return (o.logits, *[t for i in range(n_layers) for t in (layers[i].keys, layers[i].values)])

    class NoPositions(Wrapper):
        def forward(self, input_ids, attention_mask, *pkv):
            return super().forward(input_ids, attention_mask, None, *pkv)

    cfg = model.config
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # (GPT-2's names)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(0)
    B, T, P = 2, 4, (3 if past else 0)
    ids = torch.randint(3, cfg.vocab_size, (B, T), generator=g)
    mask = torch.ones(B, P + T, dtype=torch.long)
    pos = torch.arange(P, P + T).expand(B, T)
    pkv = [torch.randn(B, kv, P, hd, generator=g) for _ in range(2 * n_layers)] if past else []
    names = [f"{i}.{k}" for i in range(n_layers) for k in ("key", "value")]
    bs = torch.export.Dim("batch_size", min=1, max=64)
    sl = torch.export.Dim("sequence_length", min=1, max=1024)
    pl = torch.export.Dim("past_sequence_length", min=0, max=1024)
    tl = torch.export.Dim("total_sequence_length", min=1, max=2048)
    inputs, shapes = [ids, mask], [{0: bs, 1: sl}, {0: bs, 1: tl}]
    if position_ids:
        inputs.append(pos)
        shapes.append({0: bs, 1: sl})
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        prog = torch.onnx.export(
            Wrapper() if position_ids else NoPositions(), (*inputs, *pkv), None, dynamo=True, opset_version=18,
            optimize=True, verbose=False,
            input_names=["input_ids", "attention_mask"] + (["position_ids"] if position_ids else [])
            + ([f"past_key_values.{n}" for n in names] if past else []),
            output_names=["logits"] + [f"present.{n}" for n in names],
            dynamic_shapes=(*shapes, *((tuple({0: bs, 2: pl} for _ in pkv),) if past else ())))
    prog.save(str(path), external_data=False)


def merge(no_past, with_past):
    """One graph with `use_cache_branch` bool[1] and an If node (then: with past, else: no past),
    the optimum / transformers.js `decoder_model_merged.onnx` layout. Weights stay in the branches
    (`compact` hoists them)."""
    import onnx
    from onnx import helper

    outer_inputs = {i.name for i in with_past.graph.input}

    def branch(model, prefix):
        g = onnx.GraphProto()
        g.CopyFrom(model.graph)

        def rename(name):
            return name if not name or name in outer_inputs else prefix + name

        for node in g.node:
            node.name = prefix + node.name
            node.input[:] = [rename(x) for x in node.input]
            node.output[:] = [rename(x) for x in node.output]
        for item in list(g.initializer) + list(g.value_info) + list(g.output):
            item.name = rename(item.name)
        del g.input[:]
        g.name = prefix.strip("/")
        return g

    outputs = [o.name for o in with_past.graph.output]
    if_node = helper.make_node("If", ["use_cache_branch"], outputs, name="optimum::if",
                               then_branch=branch(with_past, "with_past/"), else_branch=branch(no_past, "no_past/"))
    outer_outputs = []
    for o in with_past.graph.output:
        v = onnx.ValueInfoProto()
        v.CopyFrom(o)
        if o.name.startswith("present"):
            v.type.tensor_type.shape.dim[2].dim_param = "total_sequence_length"
        outer_outputs.append(v)
    use_cache = helper.make_tensor_value_info("use_cache_branch", onnx.TensorProto.BOOL, [1])
    graph = helper.make_graph([if_node], "decoder_model_merged", list(with_past.graph.input) + [use_cache],
                              outer_outputs)
    opsets = {o.domain: o.version for o in list(no_past.opset_import) + list(with_past.opset_import)}
    return helper.make_model(graph, producer_name="raymuter", ir_version=MAX_IR_VERSION,
                             opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])


def _graphs(graph):
    """`graph` and every subgraph in it (If branches, Loop bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                yield from _graphs(sub)


def compact(model, reference: dict | None = None, min_size: int = 1024):
    """Store every float32 weight of `model` (subgraphs included) once, in the main graph, and
    drop the exporter's per-node metadata (stack traces, class names).

    A weight equal to one already stored is shared; one equal to a stored weight's transpose
    becomes a Transpose of it; a weight that float16 holds exactly is stored as float16 behind a
    Cast to float32. A weight equal to a tensor of `reference` ({name: float32 array}, e.g. the
    checkpoint), or to its transpose, is stored as that tensor under its name. onnxruntime
    constant-folds the Casts and Transposes at load, so the session computes on exactly the
    original float32 values. Weights under `min_size` elements (norm scales) stay where they are.
    """
    store = _WeightStore(reference or {})
    renames = _hoist_weights(model, store, min_size)
    _rename_and_strip(model, renames)
    main = model.graph
    rest = list(main.node)
    del main.node[:]
    main.node.extend(store.nodes + rest)
    main.initializer.extend(store.inits)
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    return model


def _key(arr):
    """An array's identity by value: its shape and a hash of its bytes."""
    import numpy as np

    return arr.shape, hashlib.sha1(np.ascontiguousarray(arr).tobytes()).hexdigest()


class _WeightStore:
    """The weights `compact` stores once in the main graph: their initializers and the Cast and
    Transpose nodes that give them back as float32, by value."""

    def __init__(self, reference: dict):
        self.stored: dict[tuple, str] = {}  # key of a float32 array -> its value name in the main graph
        self.known = {}  # key -> (reference name, transposed?)
        for name, arr in reference.items():
            self.known.setdefault(_key(arr), (name, False))
            if arr.ndim == 2:
                self.known.setdefault(_key(arr.T), (name, True))
        self.inits, self.nodes = [], []

    def value_for(self, arr, name: str) -> str:
        """The main graph's value holding `arr`: one stored already (or its transpose), else `arr`
        stored now, under its reference name where `reference` holds it, else under `name`."""
        import numpy as np

        k = _key(arr)
        if k in self.stored:
            return self.stored[k]
        if k in self.known:
            ref, transposed = self.known[k]
            if not transposed:
                return self._store(arr, ref)
            return self._transpose(self.stored.get(_key(arr.T)) or self._store(np.ascontiguousarray(arr.T), ref), arr)
        if arr.ndim == 2 and _key(arr.T) in self.stored:
            return self._transpose(self.stored[_key(arr.T)], arr)
        return self._store(arr, name)

    def _store(self, arr, name: str) -> str:
        import numpy as np
        from onnx import TensorProto, helper, numpy_helper

        out = f"weights/{name}"
        if np.array_equal(arr.astype(np.float16).astype(np.float32), arr):
            self.inits.append(numpy_helper.from_array(arr.astype(np.float16), f"{out}/fp16"))
            cast = helper.make_node("Cast", [f"{out}/fp16"], [out], to=TensorProto.FLOAT, name=f"{out}/cast")
            self.nodes.append(cast)
        else:
            self.inits.append(numpy_helper.from_array(arr, out))
        self.stored[_key(arr)] = out
        return out

    def _transpose(self, source: str, arr) -> str:
        from onnx import helper

        out = f"{source}/T"
        self.nodes.append(helper.make_node("Transpose", [source], [out], perm=[1, 0], name=out))
        self.stored[_key(arr)] = out
        return out


def _hoist_weights(model, store: _WeightStore, min_size: int) -> dict[str, str]:
    """Move every float32 initializer of at least `min_size` elements (in any graph) into `store`;
    gives {its old name: the main graph's value holding it}."""
    import numpy as np
    from onnx import TensorProto, numpy_helper

    renames = {}
    for g in _graphs(model.graph):
        keep = []
        for init in g.initializer:
            if init.data_type == TensorProto.FLOAT and np.prod(init.dims) >= min_size:
                short = init.name.split("/", 1)[1] if init.name.startswith(("with_past/", "no_past/")) else init.name
                renames[init.name] = store.value_for(numpy_helper.to_array(init), short)
            else:
                keep.append(init)
        del g.initializer[:]
        g.initializer.extend(keep)
    return renames


def _rename_and_strip(model, renames: dict[str, str]) -> None:
    """Every node reads the hoisted weights by their new names; the old names' value infos and
    inputs go, and so does the exporter's metadata."""
    for g in _graphs(model.graph):
        for node in g.node:
            node.input[:] = [renames.get(x, x) for x in node.input]
            del node.metadata_props[:]
            node.doc_string = ""
        for items in (g.value_info, g.input):
            kept = [v for v in items if v.name not in renames]
            del items[:]
            items.extend(kept)
        for v in list(g.value_info) + list(g.input) + list(g.output):
            del v.metadata_props[:]


def checkpoint_tensors(hf_dir: Path) -> dict:
    """{name: float32 array} of the checkpoint's model.safetensors."""
    import numpy as np
    from safetensors.numpy import load_file

    return {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}


def export_merged(hf_dir: Path, out: Path, work: Path) -> Path:
    """`out/onnx/decoder_model_merged.onnx` from the checkpoint in `hf_dir` (float32 compute)."""
    import onnx
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    export_decoder(model, work / "decoder_model.onnx", past=False)
    export_decoder(model, work / "decoder_with_past_model.onnx", past=True)
    merged = merge(onnx.load(str(work / "decoder_model.onnx")), onnx.load(str(work / "decoder_with_past_model.onnx")))
    path = out / "onnx" / "decoder_model_merged.onnx"
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(compact(merged, checkpoint_tensors(hf_dir)), str(path))
    return path


def build_genai(hf_dir: Path, out: Path, work: Path) -> Path:
    """`out/model.onnx` + `genai_config.json`: the onnxruntime-genai builder's fp32 CPU build of
    `hf_dir`, compacted into one file, with the tokenizer and configs of `hf_dir` beside it."""
    import onnx

    build = work / "genai"
    log = work / "genai-builder.log"
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(build),
           "-p", "fp32", "-e", "cpu", "-c", str(work / "genai-cache")]
    with open(log, "wb") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc={rc}):\n{log.read_text(errors='replace')[-3000:]}")
    out.mkdir(parents=True, exist_ok=True)
    model = compact(onnx.load(str(build / "model.onnx")), checkpoint_tensors(hf_dir))
    onnx.save(model, str(out / "model.onnx"))
    shutil.copy2(build / "genai_config.json", out / "genai_config.json")
    for name in GENAI_FILES:
        if (hf_dir / name).exists():
            shutil.copy2(hf_dir / name, out / name)
    sync_search(out)
    return out / "model.onnx"


def sync_search(folder: Path) -> None:
    """genai_config.json's `search` takes generation_config.json's repetition penalty (the
    builder copies temperature, top_k and top_p, and leaves the penalty at 1), so that
    onnxruntime-genai samples as Raymuter does."""
    path = folder / "genai_config.json"
    genai = json.loads(path.read_text())
    settings = json.loads((folder / "generation_config.json").read_text())
    genai["search"]["repetition_penalty"] = settings.get("repetition_penalty", 1.0)
    path.write_text(json.dumps(genai, indent=4) + "\n")


def export_all(folder: Path) -> None:
    """Both exports of the checkpoint in `folder`, into `folder/onnx` and `folder/genai`."""
    import tempfile

    with tempfile.TemporaryDirectory() as work:
        export_merged(folder, folder, Path(work))
        build_genai(folder, folder / "genai", Path(work))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m generation.default_model.export",
                                     description="Export a checkpoint folder (config.json, model.safetensors) to ONNX")
    parser.add_argument("folder", type=Path)
    export_all(parser.parse_args().folder)
