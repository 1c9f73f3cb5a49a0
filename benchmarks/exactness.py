"""The in-engine exact-sampling tests at full size: power >= 0.9 against a 0.05 total-variation bias.

CI runs ``tests/test_vllm_plugin.py``'s sampling tests at a size with power against a 0.1 bias;
this runs the same tests with ``--exactness-full`` (vLLM alone 9000 / 6000 requests, ours 3200 /
2400 / 3200 per arm, the negative controls as in CI) and writes what each test printed (p-value,
power, counts, time) and its outcome to a JSON file. About 15 minutes on a 2-core CPU.

    python benchmarks/exactness.py --out benchmarks/results/exactness_full.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from vllm_redrafter.results import write_json

REPO = Path(__file__).resolve().parents[1]
SELECTION = "sampling or rejection_mode or prompt_leaves_room"


class Collect:
    """A pytest plugin keeping each test's outcome, duration and printed lines."""

    def __init__(self) -> None:
        self.tests: list[dict] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            printed = "".join(text for name, text in report.sections if "stdout" in name)
            self.tests.append({"test": report.nodeid.split("::")[-1], "outcome": report.outcome,
                               "seconds": round(report.duration, 1),
                               "printed": [line for line in printed.splitlines() if line]})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/exactness_full.json")
    args = parser.parse_args()
    collect = Collect()
    code = pytest.main([str(REPO / "tests" / "test_vllm_plugin.py"), "--exactness-full", "-q",
                        "-k", SELECTION, "-p", "no:cacheprovider"], plugins=[collect])
    write_json(args.out, {"selection": SELECTION, "exit_code": int(code), "tests": collect.tests})
    for test in collect.tests:
        print(f"{test['outcome']:7} {test['seconds']:7.1f} s  {test['test']}")
        for line in test["printed"]:
            print(f"    {line}")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
