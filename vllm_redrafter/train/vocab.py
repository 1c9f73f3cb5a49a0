"""The reduced draft vocabulary: the K target tokens the drafter's head scores.

The drafter's LM head (exit_dim x V) dominates its cost (docs/costs.md, CPU: the drafter's LM
head), and most of the target's V tokens are never drafted. The head therefore scores only the K
most frequent tokens, counted on the TRAINING split (never the held-out split, never evaluation
data):

    count(token) = count in the labels (the tokens the drafter must draft)
                 + text_weight * count in the training sequences (prompts and responses)

The labels alone are a narrow distribution (a few thousand distinct tokens for ~50k positions,
docs/costs.md, CPU: a first drafter); the text term widens K's coverage towards what a user's
prompts bring in. The target's EOS id is always included (drafting the end of an answer is
common). Ties break towards the smaller id so the choice is deterministic. The ids are returned
sorted ascending; the drafter stores them as ``draft_vocab_ids`` (its checkpoint extension).
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_frequencies(labels: Tensor, text_counts: Tensor | None = None,
                      text_weight: float = 0.1) -> Tensor:
    """Counts [V] float: label tokens ([N, T] target ids, -1 = none) + weighted text counts [V]."""
    if text_counts is None:
        raise ValueError("text_counts [V] is required to know the vocabulary size")
    vocab_size = text_counts.numel()
    valid = labels[labels >= 0]
    counts = torch.bincount(valid, minlength=vocab_size).double()  # [V]
    return counts + text_weight * text_counts.double()


def select_draft_vocab(frequencies: Tensor, k: int, always: list[int] | None = None) -> Tensor:
    """The ``k`` most frequent token ids (ascending), ``always`` included.

    >>> select_draft_vocab(torch.tensor([5., 0., 9., 5., 1.]), 3)
    tensor([0, 2, 3])
    >>> select_draft_vocab(torch.tensor([5., 0., 9., 5., 1.]), 3, always=[1])
    tensor([0, 1, 2])
    """
    vocab_size = frequencies.numel()
    if not 0 < k <= vocab_size:
        raise ValueError(f"draft vocabulary size K={k} must be in [1, vocab_size={vocab_size}]")
    score = frequencies.double().clone()
    if always:
        score[torch.tensor(always)] = float("inf")
    # stable sort on -score: among equal counts the smaller id comes first
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:k]).values


def coverage(draft_ids: Tensor, tokens: Tensor) -> float:
    """Share of ``tokens`` (target ids, -1 ignored) that lie inside the draft vocabulary."""
    tokens = tokens[tokens >= 0]
    if tokens.numel() == 0:
        return float("nan")
    return float(torch.isin(tokens, draft_ids).double().mean())


def target_to_draft_map(draft_ids: Tensor, vocab_size: int, missing: int = -100) -> Tensor:
    """[V] long: the draft id of each target id, ``missing`` for ids outside the draft vocabulary.

    >>> target_to_draft_map(torch.tensor([1, 4]), 5)
    tensor([-100,    0, -100, -100,    1])
    """
    table = torch.full((vocab_size,), missing, dtype=torch.long)
    table[draft_ids] = torch.arange(draft_ids.numel())
    return table


def swap_draft_vocab(draft_ids: Tensor, frequencies: Tensor, m: int,
                     always: list[int] | None = None) -> Tensor:
    """A trained head's K ids with its ``m`` least frequent tokens swapped for the ``m`` most
    frequent tokens outside it (ascending; ``always`` stays in; ties towards the smaller id).

    >>> swap_draft_vocab(torch.tensor([0, 1, 2]), torch.tensor([5., 0., 9., 7., 1.]), 1)
    tensor([0, 2, 3])
    """
    if not 0 <= m <= draft_ids.numel():
        raise ValueError(f"draft_vocab_swap m={m} must be in [0, K={draft_ids.numel()}]")
    keep_score = frequencies.double().clone()
    if always:
        keep_score[torch.tensor(always)] = float("inf")
    kept = draft_ids[torch.sort(-keep_score[draft_ids], stable=True).indices][: draft_ids.numel() - m]
    outside = torch.ones(frequencies.numel(), dtype=torch.bool)
    outside[draft_ids] = False
    candidates = torch.nonzero(outside).squeeze(1)
    added = candidates[torch.sort(-frequencies.double()[candidates], stable=True).indices][:m]
    return torch.sort(torch.cat([kept, added])).values


def carry_head_rows(old_ids: Tensor, old_rows: Tensor, new_ids: Tensor, fresh_rows: Tensor) -> Tensor:
    """[K', E] head rows for ``new_ids``: a token the old head scored keeps its row
    (``old_rows`` [K, E], in ``old_ids`` order); any other takes its row of ``fresh_rows``
    ([K', E], in ``new_ids`` order)."""
    position = {int(t): i for i, t in enumerate(old_ids.tolist())}
    rows = fresh_rows.clone()
    for i, token in enumerate(new_ids.tolist()):
        if token in position:
            rows[i] = old_rows[position[token]]
    return rows
