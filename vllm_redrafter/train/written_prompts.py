"""Written requests: a stock of user requests written one by one, not drawn from templates.

Why: the drafter's acceptance on prompts like its training prompts is far above its acceptance on
new ones. The 1.95 drafter reached 2.76 tokens per step (reference loop, W=4 L=4, 64 tokens) on
40 held-out prompts of its template-made dataset 4, against 1.95 on MT-Bench: it had learned the
templates' answers, and every template stock added less than the one before. Each request here is
its own: 1,358 of them, about 170 in each of MT-Bench's eight kinds of task, varied in length (a
line to a paragraph with context, documents and code included), wording and subject; written for
this package on 2026-11-27. None repeats an MT-Bench question: no six-word window in common,
case and spacing aside, but for the phrase "take on the role of a" (``tests/test_train.py``);
the two closest in form, a triangle's area from its vertices and a two-dice total, were taken
out. Stored in ``written_prompts.jsonl`` beside this module, one ``{"kind": ..., "prompt": ...}``
per line. A second stock of 680 more (85 per kind, chosen not to ask what the first asks),
``written_prompts_2.jsonl``, is the source ``written_2`` (in the eighth session's stage it gave
MT-Bench 1.971 against 1.970). Two larger ones, 2,397 and 2,396 (2,400 written for each, 300 per
kind, by sixteen helper sessions, each given the stocks before it to ask other things; the same
MT-Bench check, and a request dropped when its word set overlaps an earlier one's by more than
60%: 7 of 4,800), are ``written_3`` and ``written_4``; with all four in the shipped recipe's stage
MT-Bench rose to 1.998. A fifth, 2,557 (2,560 written the same way: 400 of each of the four kinds
the 1.998 drafter did worst on, extraction, stem, humanities and writing, 240 of the others), is
``written_5`` (with it in the stage too, MT-Bench 2.012); a sixth, 2,538 of 2,560 written the same
way, ``written_6``, is not in a recipe yet. A dataset's fingerprint names how many requests it
takes, not their text: a stock stays as it is (a test pins each file's hash), and new requests go
in a new stock.
"""

from __future__ import annotations

import json
import random
from functools import cache
from itertools import chain, zip_longest
from pathlib import Path

STOCK_FILES = {n: Path(__file__).with_name("written_prompts.jsonl" if n == 1
                                            else f"written_prompts_{n}.jsonl") for n in range(1, 7)}


def source_name(stock: int) -> str:
    """The built-in dataset's source of a stock: ``written``, then ``written_2``, ..."""
    return "written" if stock == 1 else f"written_{stock}"


@cache
def written_stock(stock: int = 1) -> tuple[tuple[str, str], ...]:
    """(kind, prompt) of every written request of a stock, in the file's order."""
    if stock not in STOCK_FILES:
        raise ValueError(f"no written stock {stock}; stocks: {sorted(STOCK_FILES)}")
    lines = STOCK_FILES[stock].read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return tuple((row["kind"], row["prompt"]) for row in rows)


def written_prompts(n: int, seed: int, stock: int = 1) -> list[str]:
    """``n`` of a stock's requests, the kinds in turn, each kind's order shuffled by ``seed``."""
    if n == 0:
        return []
    requests = written_stock(stock)
    if not 0 < n <= len(requests):
        raise ValueError(f"{source_name(stock)}={n}: stock {stock} holds {len(requests)} "
                         "written requests")
    rng = random.Random(seed)
    by_kind: dict[str, list[str]] = {}
    for kind, prompt in requests:
        by_kind.setdefault(kind, []).append(prompt)
    for prompts in by_kind.values():
        rng.shuffle(prompts)
    in_turn = [p for p in chain.from_iterable(zip_longest(*by_kind.values())) if p is not None]
    return in_turn[:n]
