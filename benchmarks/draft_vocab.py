"""Reduced draft vocabulary: tokens/step and drafting time per step for K in {4K, 8K, 16K, full}.

One distillation dataset is built once (default: the ``default`` recipe's data, or ``--recipe
quick`` for a smoke run), then a drafter is trained for every K with the SAME budget (same data,
same steps, same batch, same seed), and each is measured with the reference speculative loop on
MT-Bench prompts (evaluation only; K is chosen from training-data counts, never from them):

    K  | held-out top-1 (pos 1..T) | tokens/step | draft ms/step | MT-Bench tokens inside K

Every trained drafter stays in OUT/K*/ (a rerun reuses finished ones and resumes killed ones).
Cost on a 2-core CPU with the default data: the data build is shared (hours, see recipes.py);
training is ~K-proportional per step, and the full 49K head is ~8x the 6K one: run the ``full``
arm on a GPU, or pass --ks 4096,8192,16384.

    python benchmarks/draft_vocab.py --out runs/draft_vocab [--recipe default] [--ks 4096,8192,16384,full]
        [--data-dir DIR] [--max-steps 1500] [--beam-width 4 --beam-length 4] [--num-prompts 20]
        [--max-new-tokens 128]
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
from vllm_redrafter.target import prepare_target  # noqa: E402
from vllm_redrafter.train.pipeline import run_training  # noqa: E402
from vllm_redrafter.train.recipes import get_recipe  # noqa: E402


def parse_ks(text: str) -> list[int | None]:
    return [None if k == "full" else int(k) for k in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--recipe", default="default")
    parser.add_argument("--ks", type=parse_ks, default=parse_ks("4096,8192,16384,full"))
    parser.add_argument("--max-steps", type=int, default=None, help="same budget for every K")
    parser.add_argument("--data-dir", type=Path, default=None,
                        help="reuse a run's data built with the same recipe (e.g. "
                             "~/.cache/vllm-redrafter/runs/default/work/data); default OUT/data")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    target = args.target or prepare_target()
    recipe = get_recipe(args.recipe)
    if args.max_steps is not None:
        recipe = replace(recipe, train=replace(recipe.train, max_steps=args.max_steps))
    recipe = replace(recipe, save_dtype="float32")
    data_dir = args.data_dir or args.out / "data"  # built once, shared by every K
    prompts = mt_bench_prompts(args.num_prompts)
    target_model = load_target(target)
    rows = []
    for k in args.ks:
        name = f"K{k or 'full'}"
        out = args.out / name
        arm = replace(recipe, name=f"{recipe.name}-{name}",
                      drafter=replace(recipe.drafter, draft_vocab_size=k))
        if (out / "training.json").is_file():
            record = json.loads((out / "training.json").read_text())
        else:
            record = run_training(arm, target, out, data_dir=data_dir)
        stats = run_reference(target, out, prompts, args.beam_width, args.beam_length,
                              args.max_new_tokens, model_and_tokenizer=target_model)
        row = {"arm": name, "draft_vocab_size": k, "heldout_top1": record["eval"]["top1"],
               "train_seconds": record["train_seconds_this_session"], **stats}
        rows.append(row)
        print(json.dumps(row))
        (args.out / "draft_vocab.json").write_text(json.dumps(portable(rows), indent=1))
    print(f"\n{'K':>7} {'top1@1':>7} {'tok/step':>9} {'draft ms':>9} {'in K':>6}   "
          f"(W={args.beam_width}, L={args.beam_length}, {len(prompts)} MT-Bench prompts)")
    for r in rows:
        print(f"{r['draft_vocab_size'] or 'full':>7} {r['heldout_top1'][0]:7.3f} "
              f"{r['tokens_per_step']:9.3f} {r['draft_ms_per_step']:9.1f} "
              f"{r['response_tokens_in_draft_vocab']:6.3f}")


if __name__ == "__main__":
    main()
