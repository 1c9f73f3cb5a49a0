"""``vllm-redrafter step-cost`` (``vllm_redrafter/step_cost.py``), writing this checkout's copy
to ``benchmarks/results/step_cost.{json,png}`` unless ``--out FILE.json`` says otherwise.

    python benchmarks/step_cost.py [the command's options: vllm-redrafter step-cost --help]
"""

from __future__ import annotations

import sys
from pathlib import Path

from vllm_redrafter.cli import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    if not any(a == "--out" or a.startswith("--out=") for a in argv):
        argv += ["--out", str(Path(__file__).parent / "results" / "step_cost.json")]
    sys.exit(main(["step-cost", *argv]))
