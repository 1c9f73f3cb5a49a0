"""Tiled sampling for the tree walk (after Wagner et al., "Optimized Speculative Sampling for GPU
Hardware Accelerators"): one pass over the vocabulary per packed node, per-tile partial results.

The exact tree walk (``verify.py``) needs, at every packed node, one sample x ~ P_target(. | node).
vLLM samples by the exponential race, ``argmax_v probs[v] / q[v]`` with q ~ Exponential(1)
(``sampling.sample_from_probs``). With probs = softmax(logits / T) that is, taking logs,

    x = argmax_v ( logits[v] / T - log q[v] )          (the Gumbel-max trick: -log q is Gumbel)

which needs no normaliser: the argmax is local per vocabulary tile, and the tiles' winners are
compared at the end. The kernel (grid: rows x vocabulary splits) keeps per row and split

- the best key and its token id (ties: the lower id, as torch.argmax),
- the partial log-sum-exp of logits / T (running max and sum of exponentials),

and a tiny torch merge picks the winning split and combines the log-sum-exps, so the kernel also
returns the row's normaliser ``lse`` (log P_target(v) = logits[v] / T - lse) for any verifier that
needs target probabilities (p/q, typical acceptance) without another pass. Greedy rows
(temperature < 1e-5) take the argmax of the logits (no noise), as vLLM.

Noise: pass ``noise`` (Exponential(1) [R, V], e.g. ``sampling.exponential_noise`` with the
requests' seeded generators: then the sample equals ``sample_from_probs(target_probs(...))`` up to
fp32 rounding of the comparison), or leave it None and the kernel draws q = -log(u) from Philox
(``tl.rand(seed[row], column)``), which saves writing and reading [R, V] noise but is a different
stream from torch's generators.

Top-k / top-p / min-p need a sort or a global threshold before the race: those rows fall back to
the torch path (``sample_tokens`` in ``kernels/__init__.py`` dispatches on the params).

The sigmoid approximation (opt-in, NOT exact): Wagner et al. replace the softmax by an element-wise
sigmoid of min-max scaled logits, so no global sum is needed. Our reading: with a = logits / T,
``z = (a - min a) / (max a - min a)`` scaled back to the softmax's exponent range,
``x = (max a - min a) * (z - 1)`` (= a - max a, in [-(max - min), 0]), clamped below at
``-SIGMOID_CLAMP``, and the weight ``sigmoid(x)`` replaces exp(x). The race then samples
v with probability sigmoid(x_v) / sum sigmoid(x). sigmoid(x) = exp(x) / (1 + exp(x)), so the
weights are exp(x) damped by 1/(1 + exp(x)) in (1/2, 1): the largest tokens lose up to half their
weight relative to the tail, and ``sigmoid_tv_distance`` measures the total-variation distance
from the exact distribution. The exact kernel is already a single pass (the race needs no
normaliser), while the sigmoid path needs the row's min and max first. It is never the default.

Measurements (H100) and history: docs/kernels.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
    tl = None

__all__ = [
    "SIGMOID_CLAMP",
    "sample_reference",
    "sample_tiled",
    "sigmoid_reference",
    "sigmoid_tv_distance",
    "sigmoid_weights",
]

SAMPLING_EPS = 1e-5  # vLLM's: a temperature below it is greedy
SIGMOID_CLAMP = 30.0  # x below -30: sigmoid(x) ~ 1e-13, the weight of a far tail token


# --------------------------------------------------------------------------------------------
# torch references


def sample_reference(logits: Tensor, temperature: Tensor, noise: Tensor) -> tuple[Tensor, Tensor]:
    """(tokens [R], lse [R]): vLLM's race ``argmax softmax(l / T) / q``; greedy rows the argmax."""
    greedy = temperature < SAMPLING_EPS  # [R]
    scaled = logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None]
    probs = scaled.softmax(dim=-1)
    race = torch.where(probs > 0, probs / noise, -1.0).argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), race), scaled.logsumexp(dim=-1)


def sigmoid_weights(logits: Tensor, temperature: Tensor) -> Tensor:
    """[R, V] unnormalised sigmoid-approximation weights (module docstring)."""
    a = logits.float() / temperature.float().clamp(min=SAMPLING_EPS)[:, None]
    hi, lo = a.amax(dim=-1, keepdim=True), a.amin(dim=-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-30)
    x = span * ((a - lo) / span - 1.0)  # min-max scaled back to [-(hi - lo), 0]
    return torch.sigmoid(x.clamp(min=-SIGMOID_CLAMP))


def sigmoid_reference(logits: Tensor, temperature: Tensor, noise: Tensor) -> Tensor:
    """[R] tokens of the sigmoid approximation: ``argmax sigmoid_weights / q`` (greedy: argmax)."""
    greedy = temperature < SAMPLING_EPS
    race = (sigmoid_weights(logits, temperature).log() - noise.log()).argmax(dim=-1)
    return torch.where(greedy, logits.float().argmax(dim=-1), race)


def sigmoid_tv_distance(logits: Tensor, temperature: Tensor) -> Tensor:
    """[R] total-variation distance between softmax(l / T) and the normalised sigmoid weights."""
    exact = (logits.float() / temperature.float().clamp(min=SAMPLING_EPS)[:, None]).softmax(-1)
    approx = sigmoid_weights(logits, temperature)
    approx = approx / approx.sum(dim=-1, keepdim=True)
    return 0.5 * (exact - approx).abs().sum(dim=-1)


# --------------------------------------------------------------------------------------------
# the kernel

if triton is not None:

    @triton.jit
    def _race_kernel(
        logits_ptr, temp_ptr, noise_ptr, seed_ptr, hi_ptr, lo_ptr,
        best_ptr, idx_ptr, m_ptr, s_ptr,
        vocab, chunk, num_splits, stride_lr, stride_nr,
        HAS_NOISE: tl.constexpr, SIGMOID: tl.constexpr, CLAMP: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        """Program (row, split): best race key + id and partial lse of logits / T over the split."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        temp = tl.load(temp_ptr + row)
        greedy = temp < 1e-5
        inv_t = 1.0 / tl.where(greedy, 1.0, temp)
        if SIGMOID:
            lo_a = tl.load(lo_ptr + row)
            span = tl.maximum(tl.load(hi_ptr + row) - lo_a, 1e-30)
        if not HAS_NOISE:
            seed = tl.load(seed_ptr + row)
        cols = tl.arange(0, BLOCK_V)
        best = tl.full([BLOCK_V], float("-inf"), tl.float32)  # per-lane best key
        best_idx = tl.full([BLOCK_V], 2147483647, tl.int32)
        m_i = tl.full([], -1.0e30, tl.float32)
        s_i = tl.full([], 0.0, tl.float32)
        lo = split * chunk
        hi = tl.minimum(lo + chunk, vocab)
        for v0 in range(lo, hi, BLOCK_V):
            offs = v0 + cols
            ok = offs < hi
            logit = tl.load(logits_ptr + row.to(tl.int64) * stride_lr + offs, mask=ok,
                            other=float("-inf")).to(tl.float32)
            a = logit * inv_t
            m_new = tl.maximum(m_i, tl.max(a, axis=0))
            s_i = s_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(a - m_new), axis=0)
            m_i = m_new
            if HAS_NOISE:
                q = tl.load(noise_ptr + row.to(tl.int64) * stride_nr + offs, mask=ok, other=1.0)
            else:
                q = -tl.log(1.0 - tl.rand(seed, offs))  # Exponential(1); 1 - u > 0
            if SIGMOID:
                x = span * ((a - lo_a) / span - 1.0)
                weight = tl.sigmoid(tl.maximum(x, -CLAMP))
                key = tl.log(weight) - tl.log(q)
            else:
                key = a - tl.log(q)
            key = tl.where(greedy, logit, key)
            key = tl.where(ok, key, float("-inf"))
            better = key > best  # strict: an earlier column keeps a tie
            best_idx = tl.where(better, offs, best_idx)
            best = tl.where(better, key, best)
        top = tl.max(best, axis=0)
        idx = tl.min(tl.where(best == top, best_idx, 2147483647), axis=0)  # lowest id among ties
        out = row * num_splits + split
        tl.store(best_ptr + out, top)
        tl.store(idx_ptr + out, idx)
        tl.store(m_ptr + out, m_i)
        tl.store(s_ptr + out, s_i)


def sample_tiled(
    logits: Tensor,  # [R, V] one row per packed node
    temperature: Tensor,  # [R] float
    noise: Tensor | None = None,  # [R, V] Exponential(1), or None: in-kernel Philox
    seed: Tensor | None = None,  # [R] int64 per-row Philox seeds (noise None); default random
    *,
    sigmoid: bool = False,
    num_splits: int | None = None,
    block_v: int = 1024,
) -> tuple[Tensor, Tensor]:
    """(tokens [R] long, lse [R] fp32 of logits / T) by the tiled race (module docstring).

    ``sigmoid=True`` is the opt-in, non-exact approximation (its lse output is still the exact
    normaliser of logits / T).
    """
    if triton is None:
        raise RuntimeError("sample_tiled needs triton; use sample_reference")
    if logits.dim() != 2 or temperature.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [R, V] and temperature [R], got {tuple(logits.shape)}, "
            f"{tuple(temperature.shape)}"
        )
    if noise is not None and noise.shape != logits.shape:
        raise ValueError(f"noise must be [R, V] = {tuple(logits.shape)}, got {tuple(noise.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    device = logits.device
    temperature = temperature.float().contiguous()
    if noise is not None:
        noise = noise.float()
        if noise.stride(-1) != 1:
            noise = noise.contiguous()
    elif seed is None:
        seed = torch.randint(0, 2**31 - 1, (rows,), device=device)
    hi = lo = temperature  # placeholders when not sigmoid
    if sigmoid:
        a = logits.float() / temperature.clamp(min=SAMPLING_EPS)[:, None]
        hi, lo = a.amax(dim=-1).contiguous(), a.amin(dim=-1).contiguous()
    tiles = -(-vocab // block_v)
    if num_splits is None:
        if logits.is_cuda:
            sms = torch.cuda.get_device_properties(device).multi_processor_count
            num_splits = max(1, min(tiles, -(-2 * sms // max(rows, 1))))
        else:
            num_splits = min(tiles, 2)
    chunk = -(-tiles // num_splits) * block_v
    num_splits = -(-vocab // chunk)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=device)
    idx = torch.empty(rows, num_splits, dtype=torch.int32, device=device)
    m = torch.empty_like(best)
    s = torch.empty_like(best)
    if rows == 0:
        return idx.new_empty(0).long(), best.new_empty(0)
    _race_kernel[(rows, num_splits)](
        logits, temperature, noise if noise is not None else logits, seed if seed is not None else idx,
        hi, lo, best, idx, m, s,
        vocab, chunk, num_splits, logits.stride(0), noise.stride(0) if noise is not None else 0,
        HAS_NOISE=noise is not None, SIGMOID=sigmoid, CLAMP=SIGMOID_CLAMP, BLOCK_V=block_v,
    )
    winner = best.argmax(dim=-1, keepdim=True)  # first max: the lower split (lower ids) on ties
    tokens = idx.gather(1, winner).squeeze(1).long()
    big = m.amax(dim=-1, keepdim=True)
    lse = (big + (s * torch.exp(m - big)).sum(dim=-1, keepdim=True).log()).squeeze(1)
    return tokens, lse
