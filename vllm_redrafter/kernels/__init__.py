"""GPU kernels (Triton) and the one place that chooses between them and the torch paths.

Every caller (the vLLM integration, benchmarks) goes through the functions here:

====================  =======================================  ==============================
function              Triton (CUDA tensors)                    torch (elsewhere)
====================  =======================================  ==============================
paged_tree_attention  tree_attention.tree_attention_triton     tree_attention_gathered
beam_search           fused_beam_step.beam_search_fused        beam_search.beam_search
                      (only when forced, see below)
sample_tokens         sampling.sample_tiled (temperature only)  sampling.target_probs + race
====================  =======================================  ==============================

The choice: ``VLLM_REDRAFTER_KERNELS`` = ``auto`` (default: Triton for CUDA tensors when triton
imports), ``torch`` (never Triton) or ``triton`` (always; on CPU tensors this needs
``TRITON_INTERPRET=1`` set before triton is first imported, which is how the CPU tests run the
kernels). Cases the kernels do not cover take the torch path whatever the setting: beam search
with ``return_log_probs`` (the p/q verifier's q history), and sampling with top-k / top-p / min-p.
``auto`` runs the beam search in torch on CUDA too (measured faster); ``triton`` selects the
fused step.

Measurements and history: docs/kernels.md.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import Tensor

from vllm_redrafter import beam_search as _beam_search
from vllm_redrafter import envs
from vllm_redrafter import sampling as _sampling
from vllm_redrafter.kernels.tree_attention import (
    TreeGatherPlan,
    pack_tree_mask,
    plan_tree_gather,
    tree_attention_gathered,
)

__all__ = [
    "KERNELS_ENV",
    "beam_search",
    "pack_tree_mask",
    "paged_tree_attention",
    "sample_tokens",
    "use_triton",
]

KERNELS_ENV = envs.KERNELS
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device) -> bool:
    """Whether the Triton kernels serve tensors on ``device`` (module docstring)."""
    mode = envs.kernels_mode()
    if mode == "torch" or not _HAS_TRITON:
        if mode == "triton":
            raise RuntimeError(f"{KERNELS_ENV}=triton but triton is not installed")
        return False
    if mode == "triton":
        if device.type != "cuda" and not envs.triton_interpreted():
            raise RuntimeError(
                f"{KERNELS_ENV}=triton on a {device.type} tensor needs TRITON_INTERPRET=1 "
                "(set before triton is imported)"
            )
        return True
    return device.type == "cuda"


def paged_tree_attention(
    q: Tensor,  # [total_q, Hq, D]
    key_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: Tensor,
    block_table: Tensor,  # [B, max_blocks]
    cu_seqlens_q: Tensor,  # [B + 1]
    context_lens: Tensor,  # [B]
    mask_words: Tensor,  # [total_q, n_words] (pack_tree_mask)
    scale: float | None = None,
    plan: TreeGatherPlan | None = None,
    **kernel_args,
) -> Tensor:
    """Paged tree attention (``tree_attention.py``): [total_q, Hq, D].

    ``plan``: the torch path's gather indices and mask (``plan_tree_gather``), which the layers
    of one step share; built here when not given.
    """
    if use_triton(q.device):
        from vllm_redrafter.kernels.tree_attention import tree_attention_triton

        return tree_attention_triton(
            q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, mask_words, scale,
            **kernel_args,
        )
    if plan is None:
        plan = plan_tree_gather(block_table, cu_seqlens_q, context_lens, mask_words,
                                key_cache.shape[1])
    return tree_attention_gathered(q, key_cache, value_cache, plan, scale)


def beam_search(
    drafter,
    h: Tensor,  # [B, H]
    g0: Tensor,  # [B]
    beam_width: int | Tensor,
    beam_length: int | Tensor,
    *,
    apple_warp: bool = True,
    return_log_probs: bool = False,
) -> _beam_search.BeamSearchOutput:
    """The drafter's beam search: torch, or the fused step (``fused_beam_step.py``) where
    ``VLLM_REDRAFTER_KERNELS=triton`` asks for it (module docstring: torch measured faster)."""
    if not return_log_probs and envs.kernels_mode() == "triton" and use_triton(h.device):
        from vllm_redrafter.kernels.fused_beam_step import beam_search_fused

        return beam_search_fused(drafter, h, g0, beam_width, beam_length, apple_warp=apple_warp)
    return _beam_search.beam_search(
        drafter, h, g0, beam_width, beam_length,
        apple_warp=apple_warp, return_log_probs=return_log_probs,
    )


def sample_tokens(logits: Tensor, params: _sampling.SamplingParamsBatch) -> Tensor:
    """[B, ..., V] logits -> [B, ...] samples of the target's distribution (greedy rows: argmax).

    The tiled kernel serves temperature-only batches (top_k, top_p and min_p all None); seeded
    requests get their noise from their own generators (``sampling.exponential_noise``), the
    others from the kernel's Philox stream.
    """
    plain = params.top_k is None and params.top_p is None and params.min_p is None
    if not (plain and use_triton(logits.device)):
        return _sampling.sample_from_probs(_sampling.target_probs(logits, params), params)
    from vllm_redrafter.kernels.sampling import sample_tiled

    batch, vocab = logits.shape[0], logits.shape[-1]
    rows = logits.reshape(-1, vocab)  # [B*N, V]
    per_row = rows.shape[0] // max(batch, 1)
    temperature = params.temperature.float().repeat_interleave(per_row)  # [B*N]
    noise = None
    if params.generators:
        noise = _sampling.exponential_noise(logits.shape, params, logits.device).reshape(-1, vocab)
    tokens, _ = sample_tiled(rows, temperature, noise)
    return tokens.view(logits.shape[:-1])
