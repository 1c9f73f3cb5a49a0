"""The paper's Table 5 on this machine: per-request tokens/s over beam width x batch size.

One ReDrafter engine (each request carries its beam shape in ``extra_args``, the policy is off)
and one vLLM-alone engine, side by side in this process. For every batch size B, B MT-Bench
questions (first turn, chat template, greedy) run together through vLLM alone and then through
ReDrafter at each beam width W and length L (the paper's table: L = 4); per-request tokens/s =
emitted tokens / wall time / B. Printed as a table per L with the best shape per B, written as
JSON and drawn as a heatmap of the speedup over vLLM alone (with several L: the best L per cell,
named in it).

    python benchmarks/beam_grid.py --drafter DIR [--widths 1,2,4,8,16,32]
        [--batch-sizes 1,2,4,8,16,32] [--beam-lengths 4 | 2,3,4,5] [--max-tokens 64]
        [--out benchmarks/results/beam_grid.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from vllm_redrafter.eval_sets import MT_BENCH, first_turns  # noqa: E402
from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import (
    DEFAULT_DRAFTER,
    engine_kwargs,
    int_list,
    machine,
)


def per_request_rate(llm, prompts: list[list[int]], params: list) -> float:
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                           use_tqdm=False)
    seconds = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / seconds / len(prompts)


def best_cell(cells: list[dict], **where) -> dict:
    """The fastest of the cells matching ``where`` (e.g. batch=4, width=2: the best L there)."""
    return max((c for c in cells if all(c[k] == v for k, v in where.items())),
               key=lambda c: c["speedup"])


def heatmap(cells: list[dict], widths: list[int], batches: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = [[best_cell(cells, batch=b, width=w) for w in widths] for b in batches]
    grid = [[c["speedup"] for c in row] for row in best]
    several = len({c["length"] for c in cells}) > 1
    fig, ax = plt.subplots(figsize=(6, 4.5))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.5, vmax=max(1.5, max(map(max, grid))))
    ax.set_xticks(range(len(widths)), [str(w) for w in widths])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("beam width W")
    ax.set_ylabel("batch size")
    for i, row in enumerate(best):
        for j, cell in enumerate(row):
            label = f"{cell['speedup']:.2f}" + (f"\nL={cell['length']}" if several else "")
            ax.text(j, i, label, ha="center", va="center", fontsize=7)
    fig.colorbar(image, label="per-request tokens/s vs vLLM alone")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--widths", type=int_list, default=int_list("1,2,4,8,16,32"))
    parser.add_argument("--batch-sizes", type=int_list, default=int_list("1,2,4,8,16,32"))
    parser.add_argument("--beam-lengths", type=int_list, default=int_list("4"))
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "beam_grid.json")
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_redrafter.reference_loop import chat_prompt_ids
    from vllm_redrafter.target import prepare_target

    if not (args.drafter / "config.json").is_file():
        raise SystemExit(f"no drafter at {args.drafter} (pass --drafter DIR)")
    target = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    questions = first_turns(args.prompts or MT_BENCH, max(args.batch_sizes))
    questions = (questions * max(args.batch_sizes))[: max(args.batch_sizes)]
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    L_max = max(args.beam_lengths)
    spec = {"method": "redrafter", "model": str(args.drafter.resolve()), "beam_width": 1,
            "beam_length": L_max, "beam_policy": "fixed",
            "num_speculative_tokens": min(128, max(args.widths) * (L_max - 1))}
    engine = {**engine_kwargs(target), "max_num_seqs": max(args.batch_sizes)}
    alone = LLM(**engine)
    ours = LLM(**engine, speculative_config=spec)
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (alone, ours):  # warm-up: first-call costs out of the first cell
        per_request_rate(llm, prompts[:2], [plain] * 2)
    cells = []
    for batch in tqdm(args.batch_sizes, desc="batch sizes"):
        base = per_request_rate(alone, prompts[:batch], [plain] * batch)
        for width in args.widths:
            for L in args.beam_lengths:
                shaped = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, extra_args={
                    "redrafter_beam_width": width, "redrafter_beam_length": L})
                rate = per_request_rate(ours, prompts[:batch], [shaped] * batch)
                cells.append({"batch": batch, "width": width, "length": L,
                              "tokens_per_s": rate, "alone_tokens_per_s": base,
                              "speedup": rate / base})

    best, best_length = {}, {}
    for L in args.beam_lengths:
        print(f"\nper-request tokens/s vs vLLM alone (L={L}, greedy, {args.max_tokens} tokens)")
        print("B \\ W " + "".join(f"{w:>7}" for w in args.widths))
        for batch in args.batch_sizes:
            print(f"{batch:>6} " + "".join(
                f"{best_cell(cells, batch=batch, width=w, length=L)['speedup']:>7.2f}"
                for w in args.widths))
    print("\nbest shape per batch size (none: vLLM alone is faster)")
    for batch in args.batch_sizes:
        top = best_cell(cells, batch=batch)
        best[batch] = top["width"] if top["speedup"] > 1 else 0
        best_length[batch] = top["length"] if top["speedup"] > 1 else 0
        shape = f"W={top['width']} L={top['length']}" if best[batch] else "none"
        print(f"{batch:>6}  {shape}  (fastest cell {top['speedup']:.2f}x, "
              f"W={top['width']} L={top['length']})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(portable({"machine": machine(), "drafter": str(args.drafter), "cells": cells,
                                    "best_width_per_batch": best,
                                    "best_length_per_batch": best_length}), indent=1))
    heatmap(cells, args.widths, args.batch_sizes, args.out.with_suffix(".png"))
    print(f"\nJSON and heatmap: {args.out.with_suffix('')}.*")


if __name__ == "__main__":
    main()
