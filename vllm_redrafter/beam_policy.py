"""The beam policy: per engine step, the beam shape (W, L) with the most tokens per second, or no
drafts; learnt from the engine's own timed steps, on any machine, with nothing to set up.

The proposer calls :meth:`BeamPolicy.step` once per step: what the step that just ended showed
goes in (:class:`StepObservation`), the shape for the step that starts comes out
(:class:`Choice`). Every tunable is a field of :class:`PolicyConfig`, with its reason.

Per batch-size bucket (1, 2, 3-4, 5-8, ...) a step costs ``alpha + beta * n`` seconds, n the
tokens it verifies (each drafting request's packed tree, each other request's one), fitted by
decayed least squares on timed decode steps, plain and drafted ones apart (a drafted step pays a
fixed part a plain one does not), plus the drafting, timed per shape. It emits
``B * tokens(W, L) + others`` tokens, ``tokens`` from the acceptance counted on verified trees
(greedy: seeded with the drafter's own held-out chain figures, a prior that fades).
A bucket starts plain (batch 1: with a one-token chain) and earns wider and longer shapes one
neighbour at a time, each measured before the next is allowed; it drafts the best shape earned
when that beats a plain step by ``min_gain``. The rules in order: :meth:`BeamPolicy._choose`;
in a page, with a figure: docs/beam_policy.md.

Context candidates (``context_candidates.py``) are chosen per request, apart from the shape: each
request's candidates are scored in the shadow against what it then emits (:class:`CandidateStats`),
whether verified or not, and a step takes the k candidates whose measured extra accepted tokens
beyond the drafter's pay for their tree nodes at the bucket's measured cost per verified token
(:meth:`BeamPolicy._candidates`; docs/context_candidates.md).

Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_redrafter.cpu_features import cpu_isa
from vllm_redrafter.sampling import SAMPLING_EPS

DEFAULT_MIN_GAIN = 1.05
"""How much more than a plain step's tokens/s a shape must promise to be drafted."""

KINDS = ("greedy", "sampled")
"""Requests whose acceptance is counted apart: greedy ones accept more than sampled ones."""

CHAIN = (1, 2)
"""The cheapest drafting shape (one drafted token): the only one tried before any is measured."""
PLAIN = (0, 0)
"""The "shape" of a step without drafts."""


@dataclass(frozen=True)
class PolicyConfig:
    """Every tunable of the policy. The docs' section "Settings" gives the measurements."""

    min_gain: float = DEFAULT_MIN_GAIN
    """Drafting must promise this x a plain step's tokens/s: the costs are measured with noise,
    and a shape that merely ties loses when the estimate errs."""
    explore_every: int = 32
    """One step in this many of a bucket explores: the shape hoped best among those hoped at
    ``explore_floor`` x the best choice or more (before any drafted step was timed there, the
    chain W=1 L=2; where no shape pays and none is near, the best drafted one). So a change of
    the machine or of the text is found out, at a cost of at most 1/32 of what that shape
    loses."""
    explore_floor: float = 0.8
    """A timed shape earns its neighbours (W, L+1) and (2W, L) when its expected tokens/s is at
    least this x a plain step's; an exploring step takes a shape hoped at least this x the best
    choice: shapes are tried only next to, and close to, what was measured."""
    plain_every: int = 32
    """While drafting pays, one step in this many of a bucket is plain: the cost fit needs plain
    steps to tell the fixed part (alpha) from the per-token part (beta)."""
    cost_decay: float = 0.95
    """Per timed step of a bucket, the weight kept by older steps in the cost fit: a change of
    the machine's speed is 90% reflected after 32 timed steps of that bucket (0.95^32 < 0.2)."""
    clip: float = 2.0
    """A timed step counts as at most this x (at least 1/this) the last timed step of its bucket
    and shape: a page fault or a collector pause is one step, not a new cost."""
    draft_decay: float = 0.9
    """Per drafted step of a bucket and shape, the weight its drafting time keeps: the drafter's
    time hardly varies, 10 steps are plenty."""
    acceptance_decay: float = 0.98
    """Per step, the weight kept by older steps' trees in the acceptance counts: a change of
    prompts is 80% reflected after 80 steps drafted at the shape (0.98^80 < 0.2)."""
    ucb: float = 0.1
    """Weight of the upper confidence bound on acceptance, by which exploring steps pick: a
    shape little seen is hoped above its counts, so it is tried. In simulation 0.05 left batch 1
    on the H100 table stuck at W=4 in one run of 4 (unlucky first trees); 0.2 did as well."""
    depth_prior: float = 1.0
    """Trees' worth of weight a depth's conditional acceptance gives the depth above
    (:class:`AcceptanceStats`). Without it (the EPYC, 2026-11-29, batch 1, step log) one W=1 L=3
    tree that accepted nothing rated depth 2 at 0, and the policy drafted L=2 for ~100 steps
    before an exploring step tried L=3 again. 1: the first trees that reach a depth decide it."""
    acceptance_prior_weight: float = 4.0
    """Trees' worth of weight the drafter's own held-out chain acceptance (its ``eval.json``)
    has in the greedy counts before any tree is verified (:meth:`AcceptanceStats.seed`), fading
    with them. Without it (the EPYC, 2026-11-29, batch 1, cold, step log) the first four trees
    (two of them accepting nothing) rated depth 1 at 0.25 against the drafter's 0.54, no shape
    paid, and the engine stepped plain for 22 steps until an exploring step: a third of that
    run's steps were plain. 4: two such trees move depth 1 from 0.54 to 0.36."""
    guard_every: int = 96
    """The safety net (:meth:`BeamPolicy._guard`): every this many steps of a bucket, the
    tokens/s its drafting steps delivered (drafter beams or context candidates, all costs in)
    is set against what its plain steps delivered; where drafting delivered less than
    ``min_gain`` x that (by more than its standard error: at batch 1 a drafting step's tokens
    vary), the bucket drafts nothing until the next judgement. The model (line, acceptance)
    misses costs it does not see: on the EPYC, 2026-11-27, steps with both a chain and
    candidates at batch 4 took 76 ms against the 48 of the chain alone. 0: no safety net."""
    guard_block: int = 3
    """Steps of each ``guard_every`` that keep measuring the other side: the last ones before a
    judgement are plain while drafting, the first ones after it draft while guarded. The first
    plain step after a drafted one pays that step's KV moves and is not counted."""
    guard_decay: float = 0.9
    """Per counted step of a side, the weight its older steps keep: ~10 steps' worth judge a
    side (at batch 1 a drafting step's tokens vary: 0.8 judged a 18% gain a loss in 1 of 6
    judgements in simulation). A guarded bucket still drafts its 3 steps after each judgement
    and its exploring steps (1 in ``explore_every``): ~45% fresh weight per judgement, so
    drafting resumes within a few judgements of the machine or the text turning back."""
    drafted_spread: float = 0.25
    """A bucket prices drafted steps by their own line (:meth:`Bucket.seconds`) once their
    verified token counts vary by this much (a variance: two shapes measured); before, at what
    its drafted steps cost, whatever their n. A drafted step pays a fixed part a plain one does
    not (the tree's attention, its KV moves: the EPYC, 2026-11-29, batch 1: W=1 L=2 153 ms, W=1
    L=3 157, plain 104); one line through plain and drafted steps takes it for a per-token cost,
    prices short shapes too low and long ones too high, and no shape paid (simulated: 1.05x
    plain at batch 1 where the best fixed shape gave 1.20x)."""
    prior_weight: float = 2.0
    """Steps' worth of weight a step-cost curve (``vllm-redrafter step-cost``) gives a bucket's
    fit before it is measured: a prior, soon outweighed by the bucket's own steps."""
    candidate_decay: float = 0.9
    """Per scored proposal of a request, the weight its older context candidates keep: requests
    are short (64 tokens are ~40 steps) and change topic, so ~10 proposals make the estimate."""
    candidate_prior: float = 1.0
    """Scores' worth of weight a request's candidate mean gives the mean of all requests' scores
    (:class:`CandidateScores`): a new request is rated like the ones before it until its own
    candidates are scored. Without it (the EPYC, 2026-11-29, batch 1, step log) a request took
    no candidate until one was decided, and one that copies right is decided last: 27 of 99
    steps with a candidate found took none for want of a score."""
    candidate_floor: float = 0.05
    """Context candidates are taken only where they promise at least this many extra accepted
    tokens per step: before the cost per verified token is measured, a guard against paying
    nodes for nothing."""
    candidate_share: float = 0.5
    """A step takes context candidates only if at least this share of its requests get one.
    A candidate speeds up its own request and slows every request of the step by its nodes'
    verify cost: taken for a minority, it can raise the batch's tokens/s and still slow the
    median request (EPYC, 2026-11-27, Poisson arrivals near saturation: throughput 0.98-1.01x
    vLLM alone, median time per output token 0.89-0.92x, the drafting mostly candidates of the
    requests that copy). At batch 1 and 2 one request is the share. 0: per request only."""


@dataclass(frozen=True)
class VerifiedTree:
    """One request's tree, verified in the step that just ended."""

    kind: str  # its KINDS entry (acceptance_kind of its temperature)
    width: int
    length: int
    packed: int  # the drafter's tree nodes, root included (1 where width is 0: no drafter beams)
    accepted: int  # draft tokens accepted along the drafter's beams
    candidate_nodes: int = 0  # nodes only context candidates added: verified too
    by_beams: tuple[int, ...] = ()  # what the first w beams alone accepted, w = 1 .. width
    # (RequestTree.depth_by_beams; exact under greedy verification); () = not known


@dataclass(frozen=True)
class StepObservation:
    """What the proposer knows at a step's start: the step that just ended, and who may draft."""

    now: float  # time.perf_counter() at this call: a step is the time from one call to the next
    request_ids: tuple[str, ...]  # the requests of the step that just ended
    prefilling: bool = False  # one of them ran prefill work in it (its time is not a decode's)
    verified: tuple[VerifiedTree, ...] = ()  # the trees that step verified
    draft_seconds: float = 0.0  # seconds the previous call spent drafting those trees
    kinds: tuple[str, ...] = ()  # KINDS entry of each request that takes the policy's shape now
    others: int = 0  # requests of this step that do not (no drafts, or a shape of their own)
    max_nodes: int = 1 << 30  # the most draft nodes a request may verify this step
    texts: tuple[RequestText, ...] = ()  # requests whose context candidates the policy chooses
    emitted: int = 0  # tokens the step that just ended emitted, all requests (0: not known)


@dataclass(frozen=True)
class RequestText:
    """A request that may take context candidates this step."""

    req_id: str
    output: Sequence[int]  # its output tokens so far, g0 (this step's root) last
    candidates: tuple[tuple[int, ...], ...]  # the lookup's candidates after g0, best first
    most: int = 1  # the most candidates it may take (found or not)
    drafter_accepted: int = 0  # drafts it accepted along drafter beams in the step just ended


@dataclass(frozen=True)
class Choice:
    """The shape for this step's requests; (0, 0): no drafts."""

    width: int
    length: int
    tokens_per_second: float  # expected (0.0: nothing measured yet)
    plain_tokens_per_second: float  # expected of a plain step (0.0: nothing measured yet)
    reason: str  # which rule chose it (BeamPolicy.step), for the step log
    candidates: tuple[int, ...] = ()  # context candidates to take, per StepObservation.texts


class Line:
    """``y ~ a + b x``, ``a, b >= 0``, by decayed weighted least squares (the 2x2 normal
    equations, kept as five running sums). With a single x seen, the slope is 0.

    >>> line = Line(decay=1.0)
    >>> line.add(1, 3.0); line.add(3, 7.0)
    >>> line.fit(), line(5)
    ((1.0, 2.0), 11.0)
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.w = self.x = self.xx = self.y = self.xy = 0.0

    def add(self, x: float, y: float, weight: float = 1.0) -> None:
        self.fade()
        self.w, self.x = self.w + weight, self.x + weight * x
        self.y, self.xx = self.y + weight * y, self.xx + weight * x * x
        self.xy = self.xy + weight * x * y

    def fade(self) -> None:
        """What has been seen loses weight, as if a point were added elsewhere."""
        d = self.decay
        self.w, self.x, self.y, self.xx, self.xy = (d * v for v in (self.w, self.x, self.y,
                                                                     self.xx, self.xy))

    def fit(self) -> tuple[float, float] | None:
        if self.w <= 0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        b = max(0.0, (self.xy / self.w - mx * my) / var) if var > 1e-9 * (1 + mx * mx) else 0.0
        if my - b * mx < 0:  # the line through the origin and the mean: no negative fixed cost
            b = my / mx
        return my - b * mx, b

    def __call__(self, x: float) -> float | None:
        ab = self.fit()
        return None if ab is None else ab[0] + ab[1] * x

    def variance(self) -> float:
        """The weighted variance of the x seen (0 before any)."""
        return max(0.0, self.xx / self.w - (self.x / self.w) ** 2) if self.w > 0 else 0.0


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
    wider tree). All counts fade with every step. Estimates are monotone: a wider beam never
    accepts less (rates pooled where they disagree, weighted by their counts), more depth never
    more. When exploring, a width little seen is rated up by an upper confidence bound, so it is
    tried again.
    """

    def __init__(self, widths: Sequence[int], decay: float = 0.99, ucb: float = 0.1,
                 depth_prior: float = 1.0) -> None:
        self.widths, self.decay, self.ucb = list(widths), decay, ucb
        self.depth_prior = depth_prior
        self.anchor = self.widths[0]  # the narrowest width: every tree that knows it counts there
        self.hits: dict[tuple[int, int], float] = {}  # (W, d) -> trees whose W beams took >= d
        self.trials: dict[tuple[int, int], float] = {}  # (W, d) -> trees of width >= W, length > d
        self.reach: dict[tuple[int, int], float] = {}  # (W, d) -> those trials that took >= d - 1
        self.paired: dict[tuple[int, int], list[float]] = {}  # (W, d) -> [hits of W, hits of
        # the anchor, trees] on the trees that know both
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
                        pair = self.paired.setdefault((w, d), [0.0, 0.0, 0.0])
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


@dataclass
class Bucket:
    """What the policy measured at one batch-size bucket (1, 2, 4 = 3-4, 8 = 5-8, ...)."""

    cost: Line  # seconds of a step without its drafting, by verified tokens n
    warmed: set[tuple[int, int]] = field(default_factory=set)  # shapes past their first step
    timed: set[tuple[int, int]] = field(default_factory=set)  # shapes with a timed step; (0, 0)
    last: dict[tuple[int, int], float] = field(default_factory=dict)  # shape -> its last seconds
    draft: dict[tuple[int, int], float] = field(default_factory=dict)  # shape -> drafting seconds
    steps: int = 0  # steps chosen for this bucket
    taken: dict[tuple[int, int], int] = field(default_factory=dict)  # shape -> its last step
    explored: int = 0  # the last step that explored
    trying: tuple[int, int] | None = None  # the shape explored then, if to be repeated
    best_width: int | None = None  # width of the best shape at its last step (0: plain)
    delivered: dict[bool, Delivered] = field(default_factory=dict)  # drafting (True) or plain
    # (False) -> what its steps delivered; both made by BeamPolicy._bucket
    guarded: bool = False  # the safety net holds this bucket plain (PolicyConfig.guard_every)
    sides: dict[bool, Line] = field(default_factory=dict)  # drafted (True) or plain (False) ->
    # the cost of that side's timed steps alone; made by BeamPolicy._bucket
    spread: float = 0.25  # PolicyConfig.drafted_spread

    def seconds(self, n: float, drafted: bool) -> float:
        """Seconds of a step verifying n tokens, drafting not included: by that side's own
        line where it tells (plain: once timed; drafted: once its token counts vary by
        ``spread``); drafted steps of one size only: what they cost, at any n (measuring
        another size tells the slope); before any step of the side, the line through every
        timed step (``cost``)."""
        own = self.sides.get(drafted)
        if own is None or own.w <= 0:
            return self.cost(n)
        if drafted and not self._drafted_line_tells():
            return own.y / own.w
        return own(n)

    def beta(self) -> float:
        """Seconds per verified token: the drafted steps' slope where their line tells."""
        fit = (self.sides[True] if self._drafted_line_tells() else self.cost).fit()
        return fit[1] if fit else 0.0

    def _drafted_line_tells(self) -> bool:
        """Whether the drafted steps' token counts vary enough (``spread``) for their slope."""
        own = self.sides.get(True)
        return own is not None and own.w > 0 and own.variance() >= self.spread

    def drafting(self, width: int, length: int) -> float:
        """Seconds of drafting (W, L) here; not drafted yet: the dearest drafted shape it
        contains (a bigger beam never drafts faster), 0 if none."""
        if (width, length) in self.draft:
            return self.draft[(width, length)]
        return max((s for (w, l), s in self.draft.items() if w <= width and l <= length),
                   default=0.0)


@dataclass
class Delivered:
    """Tokens and seconds of counted steps, decayed per step: what one side delivered, and
    how sure that is (the spread of its steps' tokens/s)."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    squares: float = 0.0  # decayed sum of each step's (tokens/s)^2
    decay: float = 0.9

    def add(self, tokens: float, seconds: float) -> None:
        d = self.decay
        self.tokens, self.seconds = d * self.tokens + tokens, d * self.seconds + seconds
        self.weight = d * self.weight + 1
        self.squares = d * self.squares + (tokens / seconds) ** 2

    def rate(self, min_weight: float = 3.0) -> float | None:
        """Tokens per second; None below ``min_weight`` steps' worth."""
        return self.tokens / self.seconds if self.weight >= min_weight and self.seconds else None

    def error(self) -> float:
        """Standard error of :meth:`rate` from its steps' spread (decayed: at most the
        (1 + decay) / (1 - decay) steps a decayed mean holds count)."""
        mean = self.tokens / self.seconds
        spread = max(0.0, self.squares / self.weight - mean * mean)
        return math.sqrt(spread / min(self.weight, (1 + self.decay) / (1 - self.decay)))


@dataclass(frozen=True)
class _Open:
    """The step under way: when it began, its requests, the shape chosen."""

    now: float
    ids: frozenset[str]
    choice: Choice


def _why(found: int, k: int, extra: float | None, floor: float) -> str:
    """Why a request's candidates were taken or not (the step log's ``why``): ``none`` found,
    ``taken``, ``unscored`` (no expected gain yet), ``below_floor`` or ``below_price`` (no k's
    gain exceeded its nodes' price); before ``candidate_share`` and the safety net."""
    if not found:
        return "none"
    if k:
        return "taken"
    if extra is None:
        return "unscored"
    return "below_floor" if extra < floor else "below_price"


class BeamPolicy:
    """The engine's beam policy (module docstring); ``max_width`` and ``max_length`` are the
    engine's W and L, upper bounds of every shape. ``prior``: a step-cost curve, or None;
    ``acceptance_prior``: the drafter's held-out P(a chain accepts >= d), d = 1, 2, ... (its
    ``eval.json``: ``chain_top1``), or None."""

    def __init__(self, max_width: int, max_length: int, config: PolicyConfig = PolicyConfig(),
                 prior: StepCost | BatchStepCost | None = None,
                 acceptance_prior: Sequence[float] | None = None) -> None:
        self.max_width, self.max_length = max_width, max_length
        self.config, self.prior = config, prior
        self.widths = candidate_widths(max_width)
        self.acceptance = {k: AcceptanceStats(self.widths, config.acceptance_decay, config.ucb,
                                              config.depth_prior)
                           for k in KINDS}
        if acceptance_prior:  # a greedy measure: sampled requests accept less, they start unseeded
            self.acceptance["greedy"].seed(acceptance_prior, config.acceptance_prior_weight)
        self.buckets: dict[int, Bucket] = {}
        self._open: _Open | None = None
        self.texts: dict[str, CandidateStats] = {}  # req_id -> its context candidates' scores
        self.pool = CandidateScores(config.candidate_decay)  # all requests' scores: a new one's prior
        self.calls = 0
        self.priced: list[dict] = []  # the last step's candidate decisions, for the step log
        self._drafted = False  # whether the step before the one that just ended drafted

    def step(self, obs: StepObservation) -> Choice:
        """Learn from the step that just ended; the shape for the step that starts."""
        self.calls += 1
        self._learn(obs)
        choice = self._choose(obs)
        if obs.texts:
            choice = dataclasses.replace(choice, candidates=self._candidates(obs, choice))
        choice = self._guard(len(obs.kinds) + obs.others, choice)
        self._open = _Open(obs.now, frozenset(obs.request_ids), choice)
        return choice

    def _candidates(self, obs: StepObservation, choice: Choice) -> tuple[int, ...]:
        """Per request of ``obs.texts``, the k of its candidates with the most measured extra
        accepted tokens net of their nodes' cost; 0 where none pays.

        A node costs ``min_gain`` x the bucket's measured seconds per verified token (beta) x
        the step's tokens/s: adding nodes that cost dS seconds and bring dT tokens raises the
        step's tokens/s T / S only if dT / dS > T / S."""
        n = len(obs.kinds) + obs.others
        b = self._bucket(max(n, 1))
        rate = choice.tokens_per_second or choice.plain_tokens_per_second
        if not rate and b.cost.w > 0:
            rate = n / max(b.seconds(n, False), 1e-9)
        price = self.config.min_gain * b.beta() * rate
        counts, ids, self.priced = [], set(), []
        for text in obs.texts:
            ids.add(text.req_id)
            stats = self.texts.get(text.req_id)
            if stats is None:
                stats = self.texts[text.req_id] = CandidateStats(
                    text.most, self.config.candidate_decay, self.pool, self.config.candidate_prior)
            stats.observe(self.calls, text.output, text.drafter_accepted)
            best, value, first = 0, 0.0, {"extra": None, "nodes": 0}
            for k in range(1, len(text.candidates) + 1):
                extra, nodes = stats.expected_extra(k), trie_nodes(text.candidates[:k])
                if k == 1:
                    first = {"extra": extra, "nodes": nodes}
                if extra is None or extra < self.config.candidate_floor:
                    continue
                net = extra - price * nodes
                if net > value:
                    best, value = k, net
            stats.propose(self.calls, len(text.output), text.candidates)
            counts.append(best)
            self.priced.append(dict(first, found=len(text.candidates), price=price, k=best,
                                    why=_why(len(text.candidates), best, first["extra"],
                                             self.config.candidate_floor)))
        for gone in set(self.texts) - ids:  # finished (or, for now, not drafting) requests
            del self.texts[gone]
        if sum(c > 0 for c in counts) < self.config.candidate_share * n:  # a minority's gain
            return (0,) * len(counts)  # would cost the median request (PolicyConfig)
        return tuple(counts)

    def _guard(self, n: int, choice: Choice) -> Choice:
        """The safety net over the model's choice: drafting must deliver ``min_gain`` x what
        plain steps do in the same bucket, as measured (PolicyConfig.guard_every)."""
        cfg = self.config
        drafts = bool(choice.width or any(choice.candidates))
        if not cfg.guard_every or not n or not drafts or choice.reason == "explore":
            return choice  # exploring goes on under the net: the model's own learning
        b = self._bucket(n)
        phase = b.steps % cfg.guard_every  # b.steps counts this step already (_take)
        if phase == 0:  # judged where the model would draft (judged on stale figures while
            # it does not, a bucket would stay held once drafting pays again)
            plain, drafting = b.delivered[False].rate(), b.delivered[True].rate()
            b.guarded = (plain is not None and drafting is not None  # surely below the bar
                         and drafting + b.delivered[True].error() < cfg.min_gain * plain)
        if b.guarded and not 0 < phase <= cfg.guard_block:
            reason = "guard"
        elif not b.guarded and phase > cfg.guard_every - cfg.guard_block:
            reason = "guard-plain"
        else:
            return choice
        return Choice(0, 0, choice.tokens_per_second, choice.plain_tokens_per_second, reason,
                      (0,) * len(choice.candidates))

    def _deliver(self, obs: StepObservation, last: _Open | None) -> None:
        """Count the step that just ended on its side (drafting or plain) of its bucket: a
        decode step of an unchanged batch; a plain step only if the one before did not draft."""
        drafted, after_draft = bool(obs.verified), self._drafted
        self._drafted = drafted
        ids = set(obs.request_ids)
        if (last is None or not ids or obs.prefilling or not ids <= last.ids or obs.emitted <= 0
                or (after_draft and not drafted)):
            return
        self._bucket(len(last.ids)).delivered[drafted].add(obs.emitted,
                                                           max(obs.now - last.now, 1e-9))

    def _learn(self, obs: StepObservation) -> None:
        for kind, stats in self.acceptance.items():  # the drafter's trees: its own acceptance
            stats.observe([t for t in obs.verified if t.kind == kind and t.width])
        last, ids, cfg = self._open, set(obs.request_ids), self.config
        self._deliver(obs, last)
        if last is None or not last.ids:
            return
        b, shape = self._bucket(len(last.ids)), (last.choice.width, last.choice.length)
        if shape not in b.warmed:  # a shape's first step in a bucket pays one-time costs (oneDNN
            b.warmed.add(shape)  # builds a GEMM per new row count): it would never be taken again
            return
        if shape[0] and obs.draft_seconds > 0:
            b.draft[shape] = _moving_mean(b.draft.get(shape), obs.draft_seconds, cfg.draft_decay,
                                          cfg.clip)
        # Timed: decode steps only (nobody joined, no prefill work), of the shape chosen
        drafted = any(t.width for t in obs.verified)
        if not ids or obs.prefilling or not ids <= last.ids or bool(shape[0]) != drafted:
            return
        seconds = obs.now - last.now - obs.draft_seconds
        if shape in b.last:
            seconds = min(max(seconds, b.last[shape] / cfg.clip), b.last[shape] * cfg.clip)
        b.last[shape] = seconds
        n = len(ids) - len(obs.verified) + sum(t.packed + t.candidate_nodes for t in obs.verified)
        b.cost.add(n, seconds)
        b.sides[bool(obs.verified)].add(n, seconds)
        b.sides[not obs.verified].fade()  # both sides fade per timed step: a side seldom taken
        # (drafting while the machine was slow) is judged by its latest steps when taken again
        b.timed.add(shape)

    def _choose(self, obs: StepObservation) -> Choice:
        """The rules, in order; each names itself in ``Choice.reason``."""
        cfg, drafters = self.config, len(obs.kinds)
        n = drafters + obs.others
        if not drafters:
            return Choice(0, 0, 0.0, 0.0, "nothing-to-draft")
        b, smaller = self._bucket(n), self._smaller(n)
        explore = b.steps + 1 - b.explored >= cfg.explore_every
        if b.trying is not None and b.explored == b.steps:  # an explored shape's first step in
            return self._take(b, b.trying, 0.0, 0.0, "explore")  # a bucket is warm-up: again
        if not b.timed - {PLAIN}:  # drafting's cost is unknown here: only the chain is tried, at
            # once at batch 1 or where a smaller batch drafts (one token more: cheap anywhere)
            if explore or n == 1 or (smaller is not None and smaller.best_width):
                return self._take(b, CHAIN, 0.0, 0.0, "explore")
            return self._take(b, PLAIN, 0.0, 0.0, "unmeasured")
        if PLAIN not in b.timed:  # a plain step to set the drafted ones against
            return self._take(b, PLAIN, 0.0, 0.0, "plain-refresh")
        plain = n / max(b.seconds(n, False), 1e-9)
        values, hopes = self._values(b, smaller, obs, plain)
        best = max(values, key=values.get)
        pays = values[best] > cfg.min_gain * plain
        b.best_width = best[0] if pays else 0
        if explore:  # of the shapes hoped near the best choice, the one hoped best
            bar = cfg.explore_floor * max(plain, values[best])
            near = [s for s in values if hopes[s] >= bar and not (pays and s == best)]
            if near or not pays:
                pick = max(near, key=hopes.get) if near else best
                return self._take(b, pick, values[pick], plain, "explore")
        if pays and b.steps + 1 - b.taken.get(PLAIN, 0) >= cfg.plain_every:
            return self._take(b, PLAIN, plain, plain, "plain-refresh")
        if pays:
            return self._take(b, best, values[best], plain, "best")
        return self._take(b, PLAIN, plain, plain, "no-shape-pays")

    def _values(self, b: Bucket, smaller: Bucket | None, obs: StepObservation, plain: float
                ) -> tuple[dict[tuple[int, int], float], dict[tuple[int, int], float]]:
        """Tokens/s of each shape this bucket has earned, expected (what a choice goes by) and
        hoped, at the acceptance's upper confidence bound (what exploring goes by).

        Earned: the chain, the shapes timed here or at the nearest smaller bucket, and the
        neighbours (W, L+1), (2W, L) of shapes timed here expected at ``explore_floor`` x plain
        or more; none wider than that smaller bucket's best width (widths never grow with the
        batch)."""
        drafters, others = len(obs.kinds), obs.others
        share = {kind: obs.kinds.count(kind) / drafters for kind in KINDS if kind in obs.kinds}
        cap = self.max_width if smaller is None else max(1, smaller.best_width)
        values, hopes = {}, {}
        for width in (w for w in self.widths if w <= cap):
            for length in range(2, self.max_length + 1):
                packed = sum(s * self.acceptance[k].packed(width, length)
                             for k, s in share.items())
                if packed - 1 > obs.max_nodes:
                    continue
                seconds = max(b.seconds(drafters * packed + others, True)
                              + b.drafting(width, length), 1e-9)
                for out, hopeful in ((values, False), (hopes, True)):
                    out[(width, length)] = (others + drafters * sum(
                        s * self.acceptance[k].tokens_per_step(width, length, hopeful)
                        for k, s in share.items())) / seconds
        narrower = {w: self.widths[i - 1] for i, w in enumerate(self.widths) if i}
        inherited = smaller.timed if smaller is not None else set()

        def earned(shape: tuple[int, int]) -> bool:
            width, length = shape
            parents = [(width, length - 1), (narrower.get(width, 0), length)]
            return shape == CHAIN or shape in b.timed or shape in inherited or any(
                p in b.timed and values.get(p, 0.0) >= self.config.explore_floor * plain
                for p in parents)

        keep = [shape for shape in values if earned(shape)] or [CHAIN]
        return ({s: values.get(s, 0.0) for s in keep}, {s: hopes.get(s, 0.0) for s in keep})

    def _smaller(self, n: int) -> Bucket | None:
        """The nearest smaller bucket that has judged its shapes (its best width known)."""
        keys = [k for k, b in self.buckets.items() if k < bucket(n) and b.best_width is not None]
        return self.buckets[max(keys)] if keys else None

    def _take(self, b: Bucket, shape: tuple[int, int], value: float, plain: float,
              reason: str) -> Choice:
        """The choice, counted in its bucket."""
        b.steps += 1
        b.taken[shape] = b.steps
        if reason == "explore":  # repeated once if this step is the shape's warm-up here
            b.explored, b.trying = b.steps, (shape if shape not in b.warmed else None)
        return Choice(*shape, value, plain, reason)

    def _bucket(self, n: int) -> Bucket:
        key = bucket(n)
        if key not in self.buckets:
            self.buckets[key] = b = Bucket(Line(self.config.cost_decay))
            b.delivered = {side: Delivered(decay=self.config.guard_decay) for side in (True, False)}
            b.sides = {side: Line(self.config.cost_decay) for side in (True, False)}
            b.spread = self.config.drafted_spread
            if self.prior is not None:  # pseudo-steps: a plain one and one of the widest trees
                widest = key * (1 + self.max_width * (self.max_length - 1))
                for tokens in (key, widest):
                    b.cost.add(tokens, self.prior(tokens, key), self.config.prior_weight / 2)
        return self.buckets[key]

    def describe(self, n: int) -> dict:
        """What the policy knows of the bucket of ``n`` requests, for the step log."""
        b = self.buckets.get(bucket(n))
        fit = b.cost.fit() if b else None
        return {"bucket": bucket(n), "alpha_s": fit and fit[0], "beta_s": fit and fit[1],
                "timed": sorted(b.timed) if b else [], "best_width": b.best_width if b else None}


def _moving_mean(mean: float | None, x: float, decay: float, clip: float) -> float:
    """An exponentially decayed mean; ``x`` clipped to within a factor ``clip`` of it."""
    if mean is None:
        return x
    return decay * mean + (1 - decay) * min(max(x, mean / clip), mean * clip)


def bucket(batch: int) -> int:
    """Batch sizes share a cost fit in powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch - 1).bit_length()


def candidate_widths(max_width: int) -> list[int]:
    """1, 2, 4, ... up to ``max_width`` (itself included)."""
    widths = [1]
    while widths[-1] * 2 < max_width:
        widths.append(widths[-1] * 2)
    return sorted({*widths, max_width})


def acceptance_kind(temperature: float | None) -> str:
    """The :data:`KINDS` entry of a request: greedy below vLLM's sampling epsilon."""
    return "greedy" if temperature is None or temperature < SAMPLING_EPS else "sampled"


# -- the step-cost curve: an optional prior (`vllm-redrafter step-cost` measures it) -------------


@dataclass(frozen=True)
class StepCost:
    """Seconds of one target forward over ``n`` query tokens in total (the whole batch).

    Piecewise linear between measured points, linear beyond the last two.

    >>> cost = StepCost((1, 8, 64), (0.010, 0.012, 0.040))
    >>> round(cost(4), 5), round(cost(128), 5)
    (0.01086, 0.072)
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ValueError("a step-cost curve needs >= 2 points, as many tokens as seconds")
        if list(self.tokens) != sorted(set(self.tokens)) or min(self.seconds) <= 0:
            raise ValueError("step-cost tokens must increase strictly and seconds be positive")

    @classmethod
    def from_measurements(cls, points: Iterable[tuple[int, float]]) -> StepCost:
        """The median time per token count, made monotone (:func:`monotone`): a forward over
        more tokens never costs less, so where noise says it does the points are pooled."""
        by_n: dict[int, list[float]] = {}
        for n, seconds in points:
            by_n.setdefault(int(n), []).append(float(seconds))
        ns = sorted(by_n)
        return cls(tuple(ns), tuple(monotone([sorted(by_n[n])[len(by_n[n]) // 2] for n in ns])))

    def __call__(self, n: float, requests: int = 1) -> float:
        """``requests`` is ignored: one curve for every batch size (:class:`BatchStepCost`)."""
        xs, ys = self.tokens, self.seconds
        i = 1
        while i < len(xs) - 1 and n > xs[i]:
            i += 1
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[0], ys[i - 1] + slope * (n - xs[i - 1]))

    def save(self, path: Path, **meta) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**meta, "tokens": list(self.tokens),
                                    "seconds": list(self.seconds)}, indent=1))


@dataclass(frozen=True)
class BatchStepCost:
    """Seconds of one target forward over ``n`` query tokens split among ``requests`` requests:
    one :class:`StepCost` per measured batch size, linear between batch sizes (one request's 4
    tokens cost less than two requests' 2 each).

    >>> cost = BatchStepCost(((1, StepCost((1, 8), (0.010, 0.012))),
    ...                       (4, StepCost((4, 32), (0.020, 0.040)))))
    >>> round(cost(4, 1), 5), round(cost(4, 4), 5), round(cost(8, 2), 5)
    (0.01086, 0.02, 0.01562)
    """

    curves: tuple[tuple[int, StepCost], ...]  # (batch size, its curve), batch sizes increasing

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.curves]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"step-cost batch sizes must be >= 1 and increase strictly: {sizes}")

    @classmethod
    def from_cells(cls, cells: Iterable[dict]) -> BatchStepCost:
        """From ``vllm-redrafter step-cost``'s cells (``batch``, ``total_tokens``, ``seconds``)."""
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for c in cells:
            by_batch.setdefault(int(c["batch"]), []).append((c["total_tokens"], c["seconds"]))
        return cls(tuple((b, StepCost.from_measurements(by_batch[b])) for b in sorted(by_batch)))

    def __call__(self, n: float, requests: int = 1) -> float:
        sizes = [b for b, _ in self.curves]
        i = next((i for i, b in enumerate(sizes) if b >= requests), len(sizes) - 1)
        if i == 0 or sizes[i] <= requests:
            return self.curves[i][1](n)
        (b0, lo), (b1, hi) = self.curves[i - 1], self.curves[i]
        w = (requests - b0) / (b1 - b0)
        return (1 - w) * lo(n) + w * hi(n)


def load_step_cost(path: Path) -> StepCost | BatchStepCost:
    """A saved curve: per batch size where its cells hold several, else the one curve."""
    data = json.loads(Path(path).read_text())
    if len({c["batch"] for c in data.get("cells", ())}) > 1:
        return BatchStepCost.from_cells(data["cells"])
    return StepCost(tuple(data["tokens"]), tuple(data["seconds"]))


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


def step_cost_path(model: str, dtype: str, device: str, threads: int) -> Path:
    """Where ``vllm-redrafter step-cost`` caches the curve of a model on this machine.

    The key names the CPU's ISA too (an AVX2 CPU and an AVX-512 one with as many cores have
    different curves) and, on a CPU, the model runner's torch threads (vLLM's CPU worker gets
    the cores its thread binding leaves it: by default one core is kept for the engine-core
    process; ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives it all)."""
    from vllm_redrafter.target import cache_dir

    machine = f"{platform.machine()}|{os.cpu_count()}|{cpu_isa()}|{device}"
    if device == "cpu":
        machine += f"|threads={threads}"
    key = hashlib.sha256(f"{model}|{dtype}|{machine}".encode()).hexdigest()[:16]
    return cache_dir() / "step_cost" / f"{key}.json"
