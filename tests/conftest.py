"""Shared fixtures: the embedded target (prepared once per cache) and the MT-Bench evaluation set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# One intra-op thread in the test process: on 2 cores, vLLM's CPU worker (started by some tests and
# kept for a module) holds one core, and two OpenMP threads fighting over the other one made a
# transformers forward 13x slower (953 vs 74 ms per token, measured here).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
MT_BENCH = SHARED_DATA / "mt_bench_questions.jsonl"


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from vllm_redrafter.target import prepare_target

    return prepare_target()


@pytest.fixture(scope="session")
def mt_bench_questions() -> list[str]:
    """First turns of the 80 MT-Bench questions. A missing file fails the test: never skipped."""
    assert MT_BENCH.is_file(), f"the evaluation set is missing: {MT_BENCH} (../shared/data beside the repo)"
    rows = [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    assert len(rows) == 80, f"{MT_BENCH} holds {len(rows)} questions, expected 80"
    return [row["turns"][0] for row in rows]


def save_random_drafter(path: Path) -> Path:
    """An untrained drafter for the embedded target (K = 1024 random draft tokens), saved at path:
    what engine tests use when the package ships no default drafter. Never accepted."""
    from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter

    torch.manual_seed(0)
    config = DrafterConfig(vocab_size=49152, hidden_size=576, exit_dim=2 * 576, num_draft_layers=1,
                           draft_vocab_size=1024)
    drafter = RecurrentDrafter(config)
    drafter.draft_vocab_ids = torch.randperm(49152)[:1024]
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.02)
    drafter.save_pretrained(path)
    return path
