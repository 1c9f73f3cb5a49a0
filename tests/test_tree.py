"""Dynamic tree attention (vllm_redrafter/tree.py) against a brute-force trie of plain dicts."""

from __future__ import annotations

import doctest
import random

import pytest
import torch

from vllm_redrafter import tree as tree_module
from vllm_redrafter.tree import DynamicTree, build_tree, truncate_tree

# --- the docstring's worked example --------------------------------------------------------------

EXAMPLE_BEAMS = [[[5, 1, 2], [5, 1, 3], [5, 4, 2], [5, 4, 6]]]


def test_docstring_examples_run_verbatim():
    result = doctest.testmod(tree_module)
    assert result.attempted >= 10
    assert result.failed == 0


def test_worked_example():
    tree = build_tree(torch.tensor(EXAMPLE_BEAMS))
    assert tree.prefix_tree.tolist() == [[[0, 0, 0], [0, 0, 1], [0, 2, 2], [0, 2, 3]]]
    assert tree.is_new.tolist() == [
        [[True, True, True], [False, False, True], [False, True, True], [False, False, True]]
    ]
    assert tree.tokens.tolist() == [[5, 1, 2, 3, 4, 2, 6]]
    assert tree.depth.tolist() == [[0, 1, 2, 2, 1, 2, 2]]
    assert tree.parent.tolist() == [[-1, 0, 1, 1, 0, 4, 4]]
    assert tree.num_packed.tolist() == [7]
    assert tree.unpack_index.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 4, 5], [0, 4, 6]]]
    assert tree.attention_mask.int().tolist() == [
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
            [1, 0, 0, 0, 1, 0, 0],
            [1, 0, 0, 0, 1, 1, 0],
            [1, 0, 0, 0, 1, 0, 1],
        ]
    ]


def test_compression_ratio_hand_example():
    # Request 0: the worked example, 12 candidate tokens -> 7 packed.
    # Request 1: W_b = 2, L_b = 2 of the padded [4, 3]: candidates (9, 7), (9, 8) -> 3 packed.
    beams = torch.tensor(EXAMPLE_BEAMS + [[[9, 7, 0], [9, 8, 0], [9, 7, 0], [0, 0, 0]]])
    tree = build_tree(beams, torch.tensor([4, 2]), torch.tensor([3, 2]))
    assert tree.num_packed.tolist() == [7, 3]
    assert torch.allclose(tree.compression_ratio(), torch.tensor([12 / 7, 4 / 3]))
    assert tree.tokens.tolist() == [[5, 1, 2, 3, 4, 2, 6], [9, 7, 8, 0, 0, 0, 0]]
    # Identical beams pack to a single chain: ratio W.
    same = build_tree(torch.tensor([[[3, 1, 4]] * 5]))
    assert same.num_packed.tolist() == [3]
    assert same.compression_ratio().tolist() == [5.0]


# --- the brute-force reference -------------------------------------------------------------------


def trie(beams: list[list[int]], width: int, length: int) -> tuple[dict, list]:
    """Every distinct prefix of the valid candidates, numbered in (i, j) insertion order."""
    nodes: dict[tuple[int, ...], int] = {}
    origin: list[tuple[int, int]] = []
    for i in range(width):
        for j in range(length):
            path = tuple(beams[i][: j + 1])
            if path not in nodes:
                nodes[path] = len(nodes)
                origin.append((i, j))
    return nodes, origin


def expected_request(beams: list[list[int]], width: int, length: int, cut: int | None) -> dict:
    """What the tree must hold for one request, from the trie cut to its first ``cut`` nodes."""
    nodes, origin = trie(beams, width, length)
    kept = len(nodes) if cut is None else min(cut, len(nodes))
    paths = sorted((p for p, n in nodes.items() if n < kept), key=nodes.__getitem__)
    W, L = len(beams), len(beams[0])
    unpack = [[-1] * L for _ in range(W)]
    prefix_tree = [[None] * L for _ in range(W)]
    for i in range(width):
        for j in range(length):
            node = nodes[tuple(beams[i][: j + 1])]
            unpack[i][j] = node if node < kept else -1
            prefix_tree[i][j] = min(k for k in range(width) if beams[k][: j + 1] == beams[i][: j + 1])
    return {
        "num_packed": kept,
        "tokens": [p[-1] for p in paths],
        "depth": [len(p) - 1 for p in paths],
        "parent": [nodes[p[:-1]] if len(p) > 1 else -1 for p in paths],
        "ancestors": [{nodes[p[:d]] for d in range(1, len(p) + 1)} for p in paths],
        "origin": set(origin[:kept]),
        "unpack": unpack,
        "prefix_tree": prefix_tree,
        "all_nodes": len(nodes),
    }


def assert_matches_trie(tree: DynamicTree, beams, widths, lengths, cuts=None) -> None:
    B, W, L = beams.shape
    rows = beams.tolist()
    expected = [
        expected_request(rows[b], widths[b], lengths[b], None if cuts is None else cuts[b])
        for b in range(B)
    ]
    P = max((e["num_packed"] for e in expected), default=0)
    assert tree.tokens.shape == (B, P) and tree.attention_mask.shape == (B, P, P)
    for b, e in enumerate(expected):
        n = e["num_packed"]
        assert tree.num_packed[b].item() == n
        assert tree.tokens[b].tolist() == e["tokens"] + [0] * (P - n)
        assert tree.depth[b].tolist() == e["depth"] + [0] * (P - n)
        assert tree.parent[b].tolist() == e["parent"] + [-1] * (P - n)
        assert all(parent < p for p, parent in enumerate(e["parent"]))  # parents precede children
        mask = tree.attention_mask[b].tolist()
        for p in range(P):
            row = {q for q in range(P) if mask[p][q]}
            assert row == (e["ancestors"][p] if p < n else set()), (b, p)
        assert tree.unpack_index[b].tolist() == e["unpack"]
        new = {(i, j) for i in range(W) for j in range(L) if tree.is_new[b, i, j]}
        assert new == e["origin"]
        pt = tree.prefix_tree[b].tolist()
        valid = tree.valid[b].tolist()
        for i in range(W):
            for j in range(L):
                assert valid[i][j] == (i < widths[b] and j < lengths[b])
                if valid[i][j]:
                    assert pt[i][j] == e["prefix_tree"][i][j], (b, i, j)
        # unpack(pack(x)) == x on the candidates whose packed token was kept
        unpack = tree.unpack_index[b]
        kept = unpack >= 0
        assert torch.equal(tree.tokens[b][unpack[kept]], beams[b][kept])


def random_case(rng: random.Random):
    """Small batches over a tiny vocabulary, so that prefixes are shared often."""
    B, W, L, vocab = rng.randint(1, 4), rng.randint(1, 16), rng.randint(1, 6), rng.randint(2, 4)
    beams = torch.tensor([[[rng.randrange(vocab) for _ in range(L)] for _ in range(W)] for _ in range(B)])
    if rng.random() < 0.85:  # beam search's output: every beam starts with g0 (else: a forest)
        beams[:, :, 0] = beams[:, :1, 0]
    if rng.random() < 0.2:
        return beams, None, None, [W] * B, [L] * B
    widths = [rng.randint(1, W) for _ in range(B)]
    lengths = [rng.randint(1, L) for _ in range(B)]
    return beams, torch.tensor(widths), torch.tensor(lengths), widths, lengths


def test_against_brute_force_trie():
    rng = random.Random(2403_09919)
    for _ in range(400):
        beams, beam_width, beam_length, widths, lengths = random_case(rng)
        tree = build_tree(beams, beam_width, beam_length)
        assert_matches_trie(tree, beams, widths, lengths)
        for b in range(beams.shape[0]):
            all_nodes = expected_request(beams[b].tolist(), widths[b], lengths[b], None)["all_nodes"]
            ratio = widths[b] * lengths[b] / all_nodes
            assert tree.compression_ratio()[b].item() == pytest.approx(ratio)


def test_padding_contents_are_ignored():
    torch.manual_seed(7)
    beams = torch.randint(0, 3, (3, 8, 5))
    beam_width, beam_length = torch.tensor([3, 8, 1]), torch.tensor([5, 2, 4])
    scrambled = beams.clone()
    for b in range(3):
        scrambled[b, beam_width[b] :] = torch.randint(50, 60, scrambled[b, beam_width[b] :].shape)
        scrambled[b, :, beam_length[b] :] = torch.randint(50, 60, scrambled[b, :, beam_length[b] :].shape)
    one, two = build_tree(beams, beam_width, beam_length), build_tree(scrambled, beam_width, beam_length)
    for field in ("is_new", "tokens", "depth", "parent", "num_packed", "unpack_index", "attention_mask"):
        assert torch.equal(getattr(one, field), getattr(two, field)), field


# --- truncation ------------------------------------------------------------------------------------


def test_truncate_every_prefix_is_the_cut_trie():
    rng = random.Random(11)
    for _ in range(60):
        beams, beam_width, beam_length, widths, lengths = random_case(rng)
        tree = build_tree(beams, beam_width, beam_length)
        B, P = tree.tokens.shape
        for n in range(P + 2):  # the same cut for all requests, every prefix length
            cut = truncate_tree(tree, torch.full((B,), n))
            assert_matches_trie(cut, beams, widths, lengths, [n] * B)
            for b in range(B):  # each kept node's parent is kept, and precedes it
                kept = cut.num_packed[b].item()
                assert torch.equal(cut.parent[b, :kept] >= 0, cut.depth[b, :kept] > 0)
                assert (cut.parent[b, :kept] < torch.arange(kept)).all()
        cuts = [rng.randint(0, P + 1) for _ in range(B)]  # per-request cuts
        assert_matches_trie(truncate_tree(tree, torch.tensor(cuts)), beams, widths, lengths, cuts)


def test_truncate_keeps_the_candidates_description():
    tree = build_tree(torch.tensor(EXAMPLE_BEAMS))
    cut = truncate_tree(tree, 5)
    assert cut.tokens.tolist() == [[5, 1, 2, 3, 4]]
    assert cut.unpack_index.tolist() == [[[0, 1, 2], [0, 1, 3], [0, 4, -1], [0, 4, -1]]]
    assert torch.equal(cut.prefix_tree, tree.prefix_tree) and torch.equal(cut.valid, tree.valid)
    assert cut.compression_ratio().tolist() == pytest.approx([12 / 5])
    assert truncate_tree(tree, 100).tokens.shape == (1, 7)  # a limit above the count keeps all


# --- bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "beams, width, length, message",
    [
        (torch.zeros(4, 3, dtype=torch.long), None, None, r"\[B, W, L\].*\(4, 3\)"),
        (torch.zeros(1, 4, 3), None, None, "integer token ids.*float32"),
        (torch.zeros(1, 0, 3, dtype=torch.long), None, None, "W >= 1 and L >= 1"),
        (torch.zeros(2, 4, 3, dtype=torch.long), torch.tensor([4]), None, r"beam_width.*\[2\].*\(1,\)"),
        (torch.zeros(2, 4, 3, dtype=torch.long), torch.tensor([4, 5]), None, r"1\.\.W = 1\.\.4.*\[4, 5\]"),
        (torch.zeros(2, 4, 3, dtype=torch.long), None, torch.tensor([0, 3]), r"1\.\.L = 1\.\.3.*\[0, 3\]"),
        (torch.zeros(2, 4, 3, dtype=torch.long), None, torch.tensor([1.0, 3.0]), "beam_length.*integers"),
    ],
)
def test_bad_input_is_named(beams, width, length, message):
    with pytest.raises(ValueError, match=message):
        build_tree(beams, width, length)


def test_bad_truncation_is_named():
    tree = build_tree(torch.tensor(EXAMPLE_BEAMS))
    with pytest.raises(ValueError, match="max_packed must be >= 0"):
        truncate_tree(tree, torch.tensor([-1]))
    with pytest.raises(ValueError, match=r"max_packed.*\(2,\)"):
        truncate_tree(tree, torch.tensor([1, 2]))


def test_int32_beams_and_empty_batch():
    tree = build_tree(torch.tensor(EXAMPLE_BEAMS, dtype=torch.int32))
    assert tree.tokens.dtype == torch.long and tree.tokens.tolist() == [[5, 1, 2, 3, 4, 2, 6]]
    empty = build_tree(torch.zeros(0, 4, 3, dtype=torch.long))
    assert empty.tokens.shape == (0, 0) and empty.attention_mask.shape == (0, 0, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu():
    rng = random.Random(5)
    for _ in range(50):
        beams, beam_width, beam_length, _, _ = random_case(rng)
        cpu = build_tree(beams, beam_width, beam_length)
        gpu = build_tree(
            beams.cuda(),
            None if beam_width is None else beam_width.cuda(),
            None if beam_length is None else beam_length.cuda(),
        )
        fields = ("prefix_tree", "is_new", "tokens", "depth", "parent", "num_packed", "unpack_index")
        for field in fields + ("attention_mask", "valid"):
            assert getattr(gpu, field).device.type == "cuda"
            assert torch.equal(getattr(gpu, field).cpu(), getattr(cpu, field)), field
        n = torch.tensor([rng.randint(0, 8) for _ in range(beams.shape[0])])
        cut_gpu, cut_cpu = truncate_tree(gpu, n.cuda()), truncate_tree(cpu, n)
        assert torch.equal(cut_gpu.attention_mask.cpu(), cut_cpu.attention_mask)
