"""Drafters' tokens per step on built datasets' held-out positions, without running the target.

Greedy acceptance simulated from the drafter's beams and the target's own continuations stored in a
built dataset (``train/heldout_beams.py``). A cheap check for choices made on training data: it
never touches the MT-Bench questions, and held-out prompts of a kind near MT-Bench (the written
requests, ``--builtin written=...``) rank drafters as MT-Bench does.

    python benchmarks/heldout_beams.py --data DATA_DIR[,DATA_DIR...] --drafter DIR [DIR ...]
        [--widths 4] [--lengths 4] [--max-positions 50000] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import int_list
from vllm_redrafter.drafter import RecurrentDrafter
from vllm_redrafter.target import prepare_target
from vllm_redrafter.train.distill import load_data
from vllm_redrafter.train.heldout_beams import heldout_tokens_per_step
from vllm_redrafter.train.pipeline import load_target_embedding


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="built dataset dirs, comma-separated")
    parser.add_argument("--drafter", type=Path, nargs="+", required=True)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--widths", type=int_list, default=int_list("4"))
    parser.add_argument("--lengths", type=int_list, default=int_list("4"))
    parser.add_argument("--max-positions", type=int, default=50_000)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    embedding = load_target_embedding(args.target or prepare_target())
    datasets = {name: load_data(Path(name)) for name in args.data.split(",")}
    rows = []
    for drafter_dir in args.drafter:
        drafter = RecurrentDrafter.from_pretrained(drafter_dir, embedding, dtype=torch.float32)
        drafter.eval()
        for name, data in datasets.items():
            for length in args.lengths:
                for width in args.widths:
                    row = heldout_tokens_per_step(drafter, data, width, length,
                                                  args.max_positions)
                    rows.append({"drafter": str(drafter_dir), "data": name, **row})
                    print(f"{drafter_dir}  {name}  W={width} L={length}  tokens/step "
                          f"{row['tokens_per_step']:.3f}  acceptance "
                          + " / ".join(f"{a:.3f}" for a in row["acceptance_at_least"])
                          + f"  ({row['positions']} positions)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(portable(rows), indent=1))


if __name__ == "__main__":
    main()
