"""The drafter on vLLM's CPU GEMM (vllm_plugin/cpu_gemm.py): the same beams as torch's linear."""

from __future__ import annotations

import copy

import torch

from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter
from vllm_redrafter.vllm_plugin.cpu_gemm import use_vllm_cpu_gemm


def test_drafter_on_vllm_cpu_gemm_drafts_the_same_beams():
    torch.manual_seed(0)
    config = DrafterConfig(vocab_size=500, hidden_size=64, exit_dim=128, num_draft_layers=1,
                           draft_vocab_size=300)
    drafter = RecurrentDrafter(config, torch.nn.Embedding(500, 64)).eval()
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.3)
    fast = copy.deepcopy(drafter)
    fast.attach_embedding(drafter.embedding)
    assert use_vllm_cpu_gemm(fast) == 4  # rnn_w, rnn_u, the ResBlock, the head
    h, g0 = torch.randn(3, 64), torch.tensor([1, 2, 3])
    with torch.inference_mode():
        ours, theirs = beam_search(fast, h, g0, 4, 4), beam_search(drafter, h, g0, 4, 4)
    assert torch.equal(ours.beams, theirs.beams)
    torch.testing.assert_close(ours.scores, theirs.scores, atol=1e-4, rtol=1e-5)
    # the swap changed the compute path, not the checkpoint
    assert fast.state_dict().keys() == drafter.state_dict().keys()
