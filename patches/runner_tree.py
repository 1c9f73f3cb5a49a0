"""Run a ReDrafter verify step as a tree: positions, tree attention, the tree verifier.

Wraps two methods of ``vllm.v1.worker.gpu_model_runner.GPUModelRunner`` (CPU's
``CPUModelRunner`` inherits both); vLLM 0.32.0 has no tree speculation and no hook between
building a step's inputs and running the model:

- ``_prepare_inputs``: after vLLM built a step with drafts (token rows, slot mapping,
  spec-decode metadata), line the proposer's kept trees up with the scheduled drafts
  (``vllm_plugin.tree_step.build_tree_step``) and hand the step to the tree verifier, which the
  wrapper installs in place of ``self.rejection_sampler`` on first use;
- ``_model_forward``: for that step, feed the forward RoPE positions ``p + depth`` (the KV slots
  stay at ``p + packed index``) and let the attention backend apply the tree mask.

A runner whose proposer is not ReDrafter's runs vLLM's code unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_redrafter.patches import redrafter_runner, wrap_method

logger = logging.getLogger(__name__)

PREPARE_PARAMS = ("self", "scheduler_output", "num_scheduled_tokens")
FORWARD_PARAMS = ("self", "input_ids", "positions", "intermediate_tensors", "inputs_embeds",
                  "model_kwargs")


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_method(GPUModelRunner, "_prepare_inputs", PREPARE_PARAMS, _prepare_wrapper)
    wrap_method(GPUModelRunner, "_model_forward", FORWARD_PARAMS, _forward_wrapper)


def tree_verifier(runner: Any):
    """The runner's TreeVerifier, installed on first use; None if the proposer is not ours."""
    from vllm_redrafter.vllm_plugin.verifier import TreeVerifier

    if not redrafter_runner(runner):
        return None
    proposer = runner.drafter
    verifier = runner.rejection_sampler
    if not isinstance(verifier, TreeVerifier):
        verifier = TreeVerifier(runner, runner.rejection_sampler)
        runner.rejection_sampler = verifier
        runner.redrafter_attention_layers = _attention_layers(runner)
        proposer.allow_trees = _trees_supported(runner)
    return verifier


def _attention_layers(runner: Any) -> dict[str, Any]:
    from vllm.model_executor.layers.attention import Attention

    context = runner.compilation_config.static_forward_context
    return {name: layer for name, layer in context.items() if isinstance(layer, Attention)}


def _trees_supported(runner: Any) -> bool:
    from vllm_redrafter.vllm_plugin.attention import layers_support_trees

    groups = runner.kv_cache_config.kv_cache_groups
    ok = len(groups) == 1 and layers_support_trees(runner.redrafter_attention_layers)
    if not ok:
        logger.warning("ReDrafter: this model's attention cannot mask draft trees here (backend, "
                       "cache layout or KV groups); drafting chains (beam_width 1)")
    elif _full_cudagraphs(runner):
        logger.warning("ReDrafter: full CUDA graphs replay attention without the tree mask; "
                       "drafting chains (beam_width 1). For trees, pass compilation_config="
                       "{'cudagraph_mode': 'PIECEWISE'} (or enforce_eager)")
        ok = False
    return ok


def _full_cudagraphs(runner: Any) -> bool:
    """Whether steps may replay a full CUDA graph (attention inside it, not run in Python)."""
    mode = getattr(runner.compilation_config, "cudagraph_mode", None)
    return mode is not None and mode.has_full_cudagraphs()


def _prepare_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_redrafter.vllm_plugin.tree_step import build_tree_step

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = original(self, scheduler_output, num_scheduled_tokens)
        verifier = tree_verifier(self)
        if verifier is None:
            return result
        spec_decode_metadata = result[1]
        verifier.pending = None
        if spec_decode_metadata is not None and spec_decode_metadata.max_spec_len > 0:
            num_reqs = self.input_batch.num_reqs
            step = build_tree_step(
                self.input_batch.req_ids[:num_reqs], spec_decode_metadata.num_draft_tokens,
                scheduler_output.scheduled_spec_decode_tokens,
                self.query_start_loc.np[1: num_reqs + 1].tolist(), self.drafter.trees,
            )
            step.slot_mapping = self.input_batch.block_table[0].slot_mapping.gpu
            verifier.pending = step
        return result

    return _prepare_inputs


def _forward_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_redrafter.vllm_plugin import mutations
    from vllm_redrafter.vllm_plugin.attention import tree_attention
    from vllm_redrafter.vllm_plugin.timing import timed
    from vllm_redrafter.vllm_plugin.verifier import TreeVerifier

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        verifier = getattr(self, "rejection_sampler", None)
        step = verifier.pending if isinstance(verifier, TreeVerifier) else None
        timings = getattr(getattr(self, "drafter", None), "timings", None)
        if step is None or step.forward_done:
            with timed(timings, "forward_plain", self.device):
                return original(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                                **model_kwargs)
        step.forward_done = True
        if not mutations.NO_POSITION_REWRITE:  # test-only switch, off in production
            positions = step.rewrite_positions(positions)
        causal = step.is_chain or mutations.CAUSAL_TREE_MASK  # (test-only switch)
        inputs = None if causal else step.attention_inputs(positions.device)
        with tree_attention(inputs), timed(timings, "verify", self.device):
            return original(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                            **model_kwargs)

    return _model_forward
