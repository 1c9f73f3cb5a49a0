"""Which K target tokens the draft head should score, judged per kind of work on held-out splits.

    python benchmarks/draft_vocab_by_kind.py --data DIR [DIR ...] [--drafter DIR] [--swaps 0,256,...]
        [--out benchmarks/results/draft_vocab_by_kind.json]

Each DIR is one built distillation part (``vllm-redrafter train`` writes them under
OUTPUT/work/data/partN) of written stocks, so every answer's kind is known. Counts come from the
parts' training split only, as ``train.vocab`` counts them (labels + 0.1 x text); coverage is the
share of the target's next tokens (first label) on each part's HELD-OUT split that lie inside the
head, per kind. Arms: the drafter's K (default: the shipped one), the same K chosen from scratch
on these parts, and swaps of m tokens (``train.vocab.swap_draft_vocab``: the m tokens of the
drafter's K these parts count least out, the m most counted ones outside it in; what a recipe's
``draft_vocab_swap`` does). Nothing here reads an evaluation set or MT-Bench.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from vllm_redrafter.demo import DEFAULT_DRAFTER
from vllm_redrafter.results import portable
from vllm_redrafter.target import prepare_target
from vllm_redrafter.train.vocab import select_draft_vocab, swap_draft_vocab, token_frequencies
from vllm_redrafter.train.written_prompts import STOCK_FILES, source_name, written_stock

REPO = Path(__file__).resolve().parents[1]


def part_kinds(part: Path, tokenizer) -> list[str]:
    """The written-stock kind of each sequence of a part (matched on the prompt's text)."""
    spec = json.loads((part / "meta.json").read_text())["spec"]["builtin"]
    stocks = [n for n in STOCK_FILES if spec.get(source_name(n), 0)]
    keys = {" ".join(prompt.split())[:80]: kind for n in stocks for kind, prompt in written_stock(n)}
    kinds = []
    for line in (part / "sequences.jsonl").read_text().splitlines():
        text = " ".join(tokenizer.decode(json.loads(line)).split())
        found = [kind for key, kind in keys.items() if key in text]
        kinds.append(found[0] if found else "unknown")
    return kinds


def load_part(part: Path, tokenizer) -> dict:
    arrays = torch.load(part / "arrays.pt")
    kinds = part_kinds(part, tokenizer)
    names = sorted(set(kinds))
    kind_of_sequence = torch.tensor([names.index(k) for k in kinds])
    return {"labels": arrays["labels"], "heldout": arrays["heldout"], "counts": arrays["token_counts"],
            "kind": kind_of_sequence[arrays["sequence"]], "names": names}


def counts_by_kind(draft_ids: torch.Tensor, parts: list[dict]) -> dict[str, tuple[int, int]]:
    """Per kind: (held-out next tokens inside the head, held-out next tokens)."""
    hit, total = defaultdict(int), defaultdict(int)
    for p in parts:
        held = p["heldout"] & (p["labels"][:, 0] >= 0)
        inside = torch.isin(p["labels"][held, 0], draft_ids)
        for k, name in enumerate(p["names"]):
            of_kind = p["kind"][held] == k
            hit[name] += int(inside[of_kind].sum())
            total[name] += int(of_kind.sum())
    return {name: (hit[name], total[name]) for name in sorted(total) if total[name]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, nargs="+", required=True)
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--swaps", default="0,128,256,512,1024,2048")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/draft_vocab_by_kind.json")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(prepare_target())
    parts = [load_part(p, tokenizer) for p in args.data]
    old = load_file(args.drafter / "model.safetensors")["draft_vocab_ids"].long()
    labels = torch.cat([p["labels"][~p["heldout"]] for p in parts])
    freq = token_frequencies(labels, sum(p["counts"] for p in parts), 0.1)
    always = [tokenizer.eos_token_id]
    arms = {f"swap_{m}": swap_draft_vocab(old, freq, int(m), always) for m in args.swaps.split(",")}
    arms["scratch"] = select_draft_vocab(freq, old.numel(), always)
    result = {"drafter": portable(args.drafter), "K": old.numel(),
              "parts": [portable(p) for p in args.data],
              "heldout_tokens_by_kind": {k: t for k, (_, t) in counts_by_kind(old, parts).items()},
              "arms": {}}
    for name, ids in arms.items():
        by_kind = {k: round(h / t, 4) for k, (h, t) in counts_by_kind(ids, parts).items()
                   if k != "unknown"}
        result["arms"][name] = {"mean_over_kinds": round(sum(by_kind.values()) / len(by_kind), 4),
                                "min_over_kinds": min(by_kind.values()), "by_kind": by_kind,
                                "tokens_changed": int((~torch.isin(ids, old)).sum())}
        print(f"{name:10s} mean {result['arms'][name]['mean_over_kinds']:.4f} "
              f"min {result['arms'][name]['min_over_kinds']:.4f}  "
              + " ".join(f"{k} {v:.3f}" for k, v in by_kind.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
