"""Result files are written without the machine's absolute paths (vllm_redrafter/results.py)."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_redrafter import results


def test_paths_under_the_checkout_cwd_and_home_are_made_relative(monkeypatch, tmp_path):
    monkeypatch.setattr(results, "CHECKOUT", Path("/src/vllm-redrafter"))
    monkeypatch.setattr(Path, "home", classmethod(lambda cls: Path("/users/ada")))
    monkeypatch.chdir(tmp_path)
    record = {"drafter": "/src/vllm-redrafter/vllm_redrafter/default_drafter",
              "path": Path("/src/vllm-redrafter/benchmarks"),  # a Path too (argparse's type)
              "cmd": ["vllm-redrafter", "--out", f"{tmp_path}/runs/x", "/users/ada/.cache/t"],
              "n": 3, "other": "/opt/data/set.jsonl"}
    assert results.portable(record) == {
        "drafter": "vllm_redrafter/default_drafter", "path": "benchmarks",
        "cmd": ["vllm-redrafter", "--out", "runs/x", "~/.cache/t"],
        "n": 3, "other": "/opt/data/set.jsonl"}
    results.write_json(tmp_path / "r.json", record)
    assert json.loads((tmp_path / "r.json").read_text())["drafter"] == "vllm_redrafter/default_drafter"
