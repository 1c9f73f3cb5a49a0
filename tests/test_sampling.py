"""sampling.py: the target's distribution (vLLM V1's order) against a plain-Python reference, and
sampling without host syncs (seeded rows, zero-probability tokens, the sample distribution)."""

from __future__ import annotations

import doctest
import itertools
import math

import pytest
import torch
from scipy.stats import chisquare

from vllm_redrafter import sampling
from vllm_redrafter.sampling import (
    SamplingParamsBatch,
    exponential_noise,
    sample_from_probs,
    target_probs,
    uniform_noise,
)

INF = float("inf")


def reference_probs(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> list[float]:
    """vLLM V1's sampling distribution for one row, written out in float64 Python.

    Off values: top_k <= 0 or >= V, top_p >= 1, min_p <= 0. Ties: lower token id first.
    """
    vocab = len(logits)
    order_of = lambda xs: sorted(range(vocab), key=lambda v: (-xs[v], v))  # noqa: E731
    if temperature < 1e-5:  # greedy: the first maximal id
        best = order_of(logits)[0]
        return [1.0 if v == best else 0.0 for v in range(vocab)]
    x = [value / temperature for value in logits]
    if min_p > 0:
        probs = _softmax(x)
        x = [xv if pv >= min_p * max(probs) else -INF for xv, pv in zip(x, probs)]
    order = order_of(x)
    kept = order[:top_k] if 0 < top_k < vocab else order
    if top_p < 1:
        probs = _softmax([x[v] if v in kept else -INF for v in range(vocab)])
        mass, smallest_set = 0.0, []
        for v in kept:
            if mass >= top_p:
                break
            smallest_set.append(v)
            mass += probs[v]
        kept = smallest_set
    return _softmax([x[v] if v in kept else -INF for v in range(vocab)])


def _softmax(x: list[float]) -> list[float]:
    top = max(x)
    e = [math.exp(v - top) if v > -INF else 0.0 for v in x]
    return [v / sum(e) for v in e]


def test_docstring_examples():
    assert doctest.testmod(sampling).failed == 0


def test_target_probs_matches_reference_on_parameter_grid():
    """Every combination in one mixed batch (each row its own parameters), two positions per row."""
    vocab = 8
    grid = list(
        itertools.product(
            [0.0, 0.5, 1.0, 1.7],  # temperature
            [0, -1, 1, 3, vocab, vocab + 5],  # top_k: off, off, ..., = V (off), > V (off)
            [1.0, 0.95, 0.5, 0.01],  # top_p
            [0.0, 0.1, 0.5],  # min_p
        )
    )
    temperature, top_k, top_p, min_p = (list(column) for column in zip(*grid))
    params = SamplingParamsBatch.from_lists(temperature, top_k, top_p, min_p)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(grid), 2, vocab, generator=gen) * 2  # [B, P, V]
    got = target_probs(logits, params)
    for row, (t, k, p, m) in enumerate(grid):
        for pos in range(2):
            expected = reference_probs(logits[row, pos].tolist(), t, k, p, m)
            assert got[row, pos].tolist() == pytest.approx(expected, abs=1e-5), (t, k, p, m)


def test_none_fields_equal_off_values():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 10, generator=gen)
    temperature = [0.8, 1.0, 1.3]
    off = SamplingParamsBatch.from_lists(
        temperature, top_k=[0, 10, -1], top_p=[1.0] * 3, min_p=[0.0] * 3
    )
    none = SamplingParamsBatch.from_lists(temperature)
    torch.testing.assert_close(target_probs(logits, off), target_probs(logits, none))
    plain = (logits / torch.tensor(temperature)[:, None, None]).softmax(-1)
    torch.testing.assert_close(target_probs(logits, none), plain)


@pytest.mark.parametrize(
    "logits, params, expected",
    [
        # greedy: first of the tied maxima (torch.argmax, vLLM's greedy sampler)
        ([0.0, 2.0, 2.0, 1.0], dict(temperature=[0.0]), [0, 1, 0, 0]),
        # top-k on a three-way tie keeps exactly k, lower ids first
        ([1.0, 1.0, 1.0, 0.0], dict(temperature=[1.0], top_k=[2]), [0.5, 0.5, 0, 0]),
        # top-p 0.5 on a tie (each 0.306): the smallest set with mass >= 0.5 has two tokens
        ([1.0, 1.0, 1.0, 0.0], dict(temperature=[1.0], top_p=[0.5]), [0.5, 0.5, 0, 0]),
        # exact boundary: 4 x 0.25, top_p 0.5 -> two tokens (the mass before the third is 0.5, not < 0.5)
        ([0.0, 0.0, 0.0, 0.0], dict(temperature=[1.0], top_p=[0.5]), [0.5, 0.5, 0, 0]),
        # min_p 1.0 keeps exactly the tokens tied with the maximum
        ([2.0, 1.0, 2.0, 0.0], dict(temperature=[1.0], min_p=[1.0]), [0.5, 0, 0.5, 0]),
        # top_p 1.0 is off: tiny probabilities survive
        ([30.0, 0.0, 0.0, 0.0], dict(temperature=[1.0], top_p=[1.0]), None),
    ],
)
def test_ties_and_edge_cases(logits, params, expected):
    logits = torch.tensor([logits])
    got = target_probs(logits, SamplingParamsBatch.from_lists(**params))[0]
    if expected is None:
        assert (got > 0).all() and got[1:].sum() < 1e-12
        return
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float32))
    reference = reference_probs(logits[0].tolist(), *_full(params))
    assert got.tolist() == pytest.approx(reference, abs=1e-6)


def _full(params: dict) -> tuple:
    defaults = dict(top_k=[0], top_p=[1.0], min_p=[0.0])
    full = {**defaults, **params}
    return tuple(full[name][0] for name in ("temperature", "top_k", "top_p", "min_p"))


@pytest.mark.parametrize("ties", [False, True])
def test_top_k_of_a_few_tokens_looks_at_those_only_and_keeps_the_full_sorts_rule(ties):
    """Where every row's k is small, top-k then top-p run on the best k + 1 tokens
    (``torch.topk``): the same logits as sorting the whole vocabulary, also where equal logits
    straddle the k-th rank (rounded logits: many ties; such rows are sorted whole)."""
    gen = torch.Generator().manual_seed(3)
    rows, vocab = 64, 50
    logits = torch.randn(rows, vocab, generator=gen) * 2
    if ties:
        logits = logits.round()
    top_k = torch.randint(1, 12, (rows, 1), generator=gen)
    top_p = torch.tensor([[1.0], [0.9], [0.5], [0.05]]).repeat(rows // 4, 1)
    mixed = top_k.masked_fill(torch.arange(rows)[:, None] % 3 == 0, 0)  # a third: top-k off
    for k in (top_k, mixed):
        for p in (None, top_p):
            fast = sampling._apply_top_k_top_p(logits, k, p)
            off = torch.where(k <= 0, vocab, k)
            whole = sampling._kept_in_order(logits, *sampling._descending(logits), off, p)
            assert torch.equal(fast, whole), (ties, k is mixed, p is None)
    assert int(top_k.max()) <= sampling.FAST_TOP_K  # the fast path ran


def test_top_p_is_applied_after_top_k_renormalisation():
    # probs 0.4, 0.3, 0.2, 0.1; top_k 2 -> 4/7, 3/7; top_p 0.5 then keeps only the first (4/7 >= 0.5).
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    got = target_probs(logits, SamplingParamsBatch.from_lists([1.0], top_k=[2], top_p=[0.5]))
    torch.testing.assert_close(got, torch.tensor([[1.0, 0, 0, 0]]))
    # without top-k, top_p 0.5 needs two tokens (0.4 < 0.5).
    got = target_probs(logits, SamplingParamsBatch.from_lists([1.0], top_p=[0.5]))
    torch.testing.assert_close(got, torch.tensor([[4 / 7, 3 / 7, 0, 0]]))


def test_seeded_rows_reproducible_irrespective_of_batch_composition():
    gen = torch.Generator().manual_seed(2)
    probs = torch.rand(4, 16, 50, generator=gen)  # [B, P, V]: request A = row 0
    alone = SamplingParamsBatch.from_lists([1.0], seeds=[7])
    sample_alone = sample_from_probs(probs[:1], alone)[0]

    torch.manual_seed(123)  # the global RNG (unseeded rows) must not matter
    mixed = SamplingParamsBatch.from_lists([1.0] * 4, seeds=[None, 3, None, 7])
    batch = torch.stack([probs[1], probs[2], probs[3], probs[0]])  # A is now row 3
    sample_mixed = sample_from_probs(batch, mixed)
    torch.testing.assert_close(sample_mixed[3], sample_alone)

    all_seeded = SamplingParamsBatch.from_lists([1.0] * 2, seeds=[7, 9])  # no global draw at all
    torch.testing.assert_close(sample_from_probs(probs[:2], all_seeded)[0], sample_alone)
    # a different seed gives different samples (16 positions over 50 tokens)
    other = SamplingParamsBatch.from_lists([1.0], seeds=[8])
    assert not torch.equal(sample_from_probs(probs[:1], other)[0], sample_alone)


def test_seeded_noise_rows_match_their_generator():
    params = SamplingParamsBatch.from_lists([1.0, 1.0], seeds=[None, 5])
    noise = uniform_noise((2, 3, 4), params)
    expected = torch.rand(3, 4, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(noise[1], expected)
    params = SamplingParamsBatch.from_lists([1.0, 1.0], seeds=[None, 5])  # fresh generators
    expo = exponential_noise((2, 6), params)
    expected = torch.empty(6).exponential_(generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(expo[1], expected)


def test_sample_never_picks_zero_probability_tokens():
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(64, 32, 40, generator=gen)
    probs = probs * (torch.rand(probs.shape, generator=gen) < 0.2)  # ~80% zeros
    probs[:, :, 0] += probs.sum(-1) == 0  # every row keeps some mass
    probs[0, 0] = 0.0
    probs[0, 0, 39] = 1e-30  # a lone tiny mass must still win
    params = SamplingParamsBatch.from_lists([1.0] * 64)
    for _ in range(5):
        sample = sample_from_probs(probs, params)  # [B, P]
        assert (probs.gather(-1, sample[..., None]) > 0).all()
        assert sample[0, 0] == 39


def test_zero_noise_never_selects_a_zero_probability_token(monkeypatch):
    """Even if the exponential noise underflowed to 0 (0/0 = nan would win an argmax)."""
    zero_noise = lambda shape, params, device=None: torch.zeros(shape)  # noqa: E731
    monkeypatch.setattr(sampling, "exponential_noise", zero_noise)
    probs = torch.tensor([[[0.0, 0.0, 0.7, 0.3]]])
    assert sample_from_probs(probs, SamplingParamsBatch.from_lists([1.0])).tolist() == [[2]]


def test_all_seeded_batch_leaves_the_global_rng_alone():
    state = torch.get_rng_state()
    probs = torch.ones(2, 3, 4)
    sample_from_probs(probs, SamplingParamsBatch.from_lists([1.0, 1.0], seeds=[1, 2]))
    assert torch.equal(torch.get_rng_state(), state)
    sample_from_probs(probs, SamplingParamsBatch.from_lists([1.0, 1.0], seeds=[1, None]))
    assert not torch.equal(torch.get_rng_state(), state)


def test_sample_distribution_chi_square():
    """Unnormalised probs: sample frequencies follow probs / sum (seeded, deterministic)."""
    weights = torch.tensor([3.0, 1.0, 0.0, 2.0, 0.5, 0.25])
    rows = 20_000
    params = SamplingParamsBatch.from_lists([1.0] * rows)
    torch.manual_seed(4)
    sample = sample_from_probs(weights.expand(rows, 1, -1), params).view(-1)
    counts = torch.bincount(sample, minlength=6)
    assert counts[2] == 0
    keep = weights > 0
    expected = weights[keep].double() / weights.sum().double() * rows
    assert chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue > 0.01


def test_bad_inputs_raise_with_shapes():
    shapes = r"top_k must be None or a \[B\] = \[2\] tensor, got \(3,\)"
    with pytest.raises(ValueError, match=shapes):
        SamplingParamsBatch(torch.ones(2), top_k=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be a"):
        SamplingParamsBatch(torch.ones(2, 1))
    with pytest.raises(ValueError, match="generators keys must be batch rows 0..1"):
        SamplingParamsBatch(torch.ones(2), generators={2: torch.Generator()})
    params = SamplingParamsBatch.from_lists([1.0, 1.0])
    with pytest.raises(ValueError, match=r"logits must be \[B, ..., V\] with B = 2"):
        target_probs(torch.zeros(3, 4, 5), params)
    with pytest.raises(ValueError, match="B = 2"):
        sample_from_probs(torch.ones(1, 5), params)
