"""Tests for vllm_redrafter/kernels: each Triton kernel against an independent torch reference.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is first
imported: by tests/conftest.py, or below when this file runs alone), at tiny shapes.
GPU-shape tests are marked ``gpu`` and need CUDA.
"""

from __future__ import annotations

import doctest
import os

import pytest
import torch  # does not import triton

CUDA = torch.cuda.is_available()
_SAVED_INTERPRET = os.environ.get("TRITON_INTERPRET")
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (see the docstring)

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from vllm_redrafter import kernels  # noqa: E402
from vllm_redrafter.beam_search import beam_search  # noqa: E402
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter  # noqa: E402
from vllm_redrafter.kernels import fused_beam_step as fb  # noqa: E402
from vllm_redrafter.kernels import sampling as ks  # noqa: E402
from vllm_redrafter.kernels import tree_attention as ta  # noqa: E402
from vllm_redrafter.sampling import SamplingParamsBatch, sample_from_probs, target_probs  # noqa: E402
from vllm_redrafter.tree import build_tree  # noqa: E402

from test_tree_attention import dense_tree_attention, paged_case, random_beams  # noqa: E402

# The jit decorators ran at the imports above. Triton reads the variable again at run time (lazy
# imports), so it is set for this module's tests only (the fixture below) and not leaked to others.
if _SAVED_INTERPRET is None:
    os.environ.pop("TRITON_INTERPRET", None)
else:
    os.environ["TRITON_INTERPRET"] = _SAVED_INTERPRET


@pytest.fixture(autouse=True)
def _interpret_on_cpu(monkeypatch):
    if not CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"
RUNNABLE = CUDA or INTERPRETED
DEVICE = "cuda" if CUDA else "cpu"  # where the kernels run: the GPU, else the interpreter's CPU
needs_kernels = pytest.mark.skipif(
    not RUNNABLE, reason="triton was imported without TRITON_INTERPRET=1 (test_kernels_run_in_this_process fails)"
)


def dev(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Kernel inputs built on the CPU, moved to where the kernels run (the references stay on the
    CPU: an output is compared there)."""
    return [t.to(DEVICE) for t in tensors]


def test_kernels_run_in_this_process():
    """conftest.py imports the kernels under TRITON_INTERPRET=1 before any module imports vLLM
    (which imports triton), so on a CPU every kernel test below runs, interpreted."""
    assert RUNNABLE, "triton was imported without TRITON_INTERPRET=1 before conftest.py ran"


@pytest.mark.parametrize("module", [ta, fb])
def test_doctests(module):
    assert doctest.testmod(module, raise_on_error=True).attempted > 0


# ------------------------------------------------------------------------------------------------
# tree attention


@needs_kernels
@pytest.mark.parametrize(
    "contexts, width, length, hq, hkv, dim, block_size, words, splits, layout",
    [
        ([5, 0, 13], 4, 3, 4, 2, 16, 4, 64, 1, "flash"),  # ragged, GQA 2, a request without context
        ([9, 21], 5, 4, 2, 2, 24, 5, 32, 3, "cpu"),  # D not a power of two, block 5, strided view
        ([40], 12, 6, 4, 1, 16, 16, 32, 2, "flash"),  # T > 32: two int32 words per row
    ],
)
def test_tree_attention_matches_dense(contexts, width, length, hq, hkv, dim, block_size, words, splits, layout):
    gen = torch.Generator().manual_seed(sum(contexts) + width)
    tree = build_tree(random_beams(gen, len(contexts), width, length))
    q, kc, vc, bt, cu, ctx, dense_k, dense_v = paged_case(
        gen, contexts, tree, hq=hq, hkv=hkv, dim=dim, block_size=block_size, layout=layout
    )
    mask = ta.pack_tree_mask(tree.attention_mask, tree.num_packed, words)
    scale = 0.3
    expected = dense_tree_attention(q, cu, contexts, dense_k, dense_v, tree, scale)
    reference = ta.tree_attention_reference(q, kc, vc, bt, cu, ctx, mask, scale)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    out = ta.tree_attention_triton(*dev(q, kc, vc, bt, cu, ctx, mask), scale, num_splits=splits,
                                   block_m=16, block_n=16)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_tree_attention_rejects_bad_shapes():
    q = torch.zeros(3, 4, 8)
    cache = torch.zeros(2, 4, 3, 8)  # Hq = 4 is not a multiple of Hkv = 3
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ta.tree_attention_reference(q, cache, cache, torch.zeros(1, 2), torch.tensor([0, 3]),
                                    torch.tensor([1]), torch.zeros(3, 1, dtype=torch.int64))


# ------------------------------------------------------------------------------------------------
# fused beam step


@needs_kernels
@pytest.mark.parametrize(
    "batch, beams, vocab, dim, width, warp",
    [
        (2, 3, 37, 16, 3, False),  # vocab not a multiple of the 16-column tile
        (2, 6, 37, 16, 6, False),  # W = 6 larger than the last tile's 5 candidates
        (3, 8, 5, 16, 8, False),  # W > K: candidates from several beams fill the top-W
        (2, 3, 200, 16, 3, True),  # Apple's top-50 warp, K > 50
        (1, 4, 70, 20, 4, True),  # warp, K not a multiple of the tile, E not a multiple of BLOCK_K
    ],
)
def test_fused_select_matches_torch_step(batch, beams, vocab, dim, width, warp):
    gen = torch.Generator().manual_seed(vocab + width)
    x = torch.randn(batch * beams, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen) * 2
    score = torch.randn(batch, beams, generator=gen) * 3
    score[0, -1] = float("-inf")  # a padding beam
    top, parent, draft = (t.cpu() for t in fb.fused_select(*dev(x, weight, score), width, warp,
                                                             block_n=16, block_k=16, num_splits=2))
    ref_top, ref_parent, ref_draft = fb.select_reference(x, weight, score, width, warp)
    gaps = ref_top[:, :-1] - ref_top[:, 1:]
    assert (gaps[torch.isfinite(gaps)] > 1e-3).all(), "the random case has a near tie: pick another seed"
    torch.testing.assert_close(top, ref_top, atol=1e-4, rtol=1e-5)
    assert torch.equal(parent, ref_parent) and torch.equal(draft, ref_draft)


def test_keys_order_like_logits_then_lower_id():
    logits = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.5, float("-inf"), -7.25, 3.5])
    ids = torch.arange(8)
    order = fb.encode_keys(logits, ids).argsort(descending=True)
    assert order.tolist() == [4, 7, 2, 0, 1, 3, 6, 5]  # ties (3.5) keep the lower id first
    back, back_ids = fb.decode_keys(fb.encode_keys(logits, ids))
    assert torch.equal(back, logits) and torch.equal(back_ids, ids)


def tiny_drafter(vocab: int, hidden: int = 8, seed: int = 0) -> RecurrentDrafter:
    torch.manual_seed(seed)
    drafter = RecurrentDrafter(DrafterConfig(vocab_size=vocab, hidden_size=hidden, exit_dim=2 * hidden,
                                             num_draft_layers=1))
    for p in drafter.parameters():
        torch.nn.init.normal_(p, std=0.7)
    drafter.attach_embedding(torch.nn.Embedding(vocab, hidden))
    return drafter.eval()


@needs_kernels
@pytest.mark.parametrize("warp", [True, False])
def test_beam_search_fused_matches_beam_search(warp):
    drafter = tiny_drafter(vocab=60)
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(3, 8, generator=gen)
    g0 = torch.tensor([1, 5, 9])
    width, length = torch.tensor([3, 1, 4]), torch.tensor([4, 3, 2])  # per request
    plain = beam_search(drafter, h, g0, width, length, apple_warp=warp)
    drafter.to(DEVICE), drafter.embedding.to(DEVICE)  # the target's embedding is not a submodule
    fused = fb.beam_search_fused(drafter, *dev(h, g0, width, length), apple_warp=warp,
                                 block_n=16, block_k=16)
    assert torch.equal(fused.beams.cpu(), plain.beams)
    torch.testing.assert_close(fused.scores.cpu(), plain.scores, atol=1e-4, rtol=1e-5)


# ------------------------------------------------------------------------------------------------
# sampling


@needs_kernels
def test_tiled_race_equals_torch_race_given_the_noise():
    gen = torch.Generator().manual_seed(0)
    rows, vocab = 6, 1000  # 1000 = 7 tiles of 128 + 104
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 0.0, 2.0, 1e-6, 0.8])  # rows 2 and 4 greedy
    noise = torch.empty(rows, vocab).exponential_(generator=gen)
    tokens, lse = (t.cpu() for t in ks.sample_tiled(*dev(logits, temperature, noise), block_v=128,
                                                    num_splits=3))
    ref_tokens, ref_lse = ks.sample_reference(logits, temperature, noise)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(lse, ref_lse)
    # and the reference is vLLM's path (target_probs + exponential race) given the same noise
    params = SamplingParamsBatch(temperature=temperature)
    probs = target_probs(logits, params)
    race = torch.where(probs > 0, probs / noise, -1.0).argmax(-1)
    assert torch.equal(race, ref_tokens)
    assert tokens[2] == logits[2].argmax() and tokens[4] == logits[4].argmax()


@needs_kernels
def test_tiled_race_philox_samples_the_softmax():
    scipy_stats = pytest.importorskip("scipy.stats")
    rows = 120  # one sample per row (one interpreted program each): few rows, a loose test
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5, -9.0]]).repeat(rows, 1)
    seeds = torch.arange(rows) * 7919 + 11
    tokens = ks.sample_tiled(*dev(logits, torch.ones(rows)), seed=seeds.to(DEVICE))[0].cpu()
    counts = torch.bincount(tokens, minlength=5).double()
    expected = logits[0].softmax(0).double() * rows
    assert counts[4] == 0  # probability 1.6e-5
    assert scipy_stats.chisquare(counts[:4], expected[:4] * rows / expected[:4].sum()).pvalue > 1e-4
    again = ks.sample_tiled(*dev(logits[:6], torch.ones(6)), seed=seeds[:6].to(DEVICE))[0].cpu()
    assert torch.equal(tokens[:6], again)  # a function of the seeds


@needs_kernels
def test_sigmoid_path_equals_its_reference_and_is_inexact():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 300, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.5])
    noise = torch.empty(4, 300).exponential_(generator=gen)
    tokens = ks.sample_tiled(*dev(logits, temperature, noise), sigmoid=True, block_v=64)[0].cpu()
    assert torch.equal(tokens, ks.sigmoid_reference(logits, temperature, noise))
    # the weights are sigmoid(l/T - max) (clamped), the distribution is not the softmax
    a = logits / temperature.clamp(min=1e-5)[:, None]
    expected = torch.sigmoid((a - a.amax(-1, keepdim=True)).clamp(min=-ks.SIGMOID_CLAMP))
    torch.testing.assert_close(ks.sigmoid_weights(logits, temperature), expected)
    tv = ks.sigmoid_tv_distance(logits[:2], temperature[:2])
    assert ((tv > 0.01) & (tv < 0.5)).all()


# ------------------------------------------------------------------------------------------------
# the selection point


def test_use_triton_selection(monkeypatch):
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    assert kernels.use_triton(torch.device("cpu")) is False
    monkeypatch.setenv(kernels.KERNELS_ENV, "torch")
    assert kernels.use_triton(torch.device("cuda")) is False
    monkeypatch.setenv(kernels.KERNELS_ENV, "bogus")
    with pytest.raises(ValueError, match="auto, torch or triton"):
        kernels.use_triton(torch.device("cpu"))


def test_dispatch_beam_search_is_torch_unless_forced(monkeypatch):
    """auto keeps the torch beam search where the other kernels would run (the fused step measured
    slower on an H100); VLLM_REDRAFTER_KERNELS=triton selects the fused step."""
    calls = []

    def fused(*args, **kwargs):
        calls.append(1)
        return beam_search(*args, **kwargs)

    monkeypatch.setattr(fb, "beam_search_fused", fused)
    monkeypatch.setattr(kernels, "use_triton", lambda device: True)  # as on a CUDA device
    drafter = tiny_drafter(vocab=30)
    h, g0 = torch.randn(2, 8), torch.tensor([1, 2])
    monkeypatch.delenv(kernels.KERNELS_ENV, raising=False)
    out = kernels.beam_search(drafter, h, g0, 3, 3)
    assert calls == [] and torch.equal(out.beams, beam_search(drafter, h, g0, 3, 3).beams)
    monkeypatch.setenv(kernels.KERNELS_ENV, "triton")
    kernels.beam_search(drafter, h, g0, 3, 3)
    assert calls == [1]


@needs_kernels
def test_dispatch_runs_the_kernels_when_forced(monkeypatch):
    monkeypatch.setenv(kernels.KERNELS_ENV, "triton")
    gen = torch.Generator().manual_seed(5)
    tree = build_tree(random_beams(gen, 2, 3, 3))
    q, kc, vc, bt, cu, ctx, _, _ = paged_case(gen, [6, 2], tree, hq=2, hkv=1, dim=16, block_size=4)
    mask = kernels.pack_tree_mask(tree.attention_mask, tree.num_packed)
    out = kernels.paged_tree_attention(*dev(q, kc, vc, bt, cu, ctx, mask), block_n=16)
    torch.testing.assert_close(out.cpu(), ta.tree_attention_reference(q, kc, vc, bt, cu, ctx, mask))
    # seeded requests: the kernel draws the same noise as the torch path, so the same samples
    logits = torch.randn(2, 3, 50, generator=gen).to(DEVICE)
    params = lambda: SamplingParamsBatch.from_lists([0.9, 0.0], seeds=[4, 5], device=DEVICE)  # noqa: E731
    expected = sample_from_probs(target_probs(logits, params()), params())
    assert torch.equal(kernels.sample_tokens(logits, params()), expected)
    # top-k falls back to the torch path
    params_k = lambda: SamplingParamsBatch.from_lists([0.9, 0.5], top_k=[3, 0], seeds=[1, 2],  # noqa: E731
                                                      device=DEVICE)
    expected = sample_from_probs(target_probs(logits, params_k()), params_k())
    assert torch.equal(kernels.sample_tokens(logits, params_k()), expected)


# ------------------------------------------------------------------------------------------------
# GPU shapes (bf16, real sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("context, width", [(2048, 16), (512, 16)])
def test_gpu_tree_attention_bf16(context, width):
    gen = torch.Generator().manual_seed(context)
    tree = build_tree(random_beams(gen, 8, width, 5, vocab=4))
    contexts = [context - 37 * b for b in range(8)]
    q, kc, vc, bt, cu, ctx, _, _ = paged_case(gen, contexts, tree, hq=32, hkv=8, dim=128, block_size=16,
                                              dtype=torch.bfloat16)
    mask = ta.pack_tree_mask(tree.attention_mask, tree.num_packed)
    args = [t.cuda() for t in (q, kc, vc, bt, cu, ctx, mask)]
    out = ta.tree_attention_triton(*args)
    ref = ta.tree_attention_reference(*args)
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)



@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab, dim, rows, width", [(32000, 8192, 256, 8), (128256, 8192, 64, 64)])
def test_gpu_fused_select_fp32(vocab, dim, rows, width):
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, dim, device="cuda", generator=gen) * 0.05
    weight = torch.randn(vocab, dim, device="cuda", generator=gen) * 0.05
    score = torch.randn(rows // width, width, device="cuda", generator=gen)
    for warp in (True, False):
        top, parent, draft = fb.fused_select(x, weight, score, width, warp)
        ref_top, ref_parent, ref_draft = fb.select_reference(x, weight, score, width, warp)
        torch.testing.assert_close(top, ref_top, atol=1e-3, rtol=1e-4)
        decided = torch.cat([ref_top[:, :-1] - ref_top[:, 1:] > 1e-3, torch.ones_like(top[:, :1], dtype=torch.bool)], 1)
        assert torch.equal(parent[decided], ref_parent[decided]) and torch.equal(draft[decided], ref_draft[decided])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("vocab, dim, rows, width", [(32000, 8192, 256, 8), (128256, 8192, 64, 64)])
def test_gpu_fused_select_bf16(vocab, dim, rows, width):
    """bf16 drafters (the GPU default): logits rounded to bf16 as torch's Linear rounds them; the
    accumulation order differs, so a logit may land one bf16 step away: ids are compared where
    the reference's scores are more than a few such steps apart. (Triton's interpreter runs bf16
    dots wrongly, so this check exists on the GPU only; the CPU tests cover the logic in fp32.)"""
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows, dim, device="cuda", generator=gen) * 0.05).bfloat16()
    weight = (torch.randn(vocab, dim, device="cuda", generator=gen) * 0.05).bfloat16()
    score = torch.randn(rows // width, width, device="cuda", generator=gen)
    for warp in (True, False):
        top, parent, draft = fb.fused_select(x, weight, score, width, warp)
        ref_top, ref_parent, ref_draft = fb.select_reference(x, weight, score, width, warp)
        torch.testing.assert_close(top, ref_top, atol=0.02, rtol=0)
        gap = 0.02  # ~5 bf16 steps at |logit| < 1
        decided = torch.cat([ref_top[:, :-1] - ref_top[:, 1:] > gap, torch.ones_like(top[:, :1], dtype=torch.bool)], 1)
        decided &= torch.cat([torch.ones_like(top[:, :1], dtype=torch.bool), ref_top[:, :-1] - ref_top[:, 1:] > gap], 1)
        assert decided.any()
        assert torch.equal(parent[decided], ref_parent[decided]) and torch.equal(draft[decided], ref_draft[decided])


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_sample_tiled():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(64, 128256, device="cuda", generator=gen) * 4
    temperature = torch.rand(64, device="cuda", generator=gen) + 0.2
    noise = torch.empty_like(logits).exponential_(generator=gen)
    tokens, lse = ks.sample_tiled(logits, temperature, noise)
    ref_tokens, ref_lse = ks.sample_reference(logits, temperature, noise)
    assert (tokens == ref_tokens).float().mean() > 0.99  # fp32 rounding may flip a near tie
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
