"""Distillation vs ground-truth labels, same budget: tokens/step of each drafter.

The same text, the same positions, the same drafter, steps, batch and seed; only the labels
differ (the paper's ablation, which reports ~10% more tokens/step with distillation):

- ``distill``: at each position the target's own greedy continuation (vLLM, batched);
- ``ground-truth``: the text's own next tokens.

The text is ``--dataset`` (chat data with assistant answers, or plain text), by default the
built-in local English text (stdlib docstrings and licence files: train/prompts.py). Both
drafters are measured with the reference speculative loop on MT-Bench prompts (evaluation only).
Each arm picks its K draft tokens from its own labels (part of what the labels decide; the table
shows each one's coverage of the target's MT-Bench answers). The held-out top-1 of each arm is
against its own kind of label, so only tokens/step compares the two.

    python benchmarks/distill_vs_ground_truth.py --out runs/labels [--dataset FILE]
        [--recipe default] [--max-steps 1000] [--position-stride 2] [--paragraphs N]
        [--num-prompts 20]
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
    parser.add_argument("--dataset", default="builtin")
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--max-steps", type=int, default=None, help="same budget for both arms")
    parser.add_argument("--position-stride", type=int, default=2)
    parser.add_argument("--paragraphs", type=int, default=None,
                        help="built-in dataset: how many local paragraphs (default: the recipe's)")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    target = args.target or prepare_target()
    recipe = get_recipe(args.recipe)
    train = recipe.train if args.max_steps is None else replace(recipe.train, max_steps=args.max_steps)
    prompts = mt_bench_prompts(args.num_prompts)
    target_model = load_target(target)
    builtin = recipe.data.builtin
    if args.paragraphs is not None:
        builtin = replace(builtin, text=args.paragraphs)
    rows = []
    for labels in ("distill", "ground-truth"):
        out = args.out / labels
        arm = replace(recipe, name=f"{recipe.name}-{labels}", train=train, save_dtype="float32",
                      data=replace(recipe.data, dataset=args.dataset, labels=labels,
                                   position_stride=args.position_stride, builtin=builtin),
                      extra_data=())  # one dataset, labelled both ways
        if (out / "training.json").is_file():
            record = json.loads((out / "training.json").read_text())
        else:
            record = run_training(arm, target, out)
        stats = run_reference(target, out, prompts, args.beam_width, args.beam_length,
                              args.max_new_tokens, model_and_tokenizer=target_model)
        row = {"labels": labels, "positions": record["data"]["num_positions"],
               "sequences": record["data"].get("num_sequences"),
               "data_seconds": record.get("data_seconds_this_session"),
               "train_seconds": record.get("train_seconds_this_session"),
               "heldout_top1": record["eval"]["top1"], **stats}
        rows.append(row)
        print(json.dumps(row))
        result = {"command": " ".join(sys.argv), "machine": machine(), "recipe": recipe.name,
                  "max_steps": train.max_steps, "max_new_tokens": args.max_new_tokens, "rows": rows}
        (args.out / "distill_vs_ground_truth.json").write_text(json.dumps(portable(result), indent=1))
    print(f"\n{'labels':>13} {'positions':>9} {'top1@1':>7} {'tok/step':>9} {'in K':>6}")
    for r in rows:
        print(f"{r['labels']:>13} {r['positions']:9d} {r['heldout_top1'][0]:7.3f} "
              f"{r['tokens_per_step']:9.3f} {r['response_tokens_in_draft_vocab']:6.3f}")
    if len(rows) == 2:
        print(f"distill / ground-truth tokens/step: {rows[0]['tokens_per_step'] / rows[1]['tokens_per_step']:.3f}")


if __name__ == "__main__":
    main()
