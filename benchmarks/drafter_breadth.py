"""A drafter's tokens/step on MT-Bench and on each of the project's evaluation sets of other kinds.

Reference loop (greedy, the target alone decides every token, transformers float32): tokens per
target forward (accepted + the bonus) of each drafter at each W x L, per set, with the share of
the target's response tokens inside the drafter's draft vocabulary (its K head) per set. Sets:
all 80 MT-Bench first turns and every prompt of the six evaluation sets
(``vllm_redrafter/eval_sets.py``). Evaluation only: nothing is trained or tuned on them.

    python benchmarks/drafter_breadth.py --drafters shipped=vllm_redrafter/default_drafter,new=DIR
        [--shapes 4x4,1x3] [--max-new-tokens 64] [--out benchmarks/results/drafter_breadth.json]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _reference import load_target, run_reference  # noqa: E402

from vllm_redrafter.demo import DEFAULT_DRAFTER, machine  # noqa: E402
from vllm_redrafter.eval_sets import EVAL_SETS, MT_BENCH, read_eval_set, read_questions  # noqa: E402
from vllm_redrafter.results import write_json  # noqa: E402
from vllm_redrafter.target import prepare_target  # noqa: E402


def named_paths(text: str) -> dict[str, Path]:
    """``"a=DIR,b=DIR"`` -> {name: path}."""
    pairs = [t.split("=", 1) for t in text.split(",") if t.strip()]
    if any(len(p) != 2 or not p[0] for p in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=DIR[,NAME=DIR...]")
    return {name: Path(path) for name, path in pairs}


def shapes(text: str) -> list[tuple[int, int]]:
    """``"4x4,1x3"`` -> [(W, L), ...]."""
    try:
        out = [tuple(int(x) for x in t.split("x")) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not WxL[,WxL...]") from None
    if any(len(s) != 2 or s[0] < 1 or s[1] < 2 for s in out):
        raise argparse.ArgumentTypeError(f"{text!r}: need W >= 1 and L >= 2")
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, cells = result["sets"], result["cells"]
    fig, axes = plt.subplots(1, len(result["shapes"]), figsize=(6 * len(result["shapes"]), 4),
                             squeeze=False)
    names = list(result["drafters"])
    for ax, (width, length) in zip(axes[0], result["shapes"]):
        for i, name in enumerate(names):
            cell = next(c for c in cells if c["drafter"] == name
                        and (c["beam_width"], c["beam_length"]) == (width, length))
            xs = [j + i / (len(names) + 1) for j in range(len(sets))]
            ax.bar(xs, [cell["tokens_per_step_by_category"][s] for s in sets],
                   width=1 / (len(names) + 1), label=name)
        ax.set_xticks([j + (len(names) - 1) / (2 * (len(names) + 1)) for j in range(len(sets))])
        ax.set_xticklabels(sets, rotation=30, ha="right")
        ax.set_ylabel("tokens per target forward")
        ax.set_title(f"W={width} L={length}, reference loop, greedy")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafters", type=named_paths,
                        default=named_paths(f"shipped={DEFAULT_DRAFTER}"))
    parser.add_argument("--target", type=Path, default=None)
    parser.add_argument("--shapes", type=shapes, default=shapes("4x4,1x3"))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "drafter_breadth.json")
    args = parser.parse_args()
    target = args.target or prepare_target()
    model = load_target(target)
    questions = [("mt_bench", q.first_turn) for q in read_questions(MT_BENCH)]
    questions += [(kind, q.first_turn) for kind in EVAL_SETS for q in read_eval_set(kind)]
    sets = ["mt_bench", *EVAL_SETS]
    cells: list[dict] = []
    result = {"drafters": {k: str(v) for k, v in args.drafters.items()}, "machine": machine(),
              "sets": sets, "prompts_per_set": {s: sum(1 for c, _ in questions if c == s)
                                                for s in sets},
              "max_new_tokens": args.max_new_tokens, "shapes": args.shapes, "cells": cells}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for name, drafter in args.drafters.items():
        for width, length in args.shapes:
            start = time.time()
            cell = run_reference(target, drafter, [q for _, q in questions], width, length,
                                 args.max_new_tokens, model_and_tokenizer=model,
                                 categories=[s for s, _ in questions])
            cells.append({"drafter": name, **cell})
            by_set = cell["tokens_per_step_by_category"]
            others = [by_set[s] for s in EVAL_SETS]
            print(f"{name} W={width} L={length}: " + ", ".join(
                f"{s} {by_set[s]:.2f}" for s in sets)
                + f"; other kinds mean {sum(others) / len(others):.3f} ({time.time() - start:.0f} s)",
                flush=True)
            write_json(args.out, result)  # after every cell: a run stopped early keeps its figures
    plot(result, args.out.with_suffix(".png"))
    print(f"\ntokens per target forward (reference loop, greedy, {args.max_new_tokens} tokens) / "
          "share of response tokens inside the K head")
    print(f"{'set':<15}" + "".join(f"{c['drafter'] + ' ' + str(c['beam_width']) + 'x' + str(c['beam_length']):>22}"
                                   for c in cells))
    for s in sets:
        print(f"{s:<15}" + "".join(
            f"{c['tokens_per_step_by_category'][s]:>14.3f} / {c['response_tokens_in_draft_vocab_by_category'][s]:.3f}"
            for c in cells))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
