"""Every benchmark script imports and parses its flags (they are run by hand, never by the tests)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
                    if not p.name.startswith("_"))


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_help(script: Path):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout
