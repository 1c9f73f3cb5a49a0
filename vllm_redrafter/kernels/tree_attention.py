"""Paged tree attention for the verify step: a Triton kernel and its torch reference.

The target verifies the packed draft tree (``tree.py``) in one pass. Request b has C_b cached
context tokens and T_b packed tree tokens. Before attention runs, vLLM has written every token's
K/V into the paged cache, so the tree tokens sit at logical positions C_b + 0 .. C_b + T_b - 1
(slot = block_table[b, pos // block_size] * block_size + pos % block_size). Packed query p of
request b attends to

    every context position 0 .. C_b - 1,   and   tree position C_b + j  iff  bit j of mask[p] is set

where ``mask[p]`` is p's ancestor bitmask (p itself and its ancestors: ``tree.attention_mask`` row p,
packed into machine words by ``pack_tree_mask``). Bit j lives in word ``j // bits``, bit
``j % bits`` (bits = 32 for int32 words, 64 for int64). Example: the tree 0 -> {1, 2}, 1 -> {3}::

    attention_mask (row p: who p sees)    words (int64, one per row)
    p=0: [1, 0, 0, 0]                    0b0001 = 1
    p=1: [1, 1, 0, 0]                    0b0011 = 3
    p=2: [1, 0, 1, 0]                    0b0101 = 5
    p=3: [1, 1, 0, 1]                    0b1011 = 11

Shapes (vLLM's GPU flash layout; any layout works, the kernel takes strides)::

    q            [total_q, Hq, D]   the packed tree tokens of all requests, ragged via cu_seqlens_q
    key_cache    [num_blocks, block_size, Hkv, D]     (a strided view of another layout is fine)
    value_cache  [num_blocks, block_size, Hkv, D]
    block_table  [B, max_blocks]    int32/int64 physical block ids
    cu_seqlens_q [B + 1]            int32/int64, T_b = cu[b + 1] - cu[b]
    context_lens [B]                int32/int64, C_b (cached tokens before the tree)
    mask_words   [total_q, n_words] int32/int64 ancestor bitmask, n_words * bits >= max T_b
    out          [total_q, Hq, D]

The kernel (``tree_attention_triton``):

- grouped-query aware: one program owns one KV head and the G = Hq / Hkv query heads that read
  it, for a tile of rows m = t * G + g (tree token t, head g of the group). Each K/V tile is loaded
  once and multiplied by all G * T rows (T = 64, G = 4: 256 rows, two row tiles of 128);
- split-KV (flash-decoding): the key range 0 .. C_b + T_b is cut into ``num_splits`` chunks so that
  B * Hkv * splits programs fill the GPU at batch 1 (B * Hkv = 8 programs could not read at full
  bandwidth). Each split writes its partial (lse, normalised output), a second small kernel merges
  them (with one split, the first kernel writes the output directly);
- online softmax in fp32 with exp2; masked scores are -inf, the running max starts at -1e30 (not
  -inf) so a fully masked tile leaves the state unchanged instead of producing NaN;
- the bitmask is read only for keys at positions >= C_b (masked loads elsewhere).

Limits: T_b is not bounded by the word size (any n_words); block_size and D are arbitrary (D is
padded to a power of two inside the kernel). The torch reference is the definition and runs on CPU.

Measurements (H100) and history: docs/kernels.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # triton is optional: the torch reference works without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None

__all__ = [
    "TreeGatherPlan",
    "pack_tree_mask",
    "plan_tree_gather",
    "tree_attention_gathered",
    "tree_attention_reference",
    "tree_attention_triton",
]


# --------------------------------------------------------------------------------------------
# inputs


def pack_tree_mask(attention_mask: Tensor, num_packed: Tensor, word_bits: int = 64) -> Tensor:
    """[B, P, P] bool ancestor mask + [B] packed counts -> [sum T_b, n_words] packed bit words.

    Row p of request b becomes the words of ``attention_mask[b, p, :]`` (bit j = column j), rows
    concatenated over requests in cu_seqlens order (only the first T_b rows of each request).

    >>> mask = torch.tensor([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]]).bool()
    >>> pack_tree_mask(mask, torch.tensor([4])).flatten().tolist()
    [1, 3, 5, 11]
    """
    if attention_mask.dim() != 3 or attention_mask.shape[1] != attention_mask.shape[2]:
        raise ValueError(f"attention_mask must be [B, P, P], got {tuple(attention_mask.shape)}")
    if word_bits not in (32, 64):
        raise ValueError(f"word_bits must be 32 or 64, got {word_bits}")
    batch, packed, _ = attention_mask.shape
    n_words = max(1, -(-packed // word_bits))
    bits = torch.zeros(batch, packed, n_words * word_bits, dtype=torch.int64, device=attention_mask.device)
    bits[..., :packed] = attention_mask.long()
    weights = torch.ones(word_bits, dtype=torch.int64, device=attention_mask.device) << torch.arange(
        word_bits, device=attention_mask.device
    )  # [bits]; 1 << 63 wraps to int64's minimum, as a two's-complement word should
    words = (bits.view(batch, packed, n_words, word_bits) * weights).sum(-1)  # [B, P, n_words]
    if word_bits == 32:
        words = torch.where(words >= 2**31, words - 2**32, words)  # as int32 two's complement
        words = words.to(torch.int32)
    rows = torch.arange(packed, device=attention_mask.device) < num_packed[:, None]  # [B, P]
    return words[rows]  # [sum T_b, n_words]


def _check(q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, mask_words) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [total_q, Hq, D], got {tuple(q.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    total_q, hq, dim = q.shape
    hkv = key_cache.shape[2]
    if key_cache.shape[3] != dim or hq % hkv != 0:
        raise ValueError(
            f"q {tuple(q.shape)} and key_cache {tuple(key_cache.shape)}: head_dim must match and "
            "Hq must be a multiple of Hkv"
        )
    batch = context_lens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,) or block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} must be [B + 1] and block_table "
            f"{tuple(block_table.shape)} [B, max_blocks] for context_lens [B] = [{batch}]"
        )
    if mask_words.dim() != 2 or mask_words.shape[0] != total_q or mask_words.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"mask_words must be int32/int64 [total_q, n_words] = [{total_q}, n], got "
            f"{mask_words.dtype} {tuple(mask_words.shape)}"
        )


# --------------------------------------------------------------------------------------------
# torch reference


def tree_attention_reference(
    q: Tensor,  # [total_q, Hq, D]
    key_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: Tensor,  # [B, max_blocks]
    cu_seqlens_q: Tensor,  # [B + 1]
    context_lens: Tensor,  # [B]
    mask_words: Tensor,  # [total_q, n_words]
    scale: float | None = None,
) -> Tensor:
    """Dense masked attention per request (fp32), K/V gathered through the block table."""
    _check(q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, mask_words)
    total_q, hq, dim = q.shape
    block_size, hkv = key_cache.shape[1], key_cache.shape[2]
    scale = dim**-0.5 if scale is None else scale
    word_bits = 32 if mask_words.dtype == torch.int32 else 64
    out = torch.empty_like(q)
    for b, (start, end) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())):
        tree, context = end - start, int(context_lens[b])
        if tree == 0:
            continue
        pos = torch.arange(context + tree, device=q.device)  # [S]
        blocks = block_table[b].long()[pos // block_size]
        k = key_cache[blocks, pos % block_size].float()  # [S, Hkv, D]
        v = value_cache[blocks, pos % block_size].float()
        j = torch.arange(tree, device=q.device)
        words = mask_words[start:end].long()[:, j // word_bits]  # [T, T]
        tree_mask = ((words >> (j % word_bits)) & 1).bool()  # [T, T]: query t sees tree token j
        mask = torch.cat([tree_mask.new_ones(tree, context), tree_mask], dim=1)  # [T, S]
        k = k.repeat_interleave(hq // hkv, dim=1)  # [S, Hq, D]
        v = v.repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("thd,shd->hts", q[start:end].float(), k) * scale  # [Hq, T, S]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hts,shd->thd", probs, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# torch path for the engine: the gather indices and the mask once per step, SDPA per layer


@dataclass(frozen=True)
class TreeGatherPlan:
    """What every attention layer of one verify step shares (built once per step).

    R tree requests, padded to T = max T_r queries and S = max (C_r + T_r) keys. The reference
    above rebuilds all of this per request and per layer: ~15 small ops x R x layers per step,
    which on a CPU cost more than the attention itself.
    """

    blocks: Tensor  # [R, S] long: physical block of key s of request r (a valid block when padded)
    offsets: Tensor  # [R, S] long: its offset in the block
    query_index: Tensor  # [R, T] long: q row of tree token t of request r (row 0 when padded)
    valid: Tensor  # [R, T] bool: t < T_r
    mask: Tensor  # [R, 1, T, S] bool: query t sees key s (padded queries see every key)


def plan_tree_gather(
    block_table: Tensor,  # [R, max_blocks]
    cu_seqlens_q: Tensor,  # [R + 1]
    context_lens: Tensor,  # [R]
    mask_words: Tensor,  # [total_q, n_words]
    block_size: int,
) -> TreeGatherPlan:
    """The :class:`TreeGatherPlan` of one step (same inputs as the reference)."""
    device = mask_words.device
    cu, context = cu_seqlens_q.long(), context_lens.long()
    trees = cu[1:] - cu[:-1]  # [R]
    lens = context + trees
    word_bits = 32 if mask_words.dtype == torch.int32 else 64
    s = torch.arange(int(lens.max()), device=device)[None, :]  # [1, S]
    t = torch.arange(int(trees.max()), device=device)[None, :]  # [1, T]
    in_range = s < lens[:, None]  # [R, S]
    pos = torch.where(in_range, s, 0)
    valid = t < trees[:, None]  # [R, T]
    query_index = torch.where(valid, cu[:-1, None] + t, 0)
    # [R, S]: tree index of key s (clamped into the request's tree; in_range masks the rest)
    j = torch.minimum((s - context[:, None]).clamp(min=0), trees[:, None] - 1)
    words = mask_words.long()[query_index]  # [R, T, n_words]
    word = words.gather(2, (j // word_bits)[:, None, :].expand(-1, t.shape[1], -1))  # [R, T, S]
    ancestor = ((word >> (j % word_bits)[:, None, :]) & 1).bool()
    is_context = (s < context[:, None])[:, None, :]  # [R, 1, S]
    sees = (is_context | ancestor) & in_range[:, None, :] | ~valid[:, :, None]
    return TreeGatherPlan(
        blocks=block_table.long().gather(1, pos // block_size), offsets=pos % block_size,
        query_index=query_index, valid=valid, mask=sees[:, None],
    )


def tree_attention_gathered(
    q: Tensor,  # [total_q, Hq, D]
    key_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: Tensor,
    plan: TreeGatherPlan,
    scale: float | None = None,
) -> Tensor:
    """Tree attention as one padded SDPA call over K/V gathered by ``plan``: [total_q, Hq, D]."""
    k = key_cache[plan.blocks, plan.offsets].float().transpose(1, 2)  # [R, Hkv, S, D]
    v = value_cache[plan.blocks, plan.offsets].float().transpose(1, 2)
    queries = q[plan.query_index].float().transpose(1, 2)  # [R, Hq, T, D]
    out = F.scaled_dot_product_attention(queries, k, v, attn_mask=plan.mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[1])  # [R, Hq, T, D]
    return out.transpose(1, 2)[plan.valid].to(q.dtype)


# --------------------------------------------------------------------------------------------
# Triton kernel

if triton is not None:

    @triton.jit
    def _tree_attn_split_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, cu_ptr, ctx_ptr, words_ptr,
        out_ptr, part_o_ptr, part_lse_ptr,
        sm_scale_log2,
        stride_qt, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_bt, stride_wt, stride_ot, stride_oh,
        total_q, chunk,
        HQ: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        WORD_BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, M_TILES: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Program (b * M_TILES + m_tile, kv_head, split): rows m = t * GROUP + g of request b."""
        pid = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // M_TILES
        m_tile = pid % M_TILES
        q_start = tl.load(cu_ptr + b).to(tl.int64)
        tree_len = tl.load(cu_ptr + b + 1).to(tl.int64) - q_start
        ctx_len = tl.load(ctx_ptr + b).to(tl.int64)
        kv_len = ctx_len + tree_len

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [M]
        tok = offs_m // GROUP  # tree token of each row
        head = kv_head * GROUP + offs_m % GROUP  # query head of each row
        row_ok = tok < tree_len
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        q_rows = (q_start + tok) * stride_qt + head * stride_qh  # [M]
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # running max (log2 domain), finite: see doc
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_len)
        for n0 in range(lo, hi, BLOCK_N):
            pos = n0 + tl.arange(0, BLOCK_N)  # [N] logical positions
            pos_ok = pos < hi
            block = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
            slot = pos % BLOCK_SIZE
            kv_ok = pos_ok[:, None] & d_ok[None, :]
            k = tl.load(
                k_ptr + (block * stride_kb + slot * stride_ks + kv_head * stride_kh)[:, None] + offs_d[None, :],
                mask=kv_ok, other=0.0,
            )  # [N, D]
            if IEEE:  # fp32 inputs: exact fp32 products (tl.dot would use tf32 on a GPU)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2  # [M, N]
            else:
                s = tl.dot(q, tl.trans(k)) * sm_scale_log2
            j = pos - ctx_len  # tree index of each key (negative: context)
            is_tree = j >= 0
            word_mask = row_ok[:, None] & (is_tree & pos_ok)[None, :]
            jj = tl.where(is_tree, j, 0)
            words = tl.load(
                words_ptr + ((q_start + tok) * stride_wt)[:, None] + (jj // WORD_BITS)[None, :],
                mask=word_mask, other=0,
            )  # [M, N]
            bit = (words >> (jj % WORD_BITS).to(words.dtype)[None, :]) & 1
            visible = pos_ok[None, :] & ((~is_tree)[None, :] | (bit != 0))
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(
                v_ptr + (block * stride_vb + slot * stride_vs + kv_head * stride_vh)[:, None] + offs_d[None, :],
                mask=kv_ok, other=0.0,
            )
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        if SINGLE_SPLIT:
            out_rows = (q_start + tok) * stride_ot + head * stride_oh
            tl.store(out_ptr + out_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            part_rows = (split * total_q + q_start + tok) * HQ + head  # [M]
            tl.store(part_lse_ptr + part_rows, lse, mask=row_ok)
            tl.store(part_o_ptr + part_rows[:, None] * BLOCK_D + offs_d[None, :], o, mask=row_ok[:, None])

    @triton.jit
    def _tree_attn_merge_kernel(
        part_o_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, total_q,
        HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
        SPLITS_P2: tl.constexpr,
    ):
        """Program (token, head): out = sum_s 2^(lse_s - lse) o_s over the splits."""
        row = tl.program_id(0)  # token * HQ + head
        offs_s = tl.arange(0, SPLITS_P2)
        s_ok = offs_s < NUM_SPLITS
        lse = tl.load(part_lse_ptr + offs_s * total_q * HQ + row, mask=s_ok, other=float("-inf"))
        m = tl.max(lse, axis=0)
        w = tl.where(s_ok, tl.math.exp2(lse - m), 0.0)  # every row sees itself: m is finite
        w = w / tl.sum(w, axis=0)
        offs_d = tl.arange(0, BLOCK_D)
        o = tl.load(part_o_ptr + (offs_s * total_q * HQ + row)[:, None] * BLOCK_D + offs_d[None, :],
                    mask=s_ok[:, None], other=0.0)
        o = tl.sum(o * w[:, None], axis=0)
        tok = row // HQ
        head = row % HQ
        tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
                 mask=offs_d < D)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tree_attention_triton(
    q: Tensor,  # [total_q, Hq, D]
    key_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    block_table: Tensor,  # [B, max_blocks]
    cu_seqlens_q: Tensor,  # [B + 1]
    context_lens: Tensor,  # [B]
    mask_words: Tensor,  # [total_q, n_words]
    scale: float | None = None,
    *,
    max_tree_len: int | None = None,
    max_kv_len: int | None = None,
    num_splits: int | None = None,
    out: Tensor | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> Tensor:
    """The Triton kernel (module docstring). Same result as ``tree_attention_reference``.

    ``max_tree_len`` (max T_b) and ``max_kv_len`` (max C_b + T_b) size the grid; pass them (the
    scheduler knows them) to avoid a host sync, which also makes the call CUDA-graph capturable.
    ``num_splits`` defaults to enough splits for ~2 programs per SM (1 on CPU / interpret mode).
    """
    if triton is None:
        raise RuntimeError("tree_attention_triton needs triton; use tree_attention_reference")
    _check(q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, mask_words)
    if q.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("q, key_cache and value_cache need a contiguous last (head_dim) dimension")
    if mask_words.stride(-1) != 1:
        mask_words = mask_words.contiguous()
    total_q, hq, dim = q.shape
    hkv = key_cache.shape[2]
    group = hq // hkv
    batch = context_lens.shape[0]
    scale = dim**-0.5 if scale is None else scale
    if max_tree_len is None or max_kv_len is None:  # one host sync
        tree_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        max_tree_len = int(tree_lens.max()) if batch else 0
        max_kv_len = int((tree_lens + context_lens).max()) if batch else 0
    out = torch.empty_like(q) if out is None else out
    if total_q == 0 or batch == 0:
        return out
    block_d = max(16, _next_pow2(dim))
    block_m = max(16, min(block_m, _next_pow2(max_tree_len * group)))
    m_tiles = -(-max_tree_len * group // block_m)
    if num_splits is None:
        if q.is_cuda:
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            want = max(1, (2 * sms) // max(1, batch * hkv * m_tiles))
            num_splits = max(1, min(want, -(-max_kv_len // (4 * block_n)), 64))
        else:
            num_splits = 1
    chunk = -(-max(max_kv_len, 1) // num_splits)
    chunk = -(-chunk // block_n) * block_n  # whole key tiles per split
    num_splits = -(-max(max_kv_len, 1) // chunk)
    single = num_splits == 1
    if single:
        part_o = part_lse = out  # unused
    else:
        part_o = torch.empty(num_splits, total_q, hq, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, total_q, hq, dtype=torch.float32, device=q.device)
    word_bits = 32 if mask_words.dtype == torch.int32 else 64
    _tree_attn_split_kernel[(batch * m_tiles, hkv, num_splits)](
        q, key_cache, value_cache, block_table, cu_seqlens_q, context_lens, mask_words,
        out, part_o, part_lse,
        scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), mask_words.stride(0), out.stride(0), out.stride(1),
        total_q, chunk,
        HQ=hq, GROUP=group, D=dim, BLOCK_SIZE=key_cache.shape[1], WORD_BITS=word_bits,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, M_TILES=m_tiles, SINGLE_SPLIT=single,
        IEEE=q.dtype == torch.float32,
    )
    if not single:
        _tree_attn_merge_kernel[(total_q * hq,)](
            part_o, part_lse, out, out.stride(0), out.stride(1), total_q,
            HQ=hq, D=dim, BLOCK_D=block_d, NUM_SPLITS=num_splits, SPLITS_P2=_next_pow2(num_splits),
        )
    return out

