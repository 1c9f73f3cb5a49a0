"""``TreeCPUAttentionImpl.forward``, the attention code the engine runs on CPU, called directly.

No engine starts. Everything around the call is vLLM's own, built as the CPU runner builds it:
real ``Attention`` layers over the plugin's backend, a cache allocated by vLLM's
``allocate_kv_cache`` (the ``LBHNC`` layout CPU_ATTN requires, ``[blocks, Hkv, block_size, 2D]``
per layer) and bound by ``bind_kv_cache``, the metadata built by ``CPUAttentionMetadataBuilder``
from a ``CommonAttentionMetadata`` (which also picks the ISA and sets ``layer.isa``), and the
step's trees lined up by ``build_tree_step`` as ``patches/runner_tree.py`` does.

The batch is ragged: a tree request, a plain decode row (no drafts), and a tree request the
scheduler cut; GQA (Hq = 4, Hkv = 2), block size 32 (CPU_ATTN: multiples of 32). Context KV is
in the cache beforehand (garbage everywhere else); the step's new K/V are stored through the slot
mapping by the impl's ``do_kv_cache_update`` then attended by ``forward``: CPU_ATTN has
``forward_includes_kv_cache_update = False``, so that is the engine's own pair of calls
(``unified_kv_cache_update`` then ``unified_attention_with_output``). The result is compared with
dense masked attention computed here (float64, per request, row and query head).

Negative controls: the same calls without the tree inputs (vLLM's causal kernel alone), with the
tree mask replaced by a causal one, and without storing the step's K/V, must all miss the tree
reference by far more than the tolerance.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from vllm_redrafter.tree import build_tree
from vllm_redrafter.vllm_plugin.tree_step import RequestTree, ancestor_words, build_tree_step

HQ, HKV, BLOCK_SIZE = 4, 2, 32
NUM_BLOCKS = 12  # block 0 is vLLM's null block: never handed to a request
ATOL = 1e-5
REQ_IDS = ("tree", "decode", "cut")
CONTEXTS = (45, 64, 27)  # tokens already in the cache, per request
MARGIN = 100 * ATOL  # how far a wrong mask must land from the tree reference


def request_tree(seed: int, width: int, length: int) -> RequestTree:
    """A real packed tree: beams over a 3-token vocabulary, so they share prefixes and branch."""
    g = torch.Generator().manual_seed(seed)
    beams = torch.randint(0, 3, (1, width, length), generator=g)
    beams[:, :, 0] = 7  # g0, the root every beam starts with
    tree = build_tree(beams)
    n = int(tree.num_packed[0])
    assert n < width * length  # prefixes are shared
    return RequestTree(tuple(tree.tokens[0, :n].tolist()), tuple(tree.parent[0, :n].tolist()),
                       tuple(tree.depth[0, :n].tolist()))


def dense_reference(q, keys, values, context, parent, scale):
    """Independent reference: for each row j and query head h, softmax over the request's context
    keys then its own ancestors in the tree (j included), with KV head h // (Hq // Hkv)."""
    q, keys, values = q.double(), keys.double(), values.double()
    group = q.shape[1] // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(q.shape[0]):
        seen, a = list(range(context)), j
        while a >= 0:
            seen.append(context + a)
            a = parent[a]
        for h in range(q.shape[1]):
            k, v = keys[seen, h // group], values[seen, h // group]
            out[j, h] = torch.softmax(k @ q[j, h] * scale, dim=0) @ v
    return out


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def make_case(target_dir, head_dim: int, seed: int = 0):
    """Two attention layers of one step, their cache and metadata, as the CPU runner builds them."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata, CPUAttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                            KVCacheTensor)
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache, bind_kv_cache

    from vllm_redrafter.vllm_plugin.attention import TreeCPUAttentionBackend, TreeCPUAttentionImpl

    gen = torch.Generator().manual_seed(seed)
    config = VllmConfig(model_config=ModelConfig(model=str(target_dir), dtype="float32"))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    scale = head_dim ** -0.5
    with set_current_vllm_config(config):
        layers = [Attention(HQ, head_dim, scale, HKV, prefix=name,
                            attn_backend=TreeCPUAttentionBackend) for name in names]
        assert all(type(layer.impl) is TreeCPUAttentionImpl for layer in layers)
        spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HKV, head_size=head_dim,
                                 dtype=torch.float32)
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            kv_cache_tensors=[KVCacheTensor(size=2 * NUM_BLOCKS * page, layers=names,
                                            layer_stride=NUM_BLOCKS * page, block_stride=page)],
            kv_cache_groups=[KVCacheGroupSpec(names, spec)])
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC)
        bind_kv_cache(caches, config.compilation_config.static_forward_context, [])
        builder = CPUAttentionMetadataBuilder(spec, names, config, torch.device("cpu"))
    for layer in layers:
        assert layer.kv_cache.shape == (NUM_BLOCKS, HKV, BLOCK_SIZE, 2 * head_dim)
        layer.kv_cache.copy_(torch.randn(layer.kv_cache.shape, generator=gen))  # garbage

    # The proposer's kept trees, then the scheduled step: "tree" verifies all its drafts, "decode"
    # has none, "cut" kept only a prefix of its drafts (token budget).
    proposed = {"tree": request_tree(seed, 4, 5), "cut": request_tree(seed + 1, 3, 5)}
    scheduled = {"tree": proposed["tree"].drafts, "cut": proposed["cut"].drafts[:-2]}
    num_drafts = [len(scheduled.get(r, ())) for r in REQ_IDS]
    query_lens = [k + 1 for k in num_drafts]
    query_end = torch.tensor(query_lens).cumsum(0).tolist()
    step = build_tree_step(REQ_IDS, num_drafts, scheduled, query_end, proposed)
    assert step.trees[1] is None and not step.is_chain
    assert step.trees[2] == proposed["cut"].prefix(query_lens[2])
    parents = [t.parent if t is not None else (-1,) for t in step.trees]  # the decode row: a root

    # Block table (int32, padded with the null block 0) and the slot of every scheduled token.
    seq_lens = [c + n for c, n in zip(CONTEXTS, query_lens)]
    blocks_per = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(REQ_IDS), max(blocks_per), dtype=torch.int32)
    for b, n in enumerate(blocks_per):
        block_table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]

    def slots(b, start, stop):
        pos = torch.arange(start, stop)
        return block_table[b, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE

    slot_mapping = torch.cat([slots(b, c, s) for b, (c, s) in enumerate(zip(CONTEXTS, seq_lens))])
    query_start_loc = torch.tensor([0, *query_end], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=query_start_loc, query_start_loc_cpu=query_start_loc.clone(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), num_reqs=len(REQ_IDS),
        num_actual_tokens=query_end[-1], max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=slot_mapping, causal=True)
    metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
    assert isinstance(metadata, CPUAttentionMetadata) and metadata.causal
    assert all(layer.isa == builder.isa for layer in layers)

    # Per layer: the context K/V (already in the cache, written by vLLM's op in earlier steps),
    # the step's q/k/v, and the dense per-request K/V the reference reads.
    num_tokens = query_end[-1]
    data = []
    for layer in layers:
        dense_k, dense_v = [], []
        for b, (c, s) in enumerate(zip(CONTEXTS, seq_lens)):
            k = torch.randn(c, HKV, head_dim, generator=gen)
            v = torch.randn(c, HKV, head_dim, generator=gen)
            layer.impl.do_kv_cache_update(layer, k, v, layer.kv_cache, slots(b, 0, c))
            dense_k.append(k)
            dense_v.append(v)
        q = torch.randn(num_tokens, HQ, head_dim, generator=gen)
        k = torch.randn(num_tokens, HKV, head_dim, generator=gen)
        v = torch.randn(num_tokens, HKV, head_dim, generator=gen)
        rows = [slice(s - n, s) for s, n in zip(query_end, query_lens)]
        dense_k = [torch.cat([dk, k[r]]) for dk, r in zip(dense_k, rows)]
        dense_v = [torch.cat([dv, v[r]]) for dv, r in zip(dense_v, rows)]
        data.append(SimpleNamespace(q=q, k=k, v=v, dense_k=dense_k, dense_v=dense_v, rows=rows))
    return SimpleNamespace(layers=layers, metadata=metadata, step=step, parents=parents,
                           data=data, scale=scale, isa=builder.isa, num_tokens=num_tokens,
                           head_dim=head_dim)


def run_layers(case, inputs, *, store_kv=True):
    """The engine's calls for each layer: store the step's K/V by the slot mapping, then forward
    (inside the runner's tree-attention context when ``inputs`` is given)."""
    from vllm_redrafter.vllm_plugin.attention import tree_attention

    outputs = []
    with tree_attention(inputs):
        for layer, d in zip(case.layers, case.data):
            if store_kv:
                layer.impl.do_kv_cache_update(layer, d.k, d.v, layer.kv_cache,
                                              case.metadata.slot_mapping)
            output = torch.full((case.num_tokens, HQ, case.head_dim), float("nan"))
            result = layer.impl.forward(layer, d.q, d.k, d.v, layer.kv_cache, case.metadata, output)
            assert result is output
            outputs.append(output)
    return outputs


def reference(case, d, b, parent):
    return dense_reference(d.q[d.rows[b]], d.dense_k[b], d.dense_v[b], CONTEXTS[b], parent,
                           case.scale)


def max_error(output, expected):
    return (output.double() - expected).abs().max().item()


# head_dim 32 gets vLLM's "vec" ISA on x86 without AMX; 80 (not a multiple of 32) gets "vec16"
HEAD_DIMS = [32, 80]


@pytest.fixture(params=HEAD_DIMS, ids=[f"D{d}" for d in HEAD_DIMS])
def case(request, target_dir):
    return make_case(target_dir, request.param)


def test_forward_applies_the_tree_mask(case):
    from vllm_redrafter.vllm_plugin.attention import (TRANSPOSED_K_ISAS, TreeCPUAttentionBackend,
                                                      layers_support_trees)

    assert not TreeCPUAttentionBackend.forward_includes_kv_cache_update  # hence do_kv_cache_update
    if case.isa not in TRANSPOSED_K_ISAS:
        pytest.skip(f"vLLM picked the {case.isa!r} ISA here: the plugin drafts chains on it")
    assert layers_support_trees({layer.layer_name: layer for layer in case.layers})
    outputs = run_layers(case, case.step.attention_inputs(torch.device("cpu")))
    for output, d in zip(outputs, case.data):
        assert not output.isnan().any()
        for b, parent in enumerate(case.parents):
            torch.testing.assert_close(output[d.rows[b]].double(), reference(case, d, b, parent),
                                       atol=ATOL, rtol=0)


def test_causal_kernel_alone_misses_the_tree_reference(case):
    """Negative control 1: no tree inputs (vLLM's CPU kernel only). Its output matches the causal
    reference (so the reference's scale, GQA map and cache contents are right) and misses the
    tree reference on the branched trees."""
    outputs = run_layers(case, None)
    for output, d in zip(outputs, case.data):
        for b, parent in enumerate(case.parents):
            causal = reference(case, d, b, chain(len(parent)))
            torch.testing.assert_close(output[d.rows[b]].double(), causal, atol=ATOL, rtol=0)
            if parent != chain(len(parent)):
                assert max_error(output[d.rows[b]], reference(case, d, b, parent)) > MARGIN


def test_causal_mask_in_place_of_the_tree_mask_fails(case):
    """Negative control 2: the plugin's path with a causal mask instead of the tree's."""
    from vllm_redrafter.vllm_plugin.attention import TRANSPOSED_K_ISAS

    if case.isa not in TRANSPOSED_K_ISAS:
        pytest.skip(f"vLLM picked the {case.isa!r} ISA here")
    inputs = case.step.attention_inputs(torch.device("cpu"))
    n = [len(case.step.trees[b].tokens) for b in case.step.tree_requests()]
    causal_words = torch.cat([ancestor_words(chain(k)) for k in n])
    inputs = dataclasses.replace(inputs, mask_words=causal_words, plans={})
    outputs = run_layers(case, inputs)
    for output, d in zip(outputs, case.data):
        for b in case.step.tree_requests():
            parent = case.parents[b]
            assert max_error(output[d.rows[b]], reference(case, d, b, parent)) > MARGIN


def test_step_kv_not_stored_fails(case):
    """Negative control 3: forward reads the step's K/V from the cache (the slots hold garbage
    until the slot mapping stores them)."""
    from vllm_redrafter.vllm_plugin.attention import TRANSPOSED_K_ISAS

    if case.isa not in TRANSPOSED_K_ISAS:
        pytest.skip(f"vLLM picked the {case.isa!r} ISA here")
    outputs = run_layers(case, case.step.attention_inputs(torch.device("cpu")), store_kv=False)
    for output, d in zip(outputs, case.data):
        for b, parent in enumerate(case.parents):
            assert max_error(output[d.rows[b]], reference(case, d, b, parent)) > MARGIN
