"""``vllm-redrafter train``: distil a drafter for a target model from a local dataset.

    vllm-redrafter train --recipe shipped --output-dir runs/shipped          # the shipped drafter
    vllm-redrafter train --recipe default --output-dir runs/default          # its base, from scratch
    vllm-redrafter train --recipe quick --output-dir /tmp/quick               # minutes, CPU
    vllm-redrafter train --target MODEL_DIR --dataset chats.jsonl --output-dir DIR --labels self
    vllm-redrafter train --dataset chats.jsonl --init-from default --output-dir DIR --lr 2e-4 --epochs 1
                                                            # fine-tune the shipped drafter

A recipe (recipes.py) sets every default; the flags override single settings. A killed run
resumes when the same command is run again; a finished drafter is only replaced with --overwrite.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Register the ``train`` subcommand on an ``argparse`` subparsers object."""
    p = subparsers.add_parser("train", help="train a ReDrafter drafter by distillation from a target",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="default", help="default | shipped | broad | medium | quick")
    p.add_argument("--target", type=Path, default=None,
                   help="target model directory (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dataset", default=None,
                   help="dataset file (.jsonl/.json chat, ShareGPT, prompt, text or input_ids; or "
                        "plain text), or 'builtin' (local prompts, see train/prompts.py); replaces "
                        "the recipe's datasets")
    p.add_argument("--builtin", type=_builtin_counts, default=None,
                   help="the built-in dataset's prompts per source, e.g. templated=150,documents=90 "
                        "(sources: templated, text, self_instruct, documents, constrained, detailed, "
                        "specific, written, written_2 ... written_9; and seed): one "
                        "built-in dataset, the recipe's first with these counts")
    p.add_argument("--output-dir", type=Path, required=True, help="where the drafter is written")
    p.add_argument("--overwrite", action="store_true", help="replace a drafter/run in --output-dir")
    p.add_argument("--labels", choices=("self", "distill", "ground-truth"), default=None,
                   help="self: the target answers the prompts; distill: the target continues "
                        "each position of the text; ground-truth: the text's own tokens")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="T, tokens drafted per position (5)")
    p.add_argument("--response-tokens", type=int, default=None, help="labels=self: max tokens per answer")
    p.add_argument("--position-stride", type=int, default=None,
                   help="labels=distill/ground-truth: use every n-th position")
    p.add_argument("--max-len", type=int, default=None, help="longest training sequence (tokens)")
    p.add_argument("--heldout-fraction", type=float, default=None)
    p.add_argument("--draft-vocab-size", default=None,
                   help="K, the reduced draft vocabulary, or 'full' (the target's whole vocabulary)")
    p.add_argument("--num-draft-layers", type=int, default=None, help="ResBlocks in the drafter head")
    p.add_argument("--exit-dim", type=int, default=None, help="ResBlock width (default 2H: no input_proj)")
    p.add_argument("--head-init", choices=("target", "random"), default=None)
    p.add_argument("--init-from", default=None,
                   help="fine-tune: start from this trained drafter (a directory, or 'default': the "
                        "package's), keeping its shape and draft vocabulary")
    p.add_argument("--epochs", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=None, help="positions per step")
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--soft-label-weight", type=float, default=None,
                   help="w in (1-w) CE + w KL(target || drafter): learn the target's whole "
                        "distribution at each label, not only its argmax (labels=self or ground-truth)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--save-every", type=int, default=None, help="steps between checkpoints")
    p.add_argument("--device", default=None, help="auto | cpu | cuda[:i]")
    p.add_argument("--dtype", default=None, help="training math: auto (fp32 CPU, bf16 GPU) | float32 | bfloat16")
    p.add_argument("--save-dtype", choices=("float32", "float16", "bfloat16"), default=None)
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where the distillation data is built/reused (default OUTPUT/work/data)")
    p.add_argument("--stop-after-steps", type=int, default=None,
                   help="stop with a checkpoint after this many steps (resume by rerunning)")
    p.set_defaults(func=run_train_command)
    return p


def recipe_from_args(args: argparse.Namespace):
    from vllm_redrafter.train.recipes import get_recipe, with_overrides

    recipe = get_recipe(args.recipe)
    vocab = args.draft_vocab_size
    recipe = with_overrides(
        recipe,
        data=dict(dataset=args.dataset, labels=args.labels, num_draft_tokens=args.num_draft_tokens,
                  response_tokens=args.response_tokens, position_stride=args.position_stride,
                  max_len=args.max_len, heldout_fraction=args.heldout_fraction),
        drafter=dict(num_draft_layers=args.num_draft_layers, exit_dim=args.exit_dim,
                     head_init=args.head_init, init_from=args.init_from,
                     draft_vocab_size=None if vocab in (None, "full") else _positive_int(vocab)),
        train=dict(epochs=args.epochs, max_steps=args.max_steps, batch_size=args.batch_size,
                   lr=args.lr, seed=args.seed, save_every=args.save_every, device=args.device,
                   dtype=args.dtype, soft_label_weight=args.soft_label_weight),
        save_dtype=args.save_dtype,
    )
    if vocab == "full":
        recipe = replace(recipe, drafter=replace(recipe.drafter, draft_vocab_size=None))
    if args.builtin:
        builtin = replace(recipe.data.builtin, **args.builtin)  # one built-in dataset
        recipe = replace(recipe, data=replace(recipe.data, builtin=builtin), extra_data=())
    return recipe


def _builtin_counts(text: str) -> dict[str, int]:
    """``templated=150,documents=90`` -> counts of the built-in dataset's sources (BuiltinSpec)."""
    from dataclasses import fields

    from vllm_redrafter.train.distill import BuiltinSpec

    known = {f.name for f in fields(BuiltinSpec)}
    counts = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key.strip() not in known or not value.strip().isdigit():
            raise argparse.ArgumentTypeError(
                f"{item!r}: expected SOURCE=COUNT with SOURCE one of {sorted(known)}")
        counts[key.strip()] = int(value)
    return counts


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"--draft-vocab-size must be a positive integer or 'full', got {text!r}") from None
    if value <= 0:
        raise ValueError(f"--draft-vocab-size must be positive, got {value}")
    return value


def run_train_command(args: argparse.Namespace) -> int:
    """Run ``train``; bad input (dataset, output dir, settings) prints one error line, exit 2."""
    from vllm_redrafter.train.pipeline import run_training

    try:
        recipe = recipe_from_args(args)
        target = args.target
        if target is None:
            from vllm_redrafter.target import prepare_target

            target = prepare_target()
        record = run_training(recipe, target, args.output_dir, overwrite=args.overwrite,
                              stop_after_steps=args.stop_after_steps, data_dir=args.data_dir)
    except (ValueError, FileNotFoundError) as err:
        print(f"vllm-redrafter train: error: {err}", file=sys.stderr)
        return 2
    if record.get("finished"):
        print(f"drafter written to {args.output_dir} ({record['steps_done']} steps)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m vllm_redrafter.train.cli``)."""
    parser = argparse.ArgumentParser(prog="vllm-redrafter")
    add_train_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["train", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
