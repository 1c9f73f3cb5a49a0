"""A fused beam-search step: the drafter's LM head, log-sum-exp and top-W, over vocabulary tiles.

The torch step (``beam_search.py``) computes, per step::

    logits = x @ W_head^T                          # [B*W, K]  (x: the head's input, [B*W, E])
    log q  = log_softmax(warp(logits))             # [B, W, K] fp32
    top-W of score[b, w] + log q[b, w, k] over (w, k)  -> (scores, parent w, draft id k)

which writes and re-reads [B, W, K] fp32 several times: at B*W = 1024 that, not the weights, is
most of the step (docs/costs.md, H100: the drafter's beam search). The fused step never
materialises [B, W, K]:

1. Kernel (grid: row tiles x vocabulary splits). A program multiplies a tile of beams by the
   head's rows of its vocabulary split, BLOCK_N columns at a time (fp32 accumulation, rounded to
   x's dtype as torch's Linear rounds its output), and keeps per beam:
   - the partial log-sum-exp of its split (running max m and sum of exp(logit - m));
   - its TOPN largest logits with their ids, as int64 sort keys (order-preserving int32 image of
     the fp32 logit in the high word, ~id in the low word: ties keep the lower id first). A new
     tile is sorted ascending and merged into the running descending top list by an element-wise
     max, which holds exactly the TOPN largest of the union (a bitonic merge step), then resorted.
2. A small torch merge over [B*W, splits, TOPN]: the beam's log-sum-exp from the partials, its
   TOPN best log-probs, then the top-W over each request's W * TOPN candidates.

The top-W extensions of a request are among the top-W tokens of each beam, so TOPN >= W suffices
without the warp.

Apple's top-50 warp (``apple_warp=True``): the warp keeps each beam's 50 largest logits (and any
tied with the 50th) and sets the rest to -5e4 before the log_softmax. With TOPN >= 50 the kept set
is read off the beam's sorted top-TOPN list (logit >= the 50th), so the warped log-sum-exp is
``logaddexp(lse(kept), -5e4 + log(K - n_kept))`` and every log q is known, with no second pass:
kept tokens ``logit - lse_w``, the others ``-5e4 - lse_w`` (all tied; any of them may fill the
beam's places past n_kept, as torch.topk's tie order is unspecified too). TOPN = 64 for W <= 64.
Limit: if more than TOPN - 50 = 14 logits tie exactly with a beam's 50th largest, the kept set is
cut at TOPN (torch keeps them all) and that beam's normaliser is too small. Exactly equal fp32
logits are rare; bf16 logits make it possible, not likely.

Exactness: the same beams as the torch path wherever the W-th and (W+1)-th candidate scores differ
by more than rounding (the GEMM's accumulation order differs from torch's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_redrafter.beam_search import (
    APPLE_TOP_K,
    LOG_ZERO,
    BeamSearchOutput,
    Drafter,
    _check_inputs,
    _log_q,
    _max_sizes,
    _per_request,
    _select,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = [
    "beam_search_fused",
    "fused_select",
    "head_input",
    "select_reference",
]

_INT64_MIN = -(2**63)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


# --------------------------------------------------------------------------------------------
# the keys: fp32 logit + token id -> one sortable int64


def encode_keys(logits: Tensor, ids: Tensor) -> Tensor:
    """fp32 logits + int ids -> int64 keys ordered like (logit, -id) (the kernel's encoding).

    >>> keys = encode_keys(torch.tensor([1.0, -2.0, 1.0]), torch.tensor([5, 3, 2]))
    >>> keys.argsort(descending=True).tolist()  # 1.0 at id 2, 1.0 at id 5, then -2.0
    [2, 0, 1]
    >>> decode_keys(keys)
    (tensor([ 1., -2.,  1.]), tensor([5, 3, 2]))
    """
    bits = logits.float().contiguous().view(torch.int32)
    sortable = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negative floats: flip magnitude bits
    return (sortable.long() << 32) | (0xFFFFFFFF - ids.long())


def decode_keys(keys: Tensor) -> tuple[Tensor, Tensor]:
    """int64 keys -> (fp32 logits, long ids); the inverse of ``encode_keys``."""
    sortable = (keys >> 32).to(torch.int32)
    bits = sortable ^ ((sortable >> 31) & 0x7FFFFFFF)
    return bits.view(torch.float32), 0xFFFFFFFF - (keys & 0xFFFFFFFF)


# --------------------------------------------------------------------------------------------
# the kernel

if triton is not None:
    from triton.language.standard import _log2  # a constexpr function (not jit): any mode

    @triton.jit
    def _indicator(n_dims: tl.constexpr, j: tl.constexpr):
        """[1, .., 2, .., 1] = [0, 1] along the j-th innermost of n_dims axes (Triton's own,
        redefined here so that reloading this module under TRITON_INTERPRET=1 suffices)."""
        ar = tl.arange(0, 2)
        return tl.reshape(ar, [1] * (n_dims - j - 1) + [2] + [1] * j)

    @triton.jit
    def _compare_and_swap(x, flip, i: tl.constexpr):
        """Triton's bitonic compare-and-swap (triton/language/standard.py), with the partner
        found by a sum instead of an xor-sum: ``sum(pair) - x`` is the other element of the pair,
        exact for int64 under two's-complement wrap-around. (The interpreter runs an xor-sum
        element by element in Python, ~100x slower than the sum: this keeps the CPU tests fast.)"""
        n_dims: tl.constexpr = _log2(x.numel)
        y = tl.sum(x, n_dims - 1 - i, keep_dims=True) - x
        is_right = _indicator(n_dims, i)
        return tl.where((x > y) != (flip ^ is_right), y, x)

    @triton.jit
    def _bitonic_merge(x, stage: tl.constexpr, order: tl.constexpr):
        """order 0 ascending, 1 descending, 2 alternating (as Triton's)."""
        if order == 2:
            flip = _indicator(_log2(x.numel), stage)
        else:
            flip = order
        for i in tl.static_range(stage):
            x = _compare_and_swap(x, flip, stage - 1 - i)
        return x

    @triton.jit
    def _sort_rows(x, descending: tl.constexpr):
        """Sort a [M, N] integer tile along its last dim (M, N powers of two): Triton's sort."""
        log_n: tl.constexpr = _log2(x.shape[1])
        n_dims: tl.constexpr = _log2(x.numel)
        h = tl.reshape(x, [2] * n_dims)
        for i in tl.static_range(1, log_n + 1):
            h = _bitonic_merge(h, i, 2 if i < log_n else descending)
        return tl.reshape(h, x.shape)

    @triton.jit
    def _head_topk_kernel(
        x_ptr, w_ptr, keys_ptr, m_ptr, s_ptr,
        rows, vocab, dim, chunk, num_splits,
        stride_xr, stride_wk,
        TOPN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        """Program (row tile, split): per beam row, partial lse and top-TOPN keys of the split."""
        row_tile = tl.program_id(0)
        split = tl.program_id(1)
        offs_m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = offs_m < rows
        offs_k = tl.arange(0, BLOCK_K)
        cols = tl.arange(0, BLOCK_N)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        s_i = tl.zeros([BLOCK_M], tl.float32)
        best = tl.full([BLOCK_M, BLOCK_N], -9223372036854775808, tl.int64)  # descending top keys
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for v0 in range(lo, hi, BLOCK_N):
            offs_n = v0 + cols
            col_ok = offs_n < hi
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for k0 in range(0, dim, BLOCK_K):
                k_ok = (k0 + offs_k) < dim
                x = tl.load(x_ptr + offs_m[:, None] * stride_xr + (k0 + offs_k)[None, :],
                            mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wk + (k0 + offs_k)[None, :],
                            mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                if IEEE:
                    acc += tl.dot(x, tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(x, tl.trans(w))
            logit = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # torch's Linear output rounding
            logit = tl.where(col_ok[None, :], logit, float("-inf"))
            # partial log-sum-exp
            m_new = tl.maximum(m_i, tl.max(logit, axis=1))
            s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(logit - m_new[:, None]), axis=1)
            m_i = m_new
            # keys: order-preserving int32 image of the logit, ~id below it
            bits = logit.to(tl.int32, bitcast=True)
            sortable = bits ^ ((bits >> 31) & 0x7FFFFFFF)
            key = (sortable.to(tl.int64) << 32) | (4294967295 - offs_n.to(tl.int64))[None, :]
            key = tl.where(col_ok[None, :], key, -9223372036854775808)
            # bitonic merge: max(desc, asc) holds the BLOCK_N largest of the union
            best = _sort_rows(tl.maximum(best, _sort_rows(key, 0)), 1)
        out_row = offs_m.to(tl.int64) * num_splits + split  # [M]
        tl.store(m_ptr + out_row, m_i, mask=row_ok)
        tl.store(s_ptr + out_row, s_i, mask=row_ok)
        tl.store(keys_ptr + out_row[:, None] * TOPN + cols[None, :], best,
                 mask=row_ok[:, None] & (cols < TOPN)[None, :])


def _topn(width: int, vocab: int, apple_warp: bool) -> int:
    """Candidates kept per beam: enough for the top-W, and for the warp's top-50 set."""
    need = min(width, vocab)
    if apple_warp and vocab > APPLE_TOP_K:
        need = max(need, APPLE_TOP_K + 14)  # 64: see the module docstring (ties with the 50th)
    return _next_pow2(need)


def head_topk_partials(
    x: Tensor,  # [R, E] the head's input, R = B*W beams
    weight: Tensor,  # [K, E] the head's weight
    topn: int,
    *,
    num_splits: int | None = None,
    block_m: int = 32,
    block_n: int = 64,
    block_k: int = 64,
) -> tuple[Tensor, Tensor, Tensor]:
    """Stage 1 (Triton): keys [R, S, TOPN] int64, m [R, S], s [R, S] (S = vocabulary splits)."""
    if triton is None:
        raise RuntimeError("the fused beam step needs triton")
    rows, dim = x.shape
    vocab = weight.shape[0]
    block_n = max(block_n, topn)
    block_m = max(16, min(block_m, _next_pow2(rows)))
    row_tiles = -(-rows // block_m)
    vocab_tiles = -(-vocab // block_n)
    if num_splits is None:
        if x.is_cuda:
            sms = torch.cuda.get_device_properties(x.device).multi_processor_count
            num_splits = max(1, min(vocab_tiles, -(-2 * sms // row_tiles)))
        else:
            num_splits = min(vocab_tiles, 4)
    chunk = -(-vocab_tiles // num_splits) * block_n
    num_splits = -(-vocab // chunk)
    keys = torch.empty(rows, num_splits, topn, dtype=torch.int64, device=x.device)
    m = torch.empty(rows, num_splits, dtype=torch.float32, device=x.device)
    s = torch.empty(rows, num_splits, dtype=torch.float32, device=x.device)
    _head_topk_kernel[(row_tiles, num_splits)](
        x, weight, keys, m, s, rows, vocab, dim, chunk, num_splits, x.stride(0), weight.stride(0),
        TOPN=topn, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        IEEE=x.dtype == torch.float32,
    )
    return keys, m, s


# --------------------------------------------------------------------------------------------
# stage 2: the small merge


def merge_partials(
    keys: Tensor,  # [R, S, TOPN] int64
    m: Tensor,  # [R, S]
    s: Tensor,  # [R, S]
    score: Tensor,  # [B, W] current beam scores
    width: int,
    vocab: int,
    apple_warp: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(top scores [B, width], parent beam [B, width], draft id [B, width]) from the partials."""
    rows, _, topn = keys.shape
    batch, beams = score.shape
    best = keys.reshape(rows, -1).topk(topn, dim=-1).values  # [R, TOPN] descending keys
    valid = best != _INT64_MIN
    logit, ids = decode_keys(best)  # [R, TOPN]
    logit = logit.masked_fill(~valid, float("-inf"))
    big = m.amax(dim=-1, keepdim=True)  # [R, 1]
    lse = big + (s * torch.exp(m - big)).sum(dim=-1, keepdim=True).log()  # [R, 1]
    if apple_warp and vocab > APPLE_TOP_K:
        kept = logit >= logit[:, APPLE_TOP_K - 1 : APPLE_TOP_K]  # ties with the 50th are kept
        lse_kept = logit.masked_fill(~kept, float("-inf")).logsumexp(dim=-1, keepdim=True)
        n_rest = (vocab - kept.sum(dim=-1, keepdim=True)).clamp(min=1)
        rest = torch.where(kept.sum(-1, keepdim=True) < vocab, LOG_ZERO + n_rest.float().log(), float("-inf"))
        lse = torch.logaddexp(lse_kept, rest)
        log_q = torch.where(kept, logit, LOG_ZERO) - lse
    else:
        log_q = logit - lse
    cand = score.reshape(rows, 1).float() + log_q.masked_fill(~valid, float("-inf"))  # [R, TOPN]
    top, index = cand.reshape(batch, beams * topn).topk(width, dim=-1)  # [B, width]
    draft = ids.reshape(batch, beams * topn).gather(1, index)
    return top, index // topn, draft


def fused_select(
    x: Tensor,  # [B*W, E] the head's input of every beam (request-major)
    weight: Tensor,  # [K, E] the head's weight
    score: Tensor,  # [B, W] fp32 beam scores
    width: int,
    apple_warp: bool = True,
    **kernel_args,
) -> tuple[Tensor, Tensor, Tensor]:
    """The fused form of ``_select(score[..., None] + _log_q(x @ weight.T, apple_warp), width)``."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [R, E] and weight [K, E] must share E, got {tuple(x.shape)}, {tuple(weight.shape)}")
    if score.dim() != 2 or score.numel() != x.shape[0]:
        raise ValueError(f"score must be [B, W] with B*W = rows of x = {x.shape[0]}, got {tuple(score.shape)}")
    if x.dtype != weight.dtype or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) need one dtype and contiguous rows")
    vocab = weight.shape[0]
    topn = _topn(width, vocab, apple_warp)
    keys, m, s = head_topk_partials(x, weight, topn, **kernel_args)
    return merge_partials(keys, m, s, score, width, vocab, apple_warp)


def select_reference(
    x: Tensor, weight: Tensor, score: Tensor, width: int, apple_warp: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """The torch step of ``beam_search.py`` (its own ``_log_q`` and ``_select``), for comparison."""
    batch, beams = score.shape
    logits = (x @ weight.T).reshape(batch, beams, -1)  # [B, W, K]
    return _select(score[:, :, None] + _log_q(logits, apple_warp), width)


# --------------------------------------------------------------------------------------------
# the whole beam search with the fused step


def head_input(drafter, h: Tensor, state: Tensor) -> Tensor:
    """The last Linear's input: ResBlocks(input_proj?([h, s])), [..., E] (cf. draft_logits)."""
    lead = torch.broadcast_shapes(h.shape[:-1], state.shape[:-1])
    dtype = drafter.lm_head[-1].weight.dtype
    z = torch.cat([h.to(dtype).expand(*lead, h.shape[-1]), state.expand(*lead, state.shape[-1])], dim=-1)
    if drafter.config.uses_input_proj:
        z = drafter.input_proj(z)
    for block in drafter.lm_head[:-1]:
        z = block(z)
    return z  # [..., E]


@torch.no_grad()
def beam_search_fused(
    drafter: Drafter,
    h: Tensor,  # [B, H]
    g0: Tensor,  # [B]
    beam_width: int | Tensor,
    beam_length: int | Tensor,
    *,
    apple_warp: bool = True,
    return_log_probs: bool = False,
    **kernel_args,
) -> BeamSearchOutput:
    """``beam_search`` with the fused step (same contract, same padding; no log_probs history).

    The loop is ``beam_search.beam_search``'s, with ``_select(score + _log_q(logits))`` replaced by
    ``fused_select(head_input(...), W_head, score)``.
    """
    if return_log_probs:
        raise ValueError("beam_search_fused does not return log_probs: use beam_search for p/q verify")
    batch, device = _check_inputs(h, g0)
    w_b = _per_request(beam_width, "beam_width", batch, device)
    l_b = _per_request(beam_length, "beam_length", batch, device)
    width, length = _max_sizes(w_b, l_b, beam_width, beam_length)
    rows = torch.arange(batch, device=device)[:, None]
    beam_ids = torch.arange(width, device=device)
    padding = beam_ids >= w_b[:, None]  # [B, W]
    weight = drafter.lm_head[-1].weight  # [K, E]

    state = drafter.init_state((batch, width))  # [B, W, H]
    score = torch.full((batch, width), LOG_ZERO, dtype=torch.float32, device=device)
    score[:, 0] = 0.0
    score = score.masked_fill(padding, float("-inf"))
    beams = g0.long()[:, None, None].expand(batch, width, 1)
    h = h[:, None, :].expand(batch, width, h.shape[-1])
    for t in range(length - 1):
        state = drafter.update_state(state, beams[:, :, -1])
        x = head_input(drafter, h, state).reshape(batch * width, -1).contiguous()  # [B*W, E]
        top, parent, draft = fused_select(x, weight, score, width, apple_warp, **kernel_args)
        live = (t < l_b - 1)[:, None]
        parent = torch.where(live, parent, beam_ids)
        score = torch.where(live, top.masked_fill(padding, float("-inf")), score)
        beams = beams[rows, parent]
        token = torch.where(live, drafter.to_target_ids(draft), beams[:, :, -1])
        beams = torch.cat([beams, token[:, :, None]], dim=-1)
        state = state[rows, parent]
    beams = torch.where(padding[:, :, None], beams[:, :1], beams)
    return BeamSearchOutput(beams=beams, scores=score, log_probs=None)

