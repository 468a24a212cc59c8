"""The machine a bench table ran on, as its heading names it: the CPU model and the instruction
sets that decide its speed (the CPU model changes between sessions)."""
from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu() -> str:
    """'AMD EPYC (avx2), 2 CPUs': /proc/cpuinfo's model name, its amx / avx512 / avx2 flags."""
    info = Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []
    name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                platform.processor() or platform.machine() or "?")
    flags = next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    have = [f for f in ("amx_tile", "avx512f", "avx512_vnni", "avx2") if f in flags] or ["none of amx, avx512, avx2"]
    return f"{name} ({', '.join(have)}), {os.cpu_count()} CPUs"
