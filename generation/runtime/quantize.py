"""Int8 matrix products for a float32 decoder, made at load and cached: the precision CPUs with
int8 dot-product instructions (AVX-512 VNNI, AVX-VNNI, AMX) are fast at.

Every MatMul whose second input is a float32 weight [K, N] becomes one `raymuter.QuantizedMatMul`
node (a function of the model, inlined by onnxruntime):

    amax  = max(|x|) over the last axis                      # x: [..., K] float32, one token a row
    scale = max(amax, 1e-30) / 127                           # [..., 1]
    q     = uint8(round_half_even(x / scale) + 128)          # -127..127 around 128 (QuantizeLinear)
    y     = MatMulIntegerToFloat(q, w, scale, w_scale, 128)  # (q - 128) x w in int32, then * scale * w_scale

with the weight quantized once, symmetric per output channel: w_scale[n] = max |W[:, n]| / 127,
w = int8(round_half_even(W / w_scale)). The activation's scale is each token's own (vLLM's dynamic
per-token int8, llama.cpp's Q8 activations), so a token's output depends on nothing but its own
hidden state: not on the rows beside it in a batch, not on padding, not on how a prompt is chunked.
The products are exact in int32 and each output is scaled by the same two floats, so the rows of a
batch equal the rows run alone bit for bit. onnxruntime runs the product on MLAS's int8 kernels
(VNNI / AMX where the CPU has them) and scales inside the kernel.

A node's first input stays the hidden states, so runtime.head's gather of the read positions goes
before it as before a MatMul. The rewrite is built once per source file and kept under
$RAYMUTER_CACHE/quantized/<hash of the source and VERSION>, beside the fused graphs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .errors import ModelError
from .onnx_graph import default_opset, graphs

log = logging.getLogger(__name__)

VERSION = 5  # part of every cache key: bump when the rewrite changes
DOMAIN = "raymuter"
FUNCTION = "QuantizedMatMul"
ALPHA = 0.5  # SmoothQuant's migration strength: of 0.3, 0.4, 0.5 and 0.8, 0.5 gave SmolLM2-135M the lowest KL
# what the calibration prefill reads (the activations' channel ranges): prose, code and numbers
CALIBRATION = ("The committee met on Tuesday to discuss the new budget. She opened the window to let the cold "
               "morning air into the room. def mean(values):\n    return sum(values) / len(values)  # 3.14159\n"
               "Mountains in the north are covered with snow for half the year; in 1887, 42% of the town voted. "
               "<html><body><p>Hello, world!</p></body></html> SELECT name, price FROM items WHERE price > 100; "
               "Les enfants jouent dans le jardin. 2 + 2 = 4, 7 * 8 = 56, x**2 - 3*x + 2 = 0. "
               "import numpy as np\nfor i in range(10):\n    print(f'{i:02d}', np.sqrt(i))\n")
LEVELS = 127  # symmetric: -127..127 (no -128, so negation is exact and both signs weigh the same)
ZERO_POINT = 128  # activations as uint8 around 128: MLAS's fast int8 kernels take uint8 x int8 (VNNI's vpdpbusd)


class QuantizeError(ModelError):
    """The decoder cannot run at the asked precision; the message says why."""


def quantized_decoder(path: Path, cache_root: Path, calibration_ids: np.ndarray | None = None,
                      graph_of=None) -> Path:
    """The int8 rewrite of the float32 decoder at `path` (built once, then read from the cache).
    With `calibration_ids` [1, S] and `graph_of(session) -> DecoderGraph`, each projection is
    smoothed first (SmoothQuant: `smoothing`) by the channel ranges a prefill of those ids gives.
    QuantizeError where the graph has no float32 MatMul weight to quantize."""
    from .fusion import _exclusive

    folder = cache_root / "quantized" / cache_key(path, calibration_ids)
    built = folder / "model.onnx"
    with _exclusive(folder):  # replicas starting together on one node: one builds, the others load it
        if built.exists():
            log.info("%s runs as its int8 rewrite %s", path.name, built)
            return built
        # a warning, so that a command line shows it: the build reads every weight (minutes for a large model)
        log.warning("quantizing %s to int8 (once; cached in %s) ...", path, folder)
        import onnx

        ranges = activation_ranges(path, calibration_ids, graph_of) if calibration_ids is not None else {}
        model = onnx.load(str(path), load_external_data=True)
        count = quantize_graph(model, ranges)
        if not count:
            raise QuantizeError(f"{path.name} has no MatMul with a float32 weight to quantize (int8 applies to a "
                                "float32 export; a quantized file runs as exported)")
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".building-"))
        onnx.save_model(model, str(staging / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                        location="model.onnx.data", size_threshold=1024)
        try:
            os.rename(staging, folder)
        except OSError:  # another machine built it first (a cache shared over a filesystem the lock does not span)
            shutil.rmtree(staging, ignore_errors=True)
        log.info("%s quantized to int8: %s", path.name, next(p.value for p in model.metadata_props if p.key == "raymuter.int8"))
        return built


def calibration_ids(tokenizer_path: Path | None, vocab: int) -> np.ndarray:
    """[1, S] the ids of CALIBRATION by the model's tokenizer (ids spread over the vocabulary
    without one)."""
    if tokenizer_path is not None:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(tokenizer_path)).encode(CALIBRATION).ids
        ids = [i for i in ids if 0 <= i < vocab]
        if len(ids) >= 16:
            return np.array([ids[:256]], np.int64)
    return ((np.arange(128, dtype=np.int64) * 7919 + 3) % vocab)[None, :]


def activation_ranges(path: Path, ids: np.ndarray, graph_of) -> dict[str, np.ndarray]:
    """{name: max |x| per channel [K]} of each float32 projection's input in the top graph of the
    decoder at `path`, over a prefill of `ids` [1, S] with an empty past (a merged decoder's If
    branches are not read: their projections run unsmoothed)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from .feeds import step_inputs

    model = onnx.load(str(path), load_external_data=False)
    weights = {t.name for t in model.graph.initializer if t.data_type == 1 and len(t.dims) == 2}
    names = sorted({n.input[0] for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights})
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names
                              if n not in outputs)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    graph = graph_of(session)
    width = ids.shape[1]
    feeds = step_inputs(graph, ids, np.ones((1, width), np.int64), np.arange(width)[None, :], 0)
    feeds.update({e.past: np.zeros((1, e.heads, 0, e.head_dim), graph.cache_dtype) for e in graph.cache})
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}}
    values = session.run(names, feeds)
    return {n: np.abs(v.reshape(-1, v.shape[-1])).max(axis=0).astype(np.float32) for n, v in zip(names, values)}


def _smoothings(model, weights: dict, ranges: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """{input name: s [K]} for each input of the top graph's projections that `ranges` covers: one
    factor for all the projections that read it (q, k and v; gate and up), so they still quantize
    the same x / s (onnxruntime then computes it once)."""
    from onnx import numpy_helper

    rows: dict[str, np.ndarray] = {}
    for node in model.graph.node:
        x = node.input[0] if node.input else None
        if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and node.input[1] in weights and x in ranges:
            w_range = np.abs(numpy_helper.to_array(weights[node.input[1]])).max(axis=1)
            rows[x] = np.maximum(rows[x], w_range) if x in rows else w_range
    factors = {x: smoothing(ranges[x], w_range) for x, w_range in rows.items()}
    top = _TopGraph(model.graph, set(weights))
    return {x: f for x, f in factors.items() if _fold(top, x, f)}


class _TopGraph:
    """What `_fold` asks of the top graph for every input, read once: who makes and who reads each
    name, its initializers, and the names read in subgraphs or given out."""

    def __init__(self, graph, weights: set[str]):
        self.weights = weights
        self.initializers = {t.name: t for t in graph.initializer}
        self.makers = {name: n for n in graph.node for name in n.output}
        self.readers: dict[str, list] = {}
        for node in graph.node:
            for name in set(node.input):
                self.readers.setdefault(name, []).append(node)
        self.outside = ({i for g in graphs(graph) if g is not graph for n in g.node for i in n.input}
                        | {o.name for o in graph.output})


def _fold(top: _TopGraph, x: str, factor: np.ndarray) -> bool:
    """Divide the scale of the norm that makes `x` by `factor`, so x comes out already divided by it
    (an operator x / s would cost more than it saves: measured 9% of a step at 32 rows); False
    where `x` is not an RMS norm's output read by projections only (it then runs unsmoothed)."""
    from onnx import numpy_helper

    maker = top.makers.get(x)
    gamma_at = {"SimplifiedLayerNormalization": 1, "SkipSimplifiedLayerNormalization": 2, "Mul": None}
    if maker is None or maker.op_type not in gamma_at or list(maker.output).index(x) != 0:
        return False
    at = gamma_at[maker.op_type]
    if at is None:  # an exported RMS norm's last step: Mul(normed, weight [K])
        at = next((i for i, name in enumerate(maker.input) if name in top.initializers), None)
    if at is None or at >= len(maker.input) or maker.input[at] not in top.initializers:
        return False
    gamma = top.initializers[maker.input[at]]
    readers = {id(n): n for n in top.readers.get(x, []) + top.readers.get(gamma.name, [])}.values()
    projections = all(r.op_type == "MatMul" and r.domain in ("", "ai.onnx") and list(r.input[:1]) == [x]
                      and r.input[1] in top.weights for r in readers if r is not maker)
    if (list(gamma.dims) != [len(factor)] or gamma.data_type != 1 or not projections or gamma.name in maker.input[:at]
            or x in top.outside or gamma.name in top.outside):
        return False
    gamma.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(gamma) / factor).astype(np.float32), gamma.name))
    return True


def smoothing(x_range: np.ndarray, w_range: np.ndarray) -> np.ndarray:
    """SmoothQuant's per-channel factor s [K] for x [.., K] @ W [K, N], from max |x| [K] and the
    weights' max |W row| [K] (over every projection of x): (x / s) @ (s W) is the same product
    with the activations' outlier channels moved into the weights, where int8 per column takes
    them better than int8 per token does: s = max|x|^ALPHA / max|W row|^(1 - ALPHA)."""
    ok = (x_range > 0) & (w_range > 0)
    s = np.where(ok, np.maximum(x_range, 1e-30) ** ALPHA / np.maximum(w_range, 1e-30) ** (1 - ALPHA), 1.0)
    return np.clip(s, 1e-4, 1e4).astype(np.float32)


def cache_key(path: Path, calibration_ids: np.ndarray | None = None) -> str:
    from .fusion import hash_files

    digest = hashlib.sha256(f"raymuter-int8-{VERSION}".encode())
    if calibration_ids is not None:
        digest.update(np.ascontiguousarray(calibration_ids, np.int64).tobytes())
    return hash_files(digest, path)


def matmul_weight_bytes(model) -> int:
    """Bytes of the float32 weights the MatMuls of `model` (an onnx ModelProto, weights not
    needed) multiply by: what int8 would shrink to a quarter."""
    sizes = {t.name: int(np.prod(t.dims)) * 4 for t in _initializers(model) if t.data_type == 1 and len(t.dims) == 2}
    return sum(sizes.get(n.input[1], 0) for g in graphs(model.graph) for n in g.node
               if n.op_type == "MatMul" and n.domain in ("", "ai.onnx"))


def quantize_graph(model, ranges: dict[str, np.ndarray] | None = None) -> int:
    """Rewrite, in place, each MatMul of `model` (an onnx ModelProto with its weights) whose second
    input is a 2-D float32 initializer into a QuantizedMatMul (in a merged decoder's If branches
    too); where `ranges` gives an input's channel ranges and an RMS norm makes that input, its
    projections are smoothed first (SmoothQuant, folded into the norm's scale). The number
    rewritten; a weight read by anything else besides MatMuls is kept too."""
    from onnx import numpy_helper

    opset = default_opset(model)
    if opset < 13:
        raise QuantizeError(f"its opset {opset} is older than 13 (Clip and ReduceMax as the rewrite writes them)")
    weights = {t.name: t for t in _initializers(model) if t.data_type == 1 and len(t.dims) == 2}
    factors = _smoothings(model, weights, ranges or {})
    made: dict[tuple[str, str | None], list[str]] = {}
    count = 0
    for graph in graphs(model.graph):
        for node in graph.node:
            if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or node.input[1] not in weights:
                continue
            name, x = node.input[1], node.input[0]
            smooth = x if graph is model.graph and x in factors else None
            if (name, smooth) not in made:
                tag = f"{name}/int8" + (f"/{len(made)}" if smooth else "")
                weight = numpy_helper.to_array(weights[name])
                if smooth:  # its norm's scale was divided by the same factor (_fold)
                    weight = weight * factors[x][:, None]
                arrays = dict(zip((tag, f"{tag}_scale"), quantize_weight(weight)))
                model.graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in arrays.items())
                made[name, smooth] = list(arrays)
            node.op_type, node.domain = FUNCTION, DOMAIN
            node.input[:] = [x, *made[name, smooth]]
            count += 1
    if not count:
        return 0
    readers = {i for g in graphs(model.graph) for n in g.node for i in n.input} | {o.name for o in model.graph.output}
    replaced = {name for name, _ in made}
    kept = [t for t in model.graph.initializer if t.name not in replaced or t.name in readers]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.opset_import.append(_opset(DOMAIN, 1))
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(_opset("com.microsoft", 1))
    model.ir_version = max(model.ir_version, 8)  # model-local functions
    model.functions.append(quantized_matmul(opset))
    _say(model, "raymuter.int8", f"{count} projections, {len(factors)} inputs smoothed (alpha {ALPHA})")
    return count


def _say(model, key: str, value: str) -> None:
    """Set `key` of the model's metadata_props (what the rewrite did, read back by tests and users)."""
    for prop in model.metadata_props:
        if prop.key == key:
            prop.value = value
            return
    model.metadata_props.add(key=key, value=value)


def quantize_weight(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """W [K, N] float32 -> (int8 [K, N], scale [N] float32), symmetric per output column:
    W ~ w * scale. A column of zeros takes scale 1."""
    weight = np.asarray(weight, np.float32)
    amax = np.abs(weight).max(axis=0)
    scale = np.where(amax > 0, amax / np.float32(LEVELS), np.float32(1)).astype(np.float32)
    w = np.clip(np.rint(weight / scale), -LEVELS, LEVELS).astype(np.int8)
    return w, scale


def quantized_matmul(opset: int):
    """The FunctionProto of raymuter.QuantizedMatMul(x, w, w_scale) -> y, in opset `opset`."""
    from onnx import TensorProto, helper

    def constant(name, value, kind=TensorProto.FLOAT):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, kind, [], [value]))

    if opset >= 18:  # ReduceMax takes its axes as an input from opset 18
        reduce = [helper.make_node("Constant", [], ["axes"], value=helper.make_tensor("axes", TensorProto.INT64, [1], [-1])),
                  helper.make_node("ReduceMax", ["absolute", "axes"], ["amax"], keepdims=1)]
    else:
        reduce = [helper.make_node("ReduceMax", ["absolute"], ["amax"], axes=[-1], keepdims=1)]
    nodes = [helper.make_node("Abs", ["x"], ["absolute"]), *reduce,
             constant("floor", 1e-30), constant("levels", float(LEVELS)),
             helper.make_node("Max", ["amax", "floor"], ["amax_floored"]),
             helper.make_node("Div", ["amax_floored", "levels"], ["scale"])]
    if opset >= 21:  # one blocked QuantizeLinear (a block spans the whole last axis): x / scale, rounded, + 128
        fill = helper.make_tensor("fill", TensorProto.UINT8, [1], [ZERO_POINT])
        nodes += [helper.make_node("Shape", ["scale"], ["scale_shape"]),
                  helper.make_node("ConstantOfShape", ["scale_shape"], ["zero_points"], value=fill),  # QuantizeLinear's
                  constant("zero_point", ZERO_POINT, TensorProto.UINT8),  # MatMulIntegerToFloat's: a scalar
                  helper.make_node("QuantizeLinear", ["x", "scale", "zero_points"], ["q"], axis=-1, block_size=1 << 30),
                  helper.make_node("MatMulIntegerToFloat", ["q", "w", "scale", "w_scale", "zero_point"], ["y"],
                                   domain="com.microsoft")]
    else:  # the same arithmetic, operator by operator
        nodes += [constant("low", -float(LEVELS)), constant("offset", float(ZERO_POINT)),
                  constant("zero_point", ZERO_POINT, TensorProto.UINT8),
                  helper.make_node("Div", ["x", "scale"], ["scaled"]),
                  helper.make_node("Round", ["scaled"], ["rounded"]),
                  helper.make_node("Clip", ["rounded", "low", "levels"], ["clipped"]),
                  helper.make_node("Add", ["clipped", "offset"], ["shifted"]),
                  helper.make_node("Cast", ["shifted"], ["q"], to=TensorProto.UINT8),
                  helper.make_node("MatMulIntegerToFloat", ["q", "w", "scale", "w_scale", "zero_point"], ["y"],
                                   domain="com.microsoft")]
    return helper.make_function(DOMAIN, FUNCTION, ["x", "w", "w_scale"], ["y"], nodes,
                                [_opset("", opset), _opset("com.microsoft", 1)])


def _opset(domain: str, version: int):
    from onnx import helper

    return helper.make_opsetid(domain, version)


def _initializers(model):
    return [t for g in graphs(model.graph) for t in g.initializer]
