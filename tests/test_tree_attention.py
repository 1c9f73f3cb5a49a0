"""The tree-attention paths that need no Triton: the torch reference, the engine's gather + SDPA
path and the mask packing, against an independent dense computation on a paged cache. The Triton
kernel is checked against the same reference in test_kernels.py (which needs triton)."""

from __future__ import annotations

import pytest
import torch

from vllm_redrafter.kernels import tree_attention as ta
from vllm_redrafter.tree import build_tree


def random_beams(gen: torch.Generator, batch: int, width: int, length: int, vocab: int = 3):
    """Beams over a tiny vocabulary, so that prefixes are shared and the trees branch."""
    beams = torch.randint(0, vocab, (batch, width, length), generator=gen)
    beams[:, :, 0] = 7  # g0, the root
    return beams


def paged_case(gen, contexts, tree, *, hq, hkv, dim, block_size, dtype=torch.float32, layout="flash"):
    """A paged cache holding each request's context then its packed tree tokens, plus the dense
    per-request K/V it was written from (the independent reference reads those)."""
    batch = len(contexts)
    trees = tree.num_packed.tolist()
    lens = [c + t for c, t in zip(contexts, trees)]
    blocks_per = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_per) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per)
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, hkv, dim)
    if layout == "flash":
        key_cache = torch.randn(shape, generator=gen).to(dtype)
        value_cache = torch.randn(shape, generator=gen).to(dtype)
    else:  # vLLM CPU-style [num_blocks, Hkv, block_size, D], seen through a permuted view
        key_cache = torch.randn(num_blocks, hkv, block_size, dim, generator=gen).to(dtype).transpose(1, 2)
        value_cache = torch.randn(num_blocks, hkv, block_size, dim, generator=gen).to(dtype).transpose(1, 2)
    dense_k, dense_v, used = [], [], 0
    for b in range(batch):
        ids = perm[used : used + blocks_per[b]]
        used += blocks_per[b]
        block_table[b, : len(ids)] = ids.int()
        k = torch.randn(lens[b], hkv, dim, generator=gen).to(dtype)
        v = torch.randn(lens[b], hkv, dim, generator=gen).to(dtype)
        pos = torch.arange(lens[b])
        key_cache[ids[pos // block_size], pos % block_size] = k
        value_cache[ids[pos // block_size], pos % block_size] = v
        dense_k.append(k)
        dense_v.append(v)
    cu = torch.tensor([0, *torch.tensor(trees).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, dim, generator=gen).to(dtype)
    return q, key_cache, value_cache, block_table, cu, torch.tensor(contexts, dtype=torch.int32), dense_k, dense_v


def dense_tree_attention(q, cu, contexts, dense_k, dense_v, tree, scale):
    """Independent reference: per request and query head, softmax over [context | own ancestors]."""
    out = torch.empty(q.shape, dtype=torch.float32)
    hq, hkv = q.shape[1], dense_k[0].shape[1]
    for b, ctx in enumerate(contexts):
        start, end = int(cu[b]), int(cu[b + 1])
        for t in range(end - start):
            visible = torch.cat([torch.ones(ctx, dtype=torch.bool), tree.attention_mask[b, t, : end - start]])
            for head in range(hq):
                k = dense_k[b][visible, head // (hq // hkv)].float()  # [S', D]
                v = dense_v[b][visible, head // (hq // hkv)].float()
                w = (k @ q[start + t, head].float() * scale).softmax(0)
                out[start + t, head] = w @ v
    return out


@pytest.mark.parametrize(
    "contexts, width, length, hq, hkv, dim, block_size, words, layout",
    [
        ([5, 0, 13], 4, 3, 4, 2, 16, 4, 64, "flash"),  # ragged, GQA 2, a request without context
        ([9, 21], 5, 4, 2, 2, 24, 5, 32, "cpu"),  # block 5, vLLM CPU's strided view
        ([40, 3], 12, 6, 4, 1, 16, 16, 32, "cpu"),  # T > 32: two int32 words per row
    ],
)
def test_torch_tree_attention_paths_match_dense(contexts, width, length, hq, hkv, dim, block_size,
                                                words, layout):
    """The reference and the engine's torch path (one gather plan per step, SDPA per layer)."""
    gen = torch.Generator().manual_seed(sum(contexts) + width)
    tree = build_tree(random_beams(gen, len(contexts), width, length))
    q, kc, vc, bt, cu, ctx, dense_k, dense_v = paged_case(
        gen, contexts, tree, hq=hq, hkv=hkv, dim=dim, block_size=block_size, layout=layout
    )
    mask = ta.pack_tree_mask(tree.attention_mask, tree.num_packed, words)
    expected = dense_tree_attention(q, cu, contexts, dense_k, dense_v, tree, 0.3)
    reference = ta.tree_attention_reference(q, kc, vc, bt, cu, ctx, mask, 0.3)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    plan = ta.plan_tree_gather(bt, cu, ctx, mask, block_size)
    torch.testing.assert_close(ta.tree_attention_gathered(q, kc, vc, plan, 0.3), expected,
                               atol=1e-5, rtol=1e-5)


def test_pack_tree_mask_words():
    """Bit j of row p = column j: bit 31 of an int32 word and bit 63 of an int64 word included."""
    mask = torch.zeros(1, 70, 70, dtype=torch.bool)
    mask[0, 3, [0, 31, 32, 63, 64, 69]] = True
    w32 = ta.pack_tree_mask(mask, torch.tensor([70]), 32)
    w64 = ta.pack_tree_mask(mask, torch.tensor([70]), 64)
    assert w32.dtype == torch.int32 and w32.shape == (70, 3) and w64.shape == (70, 2)
    assert w32[3].tolist() == [1 - 2**31, 1 + 2**31 - 2**32, 1 + 2**5]
    assert w64[3].tolist() == [1 + 2**31 + 2**32 - 2**63, 1 + 2**5]
    with pytest.raises(ValueError, match="P, P"):
        ta.pack_tree_mask(mask[0], torch.tensor([70]))
