"""The vLLM seam's tree bookkeeping (tree_step.py) and the CPU cache layout it reads (fast).

Engine-level identity (greedy vs vLLM alone, exact sampling) is in test_vllm_plugin.py; here the
pieces: a scheduled step lined up with the proposer's trees, positions, ancestor masks, KV moves,
and the strided views of vLLM's CPU KV cache checked against vLLM's own cache-write op.
"""

from __future__ import annotations

import pytest
import torch

from vllm_redrafter.kernels import pack_tree_mask
from vllm_redrafter.kernels.tree_attention import tree_attention_reference
from vllm_redrafter.tree import PackedTree, build_tree, truncate_tree
from vllm_redrafter.verify import verify_greedy, verify_greedy_choice
from vllm_redrafter.vllm_plugin.tree_step import (
    RequestTree,
    ancestor_words,
    build_tree_step,
    lowest_beams,
)

# The worked example of tree.py: W = 4, L = 3, g0 = 5.
BEAMS = torch.tensor([[[5, 1, 2], [5, 1, 3], [5, 4, 2], [5, 4, 6]]])


def request_tree(beams=BEAMS, mode="exact") -> RequestTree:
    tree = build_tree(beams)
    n = int(tree.num_packed[0])
    return RequestTree(tuple(tree.tokens[0, :n].tolist()), tuple(tree.parent[0, :n].tolist()),
                       tuple(tree.depth[0, :n].tolist()), mode)


def test_ancestor_words_equal_the_tree_mask_packed():
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        beams = torch.randint(3, (1, 8, 5), generator=g)
        beams[:, :, 0] = 7
        tree = build_tree(beams)
        n = int(tree.num_packed[0])
        expected = pack_tree_mask(tree.attention_mask, tree.num_packed)
        assert torch.equal(ancestor_words(tree.parent[0, :n].tolist()), expected)


def test_ancestor_words_beyond_64_nodes_use_more_words():
    parent = [-1] + list(range(99))  # a chain of 100 nodes
    words = ancestor_words(parent)
    assert words.shape == (100, 2)
    assert words[99, 0] == -1 and words[99, 1] == (1 << 36) - 1  # all 64 bits, then 36


def test_step_lines_trees_up_with_scheduled_rows_and_cuts():
    tree = request_tree()  # 7 nodes: drafts [1, 2, 3, 4, 2, 6]
    proposed = {"a": tree, "c": tree}
    # a: all 6 drafts; b: a prefill (no drafts); c: the scheduler kept 3 drafts
    step = build_tree_step(["a", "b", "c"], [6, 0, 3],
                           {"a": tree.drafts, "c": tree.drafts[:3]}, [7, 20, 24], proposed)
    assert step.trees[1] is None and step.root_rows == [0, -1, 20]
    assert step.trees[0] == tree and step.trees[2] == tree.prefix(4)
    assert step.trees[2].parent == (-1, 0, 1, 1)
    assert not step.is_chain


def test_depth_by_beams_is_what_the_first_w_beams_alone_accept():
    """Random beams sharing prefixes, packed as the proposer packs them (cut to a budget too):
    for every w, how deep the accepted path runs on the first w beams equals the longest match
    of the target's continuation among those beams alone (brute force)."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(200):
        W, L = 6, 5
        beams = torch.randint(0, 3, (1, W, L), generator=rng)  # 3 tokens: many shared prefixes
        beams[:, :, 0] = 7
        target = [7, *torch.randint(0, 3, (L,), generator=rng).tolist()]
        tree = truncate_tree(build_tree(beams), 1 + trial % (W * L))
        n = int(tree.num_packed[0])
        request = RequestTree(tuple(tree.tokens[0, :n].tolist()), tuple(tree.parent[0, :n].tolist()),
                              tuple(tree.depth[0, :n].tolist()),
                              beam_of=lowest_beams(tree.is_new.sum(-1)[0].tolist(), n))
        path = request.accepted_path(target[1:])
        kept = tree.unpack_index[0]  # -1: cut by the budget

        def matched(i: int) -> int:  # drafts of beam i the target accepts, within what was kept
            j = 1
            while j < L and kept[i, j] >= 0 and beams[0, i, j] == target[j]:
                j += 1
            return j - 1

        expected = tuple(max(matched(i) for i in range(w)) for w in range(1, W + 1))
        assert request.depth_by_beams(path, W) == expected, (trial, beams, target)


def test_mismatching_drafts_are_verified_as_a_chain():
    tree = request_tree()
    step = build_tree_step(["a"], [2], {"a": [9, 9]}, [3], {"a": tree})
    assert step.trees[0].is_chain and step.is_chain and step.trees[0].drafts == [9, 9]


def test_positions_follow_depth_while_rows_follow_packing():
    tree = request_tree()  # depths 0 1 2 2 1 2 2
    step = build_tree_step(["x", "a"], [0, 6], {"a": tree.drafts}, [5, 12], {"a": tree})
    positions = torch.arange(12) + 100  # vLLM's: context + row
    out = step.rewrite_positions(positions)
    assert out[:5].tolist() == list(range(100, 105))  # the other request untouched
    root = positions[5].item()
    assert out[5:].tolist() == [root + d for d in tree.depth]
    assert positions[6].item() == root + 1  # vLLM's tensor is not modified


def test_kv_moves_put_the_accepted_path_in_sequence_order():
    tree = request_tree()
    step = build_tree_step(["a", "b"], [6, 6], {"a": tree.drafts, "b": tree.drafts}, [7, 14],
                           {"a": tree, "b": tree})
    src, dst = step.kv_moves({0: [0, 1, 3], 1: [0, 4, 6]})
    assert (src, dst) == ([3, 11, 13], [2, 8, 9])  # beam 0's node 1 stays; beam 1 moves; beam 3


def test_attention_inputs_cover_only_tree_requests():
    tree = request_tree()
    step = build_tree_step(["a", "b"], [0, 6], {"b": tree.drafts}, [4, 11], {"b": tree})
    inputs = step.attention_inputs(torch.device("cpu"))
    assert inputs.rows.tolist() == list(range(4, 11)) and inputs.requests.tolist() == [1]
    assert inputs.cu_seqlens_q.tolist() == [0, 7] and inputs.num_nodes.tolist() == [7]


def test_greedy_choice_walk_equals_the_logits_walk():
    tree = truncate_tree(build_tree(BEAMS), 6)
    packed = PackedTree(tree.tokens, tree.depth, tree.parent, tree.num_packed)
    logits = torch.randn(1, tree.tokens.shape[1], 8)
    logits[0, 0, 4] = logits[0, 4, 6] = 9.0  # root -> 4 -> (6 was cut: bonus)
    expected = verify_greedy(tree, logits)
    got = verify_greedy_choice(packed, logits.argmax(-1))
    assert torch.equal(got.tokens, expected.tokens) and got.path[0].tolist()[:2] == [0, 4]


# -- vLLM's CPU cache layout ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_views_read_what_vllm_writes(dtype):
    attention = pytest.importorskip("vllm_redrafter.vllm_plugin.attention")
    assert attention.check_cache_layout("vec", 32, 3, 64, dtype)
    assert not attention.check_cache_layout("amx", 32, 3, 64, dtype)  # unknown: no trees


def test_tree_attention_over_a_vllm_written_cache_and_kv_moves():
    """The backend's tree path on a cache written by vLLM's op: equals dense attention over the
    context and each node's ancestors; then moving a path's KV makes it a plain sequence."""
    attention = pytest.importorskip("vllm_redrafter.vllm_plugin.attention")
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    hkv, hq, dim, block_size, num_blocks = 3, 9, 64, 32, 4
    tree = request_tree()
    context, nodes = 40, len(tree.tokens)
    kv_cache = torch.zeros(num_blocks, hkv, block_size, 2 * dim)
    block_table = torch.tensor([[2, 0, 3]])
    positions = torch.arange(context + nodes)
    slots = block_table[0, positions // block_size] * block_size + positions % block_size
    keys, values = torch.randn(context + nodes, hkv, dim), torch.randn(context + nodes, hkv, dim)
    key_cache, value_cache = attention._raw_caches(kv_cache)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, "vec")

    key_view, value_view = attention.cache_views(kv_cache, "vec")
    q = torch.randn(nodes, hq, dim)
    words = ancestor_words(tree.parent)
    out = tree_attention_reference(q, key_view, value_view, block_table, torch.tensor([0, nodes]),
                                   torch.tensor([context]), words)
    dense = dense_tree_attention(q, keys, values, context, tree.parent)
    torch.testing.assert_close(out, dense, atol=1e-5, rtol=1e-5)

    # accept root -> 4 -> 6 (beam 3): nodes 4 and 6 move to positions context + 1, + 2
    impl = object.__new__(attention.TreeCPUAttentionImpl)
    impl.kv_cache_dtype, impl.attn_type = "auto", attention.AttentionType.DECODER
    layer = type("Layer", (), {"isa": "vec", "_k_scale_float": 1.0, "_v_scale_float": 1.0})()
    src = slots[torch.tensor([context + 4, context + 6])]
    dst = slots[torch.tensor([context + 1, context + 2])]
    impl.move_kv(layer, kv_cache, src, dst)
    for moved, source in ((1, 4), (2, 6)):
        block, offset = divmod(int(slots[context + moved]), block_size)
        assert torch.equal(key_view[block, offset], keys[context + source])
        assert torch.equal(value_view[block, offset], values[context + source])


# -- the CUDA backend's path, run on CPU with FlashAttention's kernels swapped for torch --------


def dense_tree_attention(q, keys, values, context: int, parent) -> torch.Tensor:
    """Each node attends to the context and its ancestors (and itself): SDPA with a dense mask."""
    nodes = len(parent)
    mask = torch.zeros(nodes, context + nodes, dtype=torch.bool)
    mask[:, :context] = True
    for j in range(nodes):
        a = j
        while a >= 0:
            mask[j, context + a] = True
            a = parent[a]
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, 1).transpose(0, 1)
    v = values.repeat_interleave(group, 1).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


@pytest.fixture
def flash_impl(monkeypatch):
    """vLLM's FlashAttention impl with our tree mixin, built on CPU; its CUDA kernels (causal
    attention, the cache write) replaced by torch equivalents."""
    flash = pytest.importorskip("vllm.v1.attention.backends.flash_attn")
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from vllm_redrafter.target import prepare_target
    from vllm_redrafter.vllm_plugin.flash_attention import TreeFlashAttentionImpl

    def write_cache(key, value, key_cache, value_cache, slot_mapping, *args):
        block_size = key_cache.shape[1]
        key_cache[slot_mapping // block_size, slot_mapping % block_size] = key
        value_cache[slot_mapping // block_size, slot_mapping % block_size] = value

    def causal_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args):
        key_cache, value_cache = self.tree_cache_views(layer, kv_cache)
        starts = attn_metadata.query_start_loc.tolist()
        for b in range(len(starts) - 1):
            n = starts[b + 1] - starts[b]
            chain = ancestor_words(list(range(-1, n - 1)))
            out = tree_attention_reference(
                query[starts[b]:starts[b + 1]], key_cache, value_cache,
                attn_metadata.block_table[b:b + 1], torch.tensor([0, n]),
                attn_metadata.seq_lens[b:b + 1].long() - n, chain, scale=self.scale)
            output[starts[b]:starts[b + 1]] = out.reshape(n, -1)
        return output

    monkeypatch.setattr(flash, "reshape_and_cache_flash", write_cache, raising=False)  # CUDA-only name
    monkeypatch.setattr(flash.FlashAttentionImpl, "forward", causal_forward)
    config = VllmConfig(model_config=ModelConfig(model=str(prepare_target()), dtype="float32"))
    with set_current_vllm_config(config):
        return TreeFlashAttentionImpl(num_heads=9, head_size=64, scale=64 ** -0.5, num_kv_heads=3,
                                      alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def test_flash_backend_tree_path_with_kernels_swapped(flash_impl):
    """The CUDA backend's code path: a tree request and a plain decode row in one step; the tree
    rows get the tree mask, the plain row keeps vLLM's output; then a KV move by vLLM's write."""
    from types import SimpleNamespace

    from vllm_redrafter.vllm_plugin.attention import layers_support_trees, tree_attention
    from vllm_redrafter.vllm_plugin.tree_step import TreeStep

    torch.manual_seed(0)
    impl, hkv, hq, dim, block_size = flash_impl, 3, 9, 64, 16
    kv_cache = torch.zeros(8, hkv, block_size, 2 * dim)  # FlashAttention's [blocks, Hkv, bs, 2D]
    layer = SimpleNamespace(impl=impl, kv_cache=kv_cache, _k_scale=torch.tensor(1.0),
                            _v_scale=torch.tensor(1.0))
    assert impl.supports_trees and layers_support_trees({"layer": layer})
    tree = request_tree()
    nodes, contexts = len(tree.tokens), (40, 20)
    block_table = torch.tensor([[5, 1, 7, 0], [2, 3, 0, 0]])
    lengths = (contexts[0] + nodes, contexts[1] + 1)  # request 1: a plain decode row
    keys = [torch.randn(n, hkv, dim) for n in lengths]
    values = [torch.randn(n, hkv, dim) for n in lengths]
    slots = []
    for b, n in enumerate(lengths):
        pos = torch.arange(n)
        slots.append(block_table[b, pos // block_size] * block_size + pos % block_size)
        impl.do_kv_cache_update(layer, keys[b], values[b], kv_cache, slots[b])
    q = torch.randn(nodes + 1, hq, dim)
    metadata = SimpleNamespace(seq_lens=torch.tensor(lengths, dtype=torch.int32),
                               block_table=block_table, num_actual_tokens=nodes + 1,
                               query_start_loc=torch.tensor([0, nodes, nodes + 1]))
    step = TreeStep(trees=[tree, None], root_rows=[0, -1])
    output = torch.zeros(nodes + 1, hq * dim)
    with tree_attention(step.attention_inputs(q.device)):
        impl.forward(layer, q, None, None, kv_cache, metadata, output)
    output = output.view(nodes + 1, hq, dim)
    tree_rows = dense_tree_attention(q[:nodes], keys[0], values[0],
                                     contexts[0], tree.parent)
    torch.testing.assert_close(output[:nodes], tree_rows, atol=1e-5, rtol=1e-5)
    plain = dense_tree_attention(q[nodes:], keys[1], values[1],
                                 contexts[1], [-1])
    torch.testing.assert_close(output[nodes:], plain, atol=1e-5, rtol=1e-5)

    # accept root -> 4 -> 6 (beam 3): nodes 4 and 6 move to positions context + 1, + 2
    src = slots[0][torch.tensor([contexts[0] + 4, contexts[0] + 6])]
    dst = slots[0][torch.tensor([contexts[0] + 1, contexts[0] + 2])]
    impl.move_kv(layer, kv_cache, src, dst)
    key_view, value_view = impl.tree_cache_views(layer, kv_cache)
    for moved, source in ((1, 4), (2, 6)):
        block, offset = divmod(int(slots[0][contexts[0] + moved]), block_size)
        assert torch.equal(key_view[block, offset], keys[0][contexts[0] + source])
        assert torch.equal(value_view[block, offset], values[0][contexts[0] + source])


@pytest.mark.parametrize("module", ["vllm_redrafter.tree", "vllm_redrafter.verify",
                                    "vllm_redrafter.sampling", "vllm_redrafter.vllm_plugin.tree_step",
                                    "vllm_redrafter.patches.runner_hidden_states"])
def test_doctests(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
