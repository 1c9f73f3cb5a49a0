"""Hand the ReDrafter proposer the target's hidden states (at each request's last accepted node).

Wraps ``vllm.v1.worker.gpu_model_runner.GPUModelRunner.propose_draft_token_ids`` (CPU's
``CPUModelRunner`` inherits it): vLLM's ``custom_class`` branch calls
``proposer.propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, ...)`` without the
hidden states, and no extension point passes them (Medusa's branch does, to Medusa only). For a
proposer that defines ``propose_with_hidden_states`` the wrapper picks, per request, the hidden
state (after the final norm) at the last emitted token, the way Medusa's branch does, and calls
it; every other proposer goes to vLLM's own code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from vllm_redrafter.patches import wrap_method

PARAMS = (
    "self", "scheduler_output", "sampled_token_ids", "sampling_metadata", "hidden_states",
    "sample_hidden_states", "aux_hidden_states", "spec_decode_metadata",
    "common_attn_metadata", "slot_mappings",
)


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_method(GPUModelRunner, "propose_draft_token_ids", PARAMS, _wrapper)


def hidden_state_rows(
    sampled_token_ids: Sequence[Sequence[int]],
    num_draft_tokens: Sequence[int] | None,
    last_nodes: Mapping[int, int] | None = None,
) -> list[int]:
    """Row of ``sample_hidden_states`` holding each request's last accepted node.

    ``sample_hidden_states`` has ``num_draft + 1`` rows per request: its root and its verified
    draft nodes. A tree request takes the row of its last accepted node (``last_nodes[b]``, a
    packed index, from the tree verifier); otherwise Medusa's chain rule: a request that emitted
    ``n`` tokens (n - 1 accepted drafts + the bonus) takes row ``offset + n - 1``. A request that
    emitted nothing (a prefill chunk) gets its first row; it is not drafted for.

    >>> hidden_state_rows([[5, 6, 7], [8], []], [3, 2, 0])
    [2, 4, 7]
    >>> hidden_state_rows([[5, 6, 7], [8], []], [3, 2, 0], last_nodes={0: 3})   # tree: node 3
    [3, 4, 7]
    >>> hidden_state_rows([[5], [8]], None)   # no drafts were scheduled: one row each
    [0, 1]
    """
    if num_draft_tokens is None:
        return list(range(len(sampled_token_ids)))
    last_nodes = last_nodes or {}
    rows, offset = [], 0
    for b, (tokens, num_draft) in enumerate(zip(sampled_token_ids, num_draft_tokens, strict=True)):
        rows.append(offset + last_nodes.get(b, max(len(tokens), 1) - 1))
        offset += num_draft + 1
    return rows


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata,
                                hidden_states, sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, common_attn_metadata, slot_mappings):
        proposer = getattr(self, "drafter", None)
        if not hasattr(proposer, "propose_with_hidden_states"):
            return original(self, scheduler_output, sampled_token_ids, sampling_metadata,
                            hidden_states, sample_hidden_states, aux_hidden_states,
                            spec_decode_metadata, common_attn_metadata, slot_mappings)
        self._draft_probs = None  # what vLLM's own method resets first
        self._draft_prob_req_ids = None
        num_draft = (
            None if spec_decode_metadata is None
            or sample_hidden_states.shape[0] == len(sampled_token_ids)
            else spec_decode_metadata.num_draft_tokens
        )
        verifier = getattr(self, "rejection_sampler", None)
        step = getattr(verifier, "last_step", None)
        last_nodes = step.last_nodes if step is not None and num_draft is not None else None
        rows = hidden_state_rows(sampled_token_ids, num_draft, last_nodes)
        if verifier is not None and step is not None:
            verifier.last_step = None  # consumed
        index = torch.tensor(rows, dtype=torch.long).to(sample_hidden_states.device,
                                                        non_blocking=True)
        requests = [self.requests[req_id] for req_id in self.input_batch.req_ids]
        return proposer.propose_with_hidden_states(
            sampled_token_ids, sample_hidden_states[index], requests,
            max_num_drafts=scheduler_output.num_spec_tokens_to_schedule,
        )

    return propose_draft_token_ids
