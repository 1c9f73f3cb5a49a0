"""The beam policy: per step, the beam shape with the most expected tokens per second of step.

A verify step over a batch of B requests costs one target forward over all their packed tree
tokens (``BatchStepCost``: by total tokens and batch size, measured once per machine and model by
``benchmarks/step_cost.py``) plus the drafter's beam search (``DraftCost``, measured as it runs).
It emits, per request, 1 + the accepted draft tokens, whose expectation for a beam shape (W, L)
is ``1 + sum_{d=1}^{L-1} P(accepted >= d | W)`` (``AcceptanceStats``, counted from the verified
steps, apart for greedy and sampled requests). So the policy picks

    argmax over (W, L) of  B * tokens(W, L) / (target(B * packed(W, L), B) + draft(B, W, L))

against the plain step, ``B / target(B, B)``; when no shape beats it by ``min_gain`` (default
1.05), the step goes without drafts. Unseen shapes are estimated optimistically (an upper
confidence bound), so each is tried and then judged by what it measured.

``StepTimes`` scales the model's seconds, per batch bucket and shape, by the measured wall time
of whole engine steps (from one ``propose`` call to the next); a plain step runs now and then to
keep that figure current, and an untimed shape the model rates close to a plain step is probed.

``JoinCost`` and :meth:`BeamPolicy.lockstep` (off by default; ``lockstep_slack=4`` turns them
on): while most requests' tokens left lie within ``lockstep_slack``, drafting must beat the
plain step by ``min_gain / (1 - c)``, ``c = (B - 1) J / (N t)`` the share of a plain step's t
seconds per token that the others' prefills (J seconds each, N output tokens per request) take
once drafting breaks the lockstep; fragments of a batch recently in lockstep never draft.

Nothing here imports vLLM. How it works in full, measurements and history: docs/beam_policy.md.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from vllm_redrafter.cpu_features import cpu_isa
from vllm_redrafter.sampling import SAMPLING_EPS

DEFAULT_MIN_GAIN = 1.05
"""How much more than a plain step's tokens/s a shape must promise to be drafted (BeamPolicy)."""

KINDS = ("greedy", "sampled")
"""Requests whose acceptance is counted apart: greedy ones accept more than sampled ones."""


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
        """The median time per token count of ``(total tokens, seconds)`` measurements, made
        monotone: a forward over more tokens never costs less, so where noise says it does the
        disagreeing points are pooled (:func:`monotone`) rather than believed."""
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
    """Seconds of one target forward over ``n`` query tokens split among ``requests`` requests.

    One :class:`StepCost` curve (by total tokens) per measured batch size, linear between batch
    sizes. The split matters: one request's 4 tokens cost less than two requests' 2 each, so a
    curve by total tokens alone misprices chains at batch 1 (docs/beam_policy.md).

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
        """From ``benchmarks/step_cost.py``'s cells (``batch``, ``total_tokens``, ``seconds``)."""
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
    """A curve saved by :meth:`StepCost.save` (``benchmarks/step_cost.py`` adds its cells): per
    batch size where it measured several, else the one curve."""
    data = json.loads(Path(path).read_text())
    if len({c["batch"] for c in data.get("cells", ())}) > 1:
        return BatchStepCost.from_cells(data["cells"])
    return StepCost(tuple(data["tokens"]), tuple(data["seconds"]))


def monotone(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators).

    >>> [round(v, 3) for v in monotone([0.068, 0.067, 0.048, 0.101, 0.085, 0.140])]
    [0.061, 0.061, 0.061, 0.093, 0.093, 0.14]
    """
    blocks: list[list[float]] = []  # [sum, count] of pooled runs
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(int(count))]


@dataclass
class AcceptanceStats:
    """Decayed counts, per beam width W, of ``accepted >= d`` and of packed tree sizes.

    A step verified at shape (W, L) with ``a`` accepted drafts tells ``accepted >= d`` for
    d < L. Estimates are monotone: more depth never accepts more, a wider beam never less.
    """

    decay: float = 0.999  # per observation: recent steps weigh more (the text changes)
    explore: float = 0.05  # weight of the upper confidence bound (docs/beam_policy.md)
    min_trials: float = 8.0  # observations a (W, depth) count fades to, at the least
    hits: dict[tuple[int, int], float] = field(default_factory=dict)  # (W, d) -> accepted >= d
    trials: dict[tuple[int, int], float] = field(default_factory=dict)  # (W, d) -> observations
    packed_sum: dict[tuple[int, int], float] = field(default_factory=dict)  # (W, L) -> nodes
    packed_n: dict[tuple[int, int], float] = field(default_factory=dict)
    total: float = 0.0

    def observe(self, width: int, length: int, packed: int, accepted: int) -> None:
        """One verified tree: its shape, its packed size (nodes, root included), accepted drafts."""
        self.total = self.total * self.decay + 1
        for d in range(1, length):
            key = (width, d)
            self.trials[key] = self.trials.get(key, 0.0) * self.decay + 1
            self.hits[key] = self.hits.get(key, 0.0) * self.decay + (accepted >= d)
        key = (width, length)
        self.packed_sum[key] = self.packed_sum.get(key, 0.0) * self.decay + packed
        self.packed_n[key] = self.packed_n.get(key, 0.0) * self.decay + 1

    def observe_no_drafts(self, batch: int) -> None:
        """A step without drafts: the counts fade, so drafting is tried again in time, but never
        below ``min_trials`` observations: the estimate keeps its mean and its doubt stays
        bounded, so a shape measured clearly losing is not retried in bursts (each retried step
        costs what drafting loses)."""
        fade = self.decay ** batch
        self.total = self.total * fade + batch
        for key, n in self.trials.items():
            f = max(fade, self.min_trials / n) if n > self.min_trials else 1.0
            self.trials[key] = n * f
            self.hits[key] = self.hits.get(key, 0.0) * f

    def p_accept(self, width: int, depth: int) -> float:
        """Upper confidence bound of P(accepted >= depth | width)."""
        n = self.trials.get((width, depth), 0.0)
        mean = (self.hits.get((width, depth), 0.0) + 0.5) / (n + 1.0)
        bonus = self.explore * math.sqrt(math.log(self.total + 2.0) / (n + 1.0))
        return min(1.0, mean + bonus)

    def tokens_per_step(self, width: int, length: int, widths: Sequence[int]) -> float:
        """1 + expected accepted drafts at (width, length); ``widths``: the candidate widths."""
        expected, p_prev = 1.0, 1.0
        for d in range(1, length):
            # a wider beam accepts at least what a narrower one does: its estimate is a floor
            floor = max((self._mean(w, d) for w in widths if w < width), default=0.0)
            p = min(p_prev, max(self.p_accept(width, d), floor))
            expected += p
            p_prev = p
        return expected

    def packed(self, width: int, length: int) -> float:
        """Mean packed nodes (root included); before any observation, no sharing assumed."""
        n = self.packed_n.get((width, length), 0.0)
        if n == 0:
            return 1.0 + width * (length - 1)
        return self.packed_sum[(width, length)] / n

    def _mean(self, width: int, depth: int) -> float:
        n = self.trials.get((width, depth), 0.0)
        return self.hits.get((width, depth), 0.0) / n if n else 0.0


def acceptance_kind(temperature: float | None) -> str:
    """The :data:`KINDS` entry of a request: greedy below vLLM's sampling epsilon."""
    return "greedy" if temperature is None or temperature < SAMPLING_EPS else "sampled"


class AcceptanceEstimate(Protocol):
    """What :func:`choose_shape` reads: expected tokens per step and packed tree size."""

    def tokens_per_step(self, width: int, length: int, widths: Sequence[int]) -> float: ...

    def packed(self, width: int, length: int) -> float: ...


@dataclass(frozen=True)
class BatchAcceptance:
    """A batch that mixes kinds: each kind's estimate weighted by its share of the requests."""

    parts: tuple[tuple[AcceptanceStats, float], ...]  # (a kind's stats, its share), shares sum 1

    def tokens_per_step(self, width: int, length: int, widths: Sequence[int]) -> float:
        return sum(share * s.tokens_per_step(width, length, widths) for s, share in self.parts)

    def packed(self, width: int, length: int) -> float:
        return sum(share * s.packed(width, length) for s, share in self.parts)


@dataclass
class DraftCost:
    """Seconds of the drafter's beam search, proportional to B * W * (L - 1) (its head GEMMs)."""

    decay: float = 0.98
    seconds_per_unit: float | None = None

    def observe(self, batch: int, width: int, length: int, seconds: float) -> None:
        rate = seconds / max(1, batch * width * (length - 1))
        self.seconds_per_unit = (rate if self.seconds_per_unit is None else
                                 self.decay * self.seconds_per_unit + (1 - self.decay) * rate)

    def __call__(self, batch: int, width: int, length: int) -> float:
        return (self.seconds_per_unit or 0.0) * batch * width * (length - 1)


@dataclass
class StepTimes:
    """Measured whole-step seconds as a ratio to the model's, per (batch bucket, W, L); W = 0: plain.

    Unmeasured keys borrow: plain steps the nearest bucket's plain ratio (1 if none); a shape
    its ratio at the nearest smaller bucket that measured it, relative to the plain steps of
    each (a server whose load grows starts a batch size from what drafting cost at the last one,
    rather than exploring every shape afresh), failing that the bucket's mean ratio (plain steps
    included), so every estimate there is on the measured scale. The first
    step of a key is not counted: new shapes pay one-time costs (oneDNN builds a GEMM primitive
    per new row count), and a shape judged by that step would never be tried again. Later steps
    move a key's ratio by at most a factor ``clip`` each (a page fault or a GC pause is one step).
    """

    decay: float = 0.9  # per observation of a key: steps drift (context grows, the text changes)
    clip: float = 2.0
    ratio: dict[tuple[int, int, int], float] = field(default_factory=dict)
    weight: dict[tuple[int, int, int], float] = field(default_factory=dict)
    warmed: set[tuple[int, int, int]] = field(default_factory=set)

    def observe(self, batch: int, width: int, length: int, predicted: float, seconds: float):
        key = (bucket(batch), width, length)
        if key not in self.warmed:
            self.warmed.add(key)
            return
        r = seconds / predicted
        if key in self.ratio:
            r = min(max(r, self.ratio[key] / self.clip), self.ratio[key] * self.clip)
        w = self.weight.get(key, 0.0) * self.decay
        self.ratio[key] = (self.ratio.get(key, 0.0) * w + r) / (w + 1)
        self.weight[key] = w + 1

    def measured(self, batch: int, width: int, length: int) -> bool:
        """Whether this shape's ratio at ``batch`` rests on its own timed steps (at this bucket,
        or carried from a smaller one) rather than on the bucket's mean or on nothing."""
        b = bucket(batch)
        return any(k[0] <= b and k[1:] == (width, length) for k in self.ratio)

    def correction(self, batch: int, width: int, length: int) -> float:
        b = bucket(batch)
        if (b, width, length) in self.ratio:
            return self.ratio[(b, width, length)]
        plain = self._plain(b)
        if width == 0:
            return plain
        smaller = [k[0] for k in self.ratio
                   if k[0] < b and k[1:] == (width, length) and (k[0], 0, 0) in self.ratio]
        if smaller:
            s = max(smaller)
            return plain * self.ratio[(s, width, length)] / self.ratio[(s, 0, 0)]
        seen = [(self.ratio[k], self.weight[k]) for k in self.ratio if k[0] == b]
        if not seen:
            return plain
        return sum(r * w for r, w in seen) / sum(w for _, w in seen)

    def _plain(self, b: int) -> float:
        """Bucket b's plain-step ratio, else the nearest bucket's (the curve is of plain
        forwards: its error hardly depends on the batch), else 1."""
        measured = [k[0] for k in self.ratio if k[1] == 0]
        if not measured:
            return 1.0
        nearest = min(measured, key=lambda m: (abs(m.bit_length() - b.bit_length()), m))
        return self.ratio[(nearest, 0, 0)]


@dataclass
class JoinCost:
    """What drafting costs the batch's TPOT by breaking its lockstep (see :class:`BeamPolicy`).

    Measured from the steps themselves: J = ``extra / joins``, the time steps with prefill work
    took beyond the model's decode time of the requests they continued (prefill chunks included)
    per request that joined; N = ``tokens / finished``, the output length of requests that left.
    """

    decay: float = 0.95  # per observation: the load changes
    extra: float = 0.0  # decayed seconds of prefill work
    joins: float = 0.0  # decayed count of requests that joined
    tokens: float = 0.0  # decayed output tokens of finished requests
    finished: float = 0.0  # decayed count of finished requests

    def observe_prefill(self, joined: int, seconds: float) -> None:
        """A step with prefill work: ``joined`` new requests (0: a later chunk) and the seconds
        it took beyond its decode part."""
        self.extra = self.extra * self.decay + max(0.0, seconds)
        self.joins = self.joins * self.decay + joined

    def observe_finished(self, tokens: int) -> None:
        self.tokens = self.tokens * self.decay + tokens
        self.finished = self.finished * self.decay + 1

    def tpot_share(self, batch: int, plain_seconds: float, cap: float = 0.5) -> float:
        """``(B - 1) J / (N t)``: the share of a request's time per token that the other B - 1
        requests' prefills (J seconds each, one per N-token request) take, against a plain step
        of t seconds; 0 until both were measured."""
        if batch < 2 or self.joins < 1 or self.finished < 1 or plain_seconds <= 0:
            return 0.0
        per_join, length = self.extra / self.joins, self.tokens / self.finished
        return min(cap, (batch - 1) * per_join / (max(length, 1.0) * plain_seconds))


def bucket(batch: int) -> int:
    """Batch sizes share step-time figures in powers of two: 1, 2, 4 (3-4), 8 (5-8), ..."""
    return 1 << max(0, batch - 1).bit_length()


@dataclass(frozen=True)
class Choice:
    width: int  # 0 when the step goes without drafts
    length: int
    tokens_per_second: float  # expected, on the measured scale
    seconds: float = 0.0  # the model's seconds for the step (before StepTimes' correction)


def candidate_widths(max_width: int) -> list[int]:
    """1, 2, 4, ... up to ``max_width`` (itself included)."""
    widths = [1]
    while widths[-1] * 2 < max_width:
        widths.append(widths[-1] * 2)
    return sorted({*widths, max_width})


def drafting_shapes(batch: int, max_width: int, max_length: int,
                    target: StepCost | BatchStepCost, stats: AcceptanceEstimate, draft: DraftCost,
                    max_nodes: int | None = None, others: int = 0,
                    times: StepTimes | None = None) -> list[Choice]:
    """Every beam shape this step could draft, with its expected tokens per second.

    ``batch`` requests may draft; ``others`` share the step with one token each (prefill chunks
    count their tokens). ``max_nodes``: the most draft nodes a request may verify. ``times``:
    measured whole steps, scaling the model's seconds.
    """
    n = batch + others
    widths = candidate_widths(max_width)
    shapes = []
    for width in widths if batch else ():
        for length in range(2, max_length + 1):
            packed = stats.packed(width, length)
            if max_nodes is not None and packed - 1 > max_nodes:
                continue
            seconds = target(batch * packed + others, n) + draft(batch, width, length)
            tokens = batch * stats.tokens_per_step(width, length, widths) + others
            scale = times.correction(n, width, length) if times is not None else 1.0
            shapes.append(Choice(width, length, tokens / (seconds * scale), seconds))
    return shapes


def plain_step(n: int, target: StepCost | BatchStepCost, times: StepTimes | None = None) -> Choice:
    """A step of ``n`` requests without drafts, with its tokens per second."""
    seconds = target(n, n)
    scale = times.correction(n, 0, 0) if times is not None else 1.0
    return Choice(0, 0, n / (seconds * scale), seconds)


def choose_shape(batch: int, max_width: int, max_length: int, target: StepCost | BatchStepCost,
                 stats: AcceptanceEstimate, draft: DraftCost, max_nodes: int | None = None,
                 others: int = 0, times: StepTimes | None = None,
                 min_gain: float = 1.0) -> Choice:
    """The beam shape with the most expected tokens per second for this step (module docstring);
    arguments as :func:`drafting_shapes`."""
    return best_of(plain_step(batch + others, target, times),
                   drafting_shapes(batch, max_width, max_length, target, stats, draft, max_nodes,
                                   others, times), min_gain)


def best_of(plain: Choice, shapes: Sequence[Choice], min_gain: float = 1.0) -> Choice:
    """The fastest drafting shape if it beats the plain step by the factor ``min_gain``, else
    the plain step."""
    best = max(shapes, key=lambda c: c.tokens_per_second, default=None)
    bar = plain.tokens_per_second * max(1.0, min_gain)
    return best if best is not None and best.tokens_per_second > bar else plain


class BeamPolicy:
    """The engine's policy state: the curve, the running counts, the drafter's cost, step times.

    The engine calls :meth:`step` once per step, before drafting, with the requests of the step
    that just ended; that ends the timing of the previous step, if :meth:`choose` chose its shape.
    """

    def __init__(self, target: StepCost | BatchStepCost, max_width: int, max_length: int,
                 plain_every: int | None = 32, min_gain: float = DEFAULT_MIN_GAIN,
                 probe_every: int | None = 64, probe_floor: float = 0.8,
                 lockstep_slack: int | None = None) -> None:
        self.target, self.max_width, self.max_length = target, max_width, max_length
        self.stats = {kind: AcceptanceStats() for kind in KINDS}
        self.draft, self.times = DraftCost(), StepTimes()
        self.plain_every = plain_every  # a plain step at least this often (None: never forced)
        # While plain steps win on the model, a shape it predicts losing by less than
        # ``1 - probe_floor``, but that no step has timed at this batch size (nor a smaller one),
        # is drafted for two steps in a row once in ``probe_every`` plain steps: a curve that
        # overprices drafting is otherwise never found out, since only steps taken correct it.
        # Each such shape costs a few steps, at most 1 - probe_floor of a step's time each.
        self.probe_every, self.probe_floor = probe_every, probe_floor
        self._since_probe: dict[int, int] = {}  # bucket -> plain steps since its last probe
        # bucket -> a probe's shape and its batch, to repeat on the same requests
        self._probing: dict[int, tuple[int, int, frozenset]] = {}
        # Drafting must promise this much more than a plain step: the model is measured, with
        # noise, and a shape that merely ties costs more than it gains when it errs.
        self.min_gain = min_gain
        self.joins = JoinCost()
        self._emitted: dict[str, int] = {}  # request id -> tokens emitted while in the batch
        # A batch is in lockstep when most of its requests' tokens left lie this close; None:
        # the lockstep margin is off (the default: not better in the serving sweeps,
        # docs/beam_policy.md).
        self.lockstep_slack = lockstep_slack
        self._steps = 0
        self._locked: tuple[int, int] | None = None  # (batch size, step) last seen in lockstep
        self._since_plain: dict[int, int] = {}  # bucket -> drafted steps since its last plain one
        self._open: tuple[float, frozenset, Choice | None] | None = None  # the step timed now
        # (plain step, chosen, lockstep share c) of the last choose: for the debug step log
        self.last: tuple[Choice, Choice, float] | None = None

    def step(self, request_ids: Sequence[str], prefilling: bool, now: float,
             emitted: Sequence[int] | None = None) -> None:
        """Close the timing of the previous step, if this one continues it.

        A step counts when no request joined it (a joining request's prefill would be in its
        time) and none is mid-prefill: only decode steps of the shape chosen are measured. With
        the lockstep margin on, a step with prefill work measures :class:`JoinCost` instead, and
        ``emitted`` (tokens per request, in ``request_ids`` order) the output length of the
        requests that then leave; with it off (the default) neither is kept.
        """
        ids = frozenset(request_ids)
        self._steps += 1
        if self._open is not None and ids:
            start, before, choice = self._open
            if not prefilling and not ids - before:
                if choice is not None:
                    self.times.observe(len(before), choice.width, choice.length, choice.seconds,
                                       now - start)
            elif choice is not None and self.lockstep_slack is not None:
                self._observe_prefill(ids, before, now - start)
        if self.lockstep_slack is not None:  # JoinCost is read by the lockstep margin only
            self._observe_lengths(request_ids, emitted, self._open[1] if self._open else None)
        self._open = (now, ids, None)

    def _observe_prefill(self, ids: frozenset, before: frozenset, seconds: float) -> None:
        """A step with prefill work: its time beyond the plain decode of the requests it kept."""
        kept = len(ids & before)
        decode = self.target(kept, kept) * self.times.correction(kept, 0, 0) if kept else 0.0
        self.joins.observe_prefill(len(ids - before), seconds - decode)

    def _observe_lengths(self, request_ids: Sequence[str], emitted: Sequence[int] | None,
                         before: frozenset | None) -> None:
        """Count each request's tokens; those that left the batch give JoinCost their length."""
        for request_id, tokens in zip(request_ids, emitted or ()):
            self._emitted[request_id] = self._emitted.get(request_id, 0) + tokens
        if before is None or not request_ids:
            return
        for request_id in before - frozenset(request_ids):
            self.joins.observe_finished(self._emitted.pop(request_id, 0))

    def observe(self, kind: str, width: int, length: int, packed: int, accepted: int) -> None:
        """One verified tree of a request of ``kind`` (:data:`KINDS`)."""
        self.stats[kind].observe(width, length, packed, accepted)

    def observe_no_drafts(self, kinds: Sequence[str]) -> None:
        """A step in which these requests went without drafts."""
        for kind in KINDS:
            if count := sum(k == kind for k in kinds):
                self.stats[kind].observe_no_drafts(count)

    def choose(self, kinds: Sequence[str], max_nodes: int, others: int = 0,
               tokens_left: Sequence[int] | None = None) -> Choice:
        """The shape for a step where requests of these ``kinds`` may draft, ``others`` not;
        ``tokens_left``: how many more tokens each request of the step may emit, drafting or
        not (None: unknown)."""
        batch, n = len(kinds), len(kinds) + others
        mix = BatchAcceptance(tuple((self.stats[kind], kinds.count(kind) / max(batch, 1))
                                    for kind in KINDS if kind in kinds))
        plain = plain_step(n, self.target, self.times)
        shapes = drafting_shapes(batch, self.max_width, self.max_length, self.target, mix,
                                 self.draft, max_nodes, others, self.times)
        # drafting must also win back what breaking the batch's lockstep costs its TPOT
        locked = self._locked_batch(tokens_left)
        share = self.joins.tpot_share(locked, n / plain.tokens_per_second) if locked else 0.0
        # a few of a cohort's requests running without the rest (it arrived or leaves split)
        # stay plain: drafted, they would leave the cohort for good
        fragment = locked > len(tokens_left or ())
        choice = plain if fragment else best_of(plain, shapes, self.min_gain / (1 - share))
        if not choice.width and not fragment:  # a probe would set a fragment apart too
            choice = self._probe(n, plain, shapes, share) or choice
        every = self.plain_every
        since = self._since_plain.get(bucket(n), (every or 2) - 2)  # a bucket's 2nd step: plain
        if every and choice.width and since + 1 >= every:
            choice = Choice(0, 0, 0.0, self.target(n, n))  # measure a plain step now and then
        self._since_plain[bucket(n)] = since + 1 if choice.width else 0
        if self._open is not None:
            self._open = (*self._open[:2], choice)
        self.last = (plain, choice, share)
        return choice

    def lockstep(self, tokens_left: Sequence[int] | None) -> bool:
        """Whether most requests of the batch (at least half, and two) would, without drafts,
        leave it within a few steps of each other (and their successors, in a closed loop, join
        it together): their tokens left lie within ``lockstep_slack``. Most, not all: at a
        cohort's turn-over one request is ahead or behind (it arrived a step apart)."""
        if self.lockstep_slack is None or tokens_left is None or len(tokens_left) < 2:
            return False
        left, most, start = sorted(tokens_left), 0, 0
        for end, value in enumerate(left):
            while value - left[start] > self.lockstep_slack:
                start += 1
            most = max(most, end - start + 1)
        return most >= 2 and 2 * most >= len(left)

    def _locked_batch(self, tokens_left: Sequence[int] | None) -> int:
        """The size of the batch in lockstep this step belongs to, 0 if none. A smaller step
        within two steps of a batch seen in lockstep belongs to it: a cohort arrives split
        (its first requests run a step or two before the rest join) and leaves split too;
        drafting those fragments would set them apart from the cohort."""
        recent = self._locked is not None and self._steps - self._locked[1] <= 2
        size = len(tokens_left or ())
        if size >= 2 and not (recent and self._locked[0] > size):
            self._locked = (size, self._steps) if self.lockstep(tokens_left) else None
            recent = self._locked is not None
        if not recent:
            return 0
        return max(self._locked[0], size)

    def _probe(self, n: int, plain: Choice, shapes: Sequence[Choice],
               share: float = 0.0) -> Choice | None:
        """The untimed shape to draft in place of a plain step, when one is due (see __init__).

        A probe is two steps in a row of the same requests: a shape's first timed step is
        warm-up (StepTimes); on a batch that changed, its second step could not be timed."""
        b = bucket(n)
        batch = self._open[1] if self._open is not None else frozenset()
        pending = self._probing.pop(b, None)
        if pending is not None and pending[2] == batch:
            return next((c for c in shapes if (c.width, c.length) == pending[:2]), None)
        since = self._since_probe.get(b, 0) + 1
        self._since_probe[b] = since
        if not self.probe_every or since < self.probe_every:
            return None
        untimed = [c for c in shapes if not self.times.measured(n, c.width, c.length)
                   and c.tokens_per_second * (1 - share)
                   >= self.probe_floor * plain.tokens_per_second]
        if not untimed:
            return None
        probe = max(untimed, key=lambda c: c.tokens_per_second)
        self._since_probe[b] = 0
        self._probing[b] = (probe.width, probe.length, batch)
        return probe


def step_cost_path(model: str, dtype: str, device: str, threads: int) -> Path:
    """Where ``benchmarks/step_cost.py`` caches the curve of a model on this machine.

    The key names the CPU's ISA too: an AVX2 CPU and an AVX-512 one with as many cores have
    different curves (docs/beam_policy.md). And the model runner's torch threads: on a CPU,
    vLLM's worker gets the cores its thread binding leaves it (by default one core is reserved
    for the engine-core process, so a 2-core machine serves on one thread;
    ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives it both), and every curve is a different one."""
    from vllm_redrafter.target import cache_dir

    machine = f"{platform.machine()}|{os.cpu_count()}|{cpu_isa()}|{device}"
    if device == "cpu":
        machine += f"|threads={threads}"
    key = hashlib.sha256(f"{model}|{dtype}|{machine}".encode()).hexdigest()[:16]
    return cache_dir() / "step_cost" / f"{key}.json"
