"""The target's own sampling distribution, in vLLM V1's order, and sampling without a host sync.

Exact speculative sampling needs the distribution the target *alone* would sample from, so this
module follows vLLM 0.32's sampler (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``,
the min-p logits processor in ``logits_processor/builtin.py``) step by step, on float32 logits:

1. greedy rows (temperature < 1e-5, vLLM's ``_SAMPLING_EPS``): the point mass on
   ``argmax(logits)``; torch.argmax returns the *first* maximal index, as vLLM's greedy sampler;
2. divide by the temperature;
3. min-p: drop tokens whose probability is below ``min_p * max probability``;
4. top-k: keep the k largest logits;
5. top-p: keep the smallest set of the largest tokens whose mass (renormalised after top-k) is
   >= top_p; the largest token is always kept;
6. softmax.

Ties at a top-k / top-p boundary: the lower token id is kept first (a stable descending sort).
That is what vLLM's Triton top-k/top-p kernel (the CUDA path) does with its "index-ordered
duplicate budget"; vLLM's PyTorch fallback keeps every token tied with the k-th logit and breaks
top-p ties by an unstable sort. The two differ only on exactly tied logits.

Sampling (``sample_from_probs``) is vLLM's ``random_sample``: ``argmax(probs / q)`` with
``q ~ Exponential(1)`` (the exponential race, equivalent to Gumbel-max), one noise tensor for the
unseeded rows and each seeded request's rows redrawn from its own generator. No
``torch.multinomial``, so no host sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

__all__ = [
    "SAMPLING_EPS",
    "SamplingParamsBatch",
    "exponential_noise",
    "greedy_rows",
    "sample_from_probs",
    "target_probs",
    "uniform_noise",
]

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it means greedy


@dataclass(frozen=True)
class SamplingParamsBatch:
    """Per-request sampling parameters of a batch of B requests (vLLM's SamplingMetadata subset).

    A field left None is off for every request; inside a tensor, the off values are
    ``top_k <= 0 or >= V``, ``top_p >= 1`` and ``min_p <= 0``.
    """

    temperature: Tensor  # [B] float; < SAMPLING_EPS = greedy
    top_k: Tensor | None = None  # [B] long
    top_p: Tensor | None = None  # [B] float in (0, 1]
    min_p: Tensor | None = None  # [B] float in [0, 1]
    generators: dict[int, torch.Generator] | None = None  # row -> seeded generator (on the device)

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, Tensor) or self.temperature.dim() != 1:
            shape = _shape(self.temperature)
            raise ValueError(f"temperature must be a [B] tensor, got {shape}")
        batch = self.temperature.shape[0]
        for name in ("top_k", "top_p", "min_p"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, Tensor) or value.shape != (batch,)):
                raise ValueError(
                    f"{name} must be None or a [B] = [{batch}] tensor, got {_shape(value)}"
                )
        for row in self.generators or {}:
            if not isinstance(row, int) or not 0 <= row < batch:
                raise ValueError(f"generators keys must be batch rows 0..{batch - 1}, got {row!r}")

    @property
    def batch_size(self) -> int:
        return self.temperature.shape[0]

    @classmethod
    def from_lists(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        min_p: Sequence[float] | None = None,
        seeds: Sequence[int | None] | None = None,
        device: torch.device | str = "cpu",
    ) -> "SamplingParamsBatch":
        """Build from per-request Python values; ``seeds[i]`` None = unseeded (global RNG)."""
        generators = None
        if seeds is not None:
            generators = {}
            for row, seed in enumerate(seeds):
                if seed is not None:
                    generators[row] = torch.Generator(device=device).manual_seed(seed)

        def tensor(values, dtype):
            return None if values is None else torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=tensor(temperature, torch.float32),
            top_k=tensor(top_k, torch.long),
            top_p=tensor(top_p, torch.float32),
            min_p=tensor(min_p, torch.float32),
            generators=generators,
        )


    def with_generators(self, generators: dict[int, torch.Generator]) -> SamplingParamsBatch:
        """The same parameters drawing row b's noise from ``generators[b]`` (e.g. vLLM's)."""
        return replace(self, generators=dict(generators) or None)

    def row(self, b: int) -> SamplingParamsBatch:
        """Request b alone (B = 1), with its generator if it has one."""
        def one(value: Tensor | None) -> Tensor | None:
            return None if value is None else value[b: b + 1]
        generator = (self.generators or {}).get(b)
        return SamplingParamsBatch(one(self.temperature), one(self.top_k), one(self.top_p),
                                   one(self.min_p), None if generator is None else {0: generator})


def greedy_rows(params: SamplingParamsBatch) -> Tensor:
    """[B] bool: the requests that decode greedily (temperature < 1e-5, as vLLM)."""
    return params.temperature < SAMPLING_EPS


def target_probs(logits: Tensor, params: SamplingParamsBatch) -> Tensor:
    """[B, ..., V] logits -> [B, ..., V] float32 probabilities the target samples from.

    Each request's parameters apply to all its positions (e.g. every packed tree node). Order:
    temperature -> min_p -> top_k -> top_p (vLLM V1); greedy rows get the point mass on the
    argmax. Example, one request, temperature 1, top_k 2 (ties keep the lower token ids):

    >>> logits = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    >>> target_probs(logits, SamplingParamsBatch.from_lists([1.0], top_k=[2]))
    tensor([[0.0000, 0.5000, 0.5000, 0.0000]])
    >>> target_probs(logits, SamplingParamsBatch.from_lists([0.0]))  # greedy: the first argmax
    tensor([[0., 1., 0., 0.]])
    """
    batch, vocab = _check_logits(logits, params)
    rows = logits.reshape(batch, -1, vocab).float()  # [B, N, V], N = positions per request
    positions = rows.shape[1]

    def per_row(value: Tensor) -> Tensor:  # [B] -> [B*N, 1]
        return value[:, None].expand(batch, positions).reshape(-1, 1)

    flat = rows.reshape(-1, vocab)  # [B*N, V]
    greedy = per_row(greedy_rows(params))  # [B*N, 1]
    temperature = per_row(params.temperature).masked_fill(greedy, 1.0)
    scaled = flat / temperature
    if params.min_p is not None:
        scaled = _apply_min_p(scaled, per_row(params.min_p.float()))
    if params.top_k is not None or params.top_p is not None:
        top_k = None if params.top_k is None else per_row(params.top_k.long())
        top_p = None if params.top_p is None else per_row(params.top_p.float())
        scaled = _apply_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    point_mass = torch.zeros_like(probs).scatter_(-1, flat.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy, point_mass, probs).view(logits.shape)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """vLLM's MinPLogitsProcessor: -inf where prob < min_p * max prob. [R, V], min_p [R, 1]."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


FAST_TOP_K = 1024
"""Where every row's top-k is at most this, top-k then top-p look at the k best tokens only
(``torch.topk``) instead of sorting the whole vocabulary: on 2 CPU cores 5,400 tree nodes with
top_k 5 took 0.5 s instead of 30 (docs/exactness.md)."""


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Top-k then top-p on [R, V] logits (top_k / top_p [R, 1] or None).

    In descending order (ties: lower token id first), rank r is kept when ``r < k`` and when the
    mass of the tokens ranked before it (renormalised over the top-k) is ``< top_p``: the smallest
    prefix whose mass is >= top_p. This is vLLM's rule (its PyTorch path drops a token when the
    ascending cumulative mass up to it is <= 1 - top_p, which is the same set).
    """
    vocab = logits.shape[-1]
    if top_k is None:
        return _sorted_whole(logits, None, top_p)
    k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)  # off -> keep all
    few = (k <= min(FAST_TOP_K, vocab - 1)).squeeze(-1)  # [R]: rows with a small top-k
    if bool(few.all()):
        return _top_k_first(logits, k, top_p)
    if not bool(few.any()):
        return logits if top_p is None else _sorted_whole(logits, k, top_p)
    out = torch.empty_like(logits)  # a mixed batch: each kind of row its own way
    for rows in (few, ~few):
        out[rows] = _apply_top_k_top_p(logits[rows], top_k[rows],
                                       None if top_p is None else top_p[rows])
    return out


def _descending(logits: Tensor) -> tuple[Tensor, Tensor]:
    """The whole rows sorted, descending, ties by lower token id: values and token ids."""
    return logits.sort(dim=-1, descending=True, stable=True)


def _sorted_whole(logits: Tensor, k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """:func:`_kept_in_order` on the whole rows, sorted."""
    return _kept_in_order(logits, *_descending(logits), k, top_p)


def _top_k_first(logits: Tensor, k: Tensor, top_p: Tensor | None) -> Tensor:
    """:func:`_apply_top_k_top_p` where every k < V: the best ``max(k) + 1`` tokens of each row,
    put in the full sort's order (ties by lower token id). A row whose k-th kept value ties the
    next one may have the wrong tied token in the block: those rows are sorted whole."""
    block, ids = logits.topk(int(k.max()) + 1, dim=-1)  # [R, K+1], descending
    ids, by_id = ids.sort(dim=-1)  # ties by lower token id: stable sort of the id-ordered block
    block, order = block.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(-1, order)
    last_kept = block.gather(-1, k - 1)  # [R, 1]
    tied = (last_kept == block[:, -1:]).squeeze(-1)
    out = _kept_in_order(logits, block, ids, k, top_p)
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(-1)
        sub_p = None if top_p is None else top_p[rows]
        out[rows] = _sorted_whole(logits[rows], k[rows], sub_p)
    return out


def _kept_in_order(logits: Tensor, sorted_logits: Tensor, ids: Tensor, top_k: Tensor | None,
                   top_p: Tensor | None) -> Tensor:
    """[R, V] logits with -inf but at the kept ranks, from the rows' best tokens in order
    (``sorted_logits``, their token ``ids``: the whole row, or at least its top-k)."""
    rank = torch.arange(sorted_logits.shape[-1], device=logits.device)
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep = rank < top_k
    if top_p is not None:
        probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumulative mass
        # rank 0 always survives; top_p >= 1 is off (float cumsums may reach 1 before the tail).
        keep = keep & ((mass_before < top_p) | (rank == 0) | (top_p >= 1.0))
    masked = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(-1, ids, masked)


def exponential_noise(shape: Sequence[int], params: SamplingParamsBatch, device=None) -> Tensor:
    """[B, ...] float32 Exponential(1) noise; row b drawn from request b's generator if seeded.

    As vLLM's ``random_sample``: one draw for the whole tensor (skipped when every row is seeded),
    then each seeded row redrawn from its own generator, so a seeded request's noise depends on its
    generator state and its row shape only, not on the rest of the batch.
    """
    return _noise(shape, params, device, lambda t, g: t.exponential_(generator=g))


def uniform_noise(shape: Sequence[int], params: SamplingParamsBatch, device=None) -> Tensor:
    """[B, ...] float32 U[0, 1) noise; seeded rows from their own generator (see above)."""
    return _noise(shape, params, device, lambda t, g: t.uniform_(generator=g))


def _noise(shape, params: SamplingParamsBatch, device, fill) -> Tensor:
    if shape[0] != params.batch_size:
        raise ValueError(f"noise shape {tuple(shape)} must lead with B = {params.batch_size}")
    device = params.temperature.device if device is None else device
    noise = torch.empty(tuple(shape), dtype=torch.float32, device=device)
    generators = params.generators or {}
    if len(generators) != shape[0]:
        fill(noise, None)
    for row, generator in generators.items():
        fill(noise[row], generator)
    return noise


def sample_from_probs(probs: Tensor, params: SamplingParamsBatch) -> Tensor:
    """[B, ..., V] probabilities (need not be normalised) -> [B, ...] long samples.

    ``argmax(probs / q)``, q ~ Exponential(1): token v wins with probability probs[v] / sum(probs).
    A zero-probability token never wins (scored -1, even if q underflowed to 0); ties in the
    argmax have probability zero. Greedy rows are not special-cased here: pass them the point mass
    (``target_probs`` does) or take the argmax of the logits.
    """
    if probs.dim() < 2 or probs.shape[0] != params.batch_size:
        raise ValueError(
            f"probs must be [B, ..., V] with B = {params.batch_size}, got {tuple(probs.shape)}"
        )
    q = exponential_noise(probs.shape, params, probs.device)  # [B, ..., V]
    scores = torch.where(probs > 0, probs.float() / q, -1.0)
    return scores.argmax(dim=-1)


def _check_logits(logits: Tensor, params: SamplingParamsBatch) -> tuple[int, int]:
    if not isinstance(logits, Tensor) or logits.dim() < 2 or logits.shape[0] != params.batch_size:
        raise ValueError(
            f"logits must be [B, ..., V] with B = {params.batch_size} (the sampling params), "
            f"got {_shape(logits)}"
        )
    return logits.shape[0], logits.shape[-1]


def _shape(value) -> object:
    return tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
