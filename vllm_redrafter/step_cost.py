"""``vllm-redrafter step-cost``: this machine's cost of one target forward over T new tokens per
request, against one: a curve the beam policy may start from (an optional prior; the policy
learns the machine's costs from its own steps without it).

For batch sizes B and tokens per request T, B prompts of P cached tokens (prefix cache primed)
get T new tokens each and ``max_tokens=1``: one engine step (queued first, then timed alone:
:func:`one_step`) whose forward covers B * T query tokens over a cached context, as a verify step
does. The fastest of ``--repeats`` runs (fresh suffixes each time, after one untimed run) per
cell is printed as a table of ratios to the (B, T=1) step. The curve (per batch size, seconds by
total query tokens, each made monotone) is cached where the ReDrafter proposer looks for it
(:func:`~vllm_redrafter.step_cost_curve.step_cost_path`: per model, dtype, machine, CPU ISA and the
worker's thread count), and written to ``--out`` with a PNG plot beside it; an engine can also
be given it as ``speculative_config["step_cost"]``. Measure with the environment the server
will have: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0 vllm-redrafter step-cost`` for a server started
with it.

    vllm-redrafter step-cost [--model DIR] [--dtype float32] [--batch-sizes 1,2,4,8,16,32]
        [--tokens 1,2,4,8,16,32,64] [--context 128] [--repeats 5] [--kv-cache-gib 2]
        [--out FILE.json]
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import time
from pathlib import Path

from vllm_redrafter.demo import int_list


def measure(llm, batch: int, tokens: int, context: int, repeats: int, vocab: int,
            rng: random.Random) -> float:
    """Fastest of ``repeats`` steps over ``batch`` requests x ``tokens`` new tokens.

    One untimed step of the same shape first (oneDNN builds a GEMM primitive per new row count).
    The minimum, not the median: on a shared machine every disturbance adds time, and the
    policy corrects this prior by the engine's own timed steps anyway.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    prefixes = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prefixes], params, use_tqdm=False)
    times = []
    for _ in range(repeats + 1):
        prompts = [TokensPrompt(prompt_token_ids=p + [rng.randrange(100, vocab)
                                                      for _ in range(tokens)]) for p in prefixes]
        times.append(one_step(llm, prompts, params))
    return min(times[1:])


def one_step(llm, prompts: list, params) -> float:
    """Seconds of the one engine step that runs all ``prompts`` (each emits one token).

    The requests are queued first and the step is timed alone: through ``LLM.generate`` the
    timing would hold the requests' intake, and with the engine core in its own process
    (vLLM's default) a step can start before all requests arrived, so B requests took two steps
    (measured: batch 8 at 1.8x its real step). Hence ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (set
    by :func:`main`).
    """
    engine = llm.llm_engine
    for prompt in prompts:
        engine.add_request(f"step-cost-{next(_request_ids)}", prompt, params)
    start, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - start
    if steps != 1:
        raise RuntimeError(f"{len(prompts)} requests took {steps} engine steps, not one: raise "
                           "max_num_batched_tokens / max_num_seqs")
    return seconds


_request_ids = itertools.count()


def torch_threads(worker=None) -> int:
    """The model runner's torch threads (called in vLLM's worker: its thread binding sets them)."""
    import torch

    return torch.get_num_threads()


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for batch in sorted({c["batch"] for c in cells}):
        row = [c for c in cells if c["batch"] == batch]
        ax.plot([c["tokens"] for c in row], [c["ratio"] for c in row], marker="o",
                label=f"batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("new tokens per request (T)")
    ax.set_ylabel("step time / step time at T = 1")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_step_cost_parser(sub) -> None:
    parser = sub.add_parser("step-cost", help="measure this machine's step-cost curve (an "
                            "optional prior of the beam policy) and cache it",
                            description="Measure one target forward over T new tokens per "
                            "request at each batch size B; cache the curve where the ReDrafter "
                            "proposer finds it (the beam policy's prior).")
    parser.add_argument("--model", default=None, help="target dir (default: the embedded one)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=int_list, default=int_list("1,2,4,8,16,32"))
    parser.add_argument("--tokens", type=int_list, default=int_list("1,2,4,8,16,32,64"))
    parser.add_argument("--context", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--kv-cache-gib", type=float, default=2.0)
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the curve here (JSON, a PNG plot beside it)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_PLUGINS", "")  # vLLM alone: the target's own cost
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # one step per timed batch (one_step)
    # To ask the worker its torch thread count (a function of ours, through collective_rpc).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    import torch
    from tqdm import tqdm
    from vllm import LLM

    from vllm_redrafter.step_cost_curve import StepCost, step_cost_path

    if args.model is None:
        from vllm_redrafter.target import prepare_target

        args.model = str(prepare_target())
    max_tokens = max(args.batch_sizes) * (args.context + max(args.tokens))
    llm = LLM(model=args.model, dtype=args.dtype, enforce_eager=True, seed=0,
              max_model_len=args.context + max(args.tokens) + 8,
              max_num_batched_tokens=max(8192, max_tokens), max_num_seqs=max(args.batch_sizes),
              enable_prefix_caching=True, kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30))
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    cells = []
    grid = [(b, t) for b in args.batch_sizes for t in args.tokens]
    for batch, tokens in tqdm(grid, desc="step cost (B, T)"):
        seconds = measure(llm, batch, tokens, args.context, args.repeats, vocab, rng)
        cells.append({"batch": batch, "tokens": tokens, "total_tokens": batch * tokens,
                      "seconds": seconds})
    for c in cells:
        one = next(x for x in cells if x["batch"] == c["batch"] and x["tokens"] == min(args.tokens))
        c["ratio"] = c["seconds"] / one["seconds"]

    device, threads = device_name(), llm.collective_rpc(torch_threads)[0]
    print(f"\nstep time / (same batch, T = {min(args.tokens)}), {args.model} ({args.dtype}), "
          f"{device}, {threads} worker threads, context {args.context}")
    print("B \\ T " + "".join(f"{t:>7}" for t in args.tokens))
    for batch in args.batch_sizes:
        row = [c for c in cells if c["batch"] == batch]
        print(f"{batch:>6} " + "".join(f"{c['ratio']:>7.2f}" for c in row))

    curve = StepCost.from_measurements((c["total_tokens"], c["seconds"]) for c in cells)
    dtype = str(getattr(torch, args.dtype))
    cached = step_cost_path(args.model, dtype, device, threads)
    meta = {"model": args.model, "dtype": dtype, "device": device, "worker_threads": threads,
            "cells": cells}
    curve.save(cached, **meta)
    print(f"\ncurve cached for the beam policy (its prior): {cached}")
    if args.out is not None:
        curve.save(args.out, **meta)
        plot(cells, args.out.with_suffix(".png"))
        print(f"JSON and plot: {args.out}, {args.out.with_suffix('.png')}")
    return 0
