"""The beam policy: per engine step, the beam shape (W, L) with the most tokens per second, or no
drafts; learnt from the engine's own timed steps, on any machine, with nothing to set up.

The proposer calls :meth:`BeamPolicy.step` once per step: what the step that just ended showed
goes in (:class:`StepObservation`), the shape for the step that starts comes out
(:class:`Choice`). Every tunable is a field of :class:`PolicyConfig`, with its reason.

Per batch-size bucket (1, 2, 3-4, 5-8, ...) a step costs ``alpha + beta * n`` seconds, n the
tokens it verifies (each drafting request's packed tree, each other request's one), fitted by
decayed least squares on timed decode steps, plain steps, chains and trees apart (:data:`SIDES`:
each pays a fixed part the one before does not), plus the drafting, timed per shape. It emits
``B * tokens(W, L) + others`` tokens, ``tokens`` from the acceptance counted on verified trees
(greedy: seeded with the drafter's own held-out chain figures, a prior that fades).
A bucket starts plain (batch 1: with a one-token chain) and earns wider and longer shapes one
neighbour at a time, each measured before the next is allowed; it drafts the best shape earned
when that beats a plain step by ``min_gain``, expected or, while its acceptance is little seen,
at its upper confidence bound. The rules in order: :meth:`BeamPolicy._choose`;
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
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_redrafter.acceptance import AcceptanceStats, candidate_widths
from vllm_redrafter.candidate_scores import CandidateScores, CandidateStats, trie_nodes
from vllm_redrafter.sampling import SAMPLING_EPS
from vllm_redrafter.step_cost_curve import BatchStepCost, StepCost

DEFAULT_MIN_GAIN = 1.05
"""How much more than a plain step's tokens/s a shape must promise to be drafted."""

KINDS = ("greedy", "sampled")
"""Requests whose acceptance is counted apart: greedy ones accept more than sampled ones."""

CHAIN = (1, 2)
"""The cheapest drafting shape (one drafted token): the only one tried before any is measured."""
PLAIN = (0, 0)
"""The "shape" of a step without drafts."""
SIDES = ("plain", "chain", "tree")
"""Steps whose costs are fitted apart (:meth:`Bucket.seconds`): without drafts, with one beam
(or context candidates alone), with several (chains and trees together: ``"drafted"``,
:meth:`Bucket.line`). A drafted step pays a
fixed part a plain one does not, a tree of several beams one more than a chain (its accepted
path may leave the first beam: KV moves)."""


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
    """Weight of the upper confidence bound on acceptance, by which exploring steps pick and
    by which the best shape is drafted where only its bound pays (``hoped``): a shape little
    seen is hoped above its counts, so it is tried, and counted. Acceptance is counted on
    drafted trees only: without the bound a plain bucket stays plain until an exploring step is
    lucky (the Xeon at temperature 0.8, batch 1: plain in 164-311 of ~600 steps while the chains
    drafted realized 1.15-1.51x plain; simulated 0.94x the best fixed chain, with it 0.97x). In
    simulation 0.05 left batch 1 on the H100 table stuck at W=4 in one run of 4 (unlucky first
    trees); 0.2 did as well."""
    depth_prior: float = 1.0
    """Trees' worth of weight a depth's conditional acceptance gives the depth above
    (:class:`AcceptanceStats`). Without it (the EPYC, 2026-11-29, batch 1, step log) one W=1 L=3
    tree that accepted nothing rated depth 2 at 0, and the policy drafted L=2 for ~100 steps
    before an exploring step tried L=3 again. 1: the first trees that reach a depth decide it."""
    gain_prior: float = 4.0
    """Trees' worth of no gain a wider width's paired gain over its first beam starts from
    (:class:`AcceptanceStats`), fading with its trees. Without it (the Xeon, 2026-12-08, batch
    1, greedy, step log) the first two exploring W=4 L=4 trees, whose other beams took two
    tokens more than the first, rated W=2 and W=4 at ~2.7 tokens per step: the policy drafted
    trees for the next ~10 steps, which realized 1.0-1.2x plain where the chain gave 1.5x, and
    again after each lucky exploring tree. 4: such a pair of trees counts a third of its gain."""
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
    """A bucket prices drafted steps by their own lines (:meth:`Bucket.seconds`) once their
    verified token counts vary by this much within chains or trees (a variance: two sizes
    measured); before, at what its chains (trees) cost, whatever their n. A drafted step pays a
    fixed part a plain one does not (the EPYC, 2026-11-29, batch 1: W=1 L=2 153 ms, W=1 L=3 157,
    plain 104), a tree of several beams one more (the Xeon, 2026-11-30, batch 1: W=2 L=4 113-133
    ms, W=1 L=4 92-105, 5 candidate nodes on a chain 1-4): one line through them takes a fixed
    part for a per-token cost (simulated: 1.09x plain at batch 1 where the best fixed shape gave
    1.20x, its own lines 1.18x)."""
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

    def __add__(self, other: Line) -> Line:
        """The line through both lines' points (their sums added; the same decay)."""
        line = Line(self.decay)
        line.w, line.x, line.y = self.w + other.w, self.x + other.x, self.y + other.y
        line.xx, line.xy = self.xx + other.xx, self.xy + other.xy
        return line

    def variance(self) -> float:
        """The weighted variance of the x seen (0 before any)."""
        return max(0.0, self.xx / self.w - (self.x / self.w) ** 2) if self.w > 0 else 0.0


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
    sides: dict[str, Line] = field(default_factory=dict)  # SIDES entry -> the cost of that
    # side's timed steps alone; made by BeamPolicy._bucket
    spread: float = 0.25  # PolicyConfig.drafted_spread

    def seconds(self, n: float, side: str) -> float:
        """Seconds of a step of ``side`` (:func:`side`) verifying n tokens, drafting not
        included. Plain: its own line once timed. Chains: their own line once their sizes vary
        by ``spread``, before that what they cost. Trees: their own line likewise; with one
        size timed, its cost moved along the slope of all drafted steps (chains and that size:
        on a GPU, where the cost per token grows with n, the chains' flat slope would price
        every tree at the one measured). Before any step of the side, the line through every
        timed step."""
        own, drafted = self.line(side), self.line("drafted")
        if side == "plain" or self._tells(side):
            return own(n) if own.w > 0 else self.cost(n)
        if side == "tree" and own.w > 0 and self._tells("drafted"):  # its cost, moved along
            slope = drafted.fit()[1]  # the slope of all drafted steps
            return max(0.0, own.y / own.w + slope * (n - own.x / own.w))
        for line in (own, drafted):  # one size: what it cost, whatever n
            if line.w > 0:
                return line.y / line.w
        return self.cost(n)

    def beta(self) -> float:
        """Seconds per verified token, what a context candidate's node costs: the chains'
        slope where their line tells; 0 while chains of one size are timed (priced flat, as
        :meth:`seconds` prices them: the candidates taken then vary their size); before any,
        the slope of all drafted steps or of every step. Not a line through chains and trees:
        a tree's fixed part read as a cost per token prices nodes ~10x too dear (the Xeon)."""
        if self._tells("chain"):
            return self.sides["chain"].fit()[1]
        if self.sides["chain"].w > 0:
            return 0.0
        fit = (self.line("drafted") if self._tells("drafted") else self.cost).fit()
        return fit[1] if fit else 0.0

    def line(self, side: str) -> Line:
        """A :data:`SIDES` entry's cost line; ``"drafted"``: chains' and trees' together (all
        sides fade alike per timed step, so their sums add)."""
        return self.sides["chain"] + self.sides["tree"] if side == "drafted" else self.sides[side]

    def _tells(self, side: str) -> bool:
        """Whether a side's token counts vary enough (``spread``) for its slope."""
        own = self.line(side)
        return own.w > 0 and own.variance() >= self.spread

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
                                              config.depth_prior, config.gain_prior)
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
            rate = n / max(b.seconds(n, "plain"), 1e-9)
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
        elif not b.guarded and phase >= cfg.guard_every - cfg.guard_block:  # the last before
            reason = "guard-plain"
        else:
            return choice
        return Choice(0, 0, choice.tokens_per_second, choice.plain_tokens_per_second, reason,
                      (0,) * len(choice.candidates))

    def _deliver(self, obs: StepObservation, last: _Open | None, kv_moves: bool) -> None:
        """Count the step that just ended on its side (drafting or plain) of its bucket: a
        decode step of an unchanged batch, not a plain one that paid a drafted step's KV moves."""
        drafted, ids = bool(obs.verified), set(obs.request_ids)
        if (last is None or not ids or obs.prefilling or not ids <= last.ids or obs.emitted <= 0
                or kv_moves):
            return
        self._bucket(len(last.ids)).delivered[drafted].add(obs.emitted,
                                                           max(obs.now - last.now, 1e-9))

    def _learn(self, obs: StepObservation) -> None:
        for kind, stats in self.acceptance.items():  # the drafter's trees: its own acceptance
            stats.observe([t for t in obs.verified if t.kind == kind and t.width])
        last, ids, cfg = self._open, set(obs.request_ids), self.config
        kv_moves = self._drafted and not obs.verified  # a plain step after a drafted one pays
        self._drafted = bool(obs.verified)  # that step's KV moves: neither timed nor counted
        self._deliver(obs, last, kv_moves)
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
        if (not ids or obs.prefilling or not ids <= last.ids or bool(shape[0]) != drafted
                or kv_moves):
            return
        seconds = obs.now - last.now - obs.draft_seconds
        if shape in b.last:
            seconds = min(max(seconds, b.last[shape] / cfg.clip), b.last[shape] * cfg.clip)
        b.last[shape] = seconds
        n = len(ids) - len(obs.verified) + sum(t.packed + t.candidate_nodes for t in obs.verified)
        b.cost.add(n, seconds)
        taken = side(shape[0], bool(obs.verified))
        for key, line in b.sides.items():  # every side fades per timed step: one seldom taken
            # (drafting while the machine was slow) is judged by its latest steps when taken again
            if key == taken:
                line.add(n, seconds)
            else:
                line.fade()
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
        plain = n / max(b.seconds(n, "plain"), 1e-9)
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
        if pays:
            return self._take(b, best, values[best], plain, "best")
        if hopes[best] > cfg.min_gain * plain:  # little seen, hoped to pay (PolicyConfig.ucb)
            return self._take(b, best, values[best], plain, "hoped")
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
                seconds = max(b.seconds(drafters * packed + others, side(width, True))
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
            b.delivered = {d: Delivered(decay=self.config.guard_decay) for d in (True, False)}
            b.sides = {s: Line(self.config.cost_decay) for s in SIDES}
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


def side(width: int, verified: bool) -> str:
    """The :data:`SIDES` entry of a step whose requests draft ``width`` beams (0: none; context
    candidates alone count as a chain)."""
    return "tree" if width > 1 else "chain" if width or verified else "plain"


def acceptance_kind(temperature: float | None) -> str:
    """The :data:`KINDS` entry of a request: greedy below vLLM's sampling epsilon."""
    return "greedy" if temperature is None or temperature < SAMPLING_EPS else "sampled"
