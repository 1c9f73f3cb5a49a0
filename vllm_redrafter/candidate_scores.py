"""Context candidates scored in the shadow: per request, how many drafts beyond the drafter's its
first k candidates would have accepted (:class:`CandidateStats`), whether they were verified or
not; the beam policy takes the k whose measured gain pays for their tree nodes.

Nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class Proposal:
    """Candidates a request was offered at one call, waiting to be scored."""

    call: int  # the policy call that offered them
    position: int  # the request's output length then: its output from here decides them
    candidates: Sequence[Sequence[int]]
    drafter_accepted: int | None = None  # what the drafter's beams accepted in that step, once known


class CandidateStats:
    """One request's context candidates, scored in the shadow.

    The target's output does not depend on the drafts (greedy: the same tokens; exact sampling:
    the same distribution), so each step's candidates are scored against the tokens the request
    then emits, verified or not: the first k candidates would have accepted ``m_k`` drafts, m_k
    their longest common prefix with the output, of which ``max(0, m_k - a)`` beyond the ``a``
    the drafter's beams accepted that step. Decayed means per k.

    A proposal whose candidate still matches all the output emitted since is undecided (it may
    go on matching) and counts at what it matched so far, a lower bound: a candidate that copies
    right is decided last, and leaving it out would rate a request by its misses. A request's
    mean leans on ``pool`` (all requests' scores) with ``prior`` scores' worth, so its first
    steps are rated like the requests before it.
    """

    def __init__(self, count: int, decay: float, pool: CandidateScores | None = None,
                 prior: float = 0.0) -> None:
        self.count, self.pool, self.prior = count, pool, prior
        self.scores = CandidateScores(decay)  # the decided proposals
        self.pending: list[Proposal] = []
        self.provisional = [0.0] * count  # k - 1 -> the undecided proposals' extra so far

    def observe(self, call: int, output: Sequence[int], drafter_accepted: int) -> None:
        """The step proposed at call ``call - 1`` ended with ``drafter_accepted``; score what
        the output decides, and the rest so far."""
        for p in self.pending:
            if p.drafter_accepted is None and p.call == call - 1:
                p.drafter_accepted = drafter_accepted
        self.pending = [p for p in self.pending if p.drafter_accepted is not None]  # else missed
        self.provisional = [0.0] * self.count
        undecided = []
        for p in self.pending:
            matched, decided = _matched(output[p.position:], p.candidates)
            extra = _extra(matched, p.drafter_accepted, self.count)
            if decided:
                for scores in (self.scores, self.pool):
                    if scores is not None:
                        scores.add(extra)
            else:
                undecided.append(p)
                self.provisional = [x + e for x, e in zip(self.provisional, extra)]
        self.pending = undecided

    def propose(self, call: int, position: int, candidates: Sequence[Sequence[int]]) -> None:
        if candidates and self.count:
            self.pending.append(Proposal(call, position, candidates))

    def expected_extra(self, k: int) -> float | None:
        """Extra accepted drafts per step with the first k candidates; None: none scored."""
        if k < 1 or not self.count:
            return None
        i = min(k, self.count) - 1
        pooled = self.pool.mean(i) if self.pool is not None else None
        prior = self.prior if pooled is not None else 0.0
        undecided = sum(p.drafter_accepted is not None for p in self.pending)
        weight = self.scores.weight + undecided + prior
        if weight <= 0:
            return None
        return (self.scores.total(i) + self.provisional[i] + prior * (pooled or 0.0)) / weight


class CandidateScores:
    """Decided candidate scores, decayed per score: per k, the sum of extra accepted drafts with
    the first k candidates, and their weight. One per request, and the policy's pool of all
    requests' (a new request's prior)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.extra: list[float] = []  # k - 1 -> decayed sum of extra accepted drafts with k
        self.weight = 0.0

    def add(self, extra: Sequence[float]) -> None:
        if len(extra) > len(self.extra):  # a request that may take more: its k's start level
            self.extra += [self.extra[-1] if self.extra else 0.0] * (len(extra) - len(self.extra))
        self.weight = self.decay * self.weight + 1
        self.extra = [self.decay * x + e for x, e in zip(self.extra, extra)]

    def total(self, i: int) -> float:
        """The decayed sum with the first i + 1 candidates (the most scored, if fewer)."""
        return self.extra[min(i, len(self.extra) - 1)] if self.extra else 0.0

    def mean(self, i: int) -> float | None:
        return self.total(i) / self.weight if self.weight > 0 and self.extra else None


def _matched(known: Sequence[int], candidates: Sequence[Sequence[int]]) -> tuple[list[int], bool]:
    """Each candidate's common prefix with ``known``, and whether all are decided (none still
    matches the whole of ``known`` with tokens to go)."""
    matched, decided = [], True
    for c in candidates:
        m = next((i for i, (x, y) in enumerate(zip(c, known)) if x != y), min(len(c), len(known)))
        decided = decided and not m == len(known) < len(c)
        matched.append(m)
    return matched, decided


def _extra(matched: Sequence[int], accepted: int, count: int) -> list[float]:
    """Per k = 1..count: drafts the best of the first k candidates accepts beyond ``accepted``."""
    out, best = [], 0
    for k in range(count):
        best = max(best, matched[k]) if k < len(matched) else best
        out.append(float(max(0, best - accepted)))
    return out


def trie_nodes(candidates: Sequence[Sequence[int]]) -> int:
    """Tree nodes below the root the candidates make: their distinct prefixes.

    >>> trie_nodes([(1, 2, 3), (1, 2, 4), (5,)])
    5
    """
    return len({tuple(c[: d]) for c in candidates for d in range(1, len(c) + 1)})
