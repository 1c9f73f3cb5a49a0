"""Tests for beam_search.py: parity with a plain-Python beam search, per-request shapes, no sync.

Exact parity runs in float64, where batched and one-beam-at-a-time arithmetic agree to ~1e-15, and
the reference reports the smallest score gap that decided anything (``margin``): each comparison
first checks that no tie between different extensions was involved, so the tokens must agree
exactly whatever order torch.topk gives to ties.
"""

from __future__ import annotations

import doctest
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from vllm_redrafter import beam_search as beam_search_module
from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter

NEG_INF = float("-inf")
LOG_ZERO = -5e4  # Apple's "log 0" (written out here, not imported: the test is independent)
APPLE_TOP_K = 50  # logits Apple's warp keeps
MIN_MARGIN = 1e-9  # float64: far above the batched-vs-unbatched rounding, far below real gaps


# -- drafters ----------------------------------------------------------------------------------


class FakeDrafter:
    """The drafter interface with fixed random weights: s' = tanh(E[x] + s U), logits = [h, s] A.

    ``draft_ids`` (the target ids of the K draft tokens) gives a reduced draft vocabulary.
    """

    def __init__(
        self,
        vocab: int,
        draft_ids: list[int] | None = None,
        *,
        hidden: int = 6,
        seed: int = 0,
        dtype: torch.dtype = torch.float64,
        scale: float = 2.5,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        k = vocab if draft_ids is None else len(draft_ids)
        self.config = SimpleNamespace(vocab_size=vocab, hidden_size=hidden)
        self.embed = torch.randn(vocab, hidden, generator=gen).to(dtype)
        self.u = (torch.randn(hidden, hidden, generator=gen) / hidden**0.5).to(dtype)
        self.head = (scale * torch.randn(2 * hidden, k, generator=gen) / hidden**0.5).to(dtype)
        self.draft_ids = None if draft_ids is None else torch.tensor(draft_ids)

    @property
    def draft_vocab_size(self) -> int:
        return self.head.shape[1]

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor:
        return self.embed.new_zeros((*batch_shape, self.embed.shape[1]))

    def update_state(self, state: Tensor, token_ids: Tensor) -> Tensor:
        return torch.tanh(self.embed[token_ids] + state @ self.u)

    def draft_logits(self, h: Tensor, state: Tensor) -> Tensor:
        return torch.cat([h.to(state.dtype), state], dim=-1) @ self.head

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        if self.draft_ids is None:
            return draft_ids
        return self.draft_ids.to(draft_ids.device)[draft_ids]


def real_drafter(
    *, rnn: bool = True, exit_dim: int = 16, draft_vocab: int | None = 56, seed: int = 0,
    dtype: torch.dtype = torch.float64,
) -> RecurrentDrafter:
    """A tiny RecurrentDrafter (V = 64, H = 8, 2 ResBlocks), every weight random (not zero-init)."""
    config = DrafterConfig(
        vocab_size=64, hidden_size=8, exit_dim=exit_dim, num_draft_layers=2, rnn=rnn,
        draft_vocab_size=draft_vocab,
    )
    embedding = nn.Embedding(64, 8)
    drafter = RecurrentDrafter(config, embedding)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in [*drafter.parameters(), embedding.weight]:
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
        drafter.lm_head[-1].weight.mul_(3.0)  # logits spread over a few nats
        if draft_vocab is not None:
            drafter.draft_vocab_ids.copy_(torch.randperm(64, generator=gen)[:draft_vocab])
    embedding.to(dtype)
    return drafter.to(dtype)


def inputs(drafter, batch: int, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Random h [B, H] (in the drafter's dtype) and g0 [B]."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(batch, drafter.config.hidden_size, generator=gen)
    g0 = torch.randint(drafter.config.vocab_size, (batch,), generator=gen)
    return h.to(drafter.init_state(()).dtype), g0


# -- the plain-Python reference ----------------------------------------------------------------


@dataclass
class Reference:
    beams: list[list[int]]  # [W][L] target ids
    scores: list[float]  # [W]
    log_probs: list[list[list[float]]]  # [W][L-1][V]
    margin: float  # smallest score gap between different extensions that decided a rank


def reference_beam_search(
    drafter, h: Tensor, g0: int, width: int, length: int, apple_warp: bool = True
) -> Reference:
    """Textbook beam search over Python lists: every beam's K extensions, one beam at a time.

    Candidates are ranked with Python's stable sort, so exact ties go to the lower (parent, draft
    id); beam_search leaves that order to torch.topk. ``margin`` (see ``_margin``) lets a test
    check that no tie between *different* extensions decided anything, so both must agree.
    """
    vocab, k = drafter.config.vocab_size, drafter.draft_vocab_size
    target_id = [int(drafter.to_target_ids(torch.tensor(d))) for d in range(k)]
    # a beam: (tokens, score, recurrent state before its last token is read, log-prob rows)
    beams = [([g0], 0.0 if w == 0 else LOG_ZERO, drafter.init_state(()), []) for w in range(width)]
    margin = math.inf
    for _ in range(length - 1):
        candidates = []
        for tokens, score, state, rows in beams:
            state = drafter.update_state(state, torch.tensor(tokens[-1]))  # one beam: [H]
            log_q = log_softmax(warp(drafter.draft_logits(h, state).tolist(), apple_warp))
            row = [NEG_INF] * vocab
            for d in range(k):
                row[target_id[d]] = log_q[d]
            for d in range(k):
                candidates.append((score + log_q[d], tokens + [target_id[d]], state, rows + [row]))
        candidates.sort(key=lambda c: -c[0])  # stable: ties keep the (parent, draft id) order
        margin = min(margin, _margin(candidates, width))
        beams = [(tokens, score, state, rows) for score, tokens, state, rows in candidates[:width]]
    return Reference(
        beams=[b[0] for b in beams], scores=[b[1] for b in beams], log_probs=[b[3] for b in beams],
        margin=margin,
    )


def warp(logits: list[float], apple_warp: bool) -> list[float]:
    """Keep the 50 largest logits (and any tied with the 50th); the rest become -5e4."""
    if not apple_warp or len(logits) <= APPLE_TOP_K:
        return logits
    kth = sorted(logits, reverse=True)[APPLE_TOP_K - 1]
    return [x if x >= kth else LOG_ZERO for x in logits]


def log_softmax(xs: list[float]) -> list[float]:
    top = max(xs)
    lse = top + math.log(sum(math.exp(x - top) for x in xs))
    return [x - lse for x in xs]


def _margin(ranked: list[tuple], width: int) -> float:
    """Smallest score gap between neighbours among the first width+1 ranked candidates that differ.

    Neighbours with identical tokens (extensions of identical root copies) are identical beams,
    so their order changes nothing; any other pair must be separated for the ranking to be unique.
    """
    pairs = zip(ranked[:width], ranked[1 : width + 1])
    return min((a[0] - b[0] for a, b in pairs if a[1] != b[1]), default=math.inf)


def assert_row_matches(out, b: int, ref: Reference, atol: float = 1e-9) -> None:
    width, length = out.beams.shape[1:]
    assert ref.margin > MIN_MARGIN, "a near-tie decided the reference's ranking: pick other inputs"
    assert out.beams[b].tolist() == ref.beams
    expected = torch.tensor(ref.scores, dtype=out.scores.dtype)
    torch.testing.assert_close(out.scores[b], expected, rtol=0, atol=atol)
    if out.log_probs is not None:
        vocab = out.log_probs.shape[-1]
        rows = torch.tensor(ref.log_probs, dtype=out.log_probs.dtype)
        rows = rows.reshape(width, length - 1, vocab)  # also for L = 1
        torch.testing.assert_close(out.log_probs[b], rows, rtol=0, atol=atol)


# -- tests --------------------------------------------------------------------------------------


def test_docstring_examples_run_verbatim():
    result = doctest.testmod(beam_search_module)
    assert result.attempted >= 3
    assert result.failed == 0


REDUCED_56 = [int(i) for i in torch.randperm(64, generator=torch.Generator().manual_seed(7))[:56]]

CASES = [  # (vocab, draft ids, B, W, L, apple_warp)
    (64, None, 3, 1, 5, True),  # W = 1: greedy
    (64, None, 3, 4, 4, True),
    (64, None, 2, 4, 4, False),
    (64, REDUCED_56, 2, 5, 3, True),  # K = 56 > 50: the warp cuts the reduced vocab too
    (64, REDUCED_56, 2, 5, 3, False),
    (20, [3, 17, 0, 9], 2, 6, 3, True),  # W > K: root copies survive the first step
    (16, None, 2, 16, 3, False),  # W = K
    (64, None, 2, 3, 1, True),  # L = 1: no draft step
]


@pytest.mark.parametrize(("vocab", "draft_ids", "batch", "width", "length", "apple_warp"), CASES)
def test_matches_plain_python_beam_search(vocab, draft_ids, batch, width, length, apple_warp):
    drafter = FakeDrafter(vocab, draft_ids, seed=width * 10 + length)
    h, g0 = inputs(drafter, batch)
    out = beam_search(drafter, h, g0, width, length, apple_warp=apple_warp, return_log_probs=True)
    assert out.beams.shape == (batch, width, length) and out.beams.dtype == torch.long
    assert out.log_probs.shape == (batch, width, length - 1, vocab)
    for b in range(batch):
        ref = reference_beam_search(drafter, h[b], int(g0[b]), width, length, apple_warp)
        assert_row_matches(out, b, ref)
        if length > 1 and width <= drafter.draft_vocab_size:
            assert len({tuple(beam) for beam in ref.beams}) == width  # W different candidates


@pytest.mark.parametrize("rnn, exit_dim", [(True, 16), (False, 16), (True, 12)])
def test_real_drafter_matches_plain_python_beam_search(rnn, exit_dim):
    """The RecurrentDrafter (reduced vocab K = 56 of 64; rnn=False; input_proj) vs the reference."""
    drafter = real_drafter(rnn=rnn, exit_dim=exit_dim)
    h, g0 = inputs(drafter, 2)
    out = beam_search(drafter, h, g0, 4, 4, return_log_probs=True)
    for b in range(2):
        assert_row_matches(out, b, reference_beam_search(drafter, h[b], int(g0[b]), 4, 4))
    # the reduced vocabulary shows: only draft-vocab ids are drafted, the rest have log q = -inf
    allowed = set(drafter.draft_vocab_ids.tolist())
    assert set(out.beams[:, :, 1:].flatten().tolist()) <= allowed
    outside = torch.ones(64, dtype=torch.bool)
    outside[drafter.draft_vocab_ids] = False
    assert torch.all(out.log_probs[..., outside] == NEG_INF)
    assert torch.all(out.log_probs[..., ~outside].isfinite())


def test_search_really_prunes_and_warp_really_matters():
    """Non-vacuity of the parity cases: beams get dropped and duplicated, and the warp counts."""
    drafter = FakeDrafter(64, seed=44)
    h, g0 = inputs(drafter, 3)
    long, short = beam_search(drafter, h, g0, 4, 4), beam_search(drafter, h, g0, 4, 3)
    # the best 4 of length 4 do not extend the best 4 of length 3 one to one
    assert not torch.equal(long.beams[:, :, :3], short.beams)
    # some surviving parent has two children (and so another parent was dropped)
    assert any(
        len({tuple(beam) for beam in long.beams[b, :, :3].tolist()}) < 4 for b in range(3)
    )
    unwarped = beam_search(drafter, h, g0, 4, 4, apple_warp=False)
    assert not torch.allclose(long.scores, unwarped.scores)  # normalised over 50 vs 64 tokens


@pytest.mark.parametrize("width", [1, 3, 8])
def test_length_two_is_the_top_w_of_the_first_step(width):
    """L = 2: the beams are g0 plus the W most likely first draft tokens (float32 drafter)."""
    drafter = FakeDrafter(64, dtype=torch.float32, seed=width)
    h, g0 = inputs(drafter, 3)
    out = beam_search(drafter, h, g0, width, 2)
    for b in range(3):
        state = drafter.update_state(drafter.init_state(()), g0[b])
        log_q = log_softmax(warp(drafter.draft_logits(h[b], state).tolist(), True))
        ranked = sorted(range(64), key=lambda d: -log_q[d])[: width + 1]
        assert min(log_q[i] - log_q[j] for i, j in zip(ranked, ranked[1:])) > 1e-5
        assert out.beams[b, :, 0].tolist() == [int(g0[b])] * width
        assert out.beams[b, :, 1].tolist() == ranked[:width]
        expected = torch.tensor([log_q[d] for d in ranked[:width]])
        torch.testing.assert_close(out.scores[b], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("drafter_kind", ["fake", "real"])
def test_per_request_shapes_equal_separate_calls(drafter_kind):
    """Row b of a call with mixed (W_b, L_b) is a call with that row's scalars, plus padding."""
    if drafter_kind == "fake":
        drafter = FakeDrafter(64, REDUCED_56, seed=3)
    else:
        drafter = real_drafter(seed=3)
    vocab = drafter.config.vocab_size
    widths, lengths = [3, 1, 5, 2, 4], [4, 2, 1, 3, 4]
    h, g0 = inputs(drafter, len(widths))
    out = beam_search(
        drafter, h, g0, torch.tensor(widths), torch.tensor(lengths), return_log_probs=True
    )
    assert out.beams.shape == (5, 5, 4) and out.log_probs.shape == (5, 5, 3, vocab)
    for b, (w, length) in enumerate(zip(widths, lengths)):
        alone = beam_search(drafter, h[b : b + 1], g0[b : b + 1], w, length, return_log_probs=True)
        assert torch.equal(out.beams[b, :w, :length], alone.beams[0])
        torch.testing.assert_close(out.scores[b, :w], alone.scores[0], rtol=0, atol=1e-9)
        torch.testing.assert_close(
            out.log_probs[b, :w, : length - 1], alone.log_probs[0], rtol=0, atol=1e-9
        )
        # padding, as documented: beams w >= W_b copy beam 0 and score -inf; depths j >= L_b
        # repeat the last valid token; log-prob rows j >= L_b - 1 are -inf
        assert torch.equal(out.beams[b, w:], out.beams[b, :1].expand(5 - w, 4))
        assert torch.equal(out.log_probs[b, w:], out.log_probs[b, :1].expand(5 - w, 3, vocab))
        assert torch.all(out.scores[b, w:] == NEG_INF)
        assert torch.all(out.beams[b, :, length:] == out.beams[b, :, length - 1 : length])
        assert torch.all(out.log_probs[b, :, length - 1 :] == NEG_INF)


def test_scores_are_sums_of_normalised_log_probs():
    """scores = sum_j log q_j(token j+1), and each q_j is a distribution (fp32 drafter)."""
    drafter = real_drafter(dtype=torch.float32, seed=5)
    h, g0 = inputs(drafter, 4)
    widths, lengths = torch.tensor([4, 2, 4, 1]), torch.tensor([5, 5, 3, 4])
    out = beam_search(drafter, h, g0, widths, lengths, return_log_probs=True)
    assert out.scores.dtype == torch.float32
    chosen = out.log_probs.gather(-1, out.beams[:, :, 1:, None]).squeeze(-1)  # [B, W, L-1]
    valid_row = torch.arange(4)[None, :] < lengths[:, None] - 1  # [B, L-1]
    total = torch.where(valid_row[:, None, :], chosen, 0.0).sum(dim=-1)  # [B, W]
    real_beam = torch.arange(4)[None, :] < widths[:, None]  # [B, W]
    torch.testing.assert_close(out.scores[real_beam], total[real_beam], rtol=1e-5, atol=1e-5)
    assert torch.all(out.scores[~real_beam] == NEG_INF)
    lse = out.log_probs.logsumexp(dim=-1)  # [B, W, L-1]
    mask = real_beam[:, :, None] & valid_row[:, None, :]
    torch.testing.assert_close(lse[mask], torch.zeros(int(mask.sum())), rtol=0, atol=1e-5)
    padding_depth = ~valid_row[:, None, :].expand(4, 4, 4)  # [B, W, L-1]
    assert torch.all(out.log_probs[padding_depth] == NEG_INF)
    beam_0 = out.log_probs[:, :1].expand(4, 4, 4, 64)
    assert torch.equal(out.log_probs[~real_beam], beam_0[~real_beam])  # padding beams copy beam 0


def test_low_precision_drafter_scores_in_float32():
    drafter = real_drafter(dtype=torch.bfloat16, seed=6)
    h, g0 = inputs(drafter, 2)
    out = beam_search(drafter, h, g0, 3, 3, return_log_probs=True)
    assert out.scores.dtype == out.log_probs.dtype == torch.float32
    assert torch.all(out.scores.isfinite())
    lse = out.log_probs.logsumexp(dim=-1)
    torch.testing.assert_close(lse, torch.zeros_like(lse), rtol=0, atol=1e-5)


# -- no host sync --------------------------------------------------------------------------------

TENSOR_SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                "numpy", "__repr__", "__format__")
TORCH_SYNCS = ("nonzero", "equal", "allclose", "is_nonzero")


@contextmanager
def recorded_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Record every call of a tensor method that reads values to the host (a device sync)."""
    calls: list[str] = []

    def spy(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return wrapper

    with monkeypatch.context() as patch:
        for name in TENSOR_SYNCS:
            patch.setattr(torch.Tensor, name, spy(torch.Tensor, name))
        for name in TORCH_SYNCS:
            patch.setattr(torch, name, spy(torch, name))
        yield calls


def test_the_sync_spy_sees_syncs(monkeypatch):
    with recorded_syncs(monkeypatch) as calls:
        x = torch.ones(3)
        _ = x.sum().item(), bool(x[0]), x.tolist(), int(x[1]), x.nonzero(), range(10)[x.long()[0]]
    assert calls == ["item", "__bool__", "tolist", "__int__", "nonzero", "__index__"]


@pytest.mark.parametrize("drafter_kind", ["fake", "real"])
def test_no_host_sync(monkeypatch, drafter_kind):
    """No sync at all with int W, L; with tensor W_b, L_b exactly one, before the loop."""
    drafter = FakeDrafter(64, REDUCED_56) if drafter_kind == "fake" else real_drafter()
    h, g0 = inputs(drafter, 3)
    widths, lengths = torch.tensor([3, 1, 4]), torch.tensor([2, 6, 4])
    for length in (2, 6):
        with recorded_syncs(monkeypatch) as calls:
            beam_search(drafter, h, g0, 4, length, return_log_probs=True)
        assert calls == []
        with recorded_syncs(monkeypatch) as calls:
            beam_search(drafter, h, g0, widths, lengths.clamp(max=length), return_log_probs=True)
        assert calls == ["tolist"]  # the same one for 1 and 5 draft steps: not in the loop


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_makes_no_sync_and_matches_cpu():
    cpu = real_drafter(seed=8)
    gpu = real_drafter(seed=8).cuda()
    gpu.embedding.cuda()  # the target's embedding is not the drafter's: moved on its own
    h, g0 = inputs(cpu, 3)
    h_gpu, g0_gpu = h.cuda(), g0.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = beam_search(gpu, h_gpu, g0_gpu, 4, 5, return_log_probs=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = beam_search(cpu, h, g0, 4, 5, return_log_probs=True)
    assert out.beams.device.type == "cuda"
    assert torch.equal(out.beams.cpu(), expected.beams)
    torch.testing.assert_close(out.scores.cpu(), expected.scores, rtol=0, atol=1e-9)
    torch.testing.assert_close(out.log_probs.cpu(), expected.log_probs, rtol=0, atol=1e-9)


# -- bad input -------------------------------------------------------------------------------------

G0 = torch.tensor([1, 2])


@pytest.mark.parametrize(
    ("h_shape", "g0", "width", "length", "message"),
    [
        ((2, 6, 1), torch.tensor([1, 2]), 2, 2, r"h must be \[B, H\], got shape \(2, 6, 1\)"),
        ((2, 6), torch.tensor([1, 2, 3]), 2, 2, r"g0 must be an integer tensor \[B\] = \[2\]"),
        ((2, 6), torch.tensor([1.0, 2.0]), 2, 2, "g0 must be an integer tensor"),
        ((2, 6), torch.tensor([1, 2]), 0, 2, "beam_width must be an integer >= 1, got 0"),
        ((2, 6), torch.tensor([1, 2]), 2, True, "beam_length must be an integer >= 1, got True"),
        ((2, 6), G0, torch.tensor([2]), 2, r"beam_width .* \[B\] = \[2\], got torch.int64 \(1,\)"),
        ((2, 6), G0, torch.tensor([2.0, 1.0]), 2, "beam_width must be an int or an integer tensor"),
        ((2, 6), G0, 2, torch.tensor([3, 0]), r"got beam_width \[2, 2\], beam_length \[3, 0\]"),
    ],
)
def test_bad_input_is_named(h_shape, g0, width, length, message):
    drafter = FakeDrafter(16)
    with pytest.raises(ValueError, match=message):
        beam_search(drafter, torch.zeros(h_shape, dtype=torch.float64), g0, width, length)


def test_empty_batch():
    drafter = FakeDrafter(16)
    h, g0 = torch.zeros(0, 6, dtype=torch.float64), torch.zeros(0, dtype=torch.long)
    assert beam_search(drafter, h, g0, 3, 4).beams.shape == (0, 3, 4)
    assert beam_search(drafter, h, g0, torch.zeros(0, dtype=torch.long), 4).beams.shape == (0, 1, 4)
