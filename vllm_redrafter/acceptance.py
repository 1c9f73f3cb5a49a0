"""How often the drafter's beams are accepted, per beam width and depth, counted on verified trees
(:class:`AcceptanceStats`); the beam policy's estimate of tokens per step for each shape.

Nothing here imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm_redrafter.beam_policy import VerifiedTree


class AcceptanceStats:
    """Decayed counts, per beam width W and depth d, of trees and of those whose first W beams
    accepted ``>= d``; and the packed tree sizes per shape.

    A width's rate at depth d is a **chain of conditional rates**: P(accepted >= 1) times, per
    deeper depth j, P(accepted >= j | accepted >= j - 1), each counted on the trees that could
    show it. A depth with few such trees leans on the depth above (``depth_prior`` trees' worth
    of it): one unlucky tree of a longer shape (nothing accepted at depth 1) says nothing of its
    depth 2 and no longer rates depth 2 at 0; a depth never drafted is rated as the one above.

    A tree of width D counts at every width w <= D it knows (``VerifiedTree.by_beams``): what its
    first w beams accepted on the same text. So the narrowest width's rate is always fresh, and a
    wider width W is rated by **paired gains**: that fresh rate plus what W beams accepted beyond
    the first one, per tree, on the trees at least W wide (counts that fade alike, so the gain
    keeps its value while W is not drafted; texts change the rates far more than the gain of a
    wider tree). A gain starts from ``gain_prior`` trees' worth of no gain, fading with its
    counts: a wider width is rated above its first beam only as its trees show it, not on the
    luck of the first one or two. All counts fade with every step. Estimates are monotone: a
    wider beam never accepts less (rates pooled where they disagree, weighted by their counts),
    more depth never more. When exploring, a width little seen is rated up by an upper
    confidence bound, so it is tried again.
    """

    def __init__(self, widths: Sequence[int], decay: float = 0.99, ucb: float = 0.1,
                 depth_prior: float = 1.0, gain_prior: float = 0.0) -> None:
        self.widths, self.decay, self.ucb = list(widths), decay, ucb
        self.depth_prior, self.gain_prior = depth_prior, gain_prior
        self.anchor = self.widths[0]  # the narrowest width: every tree that knows it counts there
        self.hits: dict[tuple[int, int], float] = {}  # (W, d) -> trees whose W beams took >= d
        self.trials: dict[tuple[int, int], float] = {}  # (W, d) -> trees of width >= W, length > d
        self.reach: dict[tuple[int, int], float] = {}  # (W, d) -> those trials that took >= d - 1
        self.paired: dict[tuple[int, int], list[float]] = {}  # (W, d) -> [hits of W, hits of
        # the anchor, trees] on the trees that know both, trees starting at gain_prior
        self.packed_sum: dict[tuple[int, int], float] = {}  # (W, L) -> their nodes
        self.packed_n: dict[tuple[int, int], float] = {}  # (W, L) -> trees
        self.total = 0.0
        self._rates: dict[int, dict[int, float]] = {}  # depth -> width -> rate(), until new trees

    def seed(self, chain: Sequence[float], weight: float) -> None:
        """A prior: ``weight`` chains (the anchor width) whose P(accepted >= d) is ``chain[d - 1]``
        (the drafter's own held-out figure); it fades with the counts, as trees are seen."""
        if self.anchor != 1 or weight <= 0:
            return
        for d, (above, p) in enumerate(zip([1.0, *chain], chain), start=1):
            self.trials[(1, d)] = self.trials.get((1, d), 0.0) + weight
            self.hits[(1, d)] = self.hits.get((1, d), 0.0) + weight * p
            self.reach[(1, d)] = self.reach.get((1, d), 0.0) + weight * above
        self._rates = {}

    def observe(self, trees: Sequence[VerifiedTree]) -> None:
        """One step's trees of this kind (maybe none): the counts fade once, then count them."""
        for counts in (self.hits, self.trials, self.reach, self.packed_sum, self.packed_n):
            for key in counts:
                counts[key] *= self.decay
        for pair in self.paired.values():
            pair[:] = [x * self.decay for x in pair]
        self.total = self.total * self.decay + len(trees)
        for t in trees:
            known = self._known(t)
            for w, accepted in known.items():
                for d in range(1, t.length):
                    self.trials[(w, d)] = self.trials.get((w, d), 0.0) + 1
                    self.hits[(w, d)] = self.hits.get((w, d), 0.0) + (accepted >= d)
                    self.reach[(w, d)] = self.reach.get((w, d), 0.0) + (accepted >= d - 1)
                    if w != self.anchor and self.anchor in known:
                        pair = self.paired.setdefault((w, d), [0.0, 0.0, self.gain_prior])
                        pair[0] += accepted >= d
                        pair[1] += known[self.anchor] >= d
                        pair[2] += 1
            shape = (t.width, t.length)
            self.packed_sum[shape] = self.packed_sum.get(shape, 0.0) + t.packed
            self.packed_n[shape] = self.packed_n.get(shape, 0.0) + 1
        self._rates = {}

    def _known(self, t: VerifiedTree) -> dict[int, int]:
        """Width -> drafts accepted, for the widths this tree tells of: its own, and each
        narrower one of ``widths`` its ``by_beams`` covers."""
        told = min(t.width - 1, len(t.by_beams))
        return {**{w: t.by_beams[w - 1] for w in self.widths if w <= told}, t.width: t.accepted}

    def _chained(self, width: int, depth: int) -> float:
        """P(accepted >= depth | width) from this width's own counts, as the chain of
        conditional rates (class doc); the width must have been seen at depth 1."""
        rate = conditional = self.hits.get((width, 1), 0.0) / self.trials[(width, 1)]
        for d in range(2, depth + 1):
            conditional = ((self.hits.get((width, d), 0.0) + self.depth_prior * conditional)
                           / (self.reach.get((width, d), 0.0) + self.depth_prior))
            rate *= conditional
        return rate

    def _paired_rate(self, width: int, depth: int) -> float:
        """P(accepted >= depth | width) before pooling: the anchor's fresh rate plus the paired
        gain (what W beams accepted beyond the first one, per tree, on the same trees); a width
        without paired trees, or the anchor itself: its own counts."""
        own = self._chained(width, depth)
        pair = self.paired.get((width, depth))
        if (width == self.anchor or pair is None or not pair[2]
                or not self.trials.get((self.anchor, 1))):
            return own
        return min(1.0, self._chained(self.anchor, depth) + (pair[0] - pair[1]) / pair[2])

    def rate(self, width: int, depth: int) -> float:
        """P(accepted >= depth | width), monotone in width; a width never seen: the nearest
        narrower one seen (it accepts at least that), else the nearest wider, else 0.5."""
        if depth not in self._rates:
            seen = [w for w in self.widths if self.trials.get((w, 1), 0.0) > 0]
            means = [self._paired_rate(w, depth) for w in seen]
            weights = [max(self.trials.get((w, depth), 0.0), 1e-9) for w in seen]
            self._rates[depth] = dict(zip(seen, monotone(means, weights)))
        rates = self._rates[depth]
        if width in rates:
            return rates[width]
        narrower = [w for w in rates if w < width]
        wider = [w for w in rates if w > width]
        return rates[max(narrower)] if narrower else rates[min(wider)] if wider else 0.5

    def tokens_per_step(self, width: int, length: int, hopeful: bool = False) -> float:
        """1 + expected accepted drafts at (width, length); ``hopeful``: each depth's rate
        raised by its upper confidence bound (what exploring goes by)."""
        expected, p = 1.0, 1.0
        for d in range(1, length):
            n = self.trials.get((width, d), 0.0)
            bonus = self.ucb * math.sqrt(math.log(self.total + 2.0) / (n + 1)) if hopeful else 0.0
            p = min(p, self.rate(width, d) + bonus)
            expected += p
        return expected

    def packed(self, width: int, length: int) -> float:
        """Mean packed nodes (root included). A shape not seen yet: the nodes per beam token of
        the next narrower width at this length, else of this width a step shorter, else none
        shared."""
        def mean(w: int, l: int) -> float | None:
            n = self.packed_n.get((w, l), 0.0)
            return self.packed_sum[(w, l)] / n if n else None

        narrower = max((w for w in self.widths if w < width), default=None)
        if (seen := mean(width, length)) is not None:
            return seen
        if narrower is not None and (seen := mean(narrower, length)) is not None:
            return 1.0 + (seen - 1.0) * width / narrower
        if (seen := mean(width, length - 1)) is not None:
            return 1.0 + (seen - 1.0) * (length - 1) / max(1, length - 2)
        return 1.0 + width * (length - 1)


def candidate_widths(max_width: int) -> list[int]:
    """1, 2, 4, ... up to ``max_width`` (itself included)."""
    widths = [1]
    while widths[-1] * 2 < max_width:
        widths.append(widths[-1] * 2)
    return sorted({*widths, max_width})


def monotone(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The closest non-decreasing sequence in weighted least squares (pool adjacent violators).

    >>> [round(v, 3) for v in monotone([0.068, 0.067, 0.048, 0.101, 0.085, 0.140])]
    [0.061, 0.061, 0.061, 0.093, 0.093, 0.14]
    >>> monotone([0.8, 0.2], [1, 4])
    [0.32, 0.32]
    """
    blocks: list[list[float]] = []  # [weighted sum, weight, count] of pooled runs
    for v, w in zip(values, weights or [1.0] * len(values)):
        blocks.append([v * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, weight, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += weight
            blocks[-1][2] += count
    return [total / weight for total, weight, count in blocks for _ in range(int(count))]
