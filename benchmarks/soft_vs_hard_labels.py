"""Soft vs hard labels, same data and budget: tokens/step of drafters trained with each.

One distillation dataset (``labels=self``: the target's own answers), one drafter shape, the same
steps, batch and seed; only the loss differs: ``(1 - w) CE(hard labels) + w KL(the target's
distribution || the drafter's)`` for each ``w`` of ``--weights`` (0 = the paper's Eq. 2, hard
labels only; train/soft_labels.py). Each drafter is measured with the reference speculative loop
on MT-Bench first turns (evaluation only), every ``--prompt-stride``-th question so that every
category is in, beside its held-out top-1 per draft position.

    python benchmarks/soft_vs_hard_labels.py --out runs/soft [--recipe medium] [--weights 0,0.5,1]
        [--max-steps N] [--prompt-stride 2] [--beam-width 4 --beam-length 4]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reference import load_target, mt_bench_prompts, run_reference  # noqa: E402

from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import machine  # noqa: E402
from vllm_redrafter.target import prepare_target  # noqa: E402
from vllm_redrafter.train.pipeline import run_training  # noqa: E402
from vllm_redrafter.train.recipes import get_recipe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--recipe", default="medium")
    parser.add_argument("--weights", default="0,0.5,1", help="soft-label weights, one drafter each")
    parser.add_argument("--max-steps", type=int, default=None, help="same budget for every arm")
    parser.add_argument("--prompt-stride", type=int, default=2)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    target = args.target or prepare_target()
    recipe = get_recipe(args.recipe)
    other = sorted({spec.labels for spec in recipe.datasets} - {"self"})
    if other:
        raise SystemExit(f"recipe {recipe.name} has a dataset with labels={other[0]}; this compares "
                         "soft and hard labels on the target's own answers (labels=self)")
    train = recipe.train if args.max_steps is None else replace(recipe.train, max_steps=args.max_steps)
    prompts = mt_bench_prompts()[:: args.prompt_stride]
    target_model = load_target(target)
    rows = []
    for weight in (float(w) for w in args.weights.split(",")):
        out = args.out / f"w{weight:g}"
        arm = replace(recipe, name=f"{recipe.name}-soft{weight:g}", save_dtype="float32",
                      train=replace(train, soft_label_weight=weight))
        if (out / "training.json").is_file():
            record = json.loads((out / "training.json").read_text())
        else:
            record = run_training(arm, target, out, data_dir=args.out / "data")
        stats = run_reference(target, out, prompts, args.beam_width, args.beam_length,
                              args.max_new_tokens, model_and_tokenizer=target_model)
        row = {"soft_label_weight": weight, "positions": record["data"]["num_positions"],
               "train_seconds": record.get("train_seconds_this_session"),
               "train_steps": record.get("steps_done"), "heldout_top1": record["eval"]["top1"], **stats}
        rows.append(row)
        print(json.dumps(row), flush=True)
        result = {"command": " ".join(sys.argv), "machine": machine(), "recipe": recipe.name,
                  "train_steps": record.get("steps_done"), "prompts": len(prompts),
                  "max_new_tokens": args.max_new_tokens, "rows": rows}
        (args.out / "soft_vs_hard_labels.json").write_text(json.dumps(portable(result), indent=1))
    print(f"\n{'weight':>6} {'positions':>9} {'top1@1':>7} {'top1@3':>7} {'tok/step':>9}")
    for r in rows:
        print(f"{r['soft_label_weight']:6g} {r['positions']:9d} {r['heldout_top1'][0]:7.3f} "
              f"{r['heldout_top1'][2]:7.3f} {r['tokens_per_step']:9.3f}")


if __name__ == "__main__":
    main()
