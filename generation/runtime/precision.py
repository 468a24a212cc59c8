"""Which precision a decoder runs at: as asked, or ('auto') the one this CPU is fast at.

Measured with bench/precision.py (SmolLM2-135M, 2 vCPUs; README "Precision"): on an AMD EPYC with
AVX-512 VNNI the int8 rewrite (runtime.quantize) ran 1.6-2.1x float32 at 1 to 64 rows and
1.3-3.3x vLLM's default there (bfloat16), at a KL to float32 of 0.011 (bfloat16's: 0.0007). int8's
dot products need the CPU's int8 instructions (AVX-512 VNNI, AVX-VNNI, AMX); an AVX2-only CPU was
not measured, so float32 stays there. A model whose weights fit in the CPU's caches gains little
from smaller weights and pays the activations' quantization at every projection (the 0.5 MiB test
Llama ran 0.67-0.97x float32 at int8, 1 to 32 rows): below MIN_INT8_BYTES of MatMul weights (a
model of 16M parameters, past the last-level cache) float32 stays too; where between 0.5 and
513 MiB int8 starts to pay was not measured. The batch sizes served do not enter the choice:
int8 was the faster at every batch size measured. On CUDA the precision is the fused graph's.

    choice = choose("auto", "cpu", Path("onnx/model.onnx"))
    choice.precision, choice.reason   # 'int8', 'this CPU has avx512_vnni (int8 dot products) and ...'
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

CHOICES = ("auto", "fp32", "fp16", "int8")
INT8_FLAGS = ("amx_int8", "avx512_vnni", "avx_vnni")  # /proc/cpuinfo's names, best first
MIN_INT8_BYTES = 64 * 2**20  # float32 MatMul weights below which int8 is not chosen by itself


@dataclass(frozen=True)
class Choice:
    """The precision a load runs at (None: the file as exported, its own precision) and why."""

    precision: str | None
    reason: str

    @property
    def name(self) -> str:
        return self.precision or "as exported"


def cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (/proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose(asked: str | None, provider: str, decoder: Path | None, flags: frozenset[str] | None = None,
           weight_bytes: int | None = None) -> Choice:
    """The precision for `asked` ('auto', a precision, or None: as exported) on `provider`, for
    the decoder file `decoder` (its MatMul weights counted unless `weight_bytes` gives them);
    `flags`: the CPU's (default: this machine's)."""
    if asked is not None and asked not in CHOICES:
        raise ValueError(f"precision: one of {', '.join(CHOICES)}, not {asked!r}")
    if asked != "auto":
        return Choice(asked, "asked for" if asked else "the file's own precision (none asked)")
    if provider == "cuda":
        return Choice(None, "on CUDA the fused graph runs in float16, other graphs as exported")
    flags = cpu_flags() if flags is None else flags
    have = [f for f in INT8_FLAGS if f in flags]
    if not have:
        return Choice("fp32", "this CPU has no int8 dot-product instructions (avx512_vnni, avx_vnni, amx_int8): "
                              "float32 is its fast precision")
    if weight_bytes is None:
        weight_bytes = _weight_bytes(decoder)
    if weight_bytes == 0:
        return Choice(None, ("the decoder has no float32 MatMul weights to quantize (a float16 or quantized "
                             "export): it runs as exported"))
    mib = weight_bytes / 2**20
    if weight_bytes < MIN_INT8_BYTES:
        return Choice("fp32", f"the decoder's MatMul weights are {mib:.0f} MiB, below the {MIN_INT8_BYTES >> 20} MiB "
                              "where int8 pays for quantizing its activations")
    return Choice("int8", f"this CPU has {have[0]} (int8 dot products) and the decoder's MatMul weights are "
                          f"{mib:.0f} MiB: int8 weights, per-token int8 activations")


def _weight_bytes(decoder: Path | None) -> int:
    if decoder is None:
        return 0
    import onnx

    from .quantize import matmul_weight_bytes

    return matmul_weight_bytes(onnx.load(str(decoder), load_external_data=False))
