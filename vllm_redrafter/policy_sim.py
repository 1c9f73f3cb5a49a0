"""A simulated engine for the beam policy: no vLLM, no model, no GPU.

Each step the policy gets what an engine would report (:class:`~vllm_redrafter.beam_policy.
StepObservation`) and the simulated machine charges the shape it chose: the drafting, then one
target forward over the verified tokens. Both costs come from measured tables, read as they are
(interpolated between measured points, never beyond the measured batch sizes); what the drafter
accepts is fixed beforehand from a stated source, never fitted to make the policy look good.
``tests/test_beam_policy.py`` and ``benchmarks/policy_sim.py`` run it.

Sources (the numbers are copied below, with where they come from):

- acceptance: the shipped drafter's P(accepted >= d) per width at L = 4, measured with the
  reference loop on 20 MT-Bench questions (``benchmarks/results/default_drafter_grid20_L4.json``:
  1.73 / 1.87 / 2.06 / 2.25 / 2.38 tokens per step at W = 1 / 2 / 4 / 8 / 16); depth 4 (L = 5)
  continues each width's last ratio P(>= 3) / P(>= 2). W = 64: the ReDrafter paper's 4.2 tokens
  per step (Vicuna-7B, greedy, L = 5) as a constant per-depth rate p (p + p^2 + p^3 + p^4 = 3.2).
  W = 32: each depth halfway between W = 16 and W = 64 (linear in log2 W).
- packed tree sizes: ``benchmarks/results/compression_ratio.json`` (trained drafter, L = 5):
  12.4 / 21.9 / 40.1 / 73.3 / 135.7 nodes at W = 4 / 8 / 16 / 32 / 64; W = 2 halfway between a
  chain and W = 4; shorter beams in proportion to L - 1.
- GPU costs (:func:`gpu_machine`): a ``benchmarks/gpu_kernels.py`` step table's
  ``redrafter_step`` rows, Vicuna-7B target and drafter, context 512, L = 5, CUDA graphs: the
  plain step, the verify forward by verified tokens, the drafting (beam search, scaled by
  (L - 1) / 4 for shorter beams) and the packing. H100: ``benchmarks/results/
  gpu_kernels_h100.json``, B = 1, 8, 32 (``tests/data`` keeps a copy); H200:
  ``benchmarks/results/gpu_steps_h200.json``, B = 1, 2, 4, 8, 16, 20, 32, 40 (every batch size
  of the paper's Table 5 measured, none interpolated).
- CPU costs: ``benchmarks/results/step_cost_xeon_amx.json`` (SmolLM2-135M on 2 Xeon cores, a
  forward over T tokens per request at B = 1 ... 32); drafting 1.9 ms per beam step plus 0.1 ms
  per beam row, packing 0.55 ms per request (``benchmarks/results/HISTORY.md``: beam search 3.8
  ms at W = 1 L = 3, pack 0.55 ms).
- context candidates (``run(..., candidates=...)``): per request, P(a candidate's first d
  tokens are what the target emits), d = 1, 2, ...: stated per test (a request that copies, one
  that does not), independent of the drafter's acceptance. A step's tree accepts the deeper of
  the drafter's beams and the candidate; the candidate's nodes beyond what the drafter accepted
  are verified too.
"""

from __future__ import annotations

import bisect
import math
import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from vllm_redrafter.beam_policy import BeamPolicy, RequestText, StepObservation, VerifiedTree

SHIPPED_AT_LEAST = {  # default_drafter_grid20_L4.json, "acceptance_at_least", d = 1, 2, 3
    1: (0.4502, 0.1869, 0.0955),
    2: (0.5000, 0.2463, 0.1268),
    4: (0.5670, 0.3183, 0.1777),
    8: (0.6127, 0.3926, 0.2430),
    16: (0.6419, 0.4434, 0.2894),
}
PAPER_W64_TOKENS = 4.2  # ReDrafter paper, Vicuna-7B, greedy, W = 64, L = 5
PACKED_L5 = {1: 5.0, 2: 8.7, 4: 12.4, 8: 21.9, 16: 40.1, 32: 73.3, 64: 135.7}  # compression_ratio
PAPER_TABLE5 = {1: 64, 2: 64, 8: 16, 20: 4, 32: 4, 40: 4}  # the paper's best width per batch size


@dataclass(frozen=True)
class Acceptance:
    """P(accepted >= d | W), d = 1, 2, ...: what the simulated drafter accepts at each width."""

    at_least: dict[int, tuple[float, ...]]

    def accepted(self, rng: random.Random, width: int, length: int) -> tuple[int, ...]:
        """Accepted drafts of one tree by its first w beams, w = 1 .. width (the last: the
        tree's): one uniform draw against each w's decreasing P(>= d), the same draw for every
        w, so a wider tree never accepts less (w between two tabled widths: the narrower)."""
        u = rng.random()
        tabled = [max(t for t in self.at_least if t <= w) for w in range(1, width + 1)]
        return tuple(sum(p > u for p in self.at_least[t][: length - 1]) for t in tabled)

    def tokens_per_step(self, width: int, length: int) -> float:
        return 1.0 + sum(self.at_least[width][: length - 1])

    def scaled(self, factor: float) -> Acceptance:
        """Each depth's P(>= d) times factor**d: a drafter that hits less (sampling, other text)."""
        return Acceptance({w: tuple(p * factor ** (d + 1) for d, p in enumerate(ps))
                           for w, ps in self.at_least.items()})


def shipped_acceptance(widths: Iterable[int] = (1, 2, 4, 8, 16, 32, 64)) -> Acceptance:
    """The module docstring's acceptance, depths 1-4, at the widths asked for."""
    table = {w: (*ps, ps[2] * ps[2] / ps[1]) for w, ps in SHIPPED_AT_LEAST.items()}
    p = _solve(lambda q: q + q**2 + q**3 + q**4 - (PAPER_W64_TOKENS - 1))
    table[64] = (p, p**2, p**3, p**4)
    table[32] = tuple((a + b) / 2 for a, b in zip(table[16], table[64]))
    return Acceptance({w: table[w] for w in widths})


def packed_nodes(width: int, length: int) -> float:
    """Mean packed tree size (root included) of the simulated drafter's beams."""
    return 1.0 + (PACKED_L5[width] - 1.0) * (length - 1) / 4


@dataclass(frozen=True)
class Machine:
    """Seconds of one step's two parts on a simulated machine."""

    verify: Callable[[int, float], float]  # (batch, verified tokens) -> the target's step
    draft: Callable[[int, int, int], float]  # (drafting requests, W, L) -> beam search + packing
    tree: Callable[[int], float] = lambda b: 0.0  # batch -> what a step of trees of several
    # beams pays beyond its tokens (the tree's attention, its KV moves)

    def slowed(self, verify: float = 1.0, draft: float = 1.0) -> Machine:
        """The same machine, its steps' parts this many times slower."""
        return Machine(lambda b, n: verify * self.verify(b, n),
                       lambda b, w, l: draft * self.draft(b, w, l),
                       lambda b: verify * self.tree(b))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), xs increasing; linear beyond the last two points."""
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])


def by_batch(curves: dict[int, Callable[[float], float]]) -> Callable[[int, float], float]:
    """(batch, value per request) from curves measured at some batch sizes: linear between two
    measured batch sizes at the same value per request; outside them, refused."""
    sizes = sorted(curves)

    def at(batch: int, per_request: float) -> float:
        if not sizes[0] <= batch <= sizes[-1]:
            raise ValueError(f"batch {batch} lies outside the measured {sizes[0]}-{sizes[-1]}")
        i = bisect.bisect_left(sizes, batch)
        if sizes[i] == batch:
            return curves[batch](per_request)
        lo, hi = sizes[i - 1], sizes[i]
        w = (batch - lo) / (hi - lo)
        return (1 - w) * curves[lo](per_request) + w * curves[hi](per_request)

    return at


def gpu_machine(rows: Iterable[dict], target: str = "vicuna-7b") -> Machine:
    """A GPU step table's costs (module docstring: GPU costs), milliseconds -> seconds."""
    rows = [r for r in rows if r.get("kernel") == "redrafter_step" and r["target"] == target
            and r["drafter"] == target]
    verify, draft = {}, {}
    for B in sorted({r["B"] for r in rows}):
        mine = sorted((r for r in rows if r["B"] == B), key=lambda r: r["W"])
        ns = [1.0] + [r["verify_tokens"] / B for r in mine]  # verified tokens per request
        ms = [mine[0]["plain_ms"]] + [r["verify_ms"] for r in mine]
        verify[B] = lambda t, ns=ns, ms=ms: interpolate(ns, ms, t) * 1e-3
        ws = [math.log2(r["W"]) for r in mine]
        beam, pack = [r["draft_ms"] for r in mine], [r["pack_ms"] for r in mine]
        draft[B] = lambda x, ws=ws, beam=beam, pack=pack: (
            interpolate(ws, beam, x[0]) * x[1] + interpolate(ws, pack, x[0])) * 1e-3
    verify_at, draft_at = by_batch(verify), by_batch(draft)
    return Machine(lambda b, n: verify_at(b, n / b),
                   lambda b, w, l: draft_at(b, (math.log2(w), (l - 1) / 4)))


def cpu_machine(cells: Iterable[dict]) -> Machine:
    """A step-cost table's costs (``vllm-redrafter step-cost`` cells) and the CPU drafting model
    of the module docstring."""
    verify = {}
    for B in sorted({c["batch"] for c in cells}):
        mine = sorted((c for c in cells if c["batch"] == B), key=lambda c: c["tokens"])
        verify[B] = (lambda t, ts=[c["tokens"] for c in mine], s=[c["seconds"] for c in mine]:
                     interpolate(ts, s, t))
    verify_at = by_batch(verify)
    return Machine(lambda b, n: verify_at(b, n / b),
                   lambda b, w, l: (l - 1) * (1.9e-3 + 1e-4 * b * w) + 0.55e-3 * b)


@dataclass(frozen=True)
class SimStep:
    width: int
    length: int
    tokens: int  # emitted by the batch
    seconds: float  # the whole step, drafting included
    reason: str  # the policy's rule ("fixed" without a policy)
    plain_expected: float = 0.0  # the policy's expected tokens/s of a plain step
    candidates: tuple[int, ...] = ()  # context candidates each request took
    accepted: tuple[int, ...] = ()  # drafts each request accepted (it emitted that + 1)


def run(policy: BeamPolicy | tuple[int, int], machine: Machine | Callable[[int], Machine],
        acceptance: Acceptance, batch: int, steps: int, seed: int = 0, noise: float = 0.0,
        kind: str = "greedy", tag: str = "r",
        candidates: Sequence[Sequence[float]] | None = None, paired: bool = True
        ) -> list[SimStep]:
    """``steps`` decode steps of ``batch`` requests under ``policy`` (or one fixed shape, (0, 0):
    plain). ``machine``: or a function of the step index (a machine that changes mid-run).
    ``noise``: each step's parts times a uniform factor in [1 - noise, 1 + noise]. ``tag``
    names the requests: a run with another tag is a new batch (its first step not timed).
    ``candidates``: per request, P(its context candidate's first d tokens are right), d = 1..;
    each step offers each request one candidate of ``policy.max_length`` - 1 tokens, which the
    policy takes or not (a fixed shape: always). ``paired=False``: the trees do not tell what
    their first w beams accepted (``VerifiedTree.by_beams``), a control for paired gains."""
    rng = random.Random(seed)
    ids = tuple(f"{tag}{i}" for i in range(batch))
    now, verified, draft_seconds, log, emitted = 0.0, (), 0.0, [], 0
    text_rng = random.Random(seed + 1)  # the candidates' draws: rng's sequence stays as without
    depth = policy.max_length - 1 if isinstance(policy, BeamPolicy) else max(policy[1] - 1, 1)
    truth = [[text_rng.randrange(1000) for _ in range(steps * (depth + 1) + 1)] for _ in ids] \
        if candidates is not None else [[0] for _ in ids]  # what each request emits
    outputs: list[list[int]] = [[t[0]] for t in truth]
    drafter_accepted = [0] * batch
    for i in range(steps):
        texts, right = (), [0] * batch
        if candidates is not None:
            offered = []
            for r, ps in enumerate(candidates):
                u = text_rng.random()  # depth d is right iff P(>= d) beats one draw: nested
                right[r] = sum(p > u for p in ps[:depth])
                pos = len(outputs[r])
                cand = list(truth[r][pos: pos + depth])
                if right[r] < depth:
                    cand[right[r]] = 1000 + text_rng.randrange(1000)  # wrong from there on
                offered.append(RequestText(ids[r], outputs[r], (tuple(cand),), 1,
                                           drafter_accepted[r]))
            texts = tuple(offered)
        if isinstance(policy, BeamPolicy):
            choice = policy.step(StepObservation(now, ids, False, verified, draft_seconds,
                                                 (kind,) * batch, 0, 1 << 30, texts, emitted))
            (width, length), reason = (choice.width, choice.length), choice.reason
            plain_expected, took = choice.plain_tokens_per_second, choice.candidates
        else:
            (width, length), reason, plain_expected = policy, "fixed", 0.0
            took = (1,) * len(texts)
        took = tuple(took) or (0,) * batch
        m = machine if isinstance(machine, Machine) else machine(i)
        jitter = (lambda: 1 + noise * (2 * rng.random() - 1)) if noise else (lambda: 1.0)
        packed = packed_nodes(width, length) if width else 1.0
        draft_seconds = m.draft(batch, width, length) * jitter() if width else 0.0
        by_beams = [acceptance.accepted(rng, width, length) if width else () for _ in ids]
        drafter = [b[-1] if b else 0 for b in by_beams]
        accepted = [max(a, right[r] if took[r] else 0) for r, a in enumerate(drafter)]
        extra = [depth - min(drafter[r], right[r]) if took[r] else 0 for r in range(batch)]
        verified = tuple(VerifiedTree(kind, width, length, round(packed), drafter[r], extra[r],
                                      by_beams[r] if paired else ())
                         for r in range(batch) if width or took[r])
        n = sum(packed + extra[r] if width or took[r] else 1 for r in range(batch))
        if candidates is not None:
            for r, a in enumerate(accepted):
                outputs[r].extend(truth[r][len(outputs[r]): len(outputs[r]) + a + 1])
        drafter_accepted = drafter
        tree = m.tree(batch) if width > 1 else 0.0
        seconds = draft_seconds + (m.verify(batch, n) + tree) * jitter()
        now += seconds
        emitted = batch + sum(accepted)
        log.append(SimStep(width, length, batch + sum(accepted), seconds, reason, plain_expected,
                           took, tuple(accepted)))
    return log


def rate(log: Sequence[SimStep]) -> float:
    """Tokens per second over the steps."""
    return sum(s.tokens for s in log) / sum(s.seconds for s in log)


def median_time_per_token(log: Sequence[SimStep]) -> float:
    """The median over the batch's requests of seconds per emitted token (each request waits
    for every step; vLLM's TPOT, without the prefill)."""
    seconds = sum(s.seconds for s in log)
    return statistics.median(seconds / sum(1 + s.accepted[r] for s in log)
                             for r in range(len(log[0].accepted)))


def _solve(f: Callable[[float], float], lo: float = 0.0, hi: float = 1.0) -> float:
    """The root of an increasing f in [lo, hi], by bisection."""
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < 0 else (lo, mid)
    return (lo + hi) / 2
