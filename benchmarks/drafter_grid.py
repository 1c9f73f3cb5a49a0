"""A drafter's tokens/step over beam width x beam length, with the reference speculative loop.

The target alone decides every token (greedy, transformers, float32), so the figures are the
drafter's, free of any engine: tokens per target forward (accepted + the bonus), per-position
acceptance, the drafting time per step, and the share of the target's MT-Bench response tokens
inside the drafter's K-token head. The prompts are MT-Bench first turns (evaluation only: never
training data, never used to choose K or any setting), all 80 by default, with tokens/step per
category beside the total (the file's first 20 are writing and role play only). The drafter's
``training.json`` (written by ``vllm-redrafter train``), when present beside it, adds the data
size and training time.

    python benchmarks/drafter_grid.py [--drafter DIR] [--widths 1,2,4,8,16] [--lengths 3,4,5]
        [--num-prompts 80] [--max-new-tokens 64] [--out benchmarks/results/default_drafter.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reference import load_target, mt_bench_questions, run_reference  # noqa: E402

from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import DEFAULT_DRAFTER, int_list, machine  # noqa: E402
from vllm_redrafter.target import prepare_target  # noqa: E402


def training_record(drafter_dir: Path) -> dict | None:
    """What the drafter was trained on and for how long, from its training.json."""
    path = drafter_dir / "training.json"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    data = record.get("data") or {}
    return {"recipe": record.get("recipe"), "command": " ".join(record.get("command", [])),
            "positions": data.get("num_positions"), "sequences": data.get("num_sequences"),
            "data_seconds": record.get("data_seconds_this_session"),
            "train_seconds": record.get("train_seconds_this_session"),
            "steps": record.get("steps_done"),
            "draft_vocab_coverage": record.get("draft_vocab_coverage"),
            "heldout_top1": (record.get("eval") or {}).get("top1")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--widths", type=int_list, default=int_list("1,2,4,8,16"))
    parser.add_argument("--lengths", type=int_list, default=int_list("3,4,5"))
    parser.add_argument("--num-prompts", type=int, default=80)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "default_drafter.json")
    args = parser.parse_args()
    if not (args.drafter / "config.json").is_file():
        raise SystemExit(f"no drafter at {args.drafter} (no config.json)")

    target = args.target or prepare_target()
    model = load_target(target)
    categories, prompts = map(list, zip(*mt_bench_questions(args.num_prompts)))
    cells = []
    for length in args.lengths:
        for width in args.widths:
            start = time.time()
            cell = run_reference(target, args.drafter, prompts, width, length,
                                 args.max_new_tokens, model_and_tokenizer=model,
                                 categories=categories)
            cells.append(cell)
            print(f"W={width:<3} L={length}  tokens/step {cell['tokens_per_step']:.3f}  "
                  f"draft {cell['draft_ms_per_step']:.1f} ms/step  ({time.time() - start:.0f} s)",
                  flush=True)
    result = {"drafter": str(args.drafter), "machine": machine(), "prompts": len(prompts),
              "max_new_tokens": args.max_new_tokens,
              "response_tokens_in_draft_vocab": cells[0]["response_tokens_in_draft_vocab"],
              "draft_vocab_size": cells[0]["draft_vocab_size"],
              "training": training_record(args.drafter), "grid": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(portable(result), indent=1))

    print(f"\ntokens per target forward (reference loop, {len(prompts)} MT-Bench prompts, "
          f"{args.max_new_tokens} tokens, greedy)")
    print("L \\ W " + "".join(f"{w:>8}" for w in args.widths))
    for length in args.lengths:
        row = [c for c in cells if c["beam_length"] == length]
        print(f"{length:<6}" + "".join(f"{c['tokens_per_step']:>8.2f}" for c in row))
    for length in args.lengths:
        print(f"\n{f'L={length}, by category':<20}" + "".join(f"{'W=' + str(w):>8}" for w in args.widths))
        row = [c for c in cells if c["beam_length"] == length]
        for category in dict.fromkeys(categories):
            print(f"{category:<20}" + "".join(
                f"{c['tokens_per_step_by_category'][category]:>8.2f}" for c in row))
    print(f"MT-Bench response tokens inside the K={result['draft_vocab_size']} head: "
          f"{result['response_tokens_in_draft_vocab']:.3f}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
