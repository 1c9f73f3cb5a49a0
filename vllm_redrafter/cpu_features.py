"""What this CPU can do, from /proc/cpuinfo: the choices that depend on it (training dtype, the
step-cost cache key) read it here."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The first processor's flags (empty where /proc/cpuinfo is not there)."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        return frozenset()
    for line in cpuinfo.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def cpu_isa() -> str:
    """The widest matrix/vector ISA this CPU reports (``amx_bf16``, ``avx512_bf16``, ``avx512f``,
    ``avx2``), or "". Each is a different step-cost curve (step_cost_curve.step_cost_path)."""
    flags = cpu_flags()
    return next((f for f in ("amx_bf16", "avx512_bf16", "avx512f", "avx2") if f in flags), "")


def has_amx_bf16() -> bool:
    """Whether this CPU multiplies bf16 matrices in AMX tiles. Measured on a 2-core Xeon with
    AMX: the drafter head's GEMM (5120 x 1152 by 1152 x 6144) forward and backward in 0.36 s
    under bf16 autocast, 1.06 s in float32; on AVX2 CPUs bf16 is up to 30x slower instead."""
    return "amx_bf16" in cpu_flags()
