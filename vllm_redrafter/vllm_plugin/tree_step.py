"""One verify step's draft trees as vLLM scheduled them: positions, attention mask, KV moves.

The proposer hands vLLM each request's packed tree (``tree.py``) minus its root as the request's
ragged draft list; it keeps the tree's shape (:class:`RequestTree`). The next step, vLLM schedules
the root g0 and a prefix of those drafts (the scheduler may cut the list: token budget,
``max_model_len``). :func:`build_tree_step` lines the kept shapes up with the scheduled rows:

- a tree's packed node j sits at token row ``root_row + j``, its KV in the slot of position
  ``p + j`` (vLLM's slot mapping, untouched), while its RoPE position must be ``p + depth[j]``
  (:meth:`TreeStep.rewrite_positions`);
- node j attends to the context and to its own ancestors (``ancestor_mask``), which the attention
  backend applies to the tree rows when some tree is not a chain (a chain's mask is causal);
- after verification the accepted nodes' KV moves from slot ``p + path[d]`` to ``p + d``
  (:meth:`TreeStep.kv_moves`), so the cache holds the accepted sequence in order.

This module does not import vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_redrafter.kernels.tree_attention import TreeGatherPlan, plan_tree_gather


@dataclass(frozen=True)
class RequestTree:
    """A request's proposed packed tree, root first (``tokens[0]`` = g0)."""

    tokens: tuple[int, ...]  # [P] packed tokens
    parent: tuple[int, ...]  # [P] packed index of the parent, -1 for the root
    depth: tuple[int, ...]  # [P] depth below the root
    mode: str = "exact"  # verification mode of the request
    extra: object = None  # what a verification mode needs besides the tree (rejection: beams, q)
    from_drafter: tuple[bool, ...] = ()  # [P] node on a drafter beam (else only on a context
    # candidate); () = every node is the drafter's
    beam_of: tuple[int, ...] = ()  # [P] the lowest beam (row) carrying each node: drafter beams
    # first, then context candidates; () = not known

    @property
    def candidate_nodes(self) -> int:
        """Nodes only context candidates carry (on no drafter beam)."""
        return sum(not f for f in self.from_drafter)

    @property
    def drafts(self) -> list[int]:
        """The draft token list vLLM schedules after the root."""
        return list(self.tokens[1:])

    def prefix(self, num_nodes: int) -> RequestTree:
        """The first ``num_nodes`` packed nodes: still a tree (a parent precedes its children)."""
        n = num_nodes
        return RequestTree(self.tokens[:n], self.parent[:n], self.depth[:n], self.mode, self.extra,
                           self.from_drafter[:n], self.beam_of[:n])

    def accepted_path(self, accepted: Sequence[int]) -> list[int]:
        """Packed nodes of the path that emitted ``accepted`` (the accepted drafts), root first.

        >>> RequestTree((5, 1, 4, 2), (-1, 0, 0, 2), (0, 1, 1, 2)).accepted_path([4, 2])
        [0, 2, 3]
        """
        path = [0]
        for token in accepted:
            child = next((j for j in range(path[-1] + 1, len(self.tokens))
                          if self.parent[j] == path[-1] and self.tokens[j] == token), None)
            if child is None:
                break
            path.append(child)
        return path

    def drafter_depth(self, path: Sequence[int]) -> int:
        """How deep ``path`` runs on drafter nodes (their set holds every ancestor of its own)."""
        if not self.from_drafter:
            return len(path) - 1
        return next((d for d, node in enumerate(path) if not self.from_drafter[node]), len(path)) - 1

    def depth_by_beams(self, path: Sequence[int], width: int) -> tuple[int, ...]:
        """How deep ``path`` runs on the first w drafter beams alone, w = 1 .. width: what a
        tree of the first w beams would have accepted, exactly so under greedy verification
        (along a path the lowest beam carrying a node only grows); () where beam_of is unknown.

        >>> tree = RequestTree((5, 1, 2, 4, 3), (-1, 0, 1, 0, 1), (0, 1, 2, 1, 2),
        ...                    beam_of=(0, 0, 0, 1, 2))
        >>> tree.depth_by_beams([0, 1, 4], 3)
        (1, 1, 2)
        """
        if not self.beam_of:
            return ()
        return tuple(sum(self.beam_of[p] < w for p in path[1:]) for w in range(1, width + 1))

    @staticmethod
    def chain(tokens: Sequence[int], mode: str = "exact") -> RequestTree:
        n = len(tokens)
        return RequestTree(tuple(tokens), tuple(range(-1, n - 1)), tuple(range(n)), mode,
                           beam_of=(0,) * n)

    @property
    def is_chain(self) -> bool:
        return all(p == j - 1 for j, p in enumerate(self.parent))


def lowest_beams(new_per_row: Sequence[int], num_packed: int) -> tuple[int, ...]:
    """``RequestTree.beam_of`` from build_tree's new nodes per beam row (``is_new.sum(-1)``):
    nodes are packed row by row, so row i's new nodes follow row i - 1's.

    >>> lowest_beams([3, 1, 0, 2], 5)
    (0, 0, 0, 1, 3)
    """
    return tuple(i for i, count in enumerate(new_per_row) for _ in range(count))[:num_packed]


@dataclass
class TreeStep:
    """The trees of one scheduled step, in the runner's batch order (B requests)."""

    trees: list[RequestTree | None]  # [B] None: the request verifies no drafts this step
    root_rows: list[int]  # [B] token row of each request's root (-1 without drafts)
    # filled by the runner / verifier as the step goes:
    slot_mapping: Tensor | None = None  # [num_tokens] KV slot of every scheduled token
    forward_done: bool = False  # the target's forward over this step ran
    last_nodes: dict[int, int] = field(default_factory=dict)  # batch index -> last accepted node

    @property
    def is_chain(self) -> bool:
        """Every tree is a chain: causal attention is already the tree mask."""
        return all(t is None or t.is_chain for t in self.trees)

    def tree_requests(self) -> list[int]:
        return [b for b, t in enumerate(self.trees) if t is not None]

    def rewrite_positions(self, positions: Tensor) -> Tensor:
        """Positions for the forward: node j of a tree at ``p + depth[j]`` instead of ``p + j``."""
        rows, shift = [], []
        for b in self.tree_requests():
            tree, root = self.trees[b], self.root_rows[b]
            for j, d in enumerate(tree.depth):
                if d != j:
                    rows.append(root + j)
                    shift.append(j - d)
        if not rows:
            return positions
        out = positions.clone()
        index = torch.tensor(rows, device=positions.device)
        out[index] -= torch.tensor(shift, device=positions.device, dtype=positions.dtype)
        return out

    def attention_inputs(self, device: torch.device) -> TreeAttentionInputs:
        """The tree rows and masks the attention backend needs (only for non-chain steps)."""
        reqs = self.tree_requests()
        rows, cu, words = [], [0], []
        for b in reqs:
            tree = self.trees[b]
            rows.extend(range(self.root_rows[b], self.root_rows[b] + len(tree.tokens)))
            cu.append(cu[-1] + len(tree.tokens))
            words.append(ancestor_words(tree.parent))
        n_words = max(w.shape[1] for w in words)
        mask = torch.cat([torch.nn.functional.pad(w, (0, n_words - w.shape[1])) for w in words])
        return TreeAttentionInputs(
            rows=torch.tensor(rows, device=device),
            requests=torch.tensor(reqs, device=device),
            cu_seqlens_q=torch.tensor(cu, device=device, dtype=torch.int32),
            num_nodes=torch.tensor([len(self.trees[b].tokens) for b in reqs], device=device),
            mask_words=mask.to(device),
        )

    def kv_moves(self, paths: Mapping[int, Sequence[int]]) -> tuple[list[int], list[int]]:
        """(source rows, destination rows) moving each accepted node to its depth's slot.

        ``paths[b]`` = packed indices of request b's accepted path, root first. Node ``path[d]``
        was verified at row ``root + path[d]``; the accepted sequence needs it at ``root + d``.
        ``path[d] >= d`` and the path increases, so gathering every source before writing is safe.
        """
        src, dst = [], []
        for b, path in paths.items():
            root = self.root_rows[b]
            for d, node in enumerate(path):
                if node != d:
                    src.append(root + node)
                    dst.append(root + d)
        return src, dst


@dataclass(frozen=True)
class TreeAttentionInputs:
    rows: Tensor  # [total_q] long: token rows of all tree nodes, request after request
    requests: Tensor  # [R] long: batch index of each tree request
    cu_seqlens_q: Tensor  # [R + 1] int32
    num_nodes: Tensor  # [R] long: T_r
    mask_words: Tensor  # [total_q, n_words] int64 ancestor bitmask (kernels/tree_attention.py)
    plans: dict = field(default_factory=dict)  # block_size -> TreeGatherPlan (gather_plan)

    def gather_plan(self, block_table: Tensor, context_lens: Tensor,
                    block_size: int) -> TreeGatherPlan:
        """The torch path's gather indices and mask, built by the step's first layer, then reused."""
        plan = self.plans.get(block_size)
        if plan is None:
            plan = self.plans[block_size] = plan_tree_gather(
                block_table, self.cu_seqlens_q, context_lens, self.mask_words, block_size)
        return plan


def ancestor_words(parent: Sequence[int]) -> Tensor:
    """[T, ceil(T / 64)] int64: bit j of row t set iff j is t or an ancestor of t.

    >>> ancestor_words([-1, 0, 0, 1]).flatten().tolist()
    [1, 3, 5, 11]
    """
    masks: list[int] = []
    for j, p in enumerate(parent):
        masks.append((masks[p] if p >= 0 else 0) | (1 << j))
    n_words = max(1, (len(parent) + 63) // 64)
    rows = []
    for m in masks:
        words = [(m >> (64 * w)) & ((1 << 64) - 1) for w in range(n_words)]
        rows.append([w - (1 << 64) if w >= 1 << 63 else w for w in words])  # as signed int64
    return torch.tensor(rows, dtype=torch.int64)


def build_tree_step(
    req_ids: Sequence[str],
    num_drafts: Sequence[int],  # [B] drafts scheduled per request (0: none)
    scheduled_drafts: Mapping[str, Sequence[int]],  # req_id -> the scheduled draft tokens
    query_end: Sequence[int],  # [B] cumulative scheduled tokens (query_start_loc[1:])
    proposed: Mapping[str, RequestTree],  # req_id -> the tree the proposer kept
) -> TreeStep:
    """Line the proposer's trees up with what the scheduler scheduled (see the module docstring).

    A request whose scheduled drafts are not a prefix of its kept tree's drafts (it should not
    happen) is verified as a chain: correct, since its positions and mask are then the causal ones.
    """
    trees: list[RequestTree | None] = []
    roots: list[int] = []
    for b, req_id in enumerate(req_ids):
        k = num_drafts[b]
        if k == 0:
            trees.append(None)
            roots.append(-1)
            continue
        drafts = list(scheduled_drafts.get(req_id, ()))[:k]
        tree = proposed.get(req_id)
        if tree is None or len(tree.tokens) < k + 1 or list(tree.tokens[1:k + 1]) != drafts:
            mode = tree.mode if tree is not None else "exact"
            tree = RequestTree.chain([-1, *drafts], mode)  # root token unknown here; unused
        else:
            tree = tree.prefix(k + 1)
        trees.append(tree)
        roots.append(query_end[b] - (k + 1))  # vLLM puts the drafts last in the request's rows
    return TreeStep(trees, roots)
