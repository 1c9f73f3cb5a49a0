"""Hand each step's drafts to the scheduler inside the step's output, not by an extra round trip.

Without async scheduling (vLLM turns it off for ``custom_class`` proposers, and always on CPU),
the engine core fetches a step's drafts with a second call to the workers after the step
(``EngineCore.post_step`` -> ``collective_rpc("take_draft_token_ids")``): one more message-queue
round trip per step, paid even by steps that drafted nothing. On a 2-core CPU serving 16
requests that round trip was most of what a ReDrafter server that never drafts cost over vLLM
alone. vLLM has no extension point for it, so on a redrafter engine:

- ``GPUModelRunner.sample_tokens`` (CPU's runner inherits it): the worker puts the drafts it just
  proposed on the ``ModelRunnerOutput`` it returns, as :data:`DRAFTS_ATTR`;
- ``Scheduler.update_from_output``: the engine core applies them right after the step's output
  (``update_draft_token_ids``, where ``post_step`` would have applied them next);
- ``EngineCore.post_step``: skips the round trip when the step's output carried the drafts.

Any other engine runs vLLM's code unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_redrafter.patches import redrafter_runner, wrap_method

DRAFTS_ATTR = "redrafter_draft_token_ids"
"""Attribute of ``ModelRunnerOutput`` holding the step's ``DraftTokenIds`` (or None: no drafts)."""
HANDED_OFF = "_redrafter_drafts_handed_off"
"""Set on the engine core's scheduler when the last step's output carried its drafts."""


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_method(GPUModelRunner, "sample_tokens", ("self", "grammar_output"), _sample_wrapper)
    wrap_method(Scheduler, "update_from_output",
                ("self", "scheduler_output", "model_runner_output"), _update_wrapper)
    wrap_method(EngineCore, "post_step", ("self", "model_executed"), _post_step_wrapper)


def _sample_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    def sample_tokens(self, grammar_output):
        output = original(self, grammar_output)
        if (redrafter_runner(self) and type(output) is ModelRunnerOutput
                and output is not EMPTY_MODEL_RUNNER_OUTPUT):
            setattr(output, DRAFTS_ATTR, self.take_draft_token_ids())
        return output

    return sample_tokens


def _update_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = original(self, scheduler_output, model_runner_output)
        handed_off = hasattr(model_runner_output, DRAFTS_ATTR)
        setattr(self, HANDED_OFF, handed_off)
        drafts = getattr(model_runner_output, DRAFTS_ATTR, None)
        if drafts is not None:
            self.update_draft_token_ids(drafts)
        return outputs

    return update_from_output


def _post_step_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def post_step(self, model_executed):
        if getattr(self.scheduler, HANDED_OFF, False):
            setattr(self.scheduler, HANDED_OFF, False)
            return None
        return original(self, model_executed)

    return post_step
