"""Tokens/step with and without context candidates, per evaluation set, with the reference loop.

The target alone decides every token (greedy, transformers, float32), so the figures are the
trees', free of any engine: tokens per target forward (accepted + the bonus) of the shipped
drafter's W x L beams, of the same beams with up to C context candidates (prompt lookup over
prompt + generated text, ``vllm_redrafter/context_candidates.py``) in the same tree, and of the
candidates alone (W = 0). Sets: MT-Bench (its categories in turn) and the project's evaluation
sets (``vllm_redrafter/eval_sets.py``), the first N prompts of each. Evaluation only: nothing is
tuned on them.

    python benchmarks/context_candidates.py [--num-prompts 10] [--max-new-tokens 64]
        [--arms 1x4x0,1x4x1,4x4x0,4x4x1,0x4x1] [--lookup 2,5]   (arm: WxLxC[xK], K a
        candidate's most tokens, default L - 1)
        [--out benchmarks/results/context_candidates.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reference import load_target, run_reference  # noqa: E402

from vllm_redrafter.demo import DEFAULT_DRAFTER, int_list, machine  # noqa: E402
from vllm_redrafter.eval_sets import EVAL_SETS, MT_BENCH, read_eval_set, read_questions  # noqa: E402
from vllm_redrafter.results import write_json  # noqa: E402
from vllm_redrafter.target import prepare_target  # noqa: E402


def arm(text: str) -> tuple[int, int, int, int]:
    """``"WxLxC"`` or ``"WxLxCxK"`` -> (beam width, beam length, context candidates, their most
    tokens K, default L - 1); W 0: candidates alone."""
    try:
        width, length, count, *k = (int(x) for x in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"arm {text!r} is not WxLxC[xK]") from None
    tokens = k[0] if k else length - 1
    if (width < 0 or length < 2 or count < 0 or not (width or count) or tokens < 1
            or len(k) > 1):
        raise argparse.ArgumentTypeError(
            f"arm {text!r}: need W >= 0, L >= 2, C >= 0, W + C > 0, K >= 1")
    return width, length, count, tokens


def arm_list(text: str) -> list[tuple[int, int, int, int]]:
    return [arm(t) for t in text.split(",") if t.strip()]


def mt_bench_in_turn(limit: int) -> list[str]:
    """``limit`` MT-Bench first turns taking its categories in turn (the file is sorted by
    category, so its first prompts would all be writing)."""
    by_category: dict[str, list[str]] = {}
    for q in read_questions(MT_BENCH):
        by_category.setdefault(q.category, []).append(q.first_turn)
    picked, round_ = [], 0
    while len(picked) < limit and any(round_ < len(v) for v in by_category.values()):
        picked += [v[round_] for v in by_category.values() if round_ < len(v)]
        round_ += 1
    return picked[:limit]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--arms", type=arm_list, default=arm_list("1x4x0,1x4x1,4x4x0,4x4x1,0x4x1"))
    parser.add_argument("--lookup", type=int_list, default=int_list("2,5"),
                        help="the n-gram lengths of a match: min,max")
    parser.add_argument("--sets", default=",".join(["mt_bench", *EVAL_SETS]))
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "context_candidates.json")
    args = parser.parse_args()
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    target = args.target or prepare_target()
    model = load_target(target)
    prompts = {name: (mt_bench_in_turn(args.num_prompts) if name == "mt_bench" else
                      [q.first_turn for q in read_eval_set(name, args.num_prompts)])
               for name in sets}
    cells = []
    for width, length, count, tokens in args.arms:
        start = time.time()
        questions = [q for name in sets for q in prompts[name]]
        categories = [name for name in sets for _ in prompts[name]]
        cell = run_reference(target, args.drafter, questions, width, length, args.max_new_tokens,
                             model_and_tokenizer=model, categories=categories,
                             context_candidates=count, lookup=tuple(args.lookup),
                             candidate_tokens=tokens)
        cell.pop("response_tokens_in_draft_vocab", None)
        cells.append(cell)
        print(f"W={width} L={length} C={count} K={tokens}: tokens/step {cell['tokens_per_step']:.3f}, "
              f"a candidate alone held the accepted path in {cell['candidate_won']:.1%} of steps "
              f"({time.time() - start:.0f} s)", flush=True)
    result = {"drafter": str(args.drafter), "machine": machine(), "sets": sets,
              "prompts_per_set": args.num_prompts, "max_new_tokens": args.max_new_tokens,
              "lookup_min": args.lookup[0], "lookup_max": args.lookup[1], "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, result)
    print(f"\ntokens per target forward (reference loop, greedy, {args.num_prompts} prompts per "
          f"set, {args.max_new_tokens} tokens; arm W x L x C x K)")
    print(f"{'set':<15}" + "".join(f"{f'{w}x{l}x{c}x{k}':>11}" for w, l, c, k in args.arms))
    for name in sets:
        print(f"{name:<15}" + "".join(
            f"{c['tokens_per_step_by_category'][name]:>11.2f}" for c in cells))
    print(f"{'all':<15}" + "".join(f"{c['tokens_per_step']:>11.2f}" for c in cells))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
