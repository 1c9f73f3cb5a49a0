"""Context candidates: continuations copied from the request's own context (prompt lookup).

The drafter sees the context only through the target's last hidden state, so it misses text the
answer copies (summaries, extraction, answers over a document, code edits). Prompt lookup finds
it: the last tokens of the context (prompt + generated so far, g0 last) are matched against the
same context, and the tokens that followed a match are proposed as what comes next. These
candidates join the request's tree as extra beams (:func:`merge_candidates`); the tree's dedup
merges them with the drafter's beams, and verification stays exact (docs/context_candidates.md).

Matching follows vLLM 0.32's n-gram proposer (``vllm/v1/spec_decode/ngram_proposer.py``):

- an n-gram is the context's last n tokens, ``min_n <= n <= max_n``; a match is an earlier
  occurrence of it that is followed by at least one token (the suffix itself is no match, an
  occurrence overlapping it is);
- a match's length is capped at ``max_n``; the longest match wins, and among equally long ones
  the earliest in the context (vLLM's choice);
- the candidate is the tokens after the match, at most ``length`` of them: fewer where the
  context ends first (vLLM returns such a short draft as well).

vLLM proposes the single best match; :func:`find_candidates` returns up to ``count`` candidates
in that order (longer matches first, then earlier), skipping a continuation equal to, or a
prefix of, one already chosen: it would add no node to the tree.

Nothing here imports vLLM; numpy only, one pass over the context per n-gram length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = ["PAD", "ContextIndex", "find_candidates", "merge_candidates"]

PAD = -1
"""A beam position without a token: :func:`vllm_redrafter.tree.build_tree` packs nothing there."""


def find_candidates(context: np.ndarray | Sequence[int], count: int, length: int,
                    min_n: int = 2, max_n: int = 5) -> list[tuple[int, ...]]:
    """Up to ``count`` continuations of ``context`` (1-D token ids, g0 last) of 1..``length``
    tokens each, best first (module docstring). None if no n-gram of ``min_n`` tokens recurs.

    >>> find_candidates([7, 1, 2, 3, 9, 1, 2, 8, 5, 1, 2], count=2, length=3)
    [(3, 9, 1), (8, 5, 1)]
    >>> find_candidates([4, 4, 4], count=1, length=3, min_n=1)  # overlapping the suffix
    [(4,)]
    """
    if count < 0 or length < 0 or not 1 <= min_n <= max_n:
        raise ValueError(f"find_candidates needs count >= 0, length >= 0 and 1 <= min_n <= max_n, "
                         f"got count={count}, length={length}, min_n={min_n}, max_n={max_n}")
    ctx = np.asarray(context)
    n = ctx.shape[0]
    if count == 0 or length == 0 or n <= min_n:
        return []
    # ends[i]: a match ending at position ends[i] (<= n - 2: a token must follow it)
    ends = np.flatnonzero(ctx[: n - 1] == ctx[n - 1])
    matched = np.ones(ends.shape[0], dtype=np.int64)  # matched length, capped at max_n
    alive = np.ones(ends.shape[0], dtype=bool)
    for k in range(1, max_n):
        if k >= n - 1:
            break
        back = ends - k
        ok = alive & (back >= 0)
        ok[ok] = ctx[back[ok]] == ctx[n - 1 - k]
        matched += ok
        alive = ok
    keep = matched >= min_n
    ends, matched = ends[keep], matched[keep]
    order = np.lexsort((ends, -matched))  # longest first, then earliest
    chosen: list[tuple[int, ...]] = []
    for end in ends[order].tolist():
        cont = tuple(ctx[end + 1: end + 1 + length].tolist())
        if any(c[: len(cont)] == cont for c in chosen):
            continue  # adds no node: already in the tree
        chosen = [c for c in chosen if cont[: len(c)] != c]  # a shorter one it extends
        chosen.append(cont)
        if len(chosen) == count:
            break
    return chosen


class ContextIndex:
    """One request's context (prompt + output) as a growing numpy buffer: each step appends
    the new output tokens instead of copying the whole context again."""

    def __init__(self, prompt: Sequence[int]) -> None:
        self._buf = np.empty(max(64, 2 * len(prompt)), dtype=np.int64)
        self._buf[: len(prompt)] = prompt
        self._prompt = len(prompt)
        self._n = len(prompt)

    def update(self, output: Sequence[int]) -> np.ndarray:
        """The context with ``output`` (the request's whole output so far) after the prompt."""
        seen = self._n - self._prompt
        if len(output) < seen:  # output shrank (it never should): start over
            self._n, seen = self._prompt, 0
        new = output[seen:]
        need = self._n + len(new)
        if need > self._buf.shape[0]:
            grown = np.empty(2 * need, dtype=np.int64)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n: need] = new
        self._n = need
        return self._buf[: self._n]


def merge_candidates(beams: Tensor | None, widths: Sequence[int], lengths: Sequence[int],
                     g0: Sequence[int], candidates: Sequence[Sequence[Sequence[int]]]
                     ) -> tuple[Tensor, list[int]]:
    """Each request's drafter beams followed by its candidates as one [B, R, L] beam tensor
    (CPU), and its row count R_b = W_b + C_b.

    ``beams`` [B, >= W_b, >= L_b] are the drafter's (None: no request drafts; ``widths[b]`` 0:
    request b takes no drafter beams), ``lengths[b]`` their L_b. Candidate rows are g0 and the
    candidate. L is the longest row; positions past a row's end, and rows past R_b (their g0
    aside), hold :data:`PAD`, which the tree packs nothing for, so every row keeps its own length.

    >>> merge_candidates(torch.tensor([[[5, 1, 2]]]), [1], [3], [5], [[(1, 7, 8), (4,)]])
    (tensor([[[ 5,  1,  2, -1],
             [ 5,  1,  7,  8],
             [ 5,  4, -1, -1]]]), [3])
    """
    batch = len(widths)
    rows = [widths[b] + len(candidates[b]) for b in range(batch)]
    length = max([lengths[b] if widths[b] else 1 for b in range(batch)]
                 + [1 + len(c) for cs in candidates for c in cs])
    out = torch.full((batch, max(1, max(rows, default=1)), length), PAD, dtype=torch.long)
    out[:, :, 0] = torch.tensor(list(g0), dtype=torch.long)[:, None]
    host = beams.cpu() if beams is not None else None
    for b in range(batch):
        w, l_b = widths[b], lengths[b]
        if w:
            out[b, :w, :l_b] = host[b, :w, :l_b]
        for i, cand in enumerate(candidates[b]):
            if cand:
                out[b, w + i, 1: 1 + len(cand)] = torch.tensor(list(cand), dtype=torch.long)
    return out, rows
