"""Every environment variable vllm-redrafter reads, read here and nowhere else.

=========================  =====================  ==============================================
variable                   default                meaning
=========================  =====================  ==============================================
VLLM_REDRAFTER_CACHE       ~/.cache/vllm-redrafter  prepared targets and step-cost curves
VLLM_REDRAFTER_KERNELS     auto                   auto | torch | triton (``kernels`` package)
VLLM_REDRAFTER_STEP_LOG    unset                  a file: one JSON line per engine step (debug)
=========================  =====================  ==============================================

Each is read when asked for (not at import), so a test or a launcher may set it late.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE = "VLLM_REDRAFTER_CACHE"
KERNELS = "VLLM_REDRAFTER_KERNELS"
STEP_LOG = "VLLM_REDRAFTER_STEP_LOG"
KERNEL_MODES = ("auto", "torch", "triton")


def cache_dir() -> Path:
    """Where prepared models and measured curves live."""
    return Path(os.environ.get(CACHE) or Path.home() / ".cache" / "vllm-redrafter")


def kernels_mode() -> str:
    """auto (unset), torch or triton; anything else is refused with the allowed values."""
    mode = os.environ.get(KERNELS, "auto").strip().lower()
    if mode not in KERNEL_MODES:
        raise ValueError(f"{KERNELS} must be auto, torch or triton, got {mode!r}")
    return mode


def step_log_path() -> str | None:
    """The step log's file, or None when stepping is not logged."""
    return os.environ.get(STEP_LOG) or None


def triton_interpreted() -> bool:
    """Triton's own ``TRITON_INTERPRET=1``: kernels run on CPU tensors (the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
