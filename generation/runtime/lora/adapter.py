"""Read a PEFT LoRA adapter folder, and refuse what the engine cannot apply exactly.

PEFT (0.21) saves `adapter_config.json` and `adapter_model.safetensors`, whose tensors are named
`base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]. Its LoRA linear
layer computes, in eval mode,

    y = base(x) + lora_B(lora_A(x)) * scaling,  scaling = lora_alpha / r   (use_rslora: / sqrt(r))

with r and lora_alpha per module from `rank_pattern` / `alpha_pattern` where a pattern matches the
module's name (peft.utils.other.get_pattern_key: `(.*\\.)?(pattern)$`). The modules an adapter
changes are read from its tensors, the ground truth of what `target_modules`,
`layers_to_transform` and `exclude_modules` selected when PEFT built it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."
# settings that change what an adapter computes beyond y + B A x * scaling: refused when set
REFUSED = {
    "use_dora": "DoRA's magnitude vector is not applied",
    "modules_to_save": "whole modules saved beside the adapter are not applied",
    "lora_bias": "a bias on lora_B is not applied",
    "trainable_token_indices": "trained token embeddings are not applied",
    "target_parameters": "LoRA on parameters (not modules) is not applied",
    "layer_replication": "replicated layers are not built",
    "alora_invocation_tokens": "activated LoRA is not applied",
    "use_qalora": "QA-LoRA is not applied",
    "megatron_config": "Megatron's parallel layers are not built",
    "arrow_config": "Arrow routing is not applied",
    "kasa_config": "KaSA's singular values are not applied",
    "monteclora_config": "MonteCLoRA's sampled weights are not applied",
    "velora_config": "VeLoRA is not applied",
    "use_bdlora": "block-diagonal LoRA is not applied",
}
DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class AdapterError(ValueError):
    """An adapter that cannot be applied: the message names the setting or file that is wrong."""


@dataclass(frozen=True)
class LoraWeights:
    """One module's LoRA: a [r, in] and b [out, r] as PEFT stores them, float32; scale its scaling."""

    a: np.ndarray
    b: np.ndarray
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter: its modules by their name in the base model (`model.layers.0.self_attn.q_proj`)."""

    name: str
    path: Path
    modules: dict[str, LoraWeights]
    base_model: str | None = None
    # names these weights (the file, as of its last change): a prefix cache's key of the rows it made
    serial: int = 0

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def adapter_folder(path: str | Path) -> Path:
    """The local folder of an adapter: `path` itself, or a hub id's download of its two files."""
    folder = Path(path).expanduser()
    parts = str(path).split("/")
    if folder.exists() or len(parts) != 2 or not all(parts) or str(path).startswith((".", "~", "/")):
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path), allow_patterns=[CONFIG, WEIGHTS]))
    except Exception as e:  # noqa: BLE001 - offline, no such repository, the network
        raise AdapterError(f"lora_path {str(path)!r} is not a local folder, and downloading it from the Hugging "
                           f"Face hub failed: {type(e).__name__}: {e}") from None


def read_adapter(name: str, path: str | Path) -> Adapter:
    """The adapter in folder `path` (or a hub id's), checked; AdapterError naming what cannot be applied."""
    folder = adapter_folder(path)
    if not (folder / CONFIG).is_file():
        raise AdapterError(f"lora_path {str(path)!r} has no {CONFIG}: not a PEFT adapter folder")
    try:
        config = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"lora_path {str(path)!r}: {CONFIG} is not JSON ({e})") from None
    _check_config(config)
    if not (folder / WEIGHTS).is_file():
        raise AdapterError(f"lora_path {str(path)!r} has no {WEIGHTS} (only safetensors weights are read)")
    tensors = read_safetensors(folder / WEIGHTS)
    modules = _modules(tensors, config)
    if not modules:
        raise AdapterError(f"lora_path {str(path)!r}: {WEIGHTS} holds no lora_A / lora_B weights")
    stat = (folder / WEIGHTS).stat()
    seen = f"{(folder / WEIGHTS).resolve()}|{stat.st_mtime_ns}|{stat.st_size}|{sorted(config.items())}"
    serial = int.from_bytes(hashlib.blake2b(seen.encode(), digest_size=7).digest(), "little")
    return Adapter(name, folder, modules, config.get("base_model_name_or_path"), serial)


def _check_config(config: dict) -> None:
    kind = config.get("peft_type")
    if kind != "LORA":
        raise AdapterError(f"peft_type {kind!r}: only LORA adapters are applied")
    for key, why in REFUSED.items():
        if config.get(key):
            raise AdapterError(f"{key} is set ({config[key]!r}): {why}")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias {config['bias']!r}: only bias 'none' is applied (the base's biases stay as exported)")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be a positive integer, not {rank!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(f"{key} must be an object of module patterns, not {config[key]!r}")


def _modules(tensors: dict[str, np.ndarray], config: dict) -> dict[str, LoraWeights]:
    halves: dict[str, dict[str, np.ndarray]] = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX):
            raise AdapterError(f"tensor {key!r} is not under {PREFIX!r}: not saved by PEFT's LoraModel")
        module, _, kind = key[len(PREFIX):].rpartition(".lora_")
        if kind not in ("A.weight", "B.weight"):
            what = "an embedding's LoRA" if kind.startswith("embedding") else f"lora_{kind}"
            raise AdapterError(f"tensor {key!r}: {what} is not applied (target_modules names an embedding, or "
                               "the adapter has parts beside lora_A / lora_B)")
        halves.setdefault(module, {})[kind[0]] = value
    out = {}
    for module, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"target_modules: {module} has lora_{'B' if 'A' in pair else 'A'} missing")
        a, b = pair["A"], pair["B"]
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise AdapterError(f"target_modules: {module} is not a linear layer's LoRA "
                               f"(lora_A {a.shape}, lora_B {b.shape})")
        rank = a.shape[0]
        expected = (config.get("rank_pattern") or {}).get(_pattern(config.get("rank_pattern") or {}, module),
                                                          config["r"])
        if rank != expected:
            raise AdapterError(f"r: {module}'s weights have rank {rank}, where r / rank_pattern say {expected}")
        alpha = (config.get("alpha_pattern") or {}).get(_pattern(config.get("alpha_pattern") or {}, module),
                                                        config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        out[module] = LoraWeights(a, b, float(scale))
    return out


def _pattern(patterns: dict, module: str) -> str:
    """peft.utils.other.get_pattern_key: the first pattern matching the module's name's tail."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as float32 arrays. The format is an 8-byte header length, a
    JSON header (dtype, shape, byte offsets per tensor) and the bytes; read here rather than with
    `safetensors.numpy`, which has no bfloat16 (the dtype most adapters on the hub are saved in)."""
    data = path.read_bytes()
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8:8 + size])
    except (struct.error, ValueError) as e:
        raise AdapterError(f"{path.name} is not a safetensors file ({e})") from None
    out = {}
    for key, spec in header.items():
        if key == "__metadata__":
            continue
        kind = DTYPES.get(spec.get("dtype"))
        if kind is None:
            raise AdapterError(f"{path.name}: tensor {key!r} is {spec.get('dtype')}; float32, float16 and "
                               "bfloat16 are read")
        start, end = spec["data_offsets"]
        raw = np.frombuffer(data, kind, (end - start) // np.dtype(kind).itemsize, 8 + size + start)
        array = (raw.astype(np.uint32) << 16).view(np.float32) if spec["dtype"] == "BF16" else raw
        out[key] = np.array(array, np.float32).reshape(spec["shape"])
    return out
