"""Written requests: stocks of user requests written one by one, not drawn from templates.

Stock k is ``written_prompts.jsonl`` (k = 1) or ``written_prompts_{k}.jsonl`` (k = 2..9) beside
this module, one ``{"kind": ..., "prompt": ...}`` per line: stocks 1-6 in MT-Bench's eight
kinds of task, stock 7 in seven other kinds (translation, summarization, extraction, qa, math,
code, rag), stock 8 in six of them (all but math), stock 9 in the four the drafter accepts
least on (translation, summarization, qa, rag). It is the built-in dataset's source
``written`` (k = 1) or ``written_{k}``. ``written_prompts(n, seed, stock=k)`` takes ``n`` of
its requests, the kinds in turn, each kind's order shuffled by ``seed``.

Invariants (``tests/test_train.py``): no request shares a six-word window with an MT-Bench
question (case and spacing aside; one stock phrase excepted), and no two requests share more
than 60% of their word sets (one known pair excepted). A dataset's fingerprint names how many
requests it takes, not their text: a stock stays as it is (a test pins each file's hash), and
new requests go in a new stock.

Measurements and history (why written requests, how each stock was written): docs/training.md.
"""

from __future__ import annotations

import json
import random
from functools import cache
from itertools import chain, zip_longest
from pathlib import Path

STOCK_FILES = {n: Path(__file__).with_name("written_prompts.jsonl" if n == 1
                                            else f"written_prompts_{n}.jsonl") for n in range(1, 10)}


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
