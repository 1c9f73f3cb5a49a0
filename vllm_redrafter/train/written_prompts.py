"""Written requests: a stock of user requests written one by one, not drawn from templates.

Why: the drafter's acceptance on prompts like its training prompts is far above its acceptance on
new ones. The shipped 1.95 drafter reaches 2.76 tokens per step (reference loop, W=4 L=4, 64
tokens) on 40 held-out prompts of its template-made dataset 4, against 1.95 on MT-Bench: it has
learned the templates' answers, and every template stock added less than the one before. Each
request here is its own: 1,358 of them, about 170 in each of MT-Bench's eight kinds of task,
varied in length (a line to a paragraph with context, documents and code included), wording and
subject; written for this package on 2026-11-27. None repeats an MT-Bench question (no six-word
window in common, ``tests/test_train.py``; the two closest in form, a triangle's area from its
vertices and a two-dice total, were taken out). Stored in ``written_prompts.jsonl`` beside this
module, one ``{"kind": ..., "prompt": ...}`` per line. A dataset's fingerprint names how many
requests it takes, not their text: keep the stock as it is, and add new requests as a new source.
"""

from __future__ import annotations

import json
import random
from functools import cache
from pathlib import Path

WRITTEN_FILE = Path(__file__).with_name("written_prompts.jsonl")


@cache
def written_stock() -> tuple[tuple[str, str], ...]:
    """(kind, prompt) of every written request, in the file's order."""
    rows = [json.loads(line) for line in WRITTEN_FILE.read_text().splitlines() if line.strip()]
    return tuple((row["kind"], row["prompt"]) for row in rows)


def written_prompts(n: int, seed: int) -> list[str]:
    """``n`` of the written requests, the kinds in turn, each kind's order shuffled by ``seed``."""
    stock = written_stock()
    if n > len(stock):
        raise ValueError(f"written={n}: the stock holds {len(stock)} written requests")
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = {}
    for kind, prompt in stock:
        by_kind.setdefault(kind, []).append(prompt)
    for prompts in by_kind.values():
        rng.shuffle(prompts)
    in_turn = [p for group in _zip_longest(list(by_kind.values())) for p in group]
    return in_turn[:n]


def _zip_longest(lists: list[list[str]]) -> list[list[str]]:
    """Round i holds the i-th element of each list that has one."""
    return [[items[i] for items in lists if i < len(items)]
            for i in range(max((len(items) for items in lists), default=0))]
