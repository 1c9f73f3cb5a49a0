"""GPU benchmark of vllm_redrafter/kernels, in one command, against bounds measured in the same run.

    python benchmarks/gpu_kernels.py [--out benchmarks/results/gpu_kernels_<gpu>.json] [--quick]

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
   sigmoid approximation's time and total-variation distance (synthetic Gaussian logits).

Every bound is max(bytes / copy bandwidth, FLOPs / matmul rate) with both rates measured above.
Times are CUDA-graph replays (events, mean of 20) where capture works, else plain launches
(marked). The last thing printed is the table: kernel, shape, ms, bound ms, ratio. A JSON with
every figure is written to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"vicuna-7b": (4096, 32000, None), "llama3.1-8b": (4096, 128256, None),
          "llama3.1-8b-K32000": (4096, 128256, 32000)}
BATCHES = (1, 8, 32)
WIDTHS = (1, 8, 32, 64)
LENGTH = 5


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
    """Mean ms per call of ``fn`` (CUDA-graph replay when capture works); (ms, captured)."""
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


def device_rates() -> dict:
    """Copy bandwidth (bytes/s, read + write) and bf16 matmul rate (FLOP/s), best of a few runs."""
    x = torch.empty(2**29, dtype=torch.bfloat16, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    copy_ms = min(timed(lambda: y.copy_(x), iters=10, graph=False)[0] for _ in range(3))
    bandwidth = 2 * x.numel() * x.element_size() / (copy_ms / 1e3)
    del x, y
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
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
    with torch.device("cuda"):
        drafter = RecurrentDrafter(config).to(torch.bfloat16)
        for p in drafter.parameters():
            torch.nn.init.normal_(p, std=0.02)
        if draft_vocab is not None:
            drafter.draft_vocab_ids.copy_(torch.randperm(vocab, device="cuda")[:draft_vocab])
        embedding = torch.nn.Embedding(vocab, hidden).to(torch.bfloat16)
    drafter.attach_embedding(embedding)
    return drafter.eval()


def bench_beam_search(rates: dict, quick: bool) -> list[dict]:
    from vllm_redrafter.beam_search import beam_search
    from vllm_redrafter.kernels.fused_beam_step import beam_search_fused

    rows = []
    for name, (hidden, vocab, draft_vocab) in SHAPES.items():
        drafter = make_drafter(hidden, vocab, draft_vocab)
        weight_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters())
        params = sum(p.numel() for p in drafter.parameters())
        for batch in BATCHES[:2] if quick else BATCHES:
            h = torch.randn(batch, hidden, device="cuda", dtype=torch.bfloat16)
            g0 = torch.randint(0, vocab, (batch,), device="cuda")
            for width in WIDTHS:
                nbytes = (LENGTH - 1) * (weight_bytes + batch * width * hidden * 2)
                flops = (LENGTH - 1) * 2 * batch * width * params
                bound = bound_ms(nbytes, flops, rates)
                torch_ms, g1 = timed(lambda: beam_search(drafter, h, g0, width, LENGTH))
                fused_ms, g2 = timed(lambda: beam_search_fused(drafter, h, g0, width, LENGTH))
                a = beam_search(drafter, h, g0, width, LENGTH)
                b = beam_search_fused(drafter, h, g0, width, LENGTH)
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
        torch.cuda.empty_cache()
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


def bench_tree_attention(rates: dict, quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from vllm_redrafter.kernels.tree_attention import (
        pack_tree_mask,
        tree_attention_reference,
        tree_attention_triton,
    )

    hq, hkv, dim, block = 32, 8, 128, 16
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, 8):
        for context in (512, 2048):
            for tree in (16, 64):
                total = context + tree
                blocks_per = -(-total // block)
                num_blocks = batch * blocks_per
                kc = torch.randn(num_blocks, block, hkv, dim, device="cuda", dtype=torch.bfloat16)
                vc = torch.randn_like(kc)
                bt = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per).int().cuda()
                masks = torch.stack([random_tree_mask(tree, gen) for _ in range(batch)])
                words = pack_tree_mask(masks, torch.full((batch,), tree)).cuda()
                cu = (torch.arange(batch + 1, dtype=torch.int32) * tree).cuda()
                ctx = torch.full((batch,), context, dtype=torch.int32, device="cuda")
                q = torch.randn(batch * tree, hq, dim, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(q)
                args = (q, kc, vc, bt, cu, ctx, words)
                kernel_ms, g = timed(lambda: tree_attention_triton(
                    *args, max_tree_len=tree, max_kv_len=total, out=out))
                err = (tree_attention_triton(*args).float() - tree_attention_reference(*args).float()).abs().max().item()
                # SDPA baselines over the same K/V, expanded per query head (no GQA path)
                pos = torch.arange(total, device="cuda")
                k = kc[bt.long()[:, pos // block], pos % block]  # [B, S, Hkv, D]
                v = vc[bt.long()[:, pos // block], pos % block]
                k = k.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()  # [B, Hq, S, D]
                v = v.repeat_interleave(hq // hkv, dim=2).transpose(1, 2).contiguous()
                q1 = torch.randn(batch, hq, 1, dim, device="cuda", dtype=torch.bfloat16)
                decode_ms, _ = timed(lambda: F.scaled_dot_product_attention(q1, k[:, :, :context], v[:, :, :context]))
                dense = torch.cat([torch.ones(batch, tree, context, dtype=torch.bool), masks], dim=2).cuda()
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

    rows = []
    for vocab in (32000, 128256):
        for count in (16, 64, 512):
            logits = torch.randn(count, vocab, device="cuda") * 3
            temperature = torch.full((count,), 0.8, device="cuda")
            params = SamplingParamsBatch(temperature=temperature)
            seed = torch.arange(count, device="cuda")
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
    for std in (1.0, 3.0, 6.0):
        logits = torch.randn(64, 32000, device="cuda") * std
        tv[f"gaussian_std{std:g}_T1"] = sigmoid_tv_distance(logits, torch.ones(64, device="cuda")).mean().item()
    print(f"sigmoid approximation TV distance (synthetic): {tv}")
    rows.append({"kernel": "sigmoid_tv_distance", "shape": "V=32000, Gaussian logits", "tv": tv})
    return rows


# ------------------------------------------------------------------------------------------------


def print_table(rows: list[dict]) -> None:
    print("\n| kernel | shape | ms | bound ms | ratio | graph |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if "ms" not in row:
            continue
        shape = row["shape"] if "W" not in row else f"{row['shape']} B={row['B']} W={row['W']} L={row['L']}"
        print(f"| {row['kernel']} | {shape} | {row['ms']:.4f} | {row['bound_ms']:.4f} | "
              f"{row['ratio']:.2f} | {'yes' if row['graph'] else 'no'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default benchmarks/results/...)")
    parser.add_argument("--quick", action="store_true", help="a few shapes only (a smoke run)")
    parser.add_argument("--only", choices=("beam", "tree", "sampling"), action="append", default=None)
    args = parser.parse_args(argv)
    require_gpu()
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = torch.cuda.get_device_name()
    started = time.time()
    rates = device_rates()
    print(f"{gpu}: copy {rates['copy_bandwidth_Bps'] / 1e12:.3f} TB/s, "
          f"bf16 matmul {rates['bf16_matmul_flops'] / 1e12:.1f} TFLOP/s", flush=True)
    only = set(args.only or ("beam", "tree", "sampling"))
    rows: list[dict] = []
    with torch.no_grad():
        if "tree" in only:
            rows += bench_tree_attention(rates, args.quick)
        if "sampling" in only:
            rows += bench_sampling(rates, args.quick)
        if "beam" in only:
            rows += bench_beam_search(rates, args.quick)
    slug = "".join(c if c.isalnum() else "_" for c in gpu.lower()).strip("_")
    out = args.out or REPO / "benchmarks" / "results" / f"gpu_kernels_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    import triton

    out.write_text(json.dumps({
        "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "rates": rates,
        "seconds": time.time() - started, "rows": rows,
    }, indent=1))
    print(f"\nwrote {out} ({time.time() - started:.0f} s)")
    print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
