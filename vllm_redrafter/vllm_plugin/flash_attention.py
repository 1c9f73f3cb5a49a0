"""Tree attention inside vLLM's FlashAttention backend (CUDA): the GPU twin of the CPU backend.

vLLM 0.32.0's ``FLASH_ATTN`` is causal only. :class:`TreeFlashAttentionBackend` (registered over
``FLASH_ATTN`` by the plugin on CUDA) is vLLM's FlashAttention plus
:class:`~vllm_redrafter.vllm_plugin.attention.TreeAttentionMixin`: the same tree code as on CPU,
where the tree rows are recomputed by the Triton paged tree-attention kernel. Only the cache
layout differs: FlashAttention keeps a layer's cache as ``[num_blocks, Hkv, block_size, 2 * D]``
and splits it exactly as :meth:`tree_cache_views` does (its ``do_kv_cache_update``), which also
writes the KV moves.

Full CUDA graphs would replay the causal attention without the tree rows: under them the runner
drafts chains (W = 1) with a warning (``patches/runner_tree.py``); piecewise graphs keep trees.
The GPU machines of this project cannot run vLLM 0.32 (its CUDA build needs torch 2.13): this
module's path is tested on CPU with FlashAttention's kernels swapped for torch ones
(``tests/test_tree_step.py``), and the Triton kernel against torch on the GPU.
"""

from __future__ import annotations

from torch import Tensor
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from vllm_redrafter.vllm_plugin.attention import TreeAttentionMixin

BACKEND_PATH = "vllm_redrafter.vllm_plugin.flash_attention.TreeFlashAttentionBackend"


class TreeFlashAttentionImpl(TreeAttentionMixin, FlashAttentionImpl):
    """vLLM's FlashAttention, plus the tree rows of a verify step (module docstring)."""

    def tree_cache_views(self, layer, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        """``[num_blocks, block_size, Hkv, D]`` views: FlashAttention's own split."""
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        return key_cache, value_cache

    def tree_layout_known(self, layer, kv_cache: Tensor) -> bool:
        return (kv_cache.dim() == 4 and kv_cache.shape[1] == self.num_kv_heads
                and kv_cache.shape[3] == 2 * self.head_size)


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeFlashAttentionImpl]:
        return TreeFlashAttentionImpl
