"""Dynamic tree attention: merge the beams' shared prefixes into one packed tree, verified once.

Beam search returns W candidates of L tokens per request. They all start with g0 and often share
longer prefixes, so verifying each one separately spends target compute on the same tokens again.
ReDrafter (paper, appendix A.1) packs the candidates into a prefix tree: each distinct prefix is
verified once, attending to the request's context plus its own ancestors in the tree. All candidates
have the same length, so the shared prefixes come from tensor ops, with no trie:

    matches[b, i, k, j]  = beams[b, i, j] == beams[b, k, j]                      # [B, W, W, L]
    prefix_tree[b, i, j] = argmax_k( cumsum_j(matches)[b, i, k, j] == j + 1 )    # [B, W, L]

``cumsum == j + 1`` says beam k equals beam i on every depth 0..j; argmax returns the first such k,
so ``prefix_tree[b, i, j]`` is the smallest beam that shares ``beams[b, i, :j+1]`` (at most i: beam i
shares its own prefix). (The paper's unbatched listing is wrong as printed; this is the batched
form.) Then:

- token (i, j) is *new*, and packed, iff ``prefix_tree[b, i, j] == i``. Packed tokens are the new
  ones in (i, j) order: beam 0's depths 0..L-1, then beam 1's new tokens, and so on. Packed index 0
  is the root g0, which all beams share. A parent always precedes its children, so every prefix of
  the packed list is itself a tree (``truncate_tree``);
- depth j is the packed token's position offset after the context;
- ``unpack_index[b, i, j]`` = packed index of (prefix_tree[b, i, j], j): where candidate token
  (i, j) was verified. It maps the verifier's outputs (logits, hidden states) back to candidates;
- the parent of a new (i, j), j > 0, is ``unpack_index[b, i, j-1]``; its ancestors (itself included)
  are ``unpack_index[b, i, :j+1]``, which is its row of the attention mask.

Worked example, one request, W = 4, L = 3, g0 = 5 (packed indices in brackets)::

                    5 [0]
               /            \\
           1 [1]            4 [4]
          /     \\          /     \\
      2 [2]    3 [3]    2 [5]    6 [6]

>>> beams = torch.tensor([[[5, 1, 2],
...                        [5, 1, 3],
...                        [5, 4, 2],
...                        [5, 4, 6]]])
>>> tree = build_tree(beams)
>>> tree.prefix_tree[0]
tensor([[0, 0, 0],
        [0, 0, 1],
        [0, 2, 2],
        [0, 2, 3]])
>>> tree.is_new[0].int()
tensor([[1, 1, 1],
        [0, 0, 1],
        [0, 1, 1],
        [0, 0, 1]], dtype=torch.int32)
>>> tree.tokens, tree.depth, tree.parent, tree.num_packed
(tensor([[5, 1, 2, 3, 4, 2, 6]]), tensor([[0, 1, 2, 2, 1, 2, 2]]), tensor([[-1,  0,  1,  1,  0,  4,  4]]), tensor([7]))
>>> tree.unpack_index[0]
tensor([[0, 1, 2],
        [0, 1, 3],
        [0, 4, 5],
        [0, 4, 6]])
>>> tree.attention_mask[0].int()
tensor([[1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],
        [1, 1, 0, 1, 0, 0, 0],
        [1, 0, 0, 0, 1, 0, 0],
        [1, 0, 0, 0, 1, 1, 0],
        [1, 0, 0, 0, 1, 0, 1]], dtype=torch.int32)
>>> tree.compression_ratio()
tensor([1.7143])

12 candidate tokens are verified as 7 packed ones (12 / 7 = 1.71).

Per-request widths and lengths: beams are padded to the batch's largest W and L, and tokens with
i >= W_b or j >= L_b are padding: never packed, ``unpack_index`` -1. So is a negative token
(``context_candidates.PAD``): a row may end early (a context candidate shorter than the beams),
provided nothing but padding follows it in that row. Packed tensors are padded to
P = the batch's largest packed count (tokens 0, depth 0, parent -1, mask False).

Host syncs: none, except one per ``build_tree`` / ``truncate_tree`` call to read P (packed tensors
must have a concrete width; padding to W * L instead would make the verify pass as large as
unpacked verification). The same sync carries the input checks on per-request widths.

If the beams of a request do not share their first token, the result is a forest: each distinct
first token is a root (parent -1). Beam search never produces that (every beam starts with g0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

__all__ = ["DynamicTree", "PackedTree", "build_tree", "truncate_tree"]


@dataclass(frozen=True)
class DynamicTree:
    """One verification step's packed tree, batched over B requests (P = packed width)."""

    beams: Tensor  # [B, W, L] long: the candidates (input), beams[:, :, 0] = g0
    prefix_tree: Tensor  # [B, W, L] long: smallest beam k sharing beams[b, i, :j+1]
    is_new: Tensor  # [B, W, L] bool: token (i, j) is packed (prefix_tree == i, not padding, not cut)
    tokens: Tensor  # [B, P] long: packed tokens in (i, j) order, root (= g0) at 0; padded with 0
    depth: Tensor  # [B, P] long: j of each packed token (the position offset); 0 for padding
    parent: Tensor  # [B, P] long: packed index of the parent; -1 for the root and padding
    num_packed: Tensor  # [B] long
    unpack_index: Tensor  # [B, W, L] long: packed index of candidate token (i, j); -1 on padding / cut
    attention_mask: Tensor  # [B, P, P] bool: q is p or an ancestor of p (False on padding rows/cols)
    valid: Tensor | None = None  # [B, W, L] bool: not padding (i < W_b, j < L_b, token >= 0); None = all

    def compression_ratio(self) -> Tensor:
        """[B] float: candidate tokens over packed tokens, (W_b * L_b) / num_packed.

        After ``truncate_tree`` the denominator is the kept count (inf for a request cut to 0).
        """
        if self.valid is None:
            candidates = torch.full_like(self.num_packed, self.beams.shape[1] * self.beams.shape[2])
        else:
            candidates = self.valid.sum(dim=(1, 2))
        return candidates.float() / self.num_packed.float()


@dataclass(frozen=True)
class PackedTree:
    """A packed tree as the verifier walks it, when only its shape is at hand (no beams).

    :class:`DynamicTree` carries the same four fields (and the beams they came from); inside
    vLLM the verifier rebuilds the trees of a step from the shapes the proposer kept.
    """

    tokens: Tensor  # [B, P] long, root first, padded with 0
    depth: Tensor  # [B, P] long
    parent: Tensor  # [B, P] long, -1 for the root and padding
    num_packed: Tensor  # [B] long

    @classmethod
    def from_lists(cls, tokens: Sequence[Sequence[int]], parent: Sequence[Sequence[int]],
                   depth: Sequence[Sequence[int]], device: torch.device | str = "cpu") -> PackedTree:
        """From per-request lists (ragged); parents must precede their children.

        >>> PackedTree.from_lists([[5, 1, 4], [7]], [[-1, 0, 0], [-1]], [[0, 1, 1], [0]]).parent
        tensor([[-1,  0,  0],
                [-1, -1, -1]])
        """
        width = max(len(t) for t in tokens)

        def pad(rows, fill):
            return torch.tensor([list(r) + [fill] * (width - len(r)) for r in rows], dtype=torch.long,
                                device=device)

        for p in parent:
            if any(not -1 <= q < j or (q == -1) != (j == 0) for j, q in enumerate(p)):
                raise ValueError(f"parent lists must start with -1 and point backwards, got {list(p)}")
        return cls(pad(tokens, 0), pad(depth, 0), pad(parent, -1),
                   torch.tensor([len(t) for t in tokens], dtype=torch.long, device=device))


def build_tree(
    beams: Tensor,
    beam_width: Tensor | int | None = None,
    beam_length: Tensor | int | None = None,
) -> DynamicTree:
    """Deduplicate ``beams`` [B, W, L] into a packed prefix tree (see the module docstring).

    ``beam_width`` / ``beam_length``: per-request W_b / L_b ([B] integer tensors or ints, 1..W and
    1..L); None means the full W / L. Everything runs on ``beams.device``; one host sync reads P.
    """
    batch, width, length = _check_beams(beams)
    device = beams.device
    beams = beams.long()
    beam_idx = torch.arange(width, device=device)  # [W]
    depth_idx = torch.arange(length, device=device)  # [L]
    w_b = _per_request(beam_width, "beam_width", batch, width, device)  # [B]
    l_b = _per_request(beam_length, "beam_length", batch, length, device)  # [B]
    valid = (beam_idx[:, None] < w_b[:, None, None]) & (depth_idx < l_b[:, None, None])  # [B, W, L]
    valid = valid & (beams >= 0)  # a negative token: the row ended (a short context candidate)

    prefix_tree = _prefix_tree(beams)  # [B, W, L]
    is_new = (prefix_tree == beam_idx[:, None]) & valid  # [B, W, L]

    # Packed index of each new token: its rank among the new tokens in (i, j) order.
    new_flat = is_new.flatten(1)  # [B, W*L]
    rank = new_flat.cumsum(1) - 1  # [B, W*L], meaningful where new
    num_packed = new_flat.sum(1)  # [B]
    # (prefix_tree[b, i, j], j) is the new token that carries candidate token (i, j).
    carrier = (prefix_tree * length + depth_idx).flatten(1)  # [B, W*L]
    unpack_index = rank.gather(1, carrier).view(batch, width, length).masked_fill(~valid, -1)
    no_parent = unpack_index.new_full((batch, width, 1), -1)
    parent_of = torch.cat([no_parent, unpack_index[:, :, :-1]], dim=2)  # [B, W, L]

    bad = _out_of_range(w_b, width) + _out_of_range(l_b, length)
    packed_width, num_bad = _host_sync(num_packed, bad)
    if num_bad:
        raise ValueError(
            f"beam_width must be in 1..W = 1..{width} and beam_length in 1..L = 1..{length} "
            f"(beams {tuple(beams.shape)}), got beam_width {w_b.tolist()}, beam_length {l_b.tolist()}"
        )

    slot = torch.where(new_flat, rank, packed_width)  # [B, W*L]: not new -> a dump column P
    tokens = _pack(beams, slot, packed_width, fill=0)
    depth = _pack(depth_idx.expand_as(beams), slot, packed_width, fill=0)
    parent = _pack(parent_of, slot, packed_width, fill=-1)
    beam_of = _pack(beam_idx[:, None].expand_as(beams), slot, packed_width, fill=0)
    attention_mask = _ancestor_mask(unpack_index, beam_of, depth, num_packed, packed_width)
    return DynamicTree(
        beams=beams,
        prefix_tree=prefix_tree,
        is_new=is_new,
        tokens=tokens,
        depth=depth,
        parent=parent,
        num_packed=num_packed,
        unpack_index=unpack_index,
        attention_mask=attention_mask,
        valid=valid,
    )


def truncate_tree(tree: DynamicTree, max_packed: Tensor | int) -> DynamicTree:
    """Keep only the first ``max_packed[b]`` packed tokens of each request (e.g. a token budget).

    A parent precedes its children, so the kept prefix is still a tree. Candidate tokens whose packed
    token was cut get ``unpack_index`` -1 and ``is_new`` False; ``beams``, ``prefix_tree`` and
    ``valid`` are unchanged (they describe the candidates, not what is verified). P shrinks to the
    largest kept count (one host sync). ``max_packed`` >= ``num_packed`` keeps a request whole.

    >>> tree = truncate_tree(build_tree(torch.tensor([[[5, 1, 2], [5, 1, 3], [5, 4, 2]]])), 4)
    >>> tree.tokens, tree.parent, tree.unpack_index[0]
    (tensor([[5, 1, 2, 3]]), tensor([[-1,  0,  1,  1]]), tensor([[ 0,  1,  2],
            [ 0,  1,  3],
            [ 0, -1, -1]]))
    """
    batch, old_width = tree.tokens.shape
    device = tree.tokens.device
    limit = _per_request(max_packed, "max_packed", batch, old_width, device)  # [B]
    kept_count = torch.minimum(tree.num_packed, limit.clamp(min=0))  # [B]
    new_width, num_bad = _host_sync(kept_count, (limit < 0).sum())
    if num_bad:
        raise ValueError(f"max_packed must be >= 0, got {limit.tolist()}")

    kept = torch.arange(old_width, device=device) < kept_count[:, None]  # [B, P]
    mask = tree.attention_mask & kept[:, :, None] & kept[:, None, :]  # [B, P, P]
    unpack_index = tree.unpack_index.masked_fill(tree.unpack_index >= kept_count[:, None, None], -1)
    return replace(
        tree,
        is_new=tree.is_new & (unpack_index >= 0),
        tokens=tree.tokens.masked_fill(~kept, 0)[:, :new_width],
        depth=tree.depth.masked_fill(~kept, 0)[:, :new_width],
        parent=tree.parent.masked_fill(~kept, -1)[:, :new_width],
        num_packed=kept_count,
        unpack_index=unpack_index,
        attention_mask=mask[:, :new_width, :new_width],
    )


# --- the steps ---------------------------------------------------------------------------------


def _prefix_tree(beams: Tensor) -> Tensor:
    """[B, W, L] -> [B, W, L]: the smallest beam k with beams[b, k, :j+1] == beams[b, i, :j+1]."""
    length = beams.shape[-1]
    matches = beams[:, :, None, :] == beams[:, None, :, :]  # [B, W(i), W(k), L]
    depth_plus_one = torch.arange(1, length + 1, device=beams.device)  # [L]
    shares = matches.cumsum(-1) == depth_plus_one  # [B, W, W, L]: beam k == beam i on depths 0..j
    # argmax returns the first maximal index: the smallest sharing k (k = i always shares).
    return shares.to(torch.uint8).argmax(dim=2)


def _pack(values: Tensor, slot: Tensor, packed_width: int, fill: int) -> Tensor:
    """Scatter candidate values [B, W, L] to their packed slots [B, W*L] -> [B, P].

    Slot P is a dump column for the tokens that are not new; it is dropped.
    """
    out = values.new_full((values.shape[0], packed_width + 1), fill)
    return out.scatter_(1, slot, values.flatten(1))[:, :packed_width]


def _ancestor_mask(
    unpack_index: Tensor, beam_of: Tensor, depth: Tensor, num_packed: Tensor, packed_width: int
) -> Tensor:
    """[B, P, P] bool: row p holds p's ancestors and p itself.

    Packed token p came from candidate token (i, j) = (beam_of[p], depth[p]); its ancestors are the
    packed tokens that carry the same candidate's depths 0..j: unpack_index[b, i, :j+1].
    """
    batch, width, length = unpack_index.shape
    rows = beam_of[:, :, None].expand(batch, packed_width, length)  # [B, P, L]
    ancestors = unpack_index.gather(1, rows)  # [B, P, L]: the candidate row of each packed token
    depth_idx = torch.arange(length, device=depth.device)
    real_row = torch.arange(packed_width, device=depth.device) < num_packed[:, None]  # [B, P]
    keep = (depth_idx <= depth[:, :, None]) & real_row[:, :, None]  # [B, P, L]
    columns = torch.where(keep, ancestors, packed_width)  # unkept -> dump column P
    mask = torch.zeros(batch, packed_width, packed_width + 1, dtype=torch.bool, device=depth.device)
    return mask.scatter_(2, columns, True)[:, :, :packed_width]


# --- input checks and the one host sync ---------------------------------------------------------


def _check_beams(beams: Tensor) -> tuple[int, int, int]:
    if not isinstance(beams, Tensor) or beams.dim() != 3:
        shape = tuple(beams.shape) if isinstance(beams, Tensor) else type(beams).__name__
        raise ValueError(f"beams must be a [B, W, L] tensor of token ids, got {shape}")
    if beams.dtype.is_floating_point or beams.dtype.is_complex or beams.dtype == torch.bool:
        raise ValueError(f"beams must hold integer token ids, got dtype {beams.dtype}")
    batch, width, length = beams.shape
    if width == 0 or length == 0:
        raise ValueError(f"beams must have W >= 1 and L >= 1, got shape {tuple(beams.shape)}")
    return batch, width, length


def _per_request(value: Tensor | int | None, name: str, batch: int, full: int, device) -> Tensor:
    """A per-request count as a [B] long tensor on ``device`` (None -> ``full`` for all)."""
    if value is None:
        return torch.full((batch,), full, dtype=torch.long, device=device)
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long, device=device)
    if not isinstance(value, Tensor) or value.shape != (batch,):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be an int or a [B] = [{batch}] tensor, got {shape}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got dtype {value.dtype}")
    return value.to(device=device, dtype=torch.long)


def _out_of_range(count: Tensor, full: int) -> Tensor:
    return ((count < 1) | (count > full)).sum()


def _host_sync(num_packed: Tensor, num_bad: Tensor) -> tuple[int, int]:
    """The one host sync: P = max num_packed, read together with the count of bad inputs."""
    top = num_packed.max() if num_packed.numel() else num_packed.new_zeros(())
    packed_width, bad = torch.stack([top, num_bad.to(top.dtype)]).tolist()
    return packed_width, bad
