"""Verification: pick the accepted path through the packed draft tree from the target's logits.

The target ran once over the packed tree (``tree.py``). ``logits[b, p]`` is its next-token
distribution *after* packed token p, i.e. given the context and p's path from the root. The root
(packed index 0) is the previous step's bonus token g0, already emitted.

Four modes:

- ``verify_greedy`` (temperature 0): walk from the root; at node n take ``x = argmax logits[n]``;
  if a child of n carries x, step into it (x is an accepted draft token), else emit x as the bonus
  token and stop. Token for token what the target alone produces greedily (ties: the first maximal
  id, torch.argmax, as vLLM's greedy sampler).
- ``verify_sampling`` ("exact", temperature > 0): the same walk with ``x ~ P_target(. | n)`` under
  the request's sampling parameters. One sample is drawn per packed node up front, all nodes at
  once; the walk visits each node at most once and the path to a node depends only on its
  ancestors' samples, so every emitted token is a fresh draw from the target's distribution given
  the tokens before it: the output is distributed exactly as the target alone would sample it. A
  node accepts with probability P_target(its children's tokens), the most any exact scheme can for
  a fixed tree.
- ``verify_rejection`` ("rejection", opt-in, inexact): Apple ml-recurrent-drafter / TensorRT-LLM's
  per-beam p/q test, for parity and comparison. The p/q test assumes each draft token was sampled
  from q, but beam search picks the top beams deterministically, beams sharing a prefix test it
  with independent uniforms, and the longest beam wins: the output is biased (tests/test_verify.py
  measures a total-variation distance of ~0.5 on a 5-token toy target).
- ``verify_typical`` ("typical", opt-in, inexact): Medusa's typical acceptance.

All are batched over requests and loop over the tree depth only, with no host sync. Rows with
temperature 0 get the greedy walk in every mode (``verify`` dispatches). The outputs:
``Acceptance.tokens`` = accepted draft tokens then the bonus token, ``path`` = their packed
indices (root first), both [B, L] with L = max depth + 1 (the beam length), -1 padded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from vllm_redrafter.sampling import (
    SamplingParamsBatch,
    greedy_rows,
    sample_from_probs,
    target_probs,
    uniform_noise,
)
from vllm_redrafter.tree import DynamicTree

__all__ = [
    "Acceptance",
    "MEDUSA_POSTERIOR_ALPHA",
    "MEDUSA_POSTERIOR_THRESHOLD",
    "VERIFY_MODES",
    "next_node",
    "verify",
    "verify_greedy",
    "verify_greedy_choice",
    "verify_rejection",
    "verify_sampling",
    "verify_typical",
]

VERIFY_MODES = ("exact", "rejection", "typical")

# Medusa's typical acceptance defaults (medusa_generate: posterior_threshold=0.09,
# posterior_alpha=0.3).
MEDUSA_POSTERIOR_THRESHOLD = 0.09  # epsilon: the hard floor of the acceptance threshold
MEDUSA_POSTERIOR_ALPHA = 0.3  # delta: scales exp(-entropy), the entropy-adaptive threshold
MEDUSA_ENTROPY_EPS = 1e-5  # Medusa's entropy: -sum p * log(p + 1e-5)


@dataclass(frozen=True)
class Acceptance:
    """One verification step's result, batched over B requests (L = max tree depth + 1)."""

    tokens: Tensor  # [B, L] long: accepted draft tokens then the bonus token, -1 padded
    num_accepted: Tensor  # [B] long: accepted draft tokens (the bonus not counted)
    path: Tensor  # [B, L] long: packed indices of the accepted path, root first, -1 padded
    last_node: Tensor  # [B] long: packed index of the last accepted node (feeds the next draft)
    bonus: Tensor  # [B] long: the bonus token (the next step's g0)

    @property
    def num_emitted(self) -> Tensor:
        """[B] long: tokens this step adds to each request (accepted + the bonus)."""
        return self.num_accepted + 1


# --- the tree walk (greedy and exact sampling) ---------------------------------------------------


def next_node(tree: DynamicTree, choice: Tensor) -> Tensor:
    """[B, P]: the child of packed node p whose token is ``choice[b, p]``, or -1 if none.

    Beam-search trees have distinct sibling tokens; should two children carry the same token, the
    first in packed order is taken. Padding nodes (p >= num_packed) are never children.

    >>> from types import SimpleNamespace
    >>> tree = SimpleNamespace(tokens=torch.tensor([[5, 1, 2, 4]]),
    ...                        parent=torch.tensor([[-1, 0, 1, 0]]), num_packed=torch.tensor([4]))
    >>> next_node(tree, torch.tensor([[4, 2, 7, 1]]))
    tensor([[ 3,  2, -1, -1]])
    """
    width = tree.tokens.shape[1]
    node = torch.arange(width, device=tree.tokens.device)  # [P]
    real = node < tree.num_packed[:, None]  # [B, P]
    # is_child[b, n, c]: packed c is a child of packed n  [B, P, P]
    is_child = (tree.parent[:, None, :] == node[:, None]) & real[:, None, :]
    match = is_child & (tree.tokens[:, None, :] == choice[:, :, None])  # [B, P, P]
    first = match.to(torch.uint8).argmax(dim=-1)  # first matching child in packed order
    return torch.where(match.any(dim=-1), first, -1)


def _walk(tree: DynamicTree, choice: Tensor) -> Acceptance:
    """Walk from the root following ``choice`` [B, P] (the target's token at each node)."""
    batch = tree.tokens.shape[0]
    steps = _path_length(tree)
    step = next_node(tree, choice)  # [B, P]
    cur = tree.tokens.new_zeros(batch)  # [B]: the root
    path = tree.tokens.new_full((batch, steps), -1)
    path[:, 0] = 0
    alive = torch.ones(batch, dtype=torch.bool, device=cur.device)
    for depth in range(1, steps):
        child = step.gather(1, cur[:, None]).squeeze(1)  # [B]
        alive = alive & (child >= 0)
        path[:, depth] = torch.where(alive, child, -1)
        cur = torch.where(alive, child, cur)
    bonus = choice.gather(1, cur[:, None]).squeeze(1)
    return _acceptance(tree, path, bonus)


def verify_greedy(tree: DynamicTree, logits: Tensor) -> Acceptance:
    """Greedy walk: the target's argmax at every node (see the module docstring)."""
    _check_logits(tree, logits)
    return _walk(tree, logits.argmax(dim=-1))


def verify_greedy_choice(tree: DynamicTree, argmax: Tensor) -> Acceptance:
    """The greedy walk from the target's argmax token at each node, ``argmax`` [B, P].

    Equal to ``verify_greedy(tree, logits)`` with ``argmax = logits.argmax(-1)``, for callers that
    hold the logits as rows elsewhere (vLLM) and need not copy them into [B, P, V].
    """
    if tuple(argmax.shape) != tuple(tree.tokens.shape):
        raise ValueError(f"argmax must be [B, P] = {list(tree.tokens.shape)}, got {list(argmax.shape)}")
    return _walk(tree, argmax)


def verify_sampling(tree: DynamicTree, logits: Tensor, params: SamplingParamsBatch) -> Acceptance:
    """Exact tree sampling: the walk with one independent target sample per packed node.

    Noise: one ``exponential_noise`` [B, P, V] draw (seeded requests from their own generator).
    Greedy rows take the argmax of the logits. A seeded request's samples depend on its generator
    and on its row's shape [P, V]: on CPU the stream is serial, so a wider P (a larger tree
    elsewhere in the batch) keeps the first nodes' noise; CUDA's Philox layout depends on the size.
    """
    _check_logits(tree, logits, params)
    sampled = sample_from_probs(target_probs(logits, params), params)  # [B, P]
    choice = torch.where(greedy_rows(params)[:, None], logits.argmax(dim=-1), sampled)
    return _walk(tree, choice)


# --- Apple / TensorRT-LLM per-beam p/q rejection ----------------------------------------------


def verify_rejection(
    tree: DynamicTree, logits: Tensor, params: SamplingParamsBatch, draft_log_probs: Tensor
) -> Acceptance:
    """Per-beam p/q rejection (ml-recurrent-drafter ``_choose_from_candidates``); inexact.

    For beam i and depth j >= 1 the draft token x = beams[b, i, j] is accepted when
    ``u < p(x) / q(x)``, u ~ U[0, 1) drawn per (beam, depth), p = the target's distribution
    (under ``params``) at the beam's parent node, q = exp(draft_log_probs[b, i, j-1]). A beam's
    accepted length is its first rejection; the first beam with the longest accepted prefix wins.
    The bonus token is drawn from the normalised residual max(p - q, 0) at the rejection point, or
    from p where the beam was accepted to its end (or to where ``truncate_tree`` cut it).

    Only the request's distinct, non-padding beams compete (a padding copy of beam 0 would get
    extra uniforms). Noise order per call: uniform [B, W, L-1], then exponential [B, 1, V].
    """
    _check_logits(tree, logits, params)
    beams, unpack = tree.beams, tree.unpack_index  # [B, W, L]
    batch, width, length = beams.shape
    vocab = logits.shape[-1]
    if draft_log_probs is None or tuple(draft_log_probs.shape) != (batch, width, length - 1, vocab):
        raise ValueError(
            "rejection verification needs draft_log_probs [B, W, L-1, V] = "
            f"{[batch, width, length - 1, vocab]} (beam_search(..., return_log_probs=True)), "
            f"got {None if draft_log_probs is None else list(draft_log_probs.shape)}"
        )
    if length == 1:  # no draft tokens: the bonus is the target's sample at the root
        return verify_sampling(tree, logits, params)
    probs = target_probs(logits, params)  # [B, P, V]
    in_tree = (unpack >= 0).long().cumprod(dim=-1).bool()  # [B, W, L]: each beam's verified prefix
    accepted_per_beam = _accepted_per_beam(tree, probs, draft_log_probs, params, in_tree)  # [B, W]
    best = accepted_per_beam.argmax(dim=-1)  # [B]: the first beam with the longest accepted prefix
    accepted = accepted_per_beam.gather(1, best[:, None]).squeeze(1).clamp(min=0)  # [B]

    best_nodes = unpack.gather(1, best[:, None, None].expand(batch, 1, length)).squeeze(1)  # [B, L]
    depth = torch.arange(length, device=beams.device)
    path = torch.where(depth <= accepted[:, None], best_nodes, -1)  # [B, L]
    last_node = best_nodes.gather(1, accepted[:, None]).squeeze(1)  # [B]
    verified = in_tree.gather(1, best[:, None, None].expand(batch, 1, length)).sum(dim=(1, 2)) - 1
    rejected = accepted < verified  # [B]: stopped by a failed test, not by the beam's end
    p_stop = probs.gather(1, last_node[:, None, None].expand(batch, 1, vocab)).squeeze(1)  # [B, V]
    stop_depth = accepted.clamp(max=length - 2)
    rows = torch.arange(batch, device=beams.device)
    q_stop = draft_log_probs[rows, best, stop_depth].exp()  # [B, V]
    residual = (p_stop - q_stop).clamp(min=0)  # [B, V]
    use_residual = rejected & (residual.sum(dim=-1) > 0)
    bonus_dist = torch.where(use_residual[:, None], residual, p_stop)  # sampling normalises it
    bonus = sample_from_probs(bonus_dist[:, None, :], params).squeeze(1)
    return _acceptance(tree, path, bonus)


def _accepted_per_beam(
    tree: DynamicTree,
    probs: Tensor,
    draft_log_probs: Tensor,
    params: SamplingParamsBatch,
    in_tree: Tensor,
) -> Tensor:
    """[B, W] long: draft tokens each beam gets accepted by the p/q test before its first rejection.

    Beams that do not compete (padding, or a repeat of an earlier beam) get -1.
    """
    batch, width, length = tree.beams.shape
    parent_node = tree.unpack_index[:, :, :-1].clamp(min=0)  # [B, W, L-1]: judges token j+1
    drafted = tree.beams[:, :, 1:]  # [B, W, L-1]
    p_x = _probs_at(probs, parent_node, drafted)  # [B, W, L-1]
    q_x = draft_log_probs.gather(-1, drafted[..., None]).squeeze(-1).exp()  # [B, W, L-1]
    u = uniform_noise((batch, width, length - 1), params, probs.device)
    accept = (u * q_x < p_x) & in_tree[:, :, 1:]  # u < p/q, without dividing by q = 0
    accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [B, W]
    return accepted.masked_fill(~_distinct_beams(tree), -1)


def _distinct_beams(tree: DynamicTree) -> Tensor:
    """[B, W] bool: beam i is a request's beam (not padding) and no earlier beam equals it."""
    width = tree.beams.shape[1]
    own = tree.prefix_tree == torch.arange(width, device=tree.beams.device)[:, None]  # [B, W, L]
    valid = getattr(tree, "valid", None)
    if valid is not None:
        own = own & valid
    return own.any(dim=-1) & (tree.unpack_index[:, :, 0] >= 0)


# --- Medusa typical acceptance --------------------------------------------------------------------


def verify_typical(
    tree: DynamicTree,
    logits: Tensor,
    params: SamplingParamsBatch,
    posterior_threshold: float = MEDUSA_POSTERIOR_THRESHOLD,
    posterior_alpha: float = MEDUSA_POSTERIOR_ALPHA,
) -> Acceptance:
    """Medusa's typical acceptance over the tree; inexact.

    Packed token c with parent n is accepted when
    ``p_n(tokens[c]) > min(posterior_threshold, posterior_alpha * exp(-H(p_n)))``, p_n = the
    target's distribution (under ``params``) at n, H its entropy (Medusa's
    ``-sum p log(p + 1e-5)``). The deepest node whose whole path is accepted wins (first in packed
    order on ties, which is the first beam with the longest accepted prefix; the root when none);
    the bonus token is sampled from p at that node. Medusa scores its candidates the same way
    (``evaluate_posterior``, typical: ``cumprod`` of the mask, the longest candidate).
    Noise: one exponential [B, 1, V] draw.
    """
    _check_logits(tree, logits, params)
    batch, width = tree.tokens.shape
    vocab = logits.shape[-1]
    probs = target_probs(logits, params)  # [B, P, V]
    entropy = -(probs * torch.log(probs + MEDUSA_ENTROPY_EPS)).sum(dim=-1)  # [B, P]
    threshold = (posterior_alpha * torch.exp(-entropy)).clamp(max=posterior_threshold)  # [B, P]
    parent = tree.parent.clamp(min=0)  # [B, P]
    p_token = _probs_at(probs, parent, tree.tokens)  # [B, P]: prob of each token at its parent
    node = torch.arange(width, device=logits.device)
    real = (node < tree.num_packed[:, None]) & (tree.parent >= 0)
    accept = (p_token > threshold.gather(1, parent)) & real  # [B, P]
    accept[:, 0] = True  # the root is already emitted
    reached = accept
    for _ in range(_path_length(tree) - 1):  # propagate along the depth: all ancestors accepted
        reached = accept & reached.gather(1, parent)
    score = torch.where(reached, tree.depth, -1)
    chosen = score.argmax(dim=-1)  # [B]: the deepest reached node, first in packed order
    path = _path_to(tree, chosen)
    p_stop = probs.gather(1, chosen[:, None, None].expand(batch, 1, vocab))  # [B, 1, V]
    bonus = sample_from_probs(p_stop, params).squeeze(1)
    return _acceptance(tree, path, bonus)


# --- dispatch ----------------------------------------------------------------------------------


def verify(
    tree: DynamicTree,
    logits: Tensor,
    params: SamplingParamsBatch,
    mode: str = "exact",
    draft_log_probs: Tensor | None = None,
) -> Acceptance:
    """Verify with ``mode`` in VERIFY_MODES; rows with temperature 0 take the greedy walk.

    "exact" (the default) is exact at every temperature; "rejection" (needs ``draft_log_probs``)
    and "typical" are the opt-in inexact modes of Apple's ReDrafter and of Medusa.
    """
    if mode not in VERIFY_MODES:
        allowed = ", ".join(VERIFY_MODES)
        raise ValueError(f"verification mode must be one of {allowed}; got {mode!r}")
    if mode == "exact":
        return verify_sampling(tree, logits, params)
    if mode == "rejection":
        sampled = verify_rejection(tree, logits, params, draft_log_probs)
    else:
        sampled = verify_typical(tree, logits, params)
    return _select_rows(greedy_rows(params), verify_greedy(tree, logits), sampled)


# --- helpers -----------------------------------------------------------------------------------


def _probs_at(probs: Tensor, node: Tensor, token: Tensor) -> Tensor:
    """probs[b, node[b, ...], token[b, ...]] for probs [B, P, V] and index tensors [B, ...]."""
    vocab = probs.shape[-1]
    flat = (node * vocab + token).reshape(node.shape[0], -1)
    return probs.flatten(1).gather(1, flat).view(node.shape)


def _path_to(tree: DynamicTree, node: Tensor) -> Tensor:
    """[B, L]: packed indices from the root down to ``node`` [B], by depth, -1 padded."""
    batch = node.shape[0]
    steps = _path_length(tree)
    path = node.new_full((batch, steps + 1), -1)  # column L: a dump for finished rows
    cur = node
    for _ in range(steps):
        alive = cur >= 0
        at = cur.clamp(min=0)[:, None]
        column = torch.where(alive, tree.depth.gather(1, at).squeeze(1), steps)
        path.scatter_(1, column[:, None], cur[:, None])
        cur = torch.where(alive, tree.parent.gather(1, at).squeeze(1), cur)
    return path[:, :steps]


def _acceptance(tree: DynamicTree, path: Tensor, bonus: Tensor) -> Acceptance:
    """Assemble the outputs from ``path`` [B, L] (root first, -1 padded) and ``bonus`` [B]."""
    num_accepted = (path[:, 1:] >= 0).sum(dim=1)  # [B]
    last_node = path.gather(1, num_accepted[:, None]).squeeze(1)  # [B]
    drafted = tree.tokens.gather(1, path[:, 1:].clamp(min=0))  # [B, L-1]
    drafted = torch.where(path[:, 1:] >= 0, drafted, -1)
    tokens = torch.cat([drafted, torch.full_like(bonus[:, None], -1)], dim=1)  # [B, L]
    tokens = tokens.scatter(1, num_accepted[:, None], bonus[:, None])  # bonus after the accepted
    return Acceptance(tokens, num_accepted, path, last_node, bonus)


def _select_rows(rows: Tensor, if_true: Acceptance, if_false: Acceptance) -> Acceptance:
    """Per request: ``if_true`` where rows [B] is set, else ``if_false``."""

    def pick(a: Tensor, b: Tensor) -> Tensor:
        return torch.where(rows.view(-1, *([1] * (a.dim() - 1))), a, b)

    return Acceptance(
        *(pick(getattr(if_true, f), getattr(if_false, f)) for f in Acceptance.__dataclass_fields__)
    )


def _path_length(tree: DynamicTree) -> int:
    """L = max depth + 1: the beam length (static), or one host sync for trees without beams."""
    beams = getattr(tree, "beams", None)
    if beams is not None:
        return beams.shape[-1]
    return int(tree.depth.max()) + 1


def _check_logits(
    tree: DynamicTree, logits: Tensor, params: SamplingParamsBatch | None = None
) -> None:
    batch, width = tree.tokens.shape
    is_tensor = isinstance(logits, Tensor)
    if not is_tensor or logits.dim() != 3 or tuple(logits.shape[:2]) != (batch, width):
        shape = tuple(logits.shape) if is_tensor else type(logits).__name__
        raise ValueError(
            f"logits must be [B, P, V] with [B, P] = {[batch, width]} (the packed tree), "
            f"got {shape}"
        )
    if params is not None and params.batch_size != batch:
        raise ValueError(
            f"sampling params are for {params.batch_size} requests, the tree for {batch}"
        )
