"""Shared fixtures: the embedded target (prepared once per cache) and the MT-Bench evaluation set."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

# One intra-op thread in the test process: on 2 cores, vLLM's CPU worker (started by some tests and
# kept for a module) holds one core, and two OpenMP threads fighting over the other one made a
# transformers forward 13x slower (953 vs 74 ms per token, measured here). Modules where nothing
# else runs take torch's own default (what a vLLM subprocess uses) again: ``every_core``.
_DEFAULT_THREADS = torch.get_num_threads()
torch.set_num_threads(1)
# vLLM's CPU worker replaces torch.set_num_threads with a no-op when an engine starts in this
# process; this is the original, so a module can still set and restore its threads.
_set_num_threads = torch.set_num_threads


@pytest.fixture(scope="module")
def every_core():
    """Torch's default thread count (the cores this process may use) for this module's compute
    in the test process (an in-process vLLM engine runs at the test process's thread count:
    1.55x faster on 2 cores than at 1, in a batch of 10 W = 4 L = 4 trees); back to 1 thread
    after the module."""
    _set_num_threads(_DEFAULT_THREADS)
    yield
    _set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = REPO / "vllm_redrafter" / "default_drafter"


def pytest_addoption(parser) -> None:
    parser.addoption("--exactness-full", action="store_true",
                     help="test_vllm_plugin's exact-sampling tests at full size (power against a "
                          "0.05 total-variation bias; benchmarks/exactness.py)")


def _import_kernels_interpreted() -> None:
    """On a CPU, the Triton kernels run in Triton's interpreter, which is chosen when triton and
    the kernels are first imported. Any module that imports vLLM imports triton too, so the
    kernels are imported here, before any test module, with ``TRITON_INTERPRET=1``; the variable
    is then restored (test_kernels.py sets it for its own tests) so engines never see it."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language  # noqa: F401

        from vllm_redrafter.kernels import fused_beam_step, sampling, tree_attention  # noqa: F401
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_kernels_interpreted()


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


@pytest.fixture(scope="session")
def drafter_dir(tmp_path_factory) -> Path:
    """The shipped drafter, or an untrained one where the package ships none."""
    if (DEFAULT_DRAFTER / "config.json").is_file():
        return DEFAULT_DRAFTER
    return save_random_drafter(tmp_path_factory.mktemp("drafter"))


def chat_prompts(target_dir: Path, questions: list[str]) -> list[list[int]]:
    """Questions as first turns in the target's chat template, as token ids."""
    from transformers import AutoTokenizer

    from vllm_redrafter.reference_loop import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [chat_prompt_ids(tokenizer, q) for q in questions]
