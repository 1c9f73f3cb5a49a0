"""Tree attention inside vLLM's CPU attention backend, and the KV moves after verification.

vLLM 0.32.0's ``CPU_ATTN`` computes causal attention only. :class:`TreeCPUAttentionBackend`
(registered over ``CPU_ATTN`` by the plugin) runs vLLM's own kernel for every row, then, on a
verify step whose trees are not all chains, recomputes the tree rows with the tree mask: node j
attends to the request's context and to its ancestors (``kernels.paged_tree_attention``, reading
the paged cache through the block table; the Triton kernel on CUDA; here one padded SDPA
per layer over K/V gathered by indices built once per step).
Outside a tree step (prefill, plain decode, chains, vLLM without redrafter) nothing changes.

The cache layout is vLLM's and depends on the ISA: on ``vec``/``vec16`` (AVX2, AVX-512 without
AMX, ...) a block's K is stored transposed, ``[heads, head_dim, block_size]``, V as
``[heads, block_size, head_dim]``. :func:`cache_views` exposes both as strided
``[blocks, block_size, heads, head_dim]`` views; :func:`check_cache_layout` proves them right by
writing probe tokens with vLLM's own ``cpu_attn_reshape_and_cache`` (once per ISA and shape). An
ISA whose layout is not known (AMX packs K/V differently) gets no trees: the proposer then drafts
chains, whose causal mask is already right. Moving KV after verification also writes with vLLM's
op (:meth:`TreeAttentionMixin.move_kv`, through the impl's ``do_kv_cache_update``).

:class:`TreeAttentionMixin` is the backend-independent part; ``flash_attention.py`` mixes it into
vLLM's FlashAttention for CUDA.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor
from vllm import _custom_ops as ops
from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from vllm_redrafter.kernels import paged_tree_attention, use_triton
from vllm_redrafter.vllm_plugin.tree_step import TreeAttentionInputs

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and level

BACKEND_PATH = "vllm_redrafter.vllm_plugin.attention.TreeCPUAttentionBackend"
TRANSPOSED_K_ISAS = ("vec", "vec16")

_ACTIVE: ContextVar[TreeAttentionInputs | None] = ContextVar("redrafter_tree", default=None)


@contextmanager
def tree_attention(inputs: TreeAttentionInputs | None):
    """Within the block, attention layers apply ``inputs``' tree mask to its rows."""
    token = _ACTIVE.set(inputs)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


class TreeAttentionMixin:
    """Tree rows on top of a vLLM attention impl: the same code for every backend.

    Mixed in before vLLM's impl class: ``forward`` runs vLLM's (causal) attention for every row,
    then, inside a tree step, recomputes the tree rows with the ancestor mask from the paged cache
    (:func:`~vllm_redrafter.kernels.paged_tree_attention`: Triton on CUDA, torch elsewhere).
    A backend only says where its cache keeps K and V (:meth:`tree_cache_views`, as
    ``[num_blocks, block_size, Hkv, D]`` strided views) and whether it can prove that layout
    (:meth:`tree_layout_known`); KV moves write with the impl's own ``do_kv_cache_update``.
    """

    @property
    def supports_trees(self) -> bool:
        """Plain causal decoder attention: what the tree kernel computes."""
        return (self.attn_type == AttentionType.DECODER and self.alibi_slopes is None
                and self.sliding_window in (-1, None, (-1, -1)) and not self.logits_soft_cap
                and self.sinks is None and not is_quantized_kv_cache(self.kv_cache_dtype)
                and getattr(self, "dcp_world_size", 1) in (1, None))

    def tree_cache_views(self, layer, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def tree_layout_known(self, layer, kv_cache: Tensor) -> bool:
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        tree = _ACTIVE.get()
        if tree is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        if not self.supports_trees:
            raise RuntimeError("ReDrafter tree step on an attention layer without tree support")
        key_cache, value_cache = self.tree_cache_views(layer, kv_cache)
        context_lens = attn_metadata.seq_lens[tree.requests].long() - tree.num_nodes
        block_table = attn_metadata.block_table[tree.requests]
        plan = (None if use_triton(query.device) else  # torch path: one plan for all layers
                tree.gather_plan(block_table, context_lens, block_size=key_cache.shape[1]))
        out = paged_tree_attention(
            query[tree.rows], key_cache, value_cache, block_table, tree.cu_seqlens_q,
            context_lens, tree.mask_words, scale=self.scale, plan=plan,
        )
        output.view(output.shape[0], -1)[tree.rows] = out.reshape(out.shape[0], -1).to(output.dtype)
        return output

    def move_kv(self, layer, kv_cache: Tensor, src_slots: Tensor, dst_slots: Tensor) -> None:
        """Copy the KV of ``src_slots`` to ``dst_slots`` (all sources read before any write)."""
        key_view, value_view = self.tree_cache_views(layer, kv_cache)
        block_size = key_view.shape[1]
        blocks, offsets = src_slots // block_size, src_slots % block_size
        key = key_view[blocks, offsets].clone()  # [n, Hkv, D]
        value = value_view[blocks, offsets].clone()
        self.do_kv_cache_update(layer, key, value, kv_cache, dst_slots)


class TreeCPUAttentionImpl(TreeAttentionMixin, CPUAttentionBackendImpl):
    """vLLM's CPU attention, plus the tree rows of a verify step (module docstring)."""

    def tree_cache_views(self, layer, kv_cache: Tensor) -> tuple[Tensor, Tensor]:
        return cache_views(kv_cache, layer.isa)

    def tree_layout_known(self, layer, kv_cache: Tensor) -> bool:
        _, hkv, block_size, two_d = kv_cache.shape
        return check_cache_layout(getattr(layer, "isa", ""), block_size, hkv, two_d // 2,
                                  kv_cache.dtype)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[TreeCPUAttentionImpl]:
        return TreeCPUAttentionImpl


def _raw_caches(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """vLLM's own split of a layer's CPU cache into its K and V halves (cpu_attn.py)."""
    num_blocks, num_kv_heads, block_size, _ = kv_cache.shape
    kv = kv_cache.view(num_blocks, num_kv_heads, block_size * 2, -1)
    key_cache, value_cache = kv.chunk(2, dim=2)
    return key_cache, value_cache


def cache_views(kv_cache: Tensor, isa: str) -> tuple[Tensor, Tensor]:
    """K and V of a layer's CPU cache as ``[num_blocks, block_size, Hkv, D]`` strided views."""
    if isa not in TRANSPOSED_K_ISAS:
        raise NotImplementedError(f"ReDrafter tree attention does not know the {isa!r} cache layout")
    num_blocks, hkv, block_size, two_d = kv_cache.shape
    dim = two_d // 2
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    offset = kv_cache.storage_offset()
    # per (block, head): K^T [D, block_size] then V [block_size, D]
    key = kv_cache.as_strided((num_blocks, block_size, hkv, dim), (s_block, 1, s_head, block_size),
                              offset)
    value = kv_cache.as_strided((num_blocks, block_size, hkv, dim), (s_block, dim, s_head, 1),
                                offset + block_size * dim)
    return key, value


@functools.lru_cache(maxsize=None)
def check_cache_layout(isa: str, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> bool:
    """Whether :func:`cache_views` reads what vLLM's cache-write op writes for this ISA."""
    if isa not in TRANSPOSED_K_ISAS:
        return False
    cache = torch.zeros(2, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.tensor([0, 1, block_size + 3, 2 * block_size - 1])
    key = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim).to(dtype)
    key_cache, value_cache = _raw_caches(cache)
    try:
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa)
    except Exception:  # noqa: BLE001 - an op that refuses the probe: no trees
        logger.warning("ReDrafter: the %s cache-write op refused the layout probe", isa, exc_info=True)
        return False
    key_view, value_view = cache_views(cache, isa)
    blocks, offsets = slots // block_size, slots % block_size
    return bool(torch.equal(key_view[blocks, offsets], key)
                and torch.equal(value_view[blocks, offsets], value))


def layers_support_trees(attention_layers: dict) -> bool:
    """Every decoder attention layer is ours, tree-capable, and its cache layout is known."""
    found = False
    for layer in attention_layers.values():
        impl = getattr(layer, "impl", None)
        if getattr(impl, "attn_type", None) != AttentionType.DECODER:
            continue
        found = True
        if not isinstance(impl, TreeAttentionMixin) or not impl.supports_trees:
            return False
        kv_cache = layer.kv_cache
        if not isinstance(kv_cache, Tensor) or kv_cache.dim() != 4:
            return False
        if not impl.tree_layout_known(layer, kv_cache):
            return False
    return found
