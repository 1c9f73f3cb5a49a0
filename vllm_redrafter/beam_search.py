"""The drafter's beam search (ReDrafter, arXiv 2403.09919, section 3.2), batched and on the device.

Per step the target gives h (its hidden state at the last accepted position) and g0 (the token it
produced there). The drafter grows W candidate continuations ("beams") of g0 with L - 1 draft
tokens each; L counts g0, as Apple's code does (TensorRT-LLM's draft_len_per_beam is L - 1)::

    beams[B, W, 1] = g0;   score[B, W] = [0, -5e4, ..., -5e4]      (one live root, W-1 copies)
    state = update_state(init_state, g0)
    repeat L - 1 times:
        log q = log_softmax(warp(draft_logits(h, state)))               # [B, W, K]
        cand  = score[..., None] + log q  -> flatten [B, W*K] -> topk W  # best first
        parent = idx // K, token = idx % K  (draft ids -> target ids)
        reorder beams / state / log q history by parent; append token; update state

- Scores are sums of NORMALISED log-probs (log_softmax), never raw logits: TensorRT-LLM's bug
  #3125 was scoring with logits, which compares unnormalised numbers across beams.
- ``apple_warp`` (on by default, for parity with Apple's reference): before the log_softmax keep
  the 50 largest logits of each beam and set the rest to -5e4 (a logit tied with the 50th is kept,
  as in Apple's / Hugging Face's top-k warper). It changes the scores (normalised over 50 tokens),
  and whether a token outside the top 50 can ever be drafted (only when W > 50).
- Reduced draft vocabulary: the drafter scores K <= V draft tokens; ``drafter.to_target_ids`` maps
  the chosen ones to target ids, so ``beams`` always holds TARGET ids.

Ties. The W best candidates come from ``torch.topk``, which sorts its output by value but leaves the
order of exactly equal values unspecified (device- and size-dependent; deterministic for a given
input on a given device, so the drafts stay a function of the context). Ties between *different*
extensions need exactly equal float scores: in practice low-precision (bf16) logits, or the
-5e4 tail (the warp's masked tokens, or extensions of the root copies when W > K). Ties between
root copies are harmless: copies are identical, so whichever wins yields the same beams.

Per-request widths and lengths. ``beam_width`` / ``beam_length`` may be LongTensors [B]
(W_b, L_b). The search runs with W = max W_b and L = max L_b, and ``beams[b, :W_b, :L_b]`` is
exactly what a search with the scalars (W_b, L_b) gives: beams w >= W_b get score -inf (at the
start and after every topk, so the first W_b of the sorted top-W are the top W_b), and from step
L_b - 1 on request b is frozen (parents = identity, scores unchanged). The padding in the output:

- padding beams (w >= W_b) are copies of beam 0 (tokens and log_probs), with score -inf;
- padding depths (j >= L_b) repeat the beam's last valid token ``beams[b, w, L_b - 1]``; the
  log_probs rows of those tokens (rows j >= L_b - 1: row j is token j+1's) are all -inf.

e.g. W_b = 2, L_b = 2 inside W = 3, L = 4 (g0 = 5)::

    beams[b] = [[5, 7, 7, 7],      scores[b] = [-0.4, -1.9, -inf]
                [5, 2, 2, 2],
                [5, 7, 7, 7]]      # the last row is padding: a copy of beam 0

Host syncs: none inside the loop. With tensor ``beam_width`` / ``beam_length`` one sync before
the loop reads their maxima (the output's shape) and checks them; with ints, none at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = ["APPLE_TOP_K", "LOG_ZERO", "BeamSearchOutput", "Drafter", "beam_search"]

LOG_ZERO = -5e4  # Apple's "log 0": initial score of the root copies, and the warp's mask value
APPLE_TOP_K = 50  # the warp keeps this many logits per beam


class Drafter(Protocol):
    """What beam search needs from a drafter (``RecurrentDrafter`` provides it)."""

    config: object  # .vocab_size: the target's V (only read when return_log_probs=True)

    @property
    def draft_vocab_size(self) -> int: ...
    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor: ...
    def update_state(self, state: Tensor, token_ids: Tensor) -> Tensor: ...
    def draft_logits(self, h: Tensor, state: Tensor) -> Tensor: ...
    def to_target_ids(self, draft_ids: Tensor) -> Tensor: ...


@dataclass(frozen=True)
class BeamSearchOutput:
    """W candidates of L tokens per request (padding: see the module docstring)."""

    beams: Tensor  # [B, W, L] long, TARGET token ids; beams[:, :, 0] = g0
    scores: Tensor  # [B, W] float, sum of the beam's draft log-probs, best first; -inf = padding
    # [B, W, L-1, V] float: row j is the normalised draft log-prob distribution (after the warp,
    # target vocab, -inf outside the draft vocab) that token j+1 of the beam was chosen from.
    # Only with return_log_probs=True (Apple's p/q rejection verifier needs it as q).
    log_probs: Tensor | None = None


@torch.no_grad()
def beam_search(
    drafter: Drafter,
    h: Tensor,  # [B, H] target hidden state (after the final norm) at the last accepted position
    g0: Tensor,  # [B] long: the token the target produced there (the root of every beam)
    beam_width: int | Tensor,  # W, or per-request W_b: LongTensor [B]
    beam_length: int | Tensor,  # L (counts g0), or per-request L_b: LongTensor [B]
    *,
    apple_warp: bool = True,
    return_log_probs: bool = False,
) -> BeamSearchOutput:
    """The drafter's top-W beams of length L for each of B requests (module docstring)."""
    batch, device = _check_inputs(h, g0)
    w_b = _per_request(beam_width, "beam_width", batch, device)  # [B]
    l_b = _per_request(beam_length, "beam_length", batch, device)  # [B]
    width, length = _max_sizes(w_b, l_b, beam_width, beam_length)
    rows = torch.arange(batch, device=device)[:, None]  # [B, 1]
    beam_ids = torch.arange(width, device=device)  # [W]
    padding = beam_ids >= w_b[:, None]  # [B, W]: beams w >= W_b

    state = drafter.init_state((batch, width))  # [B, W, H]
    score_dtype = torch.promote_types(state.dtype, torch.float32)
    score = torch.full((batch, width), LOG_ZERO, dtype=score_dtype, device=device)
    score[:, 0] = 0.0
    score = score.masked_fill(padding, float("-inf"))  # [B, W]
    beams = g0.long()[:, None, None].expand(batch, width, 1)  # [B, W, 1]
    h = h[:, None, :].expand(batch, width, h.shape[-1])  # [B, W, H]
    history = score.new_empty((batch, width, 0, drafter.draft_vocab_size))  # [B, W, t, K]

    for t in range(length - 1):
        state = drafter.update_state(state, beams[:, :, -1])  # [B, W, H]
        log_q = _log_q(drafter.draft_logits(h, state), apple_warp)  # [B, W, K]
        top, parent, draft = _select(score[:, :, None] + log_q, width)  # [B, W] each
        live = (t < l_b - 1)[:, None]  # [B, 1]: request b still drafting (else frozen)
        parent = torch.where(live, parent, beam_ids)
        score = torch.where(live, top.masked_fill(padding, float("-inf")), score)
        beams = beams[rows, parent]  # [B, W, t+1]
        token = torch.where(live, drafter.to_target_ids(draft), beams[:, :, -1])  # [B, W]
        beams = torch.cat([beams, token[:, :, None]], dim=-1)  # [B, W, t+2]
        state = state[rows, parent]
        if return_log_probs:
            step = torch.where(live[:, :, None], log_q[rows, parent], float("-inf"))  # [B, W, K]
            history = torch.cat([history[rows, parent], step[:, :, None]], dim=2)

    beams = torch.where(padding[:, :, None], beams[:, :1], beams)
    log_probs = None
    if return_log_probs:
        log_probs = _to_target_vocab(drafter, history)  # [B, W, L-1, V]
        log_probs = torch.where(padding[:, :, None, None], log_probs[:, :1], log_probs)
    return BeamSearchOutput(beams=beams, scores=score, log_probs=log_probs)


def _warp(logits: Tensor, top_k: int = APPLE_TOP_K) -> Tensor:
    """Apple's top-k warp: logits below the k-th largest become -5e4; ties with it are kept.

    >>> _warp(torch.tensor([1.0, 3.0, 2.0, 3.0]), top_k=2).tolist()
    [-50000.0, 3.0, -50000.0, 3.0]
    """
    if logits.shape[-1] <= top_k:
        return logits
    kth = logits.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
    return logits.masked_fill(logits < kth, LOG_ZERO)


def _log_q(logits: Tensor, apple_warp: bool) -> Tensor:
    """Normalised draft log-probs [..., K] (at least fp32) of the draft logits [..., K]."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if apple_warp:
        logits = _warp(logits)
    return logits.log_softmax(dim=-1)


def _select(candidates: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """The ``width`` best of all W*K extensions, best first: (scores, parent beam, draft id).

    ``candidates[b, w, k]`` = score of beam w + log q(k | beam w). Flattened, extension (w, k) sits
    at w*K + k, so parent = index // K and draft id = index % K.

    >>> candidates = torch.tensor([[[-1.0, -3.0, -2.5],      # beam 0
    ...                             [-2.0, -0.5, -9.0]]])    # beam 1  (B = 1, W = 2, K = 3)
    >>> _select(candidates, 2)
    (tensor([[-0.5000, -1.0000]]), tensor([[1, 0]]), tensor([[1, 0]]))
    """
    batch, beams, vocab = candidates.shape
    scores, index = candidates.reshape(batch, beams * vocab).topk(width, dim=-1)  # [B, W]
    return scores, index // vocab, index % vocab


def _to_target_vocab(drafter: Drafter, history: Tensor) -> Tensor:
    """[B, W, L-1, K] draft-vocab log-probs -> [B, W, L-1, V], -inf at ids it cannot draft."""
    draft_ids = torch.arange(history.shape[-1], device=history.device)
    target_ids = drafter.to_target_ids(draft_ids)  # [K]
    out = history.new_full((*history.shape[:-1], drafter.config.vocab_size), float("-inf"))
    return out.index_copy_(-1, target_ids, history)


def _check_inputs(h: Tensor, g0: Tensor) -> tuple[int, torch.device]:
    if h.dim() != 2:
        raise ValueError(f"h must be [B, H], got shape {tuple(h.shape)}")
    batch = h.shape[0]
    if tuple(g0.shape) != (batch,) or g0.is_floating_point() or g0.dtype == torch.bool:
        raise ValueError(
            f"g0 must be an integer tensor [B] = [{batch}] (h is {tuple(h.shape)}), "
            f"got {g0.dtype} {tuple(g0.shape)}"
        )
    return batch, h.device


def _per_request(value: int | Tensor, name: str, batch: int, device: torch.device) -> Tensor:
    """An int or an integer tensor [B] as a LongTensor [B] on ``device`` (values checked later)."""
    if isinstance(value, Tensor):
        if tuple(value.shape) != (batch,) or value.is_floating_point() or value.dtype == torch.bool:
            raise ValueError(
                f"{name} must be an int or an integer tensor [B] = [{batch}], "
                f"got {value.dtype} {tuple(value.shape)}"
            )
        return value.to(device=device, dtype=torch.long)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return torch.full((batch,), value, dtype=torch.long, device=device)


def _max_sizes(
    w_b: Tensor, l_b: Tensor, beam_width: int | Tensor, beam_length: int | Tensor
) -> tuple[int, int]:
    """(W, L) = the largest W_b, L_b; one host sync (before the loop) when either is a tensor."""
    if not isinstance(beam_width, Tensor) and not isinstance(beam_length, Tensor):
        return beam_width, beam_length
    if w_b.numel() == 0:  # an empty batch: an empty tensor has no maximum, take 1
        return (1 if isinstance(v, Tensor) else v for v in (beam_width, beam_length))
    w_min, w_max, l_min, l_max = torch.stack([w_b.min(), w_b.max(), l_b.min(), l_b.max()]).tolist()
    if w_min < 1 or l_min < 1:
        raise ValueError(
            f"beam_width and beam_length must be >= 1 for every request, got beam_width "
            f"{w_b.tolist()}, beam_length {l_b.tolist()}"
        )
    return w_max, l_max
