"""``vllm-redrafter demo`` (the README's main command), end to end on a few prompts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import save_random_drafter
from vllm_redrafter.demo import DEFAULT_DRAFTER, metric_totals
from vllm_redrafter.eval_sets import first_turns


def test_prompt_file_errors_name_the_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"turns": ["fine"]}\n{"question": "no turns"}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: not a question"):
        first_turns(bad, 10)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no questions"):
        first_turns(empty, 10)


def test_metric_totals_sum_a_counter_over_its_labels():
    """On a /metrics page as vLLM's prometheus_client writes it (labels, _created samples)."""
    from prometheus_client import CollectorRegistry, Counter, generate_latest

    registry = CollectorRegistry()
    drafts = Counter("vllm:spec_decode_num_drafts", "drafts", ["engine"], registry=registry)
    drafts.labels("0").inc(3)
    drafts.labels("1").inc(4)
    text = generate_latest(registry).decode()
    assert metric_totals(text, ["vllm:spec_decode_num_drafts_total", "vllm:absent_total"]) == {
        "vllm:spec_decode_num_drafts_total": 7.0, "vllm:absent_total": 0.0}


def test_missing_drafter_says_how_to_get_one(tmp_path):
    run = subprocess.run([sys.executable, "-m", "vllm_redrafter.cli", "demo", "--drafter",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "vllm-redrafter train" in run.stderr


@pytest.mark.slow
def test_demo_runs_both_engines_and_outputs_agree(target_dir, mt_bench_questions, tmp_path):
    """The README's main command as a user types it (shipped drafter), on a few prompts; the
    engines' cores in the demo's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: two engine-core
    processes would each import vLLM again, ~20 s each here; the server tests cover those)."""
    figures = tmp_path / "demo.json"
    args = ["--num-prompts", "3", "--max-tokens", "32", "--json", str(figures)]
    shipped = (DEFAULT_DRAFTER / "config.json").is_file()
    if not shipped:  # an untrained drafter: the run's figures, not its speed, are checked
        args += ["--drafter", str(save_random_drafter(tmp_path / "drafter"))]
    run = subprocess.run(
        [sys.executable, "-m", "vllm_redrafter.cli", "demo", *args],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "VLLM_PLUGINS": "redrafter", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    out = json.loads(figures.read_text())
    assert out["prompts"] == 3 and out["identical_outputs"] == 3
    assert out["tokens_per_step"] is not None and out["tokens_per_step"] >= 1.0
    assert "speedup" in run.stdout and "identical greedy outputs: 3/3" in run.stdout
    # a quiet run: vLLM's log at WARNING, so none of its INFO lines (config dumps) reach the user
    info = [line for line in (run.stdout + run.stderr).splitlines() if re.match(r"(\x1b\[\d+m)?INFO ", line)]
    assert not info, info[:5]
    if shipped:  # the shipped drafter is accepted: more than one token per target step
        assert out["tokens_per_step"] > 1.3, out

