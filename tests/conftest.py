"""Shared fixtures: the embedded target (prepared once per cache) and the MT-Bench evaluation set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

# One intra-op thread in the test process: on 2 cores, vLLM's CPU worker (started by some tests and
# kept for a module) holds one core, and two OpenMP threads fighting over the other one made a
# transformers forward 13x slower (953 vs 74 ms per token, measured here).
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from vllm_redrafter.target import prepare_target

    return prepare_target()


@pytest.fixture(scope="session")
def mt_bench_questions() -> list[str]:
    """First turns of the 80 MT-Bench questions shipped in the package (never skipped)."""
    from vllm_redrafter.eval_sets import MT_BENCH, first_turns

    questions = first_turns(MT_BENCH)
    assert len(questions) == 80, f"{MT_BENCH} holds {len(questions)} questions, expected 80"
    return questions


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
