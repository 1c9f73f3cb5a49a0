"""GPU benchmark of vllm_redrafter/kernels, in one command, against bounds measured in the same run.

    python benchmarks/gpu_kernels.py [--out benchmarks/results/gpu_kernels_<gpu>.json] [--quick]
    python benchmarks/gpu_kernels.py --dry-run   # on a CPU: tiny shapes, Triton's interpreter

Measures, on the current CUDA device (bf16, random weights: timing only):

1. the device's copy bandwidth (a 1 GiB device-to-device copy) and bf16 matmul rate (8192^3);
2. the drafter's beam search, L = 5, B in {1, 8, 32}, W in {1, 8, 32, 64}, at Vicuna-7B
   (H 4096, V 32000) and Llama-3.1-8B (H 4096, V 128256) drafter shapes (2 ResBlocks of width
   2H, the LM head 2H x V), plus Llama-3.1-8B with a reduced draft vocabulary (K = 32000): the
   torch path (beam_search.py) and the fused step (kernels/fused_beam_step.py);
3. paged tree attention, one layer at Llama-3.1-8B attention shapes (32 query heads, 8 KV heads,
   head_dim 128, block 16), C in {512, 2048}, T in {16, 64}, B in {1, 8}: the kernel, SDPA's
   one-token decode over the same cache (K/V expanded per query head) and SDPA with a dense tree
   mask; the kernel's error against the dense reference;
4. tiled sampling (temperature only), rows in {16, 64, 512}, V in {32000, 128256}: the kernel
   (in-kernel Philox noise) against the torch path (target_probs + exponential race), and the
   sigmoid approximation's time and total-variation distance (synthetic Gaussian logits);
5. one ReDrafter step at Vicuna-7B and Llama-3.1-8B target shapes, batch B in {1, 8, 32}, W as in
   2. (``--batches``, ``--widths``, ``--targets`` choose others), context 512: the target's plain
   one-token step and its verification step over the packed tree (every layer's weight GEMMs,
   RMSNorms and paged tree attention, then the LM head over every verified token), the drafting
   (the beam section's faster path, else torch's: the proposer's), the packing of the drafted
   beams (build_tree + the attention bitmask), and the per-step overhead c = (draft + pack +
   verify) / plain step: ReDrafter is faster than the target alone when its tokens per step
   exceed c. The drafter here is random, so its beams share little but the root: the packed
   sizes are close to the worst case W * (L - 1) + 1;
6. tune: the tree-attention kernel and the fused beam step's selection over their block sizes, at
   the shapes where their defaults lost to SDPA / torch on an H100 (slow: Triton compiles each
   configuration; ``--only`` the others to skip it).

Every bound is max(bytes / copy bandwidth, FLOPs / matmul rate) with both rates measured above.
Times are CUDA-graph replays (events, mean of 20) where capture works, else plain launches
(marked). Printed last: the kernel table (kernel, shape, ms, bound ms, ratio), then the step table
(plain, draft, pack and verify ms, and c). A JSON with every figure is written to --out after each
section, so a run cut short keeps what it measured; a section that fails is reported and the others
still run (the exit code is then 1).

``--dry-run`` runs every section on the CPU at tiny shapes in float32 (Triton's interpreter,
wall-clock timing): it checks that the script runs and that the kernels agree with their references
there, not what the GPU does; the CPU tests run it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from vllm_redrafter.results import portable

REPO = Path(__file__).resolve().parents[1]
LENGTH = 5
CONTEXT = 512  # cached tokens per request in the step section
KV_BLOCK = 16  # tokens per paged KV-cache block, everywhere here


@dataclass(frozen=True)
class TargetShape:
    """A target model's shapes, as the step section builds it (random bf16 weights)."""

    hidden: int
    intermediate: int
    layers: int
    q_heads: int
    kv_heads: int
    vocab: int
    head_dim: int = 128


@dataclass(frozen=True)
class Sizes:
    """What the run measures: the GPU's sizes, or tiny ones for the CPU dry run."""

    device: str
    dtype: torch.dtype  # of every model and kernel input (bf16; fp32 in the dry run, see main)
    drafters: dict  # name -> (H, V, K or None)
    targets: dict  # name -> TargetShape; a drafter named "<target>..." drafts for it
    batches: tuple
    widths: tuple
    tree_heads: tuple  # (Hq, Hkv, head_dim) of the tree-attention section
    tree_batches: tuple
    tree_contexts: tuple
    tree_sizes: tuple
    sample_vocabs: tuple
    sample_rows: tuple
    tune_tree_shapes: tuple  # (B, C, T) of the tune section
    tune_tree_block_m: tuple
    tune_tree_block_n: tuple
    tune_select_shapes: tuple  # (beam rows B*W, vocabulary, W) of the tune section
    rate_elements: int  # the copy test's bf16 elements
    rate_matmul: int  # the matmul test's n


GPU = Sizes(
    device="cuda",
    dtype=torch.bfloat16,
    drafters={"vicuna-7b": (4096, 32000, None), "llama3.1-8b": (4096, 128256, None),
              "llama3.1-8b-K32000": (4096, 128256, 32000)},
    targets={"vicuna-7b": TargetShape(4096, 11008, 32, 32, 32, 32000),
             "llama3.1-8b": TargetShape(4096, 14336, 32, 32, 8, 128256)},
    batches=(1, 8, 32), widths=(1, 8, 32, 64),
    tree_heads=(32, 8, 128), tree_batches=(1, 8), tree_contexts=(512, 2048), tree_sizes=(16, 64),
    sample_vocabs=(32000, 128256), sample_rows=(16, 64, 512),
    tune_tree_shapes=((8, 2048, 64), (8, 512, 64), (1, 2048, 64)), tune_tree_block_m=(16, 32, 64, 128),
    tune_tree_block_n=(32, 64, 128),
    tune_select_shapes=((8, 32000, 1), (512, 128256, 64)),
    rate_elements=2**29, rate_matmul=8192,
)
DRY_RUN = Sizes(
    device="cpu",
    dtype=torch.float32,  # Triton 3.9's interpreter computes bf16 dots wrongly
    drafters={"tiny": (64, 256, None), "tiny-K128": (64, 256, 128)},
    targets={"tiny": TargetShape(64, 128, 2, 4, 2, 256, head_dim=16)},
    batches=(1, 2), widths=(1, 4),
    tree_heads=(4, 2, 16), tree_batches=(1, 2), tree_contexts=(40,), tree_sizes=(8,),
    sample_vocabs=(1000,), sample_rows=(4,),
    tune_tree_shapes=((2, 40, 8),), tune_tree_block_m=(16,), tune_tree_block_n=(16, 32),
    tune_select_shapes=((8, 256, 4),),
    rate_elements=2**20, rate_matmul=256,
)
SIZES = GPU  # main() switches to DRY_RUN for --dry-run


def require_gpu() -> None:
    if not torch.cuda.is_available():
        sys.exit(
            "benchmarks/gpu_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}). Run it on a GPU machine; the CPU tests "
            "(tests/test_kernels.py, TRITON_INTERPRET=1) cover correctness."
        )
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("benchmarks/gpu_kernels.py needs triton (pip install triton)")


# ------------------------------------------------------------------------------------------------
# timing


def timed(fn, iters: int = 20, graph: bool = True) -> tuple[float, bool]:
    """Mean ms per call of ``fn`` (CUDA-graph replay when capture works); (ms, captured).

    On the CPU (the dry run): one wall-clock call, no warm-up, no graph (its figures only show
    that the section runs).
    """
    if SIZES.device == "cpu":
        start = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - start), False
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    captured = False
    if graph:
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fn()
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
            captured = True
        except Exception as err:  # noqa: BLE001 - timing falls back to plain launches
            print(f"  (graph capture failed: {type(err).__name__}: {str(err)[:120]}; timing launches)")
            torch.cuda.synchronize()
            run = fn
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, captured


def timed_output(fn, iters: int = 20) -> tuple[float, bool, object]:
    """:func:`timed`, and what ``fn`` returns: on the CPU the timed call's own (one call of a
    kernel in Triton's interpreter takes seconds), on a GPU a call after the timing."""
    if SIZES.device == "cpu":
        start = time.perf_counter()
        out = fn()
        return 1e3 * (time.perf_counter() - start), False, out
    ms, captured = timed(fn, iters)
    return ms, captured, fn()


def device_rates() -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s), best of a few runs."""
    x = torch.randn(SIZES.rate_elements, dtype=torch.bfloat16, device=SIZES.device)  # 1 GiB on a GPU
    y = torch.empty_like(x)
    copy_ms = min(timed(lambda: y.copy_(x), iters=10, graph=False)[0] for _ in range(3))
    bandwidth = 2 * x.numel() * x.element_size() / (copy_ms / 1e3)
    del x, y
    n = SIZES.rate_matmul
    a = torch.randn(n, n, dtype=torch.bfloat16, device=SIZES.device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=SIZES.device)
    mm_ms = min(timed(lambda: a @ b, iters=10, graph=False)[0] for _ in range(3))
    return {"copy_bandwidth_Bps": bandwidth, "bf16_matmul_flops": 2 * n**3 / (mm_ms / 1e3)}


def bound_ms(nbytes: float, flops: float, rates: dict) -> float:
    return 1e3 * max(nbytes / rates["copy_bandwidth_Bps"], flops / rates["bf16_matmul_flops"])


# ------------------------------------------------------------------------------------------------
# beam search


def make_drafter(hidden: int, vocab: int, draft_vocab: int | None):
    from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter

    config = DrafterConfig(vocab_size=vocab, hidden_size=hidden, exit_dim=2 * hidden, num_draft_layers=2,
                           draft_vocab_size=draft_vocab)
    with torch.device(SIZES.device):
        drafter = RecurrentDrafter(config).to(SIZES.dtype)
        for p in drafter.parameters():
            torch.nn.init.normal_(p, std=0.02)
        if draft_vocab is not None:
            drafter.draft_vocab_ids.copy_(torch.randperm(vocab)[:draft_vocab])
        embedding = torch.nn.Embedding(vocab, hidden).to(SIZES.dtype)
    drafter.attach_embedding(embedding)
    return drafter.eval()


def drafter_inputs(hidden: int, vocab: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    h = torch.randn(batch, hidden, device=SIZES.device, dtype=SIZES.dtype)
    return h, torch.randint(0, vocab, (batch,), device=SIZES.device)


def bench_beam_search(rates: dict, quick: bool) -> list[dict]:
    from vllm_redrafter.beam_search import beam_search
    from vllm_redrafter.kernels.fused_beam_step import beam_search_fused

    rows = []
    for name, (hidden, vocab, draft_vocab) in SIZES.drafters.items():
        drafter = make_drafter(hidden, vocab, draft_vocab)
        weight_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
        params = sum(p.numel() for p in drafter.parameters())
        for batch in SIZES.batches[:2] if quick else SIZES.batches:
            h, g0 = drafter_inputs(hidden, vocab, batch)
            for width in SIZES.widths:
                nbytes = (LENGTH - 1) * (weight_bytes + batch * width * hidden * 2)
                flops = (LENGTH - 1) * 2 * batch * width * params
                bound = bound_ms(nbytes, flops, rates)
                torch_ms, g1, a = timed_output(lambda: beam_search(drafter, h, g0, width, LENGTH))
                fused_ms, g2, b = timed_output(
                    lambda: beam_search_fused(drafter, h, g0, width, LENGTH))
                same = (a.beams == b.beams).all(-1).float().mean().item()
                for path, ms, graph in (("torch", torch_ms, g1), ("fused", fused_ms, g2)):
                    rows.append({
                        "kernel": f"beam_search_{path}", "shape": name, "B": batch, "W": width, "L": LENGTH,
                        "ms": ms, "bound_ms": bound, "ratio": ms / bound, "graph": graph,
                        "drafter_GB": weight_bytes / 1e9, "beams_equal_to_torch": same,
                    })
                print(f"{name} B={batch} W={width}: torch {torch_ms:.3f} ms, fused {fused_ms:.3f} ms, "
                      f"bound {bound:.3f} ms, beams equal {same:.3f}", flush=True)
        del drafter
        empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------
# tree attention


def random_tree_mask(tree: int, gen: torch.Generator) -> torch.Tensor:
    """[T, T] bool ancestor mask of a random tree (parent of p drawn from 0..p-1)."""
    mask = torch.zeros(tree, tree, dtype=torch.bool)
    for p in range(tree):
        if p:
            mask[p] = mask[int(torch.randint(0, p, (1,), generator=gen))]
        mask[p, p] = True
    return mask


def tree_case(batch: int, context: int, tree: int, gen: torch.Generator) -> tuple[tuple, torch.Tensor]:
    """Paged tree-attention inputs (q, key_cache, value_cache, block_table, cu_seqlens, context_lens,
    mask_words) of B random trees of T tokens over C cached tokens each, and the [B, T, T] masks."""
    from vllm_redrafter.kernels.tree_attention import pack_tree_mask

    dev = SIZES.device
    (hq, hkv, dim), block = SIZES.tree_heads, KV_BLOCK
    blocks_per = -(-(context + tree) // block)
    num_blocks = batch * blocks_per
    kc = torch.randn(num_blocks, block, hkv, dim, device=dev, dtype=SIZES.dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per).int().to(dev)
    masks = torch.stack([random_tree_mask(tree, gen) for _ in range(batch)])
    words = pack_tree_mask(masks, torch.full((batch,), tree)).to(dev)
    cu = (torch.arange(batch + 1, dtype=torch.int32) * tree).to(dev)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch * tree, hq, dim, device=dev, dtype=SIZES.dtype)
    return (q, kc, vc, bt, cu, ctx, words), masks


def bench_tree_attention(rates: dict, quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from vllm_redrafter.kernels.tree_attention import tree_attention_reference, tree_attention_triton

    dev = SIZES.device
    (hq, hkv, dim), block = SIZES.tree_heads, KV_BLOCK
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in SIZES.tree_batches:
        for context in SIZES.tree_contexts:
            for tree in SIZES.tree_sizes:
                total = context + tree
                args, masks = tree_case(batch, context, tree, gen)
                q, kc, vc, bt = args[:4]
                out = torch.empty_like(q)
                kernel_ms, g = timed(lambda: tree_attention_triton(
                    *args, max_tree_len=tree, max_kv_len=total, out=out))
                err = (tree_attention_triton(*args).float() - tree_attention_reference(*args).float()).abs().max().item()
                # SDPA baselines over the same K/V, expanded per query head (no GQA path)
                pos = torch.arange(total, device=dev)
                k = kc[bt.long()[:, pos // block], pos % block]  # [B, S, Hkv, D]
                v = vc[bt.long()[:, pos // block], pos % block]
                k = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()  # [B, Hq, S, D]
                v = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()
                q1 = torch.randn(batch, hq, 1, dim, device=dev, dtype=SIZES.dtype)
                decode_ms, _ = timed(lambda: F.scaled_dot_product_attention(q1, k[:, :, :context], v[:, :, :context]))
                dense = torch.cat([torch.ones(batch, tree, context, dtype=torch.bool), masks], dim=2).to(dev)
                qt = q.view(batch, tree, hq, dim).transpose(1, 2)
                sdpa_tree_ms, _ = timed(lambda: F.scaled_dot_product_attention(qt, k, v, attn_mask=dense[:, None]))
                nbytes = 2 * batch * total * hkv * dim * 2
                flops = 4 * batch * tree * hq * total * dim
                bound = bound_ms(nbytes, flops, rates)
                shape = f"B={batch} C={context} T={tree}"
                for kernel, ms in (("tree_attention_triton", kernel_ms), ("sdpa_one_token_decode", decode_ms),
                                   ("sdpa_dense_tree_mask", sdpa_tree_ms)):
                    rows.append({"kernel": kernel, "shape": shape, "B": batch, "C": context, "T": tree,
                                 "ms": ms, "bound_ms": bound, "ratio": ms / bound, "graph": g,
                                 "layers": 1, "max_abs_err_vs_reference": err})
                print(f"tree attention {shape}: kernel {kernel_ms:.4f} ms, SDPA decode {decode_ms:.4f}, "
                      f"SDPA tree {sdpa_tree_ms:.4f}, bound {bound:.4f} (one layer), err {err:.2e}", flush=True)
                if quick:
                    break
    return rows


# ------------------------------------------------------------------------------------------------
# sampling


def bench_sampling(rates: dict, quick: bool) -> list[dict]:
    from vllm_redrafter.kernels.sampling import sample_tiled, sigmoid_tv_distance
    from vllm_redrafter.sampling import SamplingParamsBatch, sample_from_probs, target_probs

    dev = SIZES.device
    rows = []
    for vocab in SIZES.sample_vocabs:
        for count in SIZES.sample_rows:
            logits = torch.randn(count, vocab, device=dev) * 3
            temperature = torch.full((count,), 0.8, device=dev)
            params = SamplingParamsBatch(temperature=temperature)
            seed = torch.arange(count, device=dev)
            torch_ms, _ = timed(lambda: sample_from_probs(target_probs(logits, params), params))
            kernel_ms, g = timed(lambda: sample_tiled(logits, temperature, seed=seed))
            sigmoid_ms, _ = timed(lambda: sample_tiled(logits, temperature, seed=seed, sigmoid=True))
            bound = bound_ms(count * vocab * 4, 0, rates)
            shape = f"rows={count} V={vocab}"
            for kernel, ms in (("sample_torch", torch_ms), ("sample_tiled", kernel_ms),
                               ("sample_sigmoid_approx", sigmoid_ms)):
                rows.append({"kernel": kernel, "shape": shape, "rows": count, "V": vocab, "ms": ms,
                             "bound_ms": bound, "ratio": ms / bound, "graph": g})
            print(f"sampling {shape}: torch {torch_ms:.4f} ms, tiled {kernel_ms:.4f}, sigmoid {sigmoid_ms:.4f}, "
                  f"bound {bound:.4f}", flush=True)
            if quick:
                break
    tv = {}
    vocab = SIZES.sample_vocabs[0]
    for std in (1.0, 3.0, 6.0):
        logits = torch.randn(64, vocab, device=dev) * std
        tv[f"gaussian_std{std:g}_T1"] = sigmoid_tv_distance(logits, torch.ones(64, device=dev)).mean().item()
    print(f"sigmoid approximation TV distance (synthetic, V={vocab}): {tv}")
    rows.append({"kernel": "sigmoid_tv_distance", "shape": f"V={vocab}, Gaussian logits", "tv": tv})
    return rows


# ------------------------------------------------------------------------------------------------
# block sizes of the two kernels that lost to torch in the first H100 run


def bench_tune(rates: dict, quick: bool) -> list[dict]:
    """Tree attention and the fused beam step over their block sizes, at the shapes where the
    defaults lost to SDPA / torch (H100, 2026-11-26): which defaults to ship."""
    from vllm_redrafter.kernels.fused_beam_step import fused_select, select_reference
    from vllm_redrafter.kernels.tree_attention import tree_attention_triton

    dev, rows = SIZES.device, []
    gen = torch.Generator().manual_seed(1)
    hkv, dim = SIZES.tree_heads[1:]
    for batch, context, tree in SIZES.tune_tree_shapes:
        args, _ = tree_case(batch, context, tree, gen)
        total = context + tree
        bound = bound_ms(2 * batch * total * hkv * dim * 2, 0, rates)
        shape = f"B={batch} C={context} T={tree}"
        for block_m in SIZES.tune_tree_block_m:
            for block_n in SIZES.tune_tree_block_n:
                for splits in (None, 1, 4, 16):
                    kwargs = {"block_m": block_m, "block_n": block_n, "num_splits": splits}
                    ms, graph = try_timed(lambda: tree_attention_triton(
                        *args, max_tree_len=tree, max_kv_len=total, **kwargs))
                    rows.append({"kernel": "tune_tree_attention", "shape": shape, **kwargs, "ms": ms,
                                 "bound_ms": bound, "ratio": ms / bound, "graph": graph})
        report_best(rows, "tune_tree_attention", shape)
    for count, vocab, width in SIZES.tune_select_shapes:
        dim_e = 2 * SIZES.drafters[next(iter(SIZES.drafters))][0]
        x = torch.randn(count, dim_e, device=dev, dtype=SIZES.dtype) * 0.05
        weight = torch.randn(vocab, dim_e, device=dev, dtype=SIZES.dtype) * 0.05
        score = torch.randn(count // width, width, device=dev)
        bound = bound_ms(vocab * dim_e * 2, 2 * count * vocab * dim_e, rates)
        shape = f"rows={count} V={vocab} E={dim_e} W={width}"
        torch_ms, graph = try_timed(lambda: select_reference(x, weight, score, width))
        rows.append({"kernel": "tune_select_torch", "shape": shape, "ms": torch_ms, "bound_ms": bound,
                     "ratio": torch_ms / bound, "graph": graph})
        for block_m in (16, 32):  # each configuration compiles for ~10 s (H100 run, 2026-11-26)
            for block_n in (64, 128):
                for block_k in (64, 128):
                    kwargs = {"block_m": block_m, "block_n": block_n, "block_k": block_k}
                    ms, graph = try_timed(lambda: fused_select(x, weight, score, width, **kwargs))
                    rows.append({"kernel": "tune_fused_select", "shape": shape, **kwargs, "ms": ms,
                                 "bound_ms": bound, "ratio": ms / bound, "graph": graph})
        print(f"select {shape}: torch {torch_ms:.4f} ms", flush=True)
        report_best(rows, "tune_fused_select", shape)
    return rows


def try_timed(fn) -> tuple[float, bool]:
    """``timed`` with 5 runs; ms = inf where the configuration fails (e.g. out of shared memory)."""
    try:
        return timed(fn, iters=5)
    except Exception as err:  # noqa: BLE001 - a failing configuration is a result too
        print(f"  (failed: {type(err).__name__}: {str(err)[:100]})")
        return float("inf"), False


def report_best(rows: list[dict], kernel: str, shape: str) -> None:
    mine = sorted((r for r in rows if r["kernel"] == kernel and r["shape"] == shape), key=lambda r: r["ms"])
    for r in mine[:3]:
        print(f"{kernel} {shape}: {r['ms']:.4f} ms with "
              f"{ {k: v for k, v in r.items() if k.startswith(('block', 'num_splits'))} }", flush=True)


# ------------------------------------------------------------------------------------------------
# one ReDrafter step: plain step, draft, pack, verify


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


class RandomTarget:
    """A decoder at real shapes with random bf16 weights and a paged KV cache per layer: timing only.

    ``forward`` is one engine step over N new tokens: per layer RMSNorm, fused QKV, paged tree
    attention over the cache (the new tokens' K/V are not written back), O, RMSNorm, gate-up,
    SiLU, down; then the final norm and the LM head over all N rows (verification scores every
    packed token). Rotary embeddings and the cache write are left out (elementwise, small).
    """

    block_size = KV_BLOCK

    def __init__(self, shape: TargetShape, batch: int, max_tree: int) -> None:
        dev, dim = SIZES.device, shape.head_dim

        def weight(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, device=dev, dtype=SIZES.dtype) * rows**-0.5

        qkv = (shape.q_heads + 2 * shape.kv_heads) * dim
        self.shape = shape
        self.layers = [(weight(shape.hidden, qkv), weight(shape.q_heads * dim, shape.hidden),
                        weight(shape.hidden, 2 * shape.intermediate), weight(shape.intermediate, shape.hidden))
                       for _ in range(shape.layers)]
        self.lm_head = weight(shape.hidden, shape.vocab)
        self.weight_bytes = 2 * (sum(w.numel() for layer in self.layers for w in layer) + self.lm_head.numel())
        blocks_per = -(-(CONTEXT + max_tree) // self.block_size)
        self.block_table = torch.randperm(batch * blocks_per, device=dev).view(batch, blocks_per).int()
        cache = (batch * blocks_per, self.block_size, shape.kv_heads, dim)
        self.caches = [(torch.randn(cache, device=dev, dtype=SIZES.dtype),
                        torch.randn(cache, device=dev, dtype=SIZES.dtype)) for _ in range(shape.layers)]

    def forward(self, x: torch.Tensor, cu: torch.Tensor, context: torch.Tensor, words: torch.Tensor,
                max_tree: int) -> torch.Tensor:
        from vllm_redrafter.kernels.tree_attention import tree_attention_triton

        hq, dim = self.shape.q_heads, self.shape.head_dim
        for (w_qkv, w_o, w_gate_up, w_down), (k_cache, v_cache) in zip(self.layers, self.caches):
            q = (rms_norm(x) @ w_qkv)[:, : hq * dim].view(-1, hq, dim)
            attn = tree_attention_triton(q, k_cache, v_cache, self.block_table, cu, context, words,
                                         max_tree_len=max_tree, max_kv_len=CONTEXT + max_tree)
            x = x + attn.view(-1, hq * dim) @ w_o
            gate, up = (rms_norm(x) @ w_gate_up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w_down
        return rms_norm(x) @ self.lm_head

    def time_step(self, num_packed: torch.Tensor, words: torch.Tensor, rates: dict) -> tuple[float, float, bool]:
        """(ms, bound ms, graph) of one step verifying num_packed[b] tokens of each request b."""
        dev, shape = SIZES.device, self.shape
        batch, tokens, max_tree = num_packed.numel(), int(num_packed.sum()), int(num_packed.max())
        cu = torch.nn.functional.pad(num_packed.cumsum(0), (1, 0)).int().to(dev)
        context = torch.full((batch,), CONTEXT, dtype=torch.int32, device=dev)
        x = torch.randn(tokens, shape.hidden, device=dev, dtype=SIZES.dtype)
        words = words.to(dev)  # outside the timed call: a host-to-device copy breaks graph capture
        ms, graph = timed(lambda: self.forward(x, cu, context, words, max_tree), iters=10)
        kv_bytes = shape.layers * batch * (CONTEXT + max_tree) * shape.kv_heads * shape.head_dim * 4
        flops = tokens * (self.weight_bytes + 2 * shape.layers * shape.q_heads * (CONTEXT + max_tree) * shape.head_dim * 2)
        return ms, bound_ms(self.weight_bytes + kv_bytes, flops, rates), graph


def draft_ms(beam_rows: list[dict], drafter: str, batch: int, width: int) -> float | None:
    """The faster beam-search path's time from the beam section (None if it did not run)."""
    times = [r["ms"] for r in beam_rows if r.get("shape") == drafter and r.get("B") == batch
             and r.get("W") == width and r["kernel"].startswith("beam_search")]
    return min(times) if times else None


def bench_step(rates: dict, quick: bool, beam_rows: list[dict]) -> list[dict]:
    from vllm_redrafter.beam_search import beam_search
    from vllm_redrafter.kernels.tree_attention import pack_tree_mask
    from vllm_redrafter.tree import build_tree

    def pack(beams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tree = build_tree(beams)
        return tree.num_packed, pack_tree_mask(tree.attention_mask, tree.num_packed)

    rows = []
    max_tree = max(SIZES.widths) * (LENGTH - 1) + 1
    for target_name, shape in SIZES.targets.items():
        drafters = {n: d for n, d in SIZES.drafters.items() if n.startswith(target_name)}
        for batch in SIZES.batches[:2] if quick else SIZES.batches:
            target = RandomTarget(shape, batch, max_tree)
            one = torch.ones(batch, dtype=torch.long)
            plain_ms, plain_bound, plain_graph = target.time_step(one, pack_tree_mask(torch.ones(batch, 1, 1, dtype=torch.bool), one), rates)
            print(f"{target_name} B={batch}: plain step {plain_ms:.3f} ms (bound {plain_bound:.3f})", flush=True)
            for drafter_name, (hidden, vocab, draft_vocab) in drafters.items():
                drafter = make_drafter(hidden, vocab, draft_vocab)
                h, g0 = drafter_inputs(hidden, vocab, batch)
                for width in SIZES.widths:
                    beams = beam_search(drafter, h, g0, width, LENGTH).beams
                    pack_ms, _ = timed(lambda: pack(beams), graph=False)
                    num_packed, words = pack(beams)
                    drafted = draft_ms(beam_rows, drafter_name, batch, width)
                    if drafted is None:  # the beam section did not run: time the proposer's path
                        drafted = timed(lambda: beam_search(drafter, h, g0, width, LENGTH))[0]
                    verify_ms, verify_bound, graph = target.time_step(num_packed.cpu(), words, rates)
                    c = (drafted + pack_ms + verify_ms) / plain_ms
                    rows.append({
                        "kernel": "redrafter_step", "target": target_name, "drafter": drafter_name,
                        "B": batch, "W": width, "L": LENGTH, "context": CONTEXT,
                        "packed_tokens_mean": num_packed.float().mean().item(),
                        "verify_tokens": int(num_packed.sum()), "plain_ms": plain_ms,
                        "plain_bound_ms": plain_bound, "draft_ms": drafted, "pack_ms": pack_ms,
                        "verify_ms": verify_ms, "verify_bound_ms": verify_bound, "graph": graph,
                        "plain_graph": plain_graph,
                        "verify_over_plain": verify_ms / plain_ms, "c": c,
                    })
                    print(f"  {drafter_name} W={width}: T {num_packed.float().mean():.1f}, draft {drafted:.3f} ms, "
                          f"pack {pack_ms:.3f}, verify {verify_ms:.3f} ({verify_ms / plain_ms:.2f}x plain), "
                          f"c {c:.2f}", flush=True)
                del drafter
            del target
            empty_cache()
    return rows


# ------------------------------------------------------------------------------------------------


def empty_cache() -> None:
    if SIZES.device == "cuda":
        torch.cuda.empty_cache()


def print_kernel_table(rows: list[dict]) -> None:
    print("\n| kernel | shape | ms | bound ms | ratio | graph |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "ms" not in row:
            continue
        shape = row["shape"] if "W" not in row else f"{row['shape']} B={row['B']} W={row['W']} L={row['L']}"
        print(f"| {row['kernel']} | {shape} | {row['ms']:.4f} | {row['bound_ms']:.4f} | "
              f"{row['ratio']:.2f} | {'yes' if row['graph'] else 'no'} |")


def print_step_table(rows: list[dict]) -> None:
    """One ReDrafter step against the plain step; c is the tokens per step needed to break even."""
    steps = [r for r in rows if r["kernel"] == "redrafter_step"]
    if not steps:
        return
    print(f"\nOne ReDrafter step (context {CONTEXT}, L={LENGTH}, random drafter: packed sizes near the worst case)")
    print("| target | drafter | B | W | packed T | B*T | plain ms | draft ms | pack ms | verify ms | verify/plain | c |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in steps:
        print(f"| {r['target']} | {r['drafter']} | {r['B']} | {r['W']} | {r['packed_tokens_mean']:.1f} | "
              f"{r['verify_tokens']} | {r['plain_ms']:.3f} | {r['draft_ms']:.3f} | {r['pack_ms']:.3f} | "
              f"{r['verify_ms']:.3f} | {r['verify_over_plain']:.2f} | {r['c']:.2f} |")


def plot_steps(rows: list[dict], png: Path) -> None:
    """c (draft + pack + verify over a plain step) against W, one panel per target, a line per
    drafter and batch size: ReDrafter pays where its tokens per step exceed the line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    steps = [r for r in rows if r["kernel"] == "redrafter_step"]
    targets = sorted({r["target"] for r in steps})
    fig, axes = plt.subplots(1, len(targets), figsize=(6 * len(targets), 4.5), squeeze=False)
    for ax, target in zip(axes[0], targets):
        mine = [r for r in steps if r["target"] == target]
        for drafter in sorted({r["drafter"] for r in mine}):
            for batch in sorted({r["B"] for r in mine}):
                line = sorted((r for r in mine if r["drafter"] == drafter and r["B"] == batch), key=lambda r: r["W"])
                ax.plot([r["W"] for r in line], [r["c"] for r in line], marker="o",
                        linestyle="-" if drafter == target else "--", label=f"{drafter} B={batch}")
        ax.set(xscale="log", yscale="log", xlabel="beam width W (L = 5)", ylabel="c = step cost / plain step",
               title=f"{target}, context {CONTEXT}")
        ax.set_xticks(sorted({r["W"] for r in mine}), labels=[str(w) for w in sorted({r["W"] for r in mine})])
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")


SECTIONS = ("tree", "sampling", "beam", "step", "tune")


def ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def narrowed(sizes: Sizes, batches: tuple | None, widths: tuple | None,
             targets: list[str] | None) -> Sizes:
    """``sizes`` with the command line's batch sizes, widths and targets (None: as they are)."""
    if targets is not None:
        unknown = set(targets) - set(sizes.targets)
        if unknown:
            sys.exit(f"--targets: unknown {sorted(unknown)}; known: {sorted(sizes.targets)}")
        sizes = replace(sizes, targets={t: sizes.targets[t] for t in targets})
    return replace(sizes, batches=batches or sizes.batches, widths=widths or sizes.widths)


def main(argv: list[str] | None = None) -> int:
    global SIZES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (a smoke run)")
    parser.add_argument("--only", choices=SECTIONS, action="append", default=None)
    parser.add_argument("--plot", type=Path, default=None, metavar="JSON",
                        help="only redraw the step plot of an earlier run's JSON (PNG beside it)")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU in Triton's interpreter: checks the script runs")
    parser.add_argument("--batches", type=ints, default=None, metavar="B,B,...",
                        help="batch sizes of the beam and step sections (default 1,8,32)")
    parser.add_argument("--widths", type=ints, default=None, metavar="W,W,...",
                        help="beam widths of the beam and step sections (default 1,8,32,64)")
    parser.add_argument("--targets", type=lambda s: s.split(","), default=None, metavar="NAME,...",
                        help="target shapes of the step section (default: all)")
    args = parser.parse_args(argv)
    if args.plot:
        plot_steps(json.loads(args.plot.read_text())["rows"], args.plot.with_suffix(".png"))
        return 0
    if args.dry_run:
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            sys.exit("--dry-run needs TRITON_INTERPRET=1 before triton is imported")
        os.environ["TRITON_INTERPRET"] = "1"
        SIZES = DRY_RUN
    else:
        SIZES = GPU
        require_gpu()
    SIZES = narrowed(SIZES, args.batches, args.widths, args.targets)
    import triton

    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name() if SIZES.device == "cuda" else "cpu dry run"
    started = time.time()
    rates = device_rates()
    print(f"{gpu}: copy {rates['copy_bandwidth_Bps'] / 1e12:.3f} TB/s, "
          f"bf16 matmul {rates['bf16_matmul_flops'] / 1e12:.1f} TFLOP/s", flush=True)
    slug = "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_")
    out = args.out or REPO / "benchmarks" / "results" / f"gpu_kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    failed: dict[str, str] = {}
    benches = {"tree": bench_tree_attention, "sampling": bench_sampling, "beam": bench_beam_search,
               "step": lambda r, q: bench_step(r, q, rows), "tune": bench_tune}
    for section in [s for s in SECTIONS if s in (args.only or SECTIONS)]:
        try:
            with torch.no_grad():
                rows += benches[section](rates, args.quick)
        except Exception:  # noqa: BLE001 - report the section and go on with the others
            failed[section] = traceback.format_exc()
            print(f"section {section} FAILED:\n{failed[section]}", flush=True)
            empty_cache()
        out.write_text(json.dumps(portable({
            "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "rates": rates,
            "seconds": time.time() - started, "failed": failed, "rows": rows,
        }), indent=1))
    if any(r["kernel"] == "redrafter_step" for r in rows):
        plot_steps(rows, out.with_suffix(".png"))
    print(f"\nwrote {out} ({time.time() - started:.0f} s)")
    print_kernel_table(rows)
    print_step_table(rows)
    if failed:
        print(f"\nFAILED sections: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
