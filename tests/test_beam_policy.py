"""The beam policy (beam_policy.py): step-cost curve, acceptance estimates, the shape it picks."""

from __future__ import annotations

import doctest
import json
import random

import pytest

from vllm_redrafter import beam_policy
from vllm_redrafter.beam_policy import (
    AcceptanceStats,
    BatchStepCost,
    BeamPolicy,
    DraftCost,
    JoinCost,
    StepCost,
    StepTimes,
    acceptance_kind,
    bucket,
    candidate_widths,
    choose_shape,
    load_step_cost,
)


def test_step_cost_interpolates_and_takes_the_median_of_repeats():
    cost = StepCost.from_measurements([(1, 0.010), (1, 0.011), (1, 0.5), (64, 0.040), (8, 0.012)])
    assert cost.tokens == (1, 8, 64) and cost.seconds == (0.011, 0.012, 0.040)
    assert cost(8) == pytest.approx(0.012) and cost(36) == pytest.approx(0.026)
    assert cost(0) == pytest.approx(0.011)  # never below the one-token step


def test_doctests():
    assert doctest.testmod(beam_policy).failed == 0


def test_step_cost_never_falls_with_more_tokens():
    # noise made 4 tokens look cheaper than 1 and 16 cheaper than 8: those points are pooled
    cost = StepCost.from_measurements([(1, 0.068), (2, 0.067), (4, 0.048), (8, 0.101),
                                       (16, 0.085), (32, 0.140)])
    assert list(cost.seconds) == sorted(cost.seconds)
    assert cost.seconds[:3] == pytest.approx([0.061] * 3)
    assert cost.seconds[3:] == pytest.approx([0.093, 0.093, 0.140])


@pytest.mark.parametrize("tokens, seconds", [((1,), (0.1,)), ((8, 1), (0.1, 0.2)),
                                             ((1, 8), (0.1, 0.0))])
def test_step_cost_refuses_bad_curves(tokens, seconds):
    with pytest.raises(ValueError, match="step-cost"):
        StepCost(tokens, seconds)


def test_step_cost_round_trips(tmp_path):
    cost = StepCost((1, 4, 16), (0.01, 0.02, 0.05))
    cost.save(tmp_path / "c.json", model="m")
    assert load_step_cost(tmp_path / "c.json") == cost


# benchmarks/step_cost.py on the AVX2 CPU (2026-11-25), seconds per (batch, tokens per request)
AVX2_CELLS = {(1, 1): 0.0636, (1, 2): 0.0724, (1, 4): 0.0767, (1, 8): 0.1240,
              (2, 1): 0.0943, (2, 2): 0.1005, (2, 4): 0.1057, (2, 8): 0.1222,
              (4, 1): 0.0886, (4, 2): 0.1145, (4, 4): 0.2018, (4, 8): 0.1971}


def cells(table: dict[tuple[int, int], float]) -> list[dict]:
    return [{"batch": b, "tokens": t, "total_tokens": b * t, "seconds": s}
            for (b, t), s in table.items()]


def test_batch_step_cost_keeps_each_batch_sizes_curve_and_interpolates_between():
    cost = BatchStepCost.from_cells(cells(AVX2_CELLS))
    assert [b for b, _ in cost.curves] == [1, 2, 4]
    assert cost(4, 1) == pytest.approx(0.0767) and cost(4, 2) == pytest.approx(0.1005)
    assert cost(16, 4) == pytest.approx((0.2018 + 0.1971) / 2)  # made monotone per batch size
    # 3 requests, 6 tokens: halfway between batch 2 (3 each) and batch 4 (1.5 each)
    assert cost(6, 3) == pytest.approx(((0.1005 + 0.1057) / 2 + (0.0886 + 0.1145) / 2) / 2)
    assert cost(64, 8) == cost(64, 4)  # beyond the largest batch size: its curve
    with pytest.raises(ValueError, match="batch sizes"):
        BatchStepCost(((2, StepCost((1, 2), (0.1, 0.2))), (1, StepCost((1, 2), (0.1, 0.2)))))


def test_a_curve_per_batch_size_lets_one_request_draft_chains(tmp_path):
    """By total tokens alone, 3 tokens look as dear as a batch-2 step (1.4x one): a chain of
    1.4 tokens per step does not pay. One request's own curve says 1.15x: it does."""
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    for accepted in [0] * 65 + [1] * 30 + [2] * 5:  # 1.4 tokens per step
        stats.observe(1, 3, packed=3, accepted=accepted)
    pooled = StepCost.from_measurements((c["total_tokens"], c["seconds"])
                                        for c in cells(AVX2_CELLS))
    assert choose_shape(1, 1, 3, pooled, stats, DraftCost()).width == 0
    (tmp_path / "c.json").write_text(json.dumps({"cells": cells(AVX2_CELLS), "tokens": [1, 2],
                                                 "seconds": [0.1, 0.2]}))
    per_batch = load_step_cost(tmp_path / "c.json")
    assert isinstance(per_batch, BatchStepCost)
    assert choose_shape(1, 1, 3, per_batch, stats, DraftCost()).width == 1
    # batch 4: 3 tokens each cost 1.7x one, more than 1.4 tokens per step pay for
    assert choose_shape(4, 1, 3, per_batch, stats, DraftCost()).length < 3


def test_a_shape_must_beat_the_plain_step_by_the_margin():
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    for accepted in [0] * 70 + [1] * 30:  # 1.3 tokens per step
        stats.observe(1, 2, packed=2, accepted=accepted)
    cost = StepCost((1, 2), (0.010, 0.0124))  # a 2-token step: 1.24x, so drafting gains 5%
    assert choose_shape(1, 1, 2, cost, stats, DraftCost()).width == 1
    assert choose_shape(1, 1, 2, cost, stats, DraftCost(), min_gain=1.08).width == 0
    assert BeamPolicy(cost, 1, 2).min_gain > 1.0  # the engine's policy keeps a margin


def test_candidate_widths():
    assert candidate_widths(1) == [1]
    assert candidate_widths(12) == [1, 2, 4, 8, 12]


def feed(stats: AcceptanceStats, width: int, length: int, p_step: float, n: int, seed: int = 0):
    """n verified trees where each depth is accepted with p_step given the one before."""
    rng = random.Random(seed)
    for _ in range(n):
        accepted = 0
        while accepted < length - 1 and rng.random() < p_step:
            accepted += 1
        stats.observe(width, length, packed=1 + width * (length - 1) // 2, accepted=accepted)


def test_estimates_follow_what_was_measured_and_stay_monotone():
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    feed(stats, 1, 5, 0.5, 4000)
    feed(stats, 4, 5, 0.8, 4000, seed=1)
    # 1 + p + p^2 + p^3 + p^4
    assert stats.tokens_per_step(1, 5, [1, 4]) == pytest.approx(1.9375, abs=0.05)
    assert stats.tokens_per_step(4, 5, [1, 4]) == pytest.approx(3.3616, abs=0.08)
    assert stats.packed(4, 5) == 1 + 4 * 4 // 2 and stats.packed(8, 5) == 33  # unseen: no sharing
    # a width never seen is estimated no lower than the narrower measured ones
    assert stats.tokens_per_step(8, 5, [1, 4, 8]) >= stats.tokens_per_step(4, 5, [1, 4, 8]) - 1e-9


def test_free_verification_picks_wide_long_beams_and_costly_verification_turns_drafts_off():
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    for width, p in ((1, 0.3), (2, 0.4), (4, 0.5), (8, 0.6)):
        feed(stats, width, 5, p, 3000, seed=width)
    no_draft_cost = DraftCost()
    flat = StepCost((1, 4096), (0.010, 0.0100001))  # verifying more tokens costs nothing
    choice = choose_shape(1, 8, 5, flat, stats, no_draft_cost)
    assert (choice.width, choice.length) == (8, 5)
    linear = StepCost((1, 4096), (0.010, 40.96))  # every token costs a whole step
    assert choose_shape(1, 8, 5, linear, stats, no_draft_cost).width == 0  # no drafts
    # the drafter's own cost counts too: a drafter costing a step per beam token is never used
    slow_drafter = DraftCost()
    slow_drafter.observe(1, 1, 2, seconds=0.010)
    assert choose_shape(1, 8, 5, flat, stats, slow_drafter).width < 8


def test_a_large_batch_makes_the_policy_narrow_the_beams():
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    for width, p in ((1, 0.5), (2, 0.55), (4, 0.6), (8, 0.65)):
        feed(stats, width, 4, p, 3000, seed=width)
    # GEMM-bound beyond 64 tokens in total (an H100-like curve, scaled)
    cost = StepCost((1, 64, 512, 4096), (0.010, 0.011, 0.021, 0.16))
    wide = choose_shape(1, 8, 4, cost, stats, DraftCost())
    narrow = choose_shape(32, 8, 4, cost, stats, DraftCost())
    assert wide.width > narrow.width


def test_the_policy_learns_the_best_shape_by_trying():
    """Simulated drafter (P(accept next) = 1 - 0.6 ** W per depth): starting from nothing, the
    policy's choices settle on the shape that is best under the true acceptance."""
    true_p = {w: 1 - 0.6 ** w for w in candidate_widths(16)}
    cost = StepCost((1, 16, 64, 256), (0.010, 0.011, 0.016, 0.050))
    stats, draft, rng = AcceptanceStats(), DraftCost(), random.Random(0)

    def true_rate(width: int, length: int) -> float:
        p, tokens = true_p[width], 1.0
        for d in range(1, length):
            tokens += p ** d
        return tokens / cost(1 + width * (length - 1))

    chosen = []
    for _ in range(3000):
        c = choose_shape(1, 16, 5, cost, stats, draft)
        chosen.append((c.width, c.length))
        accepted = 0
        while accepted < c.length - 1 and rng.random() < true_p[c.width]:
            accepted += 1
        stats.observe(c.width, c.length, 1 + c.width * (c.length - 1), accepted)
    best = max(((w, L) for w in true_p for L in range(2, 6)), key=lambda s: true_rate(*s))
    late = chosen[-500:]
    achieved = sum(true_rate(*s) for s in late) / len(late)
    assert achieved >= 0.95 * true_rate(*best), (best, late[-10:])


def test_drafting_off_is_retried_as_the_counts_fade():
    stats = AcceptanceStats(decay=0.99, explore=0.5)
    for _ in range(500):  # chains that accept nothing: drafting does not pay
        stats.observe(1, 4, packed=4, accepted=0)
    cost = StepCost((1, 8), (0.010, 0.030))
    assert choose_shape(1, 1, 4, cost, stats, DraftCost()).width == 0
    steps = 0
    while choose_shape(1, 1, 4, cost, stats, DraftCost()).width == 0:
        stats.observe_no_drafts(1)
        steps += 1
        assert steps < 10_000, "drafting was never tried again"
    assert steps > 10  # but not at once


def test_requests_that_cannot_draft_still_share_the_step():
    """Tokens of requests without drafts (e.g. a prefill chunk) share the step: drafting pays
    while the step stays below the GEMM-bound knee, and not once the others push it past."""
    stats = AcceptanceStats(decay=1.0, explore=0.0)
    feed(stats, 2, 4, 0.7, 3000)
    cost = StepCost((1, 64, 512, 4096), (0.010, 0.011, 0.021, 0.16))
    assert choose_shape(1, 2, 4, cost, stats, DraftCost()).width > 0
    assert choose_shape(1, 2, 4, cost, stats, DraftCost(), others=200).width > 0
    assert choose_shape(1, 2, 4, cost, stats, DraftCost(), others=2000).width == 0


def test_greedy_and_sampled_requests_are_judged_by_their_own_acceptance():
    """Greedy requests accept most drafts, sampled ones none: each kind's steps follow its own
    counts (one pool would let greedy figures send sampled batches drafting), a mix in between."""
    assert [acceptance_kind(t) for t in (0.0, 1e-6, None, 0.7, 1.0)] == [
        "greedy", "greedy", "greedy", "sampled", "sampled"]
    cost = StepCost((1, 64, 4096), (0.010, 0.016, 0.5))
    policy = BeamPolicy(cost, max_width=1, max_length=4, plain_every=None)
    for kind, stats in policy.stats.items():
        stats.explore = 0.0
        p = 0.9 if kind == "greedy" else 0.0
        feed(stats, 1, 4, p, 3000, seed=len(kind))
    greedy = policy.choose(["greedy"] * 4, max_nodes=8)
    assert greedy.width == 1 and greedy.length == 4
    assert policy.choose(["sampled"] * 4, max_nodes=8).width == 0
    mix = policy.choose(["greedy", "sampled", "sampled", "sampled"], max_nodes=8)
    assert mix.tokens_per_second < greedy.tokens_per_second
    before = {kind: stats.trials[(1, 1)] for kind, stats in policy.stats.items()}
    policy.observe_no_drafts(["sampled"] * 4)
    assert policy.stats["greedy"].trials[(1, 1)] == before["greedy"]  # untouched
    assert policy.stats["sampled"].trials[(1, 1)] < before["sampled"]


def run_engine(policy: BeamPolicy, true_seconds, true_p: float, steps: int, seed: int = 0,
               batch: int = 1, tokens_left: list[int] | None = None):
    """Simulated engine steps of ``batch`` requests under ``policy``: per step the chosen shape,
    the tokens it emitted and its true seconds (``true_seconds(width, length)``); acceptance
    P(next) = true_p per depth; ``tokens_left`` per request, as the engine would report them."""
    rng, now, log = random.Random(seed), 0.0, []
    ids = [f"r{i}" for i in range(batch)]
    for _ in range(steps):
        policy.step(ids, prefilling=False, now=now)
        choice = policy.choose(["greedy"] * batch, max_nodes=64, tokens_left=tokens_left)
        tokens = batch
        if choice.width:
            for _ in ids:
                accepted = 0
                while accepted + 1 < choice.length and rng.random() < true_p:
                    accepted += 1
                policy.observe("greedy", choice.width, choice.length,
                               1 + choice.width * (choice.length - 1), accepted)
                tokens += accepted
        else:
            policy.observe_no_drafts(["greedy"] * batch)
        seconds = true_seconds(choice.width, choice.length)
        now += seconds
        log.append((choice.width, tokens, seconds))
    return log


def test_measured_steps_overrule_a_curve_that_flatters_drafting():
    """The curve says verifying is free; on the machine every verified token costs a whole step.
    Timing whole steps, the policy ends up as fast as plain decoding (never slower)."""
    flat = StepCost((1, 4096), (0.010, 0.0100001))
    policy = BeamPolicy(flat, max_width=4, max_length=4)
    steep = lambda width, length: 0.010 * (1 + width * (length - 1))  # noqa: E731
    late = run_engine(policy, steep, true_p=0.6, steps=3000)[-1000:]
    rate = sum(tokens for _, tokens, _ in late) / sum(seconds for *_, seconds in late)
    assert rate >= 0.97 * (1 / 0.010), rate
    assert policy.times.correction(1, 0, 0) == pytest.approx(1.0)
    assert policy.times.correction(1, 4, 4) > 5


def test_a_curve_that_overprices_drafting_is_found_out_by_probes():
    """The curve prices each extra verified token at 0.6 of a step; on the machine a drafted step
    costs 1.05x a plain one. On the model drafting loses (by less than the probe floor), and
    without probes nothing ever times a drafted step to correct it. With them, the untimed shape
    is drafted now and then, its time measured, and the policy drafts from then on."""
    steep = StepCost((1, 4096), (0.010, 0.010 * (1 + 0.6 * 4095)))
    cheap = lambda width, length: 0.010 if width == 0 else 0.0105  # noqa: E731

    def late_rate_and_drafted(policy: BeamPolicy) -> tuple[float, float]:
        late = run_engine(policy, cheap, true_p=0.6, steps=3000)[-1000:]
        rate = sum(tokens for _, tokens, _ in late) / sum(seconds for *_, seconds in late)
        return rate, sum(width > 0 for width, *_ in late) / len(late)

    rate, drafted = late_rate_and_drafted(BeamPolicy(steep, max_width=1, max_length=3))
    assert drafted > 0.8 and rate > 1.4 / 0.010, (drafted, rate)
    rate, drafted = late_rate_and_drafted(BeamPolicy(steep, 1, 3, probe_every=None))
    assert drafted == 0 and rate == pytest.approx(1 / 0.010)


def test_probes_are_few_and_only_of_shapes_never_timed():
    """A curve that prices drafting right (it loses by 10%): each untimed shape is probed until
    timed (twice: a key's first step is warm-up), then never again."""
    cost = StepCost((1, 4096), (0.010, 0.010 * (1 + 0.7 * 4095)))
    true = lambda width, length: cost(1 + width * (length - 1)) if width else 0.010  # noqa: E731
    policy = BeamPolicy(cost, max_width=2, max_length=3, probe_every=16)
    log = run_engine(policy, true, true_p=0.5, steps=4000)
    drafted = [i for i, (width, *_) in enumerate(log) if width]
    assert 2 <= len(drafted) <= 2 * 4, drafted  # at most 4 shapes, each twice in a row
    assert max(drafted) < 2000, drafted  # all early: nothing left untimed
    rate = sum(tokens for _, tokens, _ in log) / sum(seconds for *_, seconds in log)
    assert rate >= 0.99 / 0.010, rate


def test_a_new_batch_size_starts_from_what_a_smaller_one_measured():
    """Drafted steps cost 2x what the curve says at every batch size. Learnt at batch 2, that
    carries to batch 4 (relative to its plain steps): it explores there only briefly."""
    flat = StepCost((1, 4096), (0.010, 0.0100001))
    slow = lambda width, length: 0.010 * (1.0 if width == 0 else 2.0 + 0.1 * width)  # noqa: E731
    policy = BeamPolicy(flat, max_width=4, max_length=4)
    run_engine(policy, slow, true_p=0.5, steps=2000, batch=2)
    log = run_engine(policy, slow, true_p=0.5, steps=1000, batch=4, seed=1)
    drafted = sum(width > 0 for width, *_ in log)
    assert drafted <= 15, drafted
    assert policy.times.correction(4, 4, 4) > 1.8  # never drafted at batch 4: carried over


def test_where_drafting_pays_a_plain_step_is_still_timed_now_and_then():
    cost = StepCost((1, 4096), (0.010, 0.011))
    policy = BeamPolicy(cost, max_width=2, max_length=3, plain_every=16)
    cheap = lambda width, length: 0.010 if width == 0 else 0.0105  # noqa: E731
    log = run_engine(policy, cheap, true_p=0.9, steps=800)
    plain = sum(width == 0 for width, *_ in log) / len(log)
    assert 1 / 16 - 0.01 <= plain <= 1 / 16 + 0.02
    assert policy.times.weight[(1, 0, 0)] > 0


def test_only_decode_steps_of_an_unchanged_batch_are_timed():
    """``step(ids, prefilling, now)`` ends the step begun by the previous call: it is timed only
    if a shape was chosen for it, nobody joined it and no prefill ran in it."""
    policy = BeamPolicy(StepCost((1, 64), (0.010, 0.020)), max_width=1, max_length=2,
                        plain_every=None)  # W=1 L=2 at every step: drafting pays on this curve

    def step(ids: list[str], now: float, prefilling: bool = False, choose: bool = True):
        policy.step(ids, prefilling=prefilling, now=now)
        return policy.choose(["greedy"] * len(ids), max_nodes=8) if choose else None

    step(["a"], 0.0)
    step(["a", "b"], 5.0)  # b joined: its prefill was in this step
    step(["a", "b"], 6.0, prefilling=True)  # a chunked prefill ran in this step
    step(["a"], 9.0, choose=False)  # b left: timed (3 s), the first step of (2, 1, 2): warm-up
    step(["a"], 10.0)  # no shape was chosen for the step that ends here
    step(["a"], 12.0, choose=False)  # timed (2 s), the first step of (1, 1, 2): warm-up
    last = policy.choose(["greedy"], max_nodes=8)
    step(["a"], 14.5, choose=False)  # timed: 2.5 s
    assert policy.times.warmed == {(2, 1, 2), (1, 1, 2)}
    assert policy.times.ratio == {(1, 1, 2): pytest.approx(2.5 / last.seconds)}


def test_join_cost_is_the_others_prefills_per_output_token():
    joins = JoinCost(decay=1.0)
    assert joins.tpot_share(8, 0.06) == 0.0  # nothing measured yet
    for _ in range(4):
        joins.observe_prefill(1, 0.080)
        joins.observe_finished(64)
    joins.observe_prefill(0, 0.0)  # a later prefill chunk of nothing: no new join
    assert joins.tpot_share(8, 0.06) == pytest.approx(7 * 0.080 / (64 * 0.06))
    assert joins.tpot_share(1, 0.06) == 0.0  # one request: nobody else's prefill in its time
    assert joins.tpot_share(64, 0.06) == 0.5  # capped


def test_a_batch_is_in_lockstep_while_its_requests_would_leave_together():
    policy = BeamPolicy(StepCost((1, 64), (0.010, 0.020)), max_width=1, max_length=2,
                        lockstep_slack=4)
    assert policy.lockstep([63, 63, 61, 59])  # within the slack of 4 tokens
    assert policy.lockstep([63, 2, 2, 2, 1, 2, 2, 2])  # a cohort and its early successor
    assert not policy.lockstep([63, 40])
    assert not policy.lockstep([60, 52, 44, 36, 28, 20, 12, 4])  # out of step
    assert not policy.lockstep([63])  # nobody else's prefill to wait for
    assert not policy.lockstep(None)  # unknown
    default = BeamPolicy(StepCost((1, 64), (0.010, 0.020)), max_width=1, max_length=2)
    assert not default.lockstep([63, 63, 63])  # the lockstep margin is off by default


def test_steps_with_prefill_measure_the_join_cost_and_finished_requests_their_length():
    """Plain steps cost what the curve says (10 ms); a step in which request c joined took 90 ms:
    80 ms of prefill beyond the decode of a and b. b leaves after emitting 2 tokens."""
    policy = BeamPolicy(StepCost((1, 64), (0.010, 0.010001)), max_width=1, max_length=2,
                        min_gain=100.0, lockstep_slack=4)  # never drafts; the margin measured

    def step(ids: list[str], now: float, emitted: list[int]):
        policy.step(ids, prefilling=False, now=now, emitted=emitted)
        policy.choose(["greedy"] * len(ids), max_nodes=8)

    step(["a", "b"], 0.0, [1, 1])
    step(["a", "b", "c"], 0.090, [1, 1, 1])  # c joined
    step(["a", "c"], 0.100, [1, 1])  # b left, after the 2 tokens of the first two calls
    assert policy.joins.extra / policy.joins.joins == pytest.approx(0.080)
    assert policy.joins.tokens / policy.joins.finished == 2


LOCKSTEP_COST = StepCost((1, 8, 24), (0.010, 0.020, 0.0304))
"""W=1 L=3 drafts give 1.36x a plain step's tokens/s alone, 1.17x in pairs, 1.15x at batch 8."""


def lockstep_policy(**kwargs) -> BeamPolicy:
    """A W=1 L=3 policy on LOCKSTEP_COST with the lockstep margin on, its join cost measured:
    40 ms of prefill per joining request, 64-token answers."""
    policy = BeamPolicy(LOCKSTEP_COST, max_width=1, max_length=3, plain_every=None,
                        lockstep_slack=4, **kwargs)
    for _ in range(10):
        policy.joins.observe_prefill(1, 0.040)
        policy.joins.observe_finished(64)
    return policy


def test_drafting_that_gains_less_than_lockstep_costs_is_left_off():
    """The curve (the machine's true cost) makes W=1 L=3 drafts 1.36x a plain step's tokens/s
    alone, 1.17x in pairs, 1.15x at batch 8. With 40 ms of prefill per joining request and
    64-token answers, breaking the batch's lockstep costs each request the other requests'
    prefills: 0.05 of a plain step per token in pairs, 0.22 at batch 8, more than drafting wins
    there. The policy drafts alone and in pairs, not at batch 8, unless that batch is out of step
    already (its requests' tokens left far apart)."""
    cost = LOCKSTEP_COST

    def drafted(batch: int, lockstep: bool = True) -> float:
        policy = lockstep_policy()
        left = [40] * batch if lockstep else [40 + 8 * i for i in range(batch)]
        true = lambda width, length: cost(batch * (1 + width * (length - 1)))  # noqa: E731
        log = run_engine(policy, true, true_p=0.5, steps=1500, batch=batch, tokens_left=left)
        return sum(width > 0 for width, *_ in log[-500:]) / 500

    assert drafted(1) > 0.9
    assert drafted(2) > 0.9
    assert drafted(8) < 0.02
    # a batch already out of step has nothing left to lose: drafting pays there
    assert drafted(8, lockstep=False) > 0.9


def test_a_cohorts_lone_first_request_does_not_draft_apart_from_it():
    """Right after a batch of 8 in lockstep, a request running alone for a step (the first of the
    next cohort to arrive) is judged as part of that batch of 8: no drafts. Alone for longer, it
    drafts: drafting alone pays 1.36x."""
    policy = lockstep_policy(probe_every=None)
    cohort = [f"r{i}" for i in range(8)]
    policy.step(cohort, prefilling=False, now=0.0)
    assert policy.choose(["greedy"], max_nodes=8, others=7, tokens_left=[62] + [1] * 7).width == 0
    widths = []
    for k in range(1, 5):
        policy.step(["next"], prefilling=False, now=0.02 * k)
        widths.append(policy.choose(["greedy"], max_nodes=8, tokens_left=[62 - k]).width)
    assert widths[:2] == [0, 0] and widths[-1] > 0, widths


def test_a_cohort_arriving_split_does_not_draft_its_first_requests():
    """3 of the next cohort of 8 arrived a step before the rest: in lockstep among themselves,
    but a fragment of the batch of 8 seen just before; drafting pays for 3 (1.17x in pairs on
    this curve) yet they stay plain until the cohort is whole, or long enough apart from it."""
    policy = lockstep_policy(probe_every=None)
    policy.step([f"r{i}" for i in range(8)], prefilling=False, now=0.0, emitted=[64] * 8)
    policy.choose(["greedy"] * 8, max_nodes=8, tokens_left=[1] * 8)
    widths = []
    for k in range(1, 5):
        policy.step(["a", "b", "c"], prefilling=False, now=0.02 * k, emitted=[1] * 3)
        widths.append(policy.choose(["greedy"] * 3, max_nodes=8, tokens_left=[63 - k] * 3).width)
    assert widths[:2] == [0, 0] and widths[-1] > 0, widths


def test_a_fragment_of_a_cohort_is_never_probed():
    """A probe is due (every plain step), but the lone request right after a batch of 8 in
    lockstep is part of that cohort: a probe would set it apart as surely as drafting would."""
    policy = BeamPolicy(LOCKSTEP_COST, max_width=1, max_length=3, plain_every=None, probe_every=1,
                        min_gain=10.0, lockstep_slack=4)  # never pays: only a probe would draft
    cohort = [f"r{i}" for i in range(8)]
    policy.step(cohort, prefilling=False, now=0.0)
    policy.choose(["greedy"] * 8, max_nodes=8, tokens_left=[40] * 8)
    policy.step(["r0"], prefilling=False, now=0.02)
    assert policy.choose(["greedy"], max_nodes=8, tokens_left=[39]).width == 0
    for k in range(2, 6):  # alone for longer: no cohort any more, probes resume
        policy.step(["r0"], prefilling=False, now=0.02 * k)
        width = policy.choose(["greedy"], max_nodes=8, tokens_left=[40 - k]).width
    assert width > 0


def test_step_times_skip_warm_up_and_clip_outliers():
    times = StepTimes(decay=1.0, clip=2.0)
    times.observe(1, 1, 3, predicted=0.05, seconds=5.0)  # first step of the shape: not counted
    assert times.correction(1, 1, 3) == 1.0
    times.observe(1, 1, 3, predicted=0.05, seconds=0.06)
    times.observe(1, 1, 3, predicted=0.05, seconds=6.0)  # a pause: moves the ratio by <= 2x
    assert times.correction(1, 1, 3) == pytest.approx((1.2 + 2.4) / 2)
    assert times.correction(1, 4, 4) == times.correction(1, 1, 3)  # unseen: the bucket's mean
    assert times.correction(2, 1, 3) == 1.0  # another bucket


def test_unmeasured_keys_borrow_from_other_buckets():
    times = StepTimes(decay=1.0)
    for _ in range(2):  # the first step of each key is warm-up
        times.observe(2, 0, 0, predicted=0.010, seconds=0.012)
        times.observe(2, 1, 4, predicted=0.010, seconds=0.024)
    assert times.correction(8, 0, 0) == pytest.approx(1.2)  # plain: the nearest bucket's
    assert times.correction(8, 1, 4) == pytest.approx(2.4)  # drafting: 2x plain, as at 2
    for _ in range(2):
        times.observe(8, 0, 0, predicted=0.010, seconds=0.015)
    assert times.correction(8, 1, 4) == pytest.approx(1.5 * 2)
    assert times.correction(1, 1, 4) == pytest.approx(1.2)  # nothing smaller: plain's, borrowed
    assert times.correction(8, 2, 4) == pytest.approx(1.5)  # never measured: the bucket's mean


def test_batch_buckets():
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]


def test_step_cost_cache_is_per_cpu_isa_and_thread_count(monkeypatch):
    paths = set()
    for isa in ("avx2", "avx512_bf16"):
        monkeypatch.setattr(beam_policy, "cpu_isa", lambda isa=isa: isa)
        for threads in (1, 2):
            paths.add(beam_policy.step_cost_path("model", "torch.float32", "cpu", threads))
    assert len(paths) == 4
    gpu = {beam_policy.step_cost_path("model", "torch.bfloat16", "NVIDIA H100", t) for t in (1, 8)}
    assert len(gpu) == 1  # on a GPU the host's threads do not set the step's cost


def test_cpu_isa_names_the_widest_matrix_unit(monkeypatch):
    from vllm_redrafter import cpu_features

    for flags, isa in (({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, "amx_bf16"),
                       ({"avx2", "avx512f", "avx512_bf16"}, "avx512_bf16"), ({"avx2"}, "avx2"),
                       (set(), "")):
        monkeypatch.setattr(cpu_features, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert cpu_features.cpu_isa() == isa
    assert cpu_features.has_amx_bf16() is False
