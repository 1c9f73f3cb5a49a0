"""Tokens per step on a built dataset's held-out positions, from the drafter's beams alone.

With ``labels="self"`` a position's labels are the target's own greedy continuation, so the longest
prefix of a beam equal to them is what greedy verification accepts at that position: the drafter's
beam search over held-out positions (batched, no target forward) measures what the reference loop
would. It averages over every position, where the loop visits one position per step; on the
shipped drafter's datasets the two agreed within 0.06 tokens per step (dataset 4's held-out
prompts: 2.82 simulated, 2.76 in the loop). It is the cheap check that showed the gap between
prompts like the training prompts (2.8) and new ones (MT-Bench 1.95): see written_prompts.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.drafter import RecurrentDrafter
from vllm_redrafter.train.distill import DistillData


def accepted_drafts(beams: Tensor, labels: Tensor) -> Tensor:
    """Drafts accepted [B]: the longest prefix of any beam's drafts equal to the labels.

    ``beams`` [B, W, L] (``beams[:, :, 0]`` is g0, the rest are drafts), ``labels`` [B, >= L-1]
    (-1 = no label: never accepted).

    >>> accepted_drafts(torch.tensor([[[5, 1, 2, 9], [5, 1, 3, 4]]]), torch.tensor([[1, 3, 4, 7]]))
    tensor([3])
    """
    drafts = beams.shape[-1] - 1
    want = labels[:, None, :drafts]
    hit = (beams[:, :, 1:] == want) & (want >= 0)  # [B, W, L-1]
    return hit.long().cumprod(dim=-1).sum(dim=-1).max(dim=-1).values


@torch.no_grad()
def heldout_tokens_per_step(drafter: RecurrentDrafter, data: DistillData, beam_width: int,
                            beam_length: int, max_positions: int = 50_000, seed: int = 0,
                            batch_size: int = 2048) -> dict:
    """Mean tokens per step (1 + accepted) over up to ``max_positions`` held-out positions drawn
    with ``seed``, and the share accepting at least 1, 2, ... drafts."""
    if data.labels.shape[1] < beam_length - 1:
        raise ValueError(f"beam_length {beam_length} needs {beam_length - 1} labels per position, "
                         f"the dataset has {data.labels.shape[1]}")
    idx = torch.nonzero(data.heldout).squeeze(1)
    if idx.numel() == 0:
        raise ValueError("the dataset has no held-out positions")
    pick = torch.randperm(idx.numel(), generator=torch.Generator().manual_seed(seed))
    idx = idx[pick[:max_positions]].sort().values
    weight = next(drafter.parameters())  # where and in what dtype the drafter runs
    accepted = []
    for start in range(0, idx.numel(), batch_size):
        batch = idx[start: start + batch_size]
        h = data.hidden(batch).to(device=weight.device, dtype=weight.dtype)
        out = beam_search(drafter, h, data.g0[batch].to(weight.device), beam_width, beam_length)
        accepted.append(accepted_drafts(out.beams, data.labels[batch].to(weight.device)).cpu())
    counts = torch.cat(accepted)
    return {"positions": int(counts.numel()), "beam_width": beam_width,
            "beam_length": beam_length,
            "tokens_per_step": 1 + counts.double().mean().item(),
            "acceptance_at_least": [(counts > k).double().mean().item()
                                    for k in range(beam_length - 1)]}
