"""verify.py: the greedy walk against plain-Python references, exact tree sampling against the
closed-form target distribution (chi-square, with its power), the measured bias of Apple's p/q
rejection, Medusa's typical acceptance, and the output invariants."""

from __future__ import annotations

import doctest
import math
import random
from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2, chisquare, ncx2

from vllm_redrafter import verify as verify_module
from vllm_redrafter.sampling import SamplingParamsBatch
from vllm_redrafter.tree import build_tree, truncate_tree
from vllm_redrafter.verify import (
    MEDUSA_POSTERIOR_ALPHA,
    MEDUSA_POSTERIOR_THRESHOLD,
    Acceptance,
    verify,
    verify_greedy,
    verify_rejection,
    verify_sampling,
    verify_typical,
)

# The worked example of tree.py: W = 4, L = 3, g0 = 5; packed indices in brackets.
#                     5 [0]
#                /            \
#            1 [1]            4 [4]
#           /     \          /     \
#       2 [2]    3 [3]    2 [5]    6 [6]
DOC_BEAMS = [[5, 1, 2], [5, 1, 3], [5, 4, 2], [5, 4, 6]]


# --- plain-Python references and helpers --------------------------------------------------------


def first_argmax(row: list[float]) -> int:
    return max(range(len(row)), key=lambda v: (row[v], -v))


def reference_walk(
    parents: list[int], tokens: list[int], choice: list[int]
) -> tuple[list[int], list[int]]:
    """The walk on one request's packed tree: (emitted tokens, path of packed indices)."""
    cur, path, emitted = 0, [0], []
    while True:
        x = choice[cur]
        children = [c for c in range(len(tokens)) if parents[c] == cur and tokens[c] == x]
        emitted.append(x)
        if not children:
            return emitted, path
        cur = children[0]
        path.append(cur)


def tree_from_parents(rows: list[tuple[list[int], list[int]]]) -> SimpleNamespace:
    """A DynamicTree-like object (tokens, parent, depth, num_packed) from explicit parent lists."""
    width = max(len(parents) for parents, _ in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    parent = torch.full((len(rows), width), -1, dtype=torch.long)
    depth = torch.zeros(len(rows), width, dtype=torch.long)
    for b, (parents, toks) in enumerate(rows):
        for p, (up, tok) in enumerate(zip(parents, toks)):
            tokens[b, p], parent[b, p] = tok, up
            depth[b, p] = 0 if up < 0 else depth[b, up] + 1
    num_packed = torch.tensor([len(parents) for parents, _ in rows])
    return SimpleNamespace(tokens=tokens, parent=parent, depth=depth, num_packed=num_packed)


def random_parent_tree(rng: random.Random, vocab: int) -> tuple[list[int], list[int]]:
    """Random packed tree: parents precede children; sibling tokens may repeat (first child wins)."""
    size = rng.randint(1, 12)
    parents, tokens = [-1], [rng.randrange(vocab)]
    for p in range(1, size):
        parents.append(rng.randrange(p))
        tokens.append(rng.randrange(vocab))
    return parents, tokens


def check_invariants(tree, acc: Acceptance, width: int) -> None:
    """Shapes, padding, the path is a root-down chain, emitted = tree tokens along it + the bonus."""
    batch = tree.tokens.shape[0]
    assert acc.tokens.shape == acc.path.shape == (batch, width)
    for b in range(batch):
        n = int(acc.num_accepted[b])
        path = acc.path[b].tolist()
        assert path[0] == 0 and all(p >= 0 for p in path[: n + 1])
        assert all(p == -1 for p in path[n + 1 :])
        for d in range(1, n + 1):
            assert int(tree.parent[b, path[d]]) == path[d - 1] and int(tree.depth[b, path[d]]) == d
            assert path[d] < int(tree.num_packed[b])
        expected = [int(tree.tokens[b, p]) for p in path[1 : n + 1]] + [int(acc.bonus[b])]
        assert acc.tokens[b].tolist() == expected + [-1] * (width - n - 1)
        assert int(acc.last_node[b]) == path[n]


def node_paths(tree, b: int) -> list[tuple[int, ...]]:
    """Token path (root first) of every packed node of request b."""
    parent, tokens = tree.parent[b].tolist(), tree.tokens[b].tolist()
    paths: list[tuple[int, ...]] = []
    for p in range(int(tree.num_packed[b])):
        paths.append((paths[parent[p]] if parent[p] >= 0 else ()) + (tokens[p],))
    return paths


def test_docstring_examples():
    assert doctest.testmod(verify_module).failed == 0


# --- greedy -------------------------------------------------------------------------------------


def test_greedy_matches_reference_walk_on_random_parent_trees():
    """300 random batches of hand-built trees; integer logits make argmax ties common."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        vocab = rng.randint(2, 5)
        rows = [random_parent_tree(rng, vocab) for _ in range(rng.randint(1, 4))]
        tree = tree_from_parents(rows)
        logits = torch.randint(0, 3, (*tree.tokens.shape, vocab), generator=gen).float()
        acc = verify_greedy(tree, logits)
        width = int(tree.depth.max()) + 1
        check_invariants(tree, acc, width)
        for b, (parents, tokens) in enumerate(rows):
            choice = [first_argmax(logits[b, p].tolist()) for p in range(len(tokens))]
            emitted, path = reference_walk(parents, tokens, choice)
            assert acc.tokens[b].tolist() == emitted + [-1] * (width - len(emitted))
            assert acc.path[b].tolist() == path + [-1] * (width - len(path))
            assert int(acc.num_accepted[b]) == len(emitted) - 1 and int(acc.bonus[b]) == emitted[-1]


def test_greedy_matches_beam_level_reference_on_built_trees():
    """Random beams (per-request W_b, L_b) through build_tree; the target's logits are a function of
    the token path, and the reference walks the beams themselves, not the packed tree."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        batch, width, length = rng.randint(1, 4), rng.randint(1, 4), rng.randint(1, 4)
        vocab = rng.randint(2, 4)
        beams = torch.randint(0, vocab, (batch, width, length), generator=gen)
        beams[:, :, 0] = torch.randint(0, vocab, (batch, 1), generator=gen)  # g0 shared by all beams
        w_b = torch.randint(1, width + 1, (batch,), generator=gen)
        l_b = torch.randint(1, length + 1, (batch,), generator=gen)
        tree = build_tree(beams, w_b, l_b)
        target: dict[tuple[int, ...], list[float]] = {}  # token path -> next-token logits

        def target_logits(path: tuple[int, ...]) -> list[float]:
            return target.setdefault(path, [float(rng.randrange(3)) for _ in range(vocab)])

        logits = torch.zeros(*tree.tokens.shape, vocab)
        for b in range(batch):
            for p, path in enumerate(node_paths(tree, b)):
                logits[b, p] = torch.tensor(target_logits(path))
        acc = verify_greedy(tree, logits)
        check_invariants(tree, acc, length)
        for b in range(batch):
            candidates = [tuple(beams[b, i, : int(l_b[b])].tolist()) for i in range(int(w_b[b]))]
            prefix = candidates[0][:1]
            while True:
                x = first_argmax(target_logits(prefix))
                longer = [c for c in candidates if len(c) > len(prefix)]
                if not any(c[: len(prefix) + 1] == prefix + (x,) for c in longer):
                    break
                prefix += (x,)
            emitted = list(prefix[1:]) + [x]
            assert acc.tokens[b].tolist() == emitted + [-1] * (length - len(emitted))


def test_greedy_respects_truncated_trees():
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    for _ in range(100):
        beams = torch.randint(0, 3, (rng.randint(1, 4), 4, 4), generator=gen)
        beams[:, :, 0] = 1
        full = build_tree(beams)
        tree = truncate_tree(full, torch.randint(1, 14, (beams.shape[0],), generator=gen))
        logits = torch.randint(0, 3, (*tree.tokens.shape, 3), generator=gen).float()
        acc = verify_greedy(tree, logits)
        check_invariants(tree, acc, 4)
        for b in range(beams.shape[0]):
            n = int(tree.num_packed[b])
            parents, tokens = tree.parent[b, :n].tolist(), tree.tokens[b, :n].tolist()
            choice = [first_argmax(row) for row in logits[b].tolist()]
            emitted, _ = reference_walk(parents, tokens, choice)
            assert acc.tokens[b].tolist() == emitted + [-1] * (4 - len(emitted))


def doc_logits(argmax_at: dict[int, int], vocab: int = 10) -> torch.Tensor:
    """[1, 7, V] logits for the DOC_BEAMS tree whose argmax at packed node p is argmax_at[p]."""
    logits = torch.zeros(1, 7, vocab)
    for node, token in argmax_at.items():
        logits[0, node, token] = 1.0
    return logits


def test_greedy_hand_example_winning_path_is_not_beam_0():
    tree = build_tree(torch.tensor([DOC_BEAMS]))
    acc = verify_greedy(tree, doc_logits({0: 4, 1: 2, 4: 6, 6: 9}))
    assert acc.tokens.tolist() == [[4, 6, 9]]
    assert acc.path.tolist() == [[0, 4, 6]]
    assert acc.num_accepted.tolist() == [2] and acc.last_node.tolist() == [6]
    assert acc.bonus.tolist() == [9]


def test_greedy_hand_example_cut_at_the_root():
    tree = build_tree(torch.tensor([DOC_BEAMS]))
    acc = verify_greedy(tree, doc_logits({0: 7, 1: 2, 4: 6}))
    assert acc.tokens.tolist() == [[7, -1, -1]] and acc.path.tolist() == [[0, -1, -1]]
    assert acc.num_accepted.tolist() == [0] and acc.last_node.tolist() == [0]
    assert acc.bonus.tolist() == [7]


def test_greedy_rows_take_the_greedy_walk_in_every_mode():
    gen = torch.Generator().manual_seed(3)
    beams = torch.randint(0, 3, (6, 4, 4), generator=gen)
    beams[:, :, 0] = 0
    tree = build_tree(beams)
    logits = torch.randn(*tree.tokens.shape, 3, generator=gen) * 3
    draft = torch.randn(6, 4, 3, 3, generator=gen).log_softmax(-1)
    params = SamplingParamsBatch.from_lists([0.0, 1.0, 0.0, 0.7, 0.0, 1.5], top_p=[0.9] * 6)
    greedy = verify_greedy(tree, logits)
    rows = torch.tensor([0, 2, 4])
    for acc in (
        verify_sampling(tree, logits, params),
        verify(tree, logits, params, "exact"),
        verify(tree, logits, params, "rejection", draft),
        verify(tree, logits, params, "typical"),
        verify_rejection(tree, logits, params, draft),  # the point-mass target reduces to greedy too
        verify_typical(tree, logits, params),
    ):
        for field in ("tokens", "path", "num_accepted", "last_node", "bonus"):
            assert torch.equal(getattr(acc, field)[rows], getattr(greedy, field)[rows]), field
        check_invariants(tree, acc, 4)


# --- exact tree sampling: the closed-form target distribution ----------------------------------
#
# A second-order Markov "target" over V = 5 tokens: its next-token logits are TABLE[prev, last],
# so the target's distribution of the first emitted tokens is known exactly. The tree is what a
# beam search (W = 4, L = 3) over a *different* draft table produces, so it holds likely and
# unlikely tokens (and shares the first draft token between two beams).

VOCAB, C_PREV, G0, NUM_ROWS = 5, 2, 0, 20_000
_tables = torch.Generator().manual_seed(11)
TARGET_TABLE = torch.randn(VOCAB, VOCAB, VOCAB, generator=_tables) * 1.5  # [prev, last, V]
DRAFT_TABLE = TARGET_TABLE + torch.randn(VOCAB, VOCAB, VOCAB, generator=_tables)  # q != p


def reference_dist(logits: list[float], temperature: float, top_p: float) -> list[float]:
    """The target's distribution in float64: temperature, then the smallest top set of mass >= top_p."""
    x = [v / temperature for v in logits]
    e = [math.exp(v - max(x)) for v in x]
    probs = [v / sum(e) for v in e]
    kept, mass = [], 0.0
    for v in sorted(range(len(x)), key=lambda v: (-x[v], v)):
        if mass < top_p:
            kept.append(v)
            mass += probs[v]
    return [probs[v] / mass if v in kept else 0.0 for v in range(len(x))]


def draft_beam_search(width: int, length: int) -> list[list[int]]:
    """Exhaustive beam search over DRAFT_TABLE's log-probs: the W best, deterministic, as ReDrafter's."""
    beams, scores = [[C_PREV, G0]], [0.0]
    for _ in range(length - 1):
        candidates = []
        for beam, score in zip(beams, scores):
            log_q = DRAFT_TABLE[beam[-2], beam[-1]].log_softmax(-1).tolist()
            candidates += [(score + log_q[v], beam + [v]) for v in range(VOCAB)]
        candidates.sort(key=lambda c: -c[0])
        beams, scores = [c[1] for c in candidates[:width]], [c[0] for c in candidates[:width]]
    return [beam[1:] for beam in beams]  # drop the context token: beams start with g0


def markov_setup(width: int = 4, length: int = 3):
    """The tree (NUM_ROWS copies), target logits [B, P, V], and draft log-probs [B, W, L-1, V]."""
    beams = draft_beam_search(width, length)
    tree = build_tree(torch.tensor([beams]).expand(NUM_ROWS, -1, -1))
    tokens, parent = tree.tokens[0].tolist(), tree.parent[0].tolist()
    prev = [C_PREV if up < 0 else tokens[up] for up in parent]
    logits = torch.stack([TARGET_TABLE[prev[p], tokens[p]] for p in range(len(tokens))])
    def draft_log_probs(beam: list[int]) -> torch.Tensor:  # [L-1, V]: q of token j+1 after 0..j
        pairs = list(zip([C_PREV] + beam, beam))[:-1]
        return torch.stack([DRAFT_TABLE[prev, last].log_softmax(-1) for prev, last in pairs])

    draft = torch.stack([draft_log_probs(beam) for beam in beams])
    return beams, tree, logits.expand(NUM_ROWS, -1, -1), draft.expand(NUM_ROWS, -1, -1, -1)


def first_two_tokens(
    acc: Acceptance, temperature: float, top_p: float, gen: torch.Generator
) -> torch.Tensor:
    """[N] index y1 * V + y2 of the first two emitted tokens. Where the step emitted only one, y2 is
    what the next step's target samples after it (drawn here from the reference distribution)."""
    next_dist = torch.tensor(
        [reference_dist(TARGET_TABLE[G0, y].tolist(), temperature, top_p) for y in range(VOCAB)]
    )
    y1 = acc.tokens[:, 0]
    fresh = torch.multinomial(next_dist[y1], 1, generator=gen).squeeze(1)
    y2 = torch.where(acc.num_accepted >= 1, acc.tokens[:, 1], fresh)
    return y1 * VOCAB + y2


def expected_joint(temperature: float, top_p: float) -> torch.Tensor:
    """[V*V] float64: P_target(y1, y2) = p(y1 | C_PREV, G0) p(y2 | G0, y1)."""
    first = reference_dist(TARGET_TABLE[C_PREV, G0].tolist(), temperature, top_p)
    second = [reference_dist(TARGET_TABLE[G0, y1].tolist(), temperature, top_p) for y1 in range(VOCAB)]
    joint = [first[y1] * second[y1][y2] for y1 in range(VOCAB) for y2 in range(VOCAB)]
    return torch.tensor(joint, dtype=torch.float64)


def chi_square_vs_target(cells: torch.Tensor, joint: torch.Tensor) -> tuple[float, float, float]:
    """(p-value, total variation, power to detect a 2-point shift) of the observed cells vs ``joint``.

    Power: moving delta = 0.02 of probability mass from cell i to cell j gives the chi-square
    statistic a noncentrality N * delta^2 * (1/p_i + 1/p_j); the smallest over all pairs is the
    hardest 2% bias to see. Power = P(noncentral chi-square > the 1% critical value).
    """
    counts = torch.bincount(cells, minlength=VOCAB * VOCAB).double()
    support = joint > 0
    assert counts[~support].sum() == 0, "a token the target can never sample was emitted"
    expected = joint[support] / joint[support].sum() * len(cells)
    p_value = chisquare(counts[support].numpy(), expected.numpy()).pvalue
    tv = 0.5 * (counts / len(cells) - joint).abs().sum().item()
    p = joint[support]
    pair_sum = (1 / p[:, None] + 1 / p[None, :]).fill_diagonal_(float("inf")).min().item()
    dof = int(support.sum()) - 1
    power = 1 - ncx2.cdf(chi2.ppf(0.99, dof), dof, len(cells) * 0.02**2 * pair_sum)
    return p_value, tv, power


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_exact_sampling_matches_the_target_distribution(temperature):
    beams, tree, logits, _ = markov_setup()
    assert len({beam[1] for beam in beams}) >= 2 and len(beams) == 4  # branches at the root
    params = SamplingParamsBatch.from_lists([temperature] * NUM_ROWS, top_p=[0.9] * NUM_ROWS)
    torch.manual_seed(0)
    acc = verify_sampling(tree, logits, params)  # one vectorised call, 20k rows
    assert 0.2 < acc.num_accepted.float().mean() < 1.8  # some acceptance, some rejection
    cells = first_two_tokens(acc, temperature, 0.9, torch.Generator().manual_seed(1))
    p_value, tv, power = chi_square_vs_target(cells, expected_joint(temperature, 0.9))
    assert power > 0.99, f"20k samples must detect a 2% shift (power {power:.3f})"
    assert p_value > 0.01, f"exact sampling is off the target: p = {p_value:.2g}, TV = {tv:.4f}"


def test_rejection_mode_is_biased_on_the_same_setup():
    """Apple's per-beam p/q test on the same tree with q != p, W = 4: the bias is large and measured."""
    _, tree, logits, draft = markov_setup()
    params = SamplingParamsBatch.from_lists([1.0] * NUM_ROWS, top_p=[0.9] * NUM_ROWS)
    torch.manual_seed(0)
    acc = verify(tree, logits, params, "rejection", draft)
    cells = first_two_tokens(acc, 1.0, 0.9, torch.Generator().manual_seed(1))
    p_value, tv, _ = chi_square_vs_target(cells, expected_joint(1.0, 0.9))
    measured = f"p/q rejection: p = {p_value:.2g}, TV = {tv:.3f} (measured 0.48)"
    assert p_value < 0.01 and tv > 0.1, measured


def test_rejection_single_beam_follows_the_p_over_q_formula():
    """W = 1, L = 2, a fixed draft token x with q(x) > p(x): the first token is x with probability
    p(x)/q(x), else drawn from the normalised residual max(p - q, 0) (which differs from p)."""
    p = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    q = torch.tensor([0.05, 0.05, 0.6, 0.2, 0.1])
    x = 2
    tree = build_tree(torch.tensor([[[0, x]]]).expand(NUM_ROWS, -1, -1))
    logits = torch.stack([p.log(), torch.zeros(VOCAB)])[None].expand(NUM_ROWS, -1, -1)
    draft = q.log()[None, None, None].expand(NUM_ROWS, 1, 1, -1)
    params = SamplingParamsBatch.from_lists([1.0] * NUM_ROWS)
    torch.manual_seed(5)
    acc = verify_rejection(tree, logits, params, draft)
    accept = p[x] / q[x]
    residual = (p - q).clamp(min=0)
    expected = (1 - accept) * residual / residual.sum()
    expected[x] = accept
    counts = torch.bincount(acc.tokens[:, 0], minlength=VOCAB).double()
    support = expected > 0
    assert counts[~support].sum() == 0
    expected = (expected[support].double() * NUM_ROWS).numpy()
    assert chisquare(counts[support].numpy(), expected).pvalue > 0.01
    assert torch.equal(acc.num_accepted == 1, acc.tokens[:, 0] == x)


def replay_rejection(
    tree, logits, draft, temperature: float, seeds: list[int]
) -> list[tuple[list[int], int]]:
    """Plain-Python p/q rejection replaying the same seeded noise: (path, bonus) per request."""
    beams, unpack = tree.beams.tolist(), tree.unpack_index.tolist()
    batch, width, length = tree.beams.shape
    out = []
    for b in range(batch):
        gen = torch.Generator().manual_seed(seeds[b])
        u = torch.rand(width, length - 1, generator=gen).tolist()
        expo = torch.empty(1, logits.shape[-1]).exponential_(generator=gen)[0]
        probs = [reference_dist(row, temperature, 1.0) for row in logits[b].tolist()]
        seen, best, best_len = set(), 0, -1
        for i in range(width):
            if unpack[b][i][0] < 0 or tuple(beams[b][i]) in seen:
                continue  # padding, or the same candidate as an earlier beam
            seen.add(tuple(beams[b][i]))
            n = 0
            while n + 1 < length and unpack[b][i][n + 1] >= 0:
                x, p_x = beams[b][i][n + 1], probs[unpack[b][i][n]][beams[b][i][n + 1]]
                if not u[i][n] * math.exp(draft[b, i, n, x]) < p_x:
                    break
                n += 1
            if n > best_len:
                best, best_len = i, n
        path = unpack[b][best][: best_len + 1]
        p_stop = torch.tensor(probs[path[-1]])
        rejected = best_len + 1 < length and unpack[b][best][best_len + 1] >= 0
        q_stop = draft[b, best, min(best_len, length - 2)].exp().double()
        dist = (p_stop - q_stop).clamp(min=0) if rejected else p_stop
        if dist.sum() == 0:
            dist = p_stop
        out.append((path, int(torch.where(dist > 0, dist / expo, -1.0).argmax())))
    return out


def test_rejection_matches_replayed_reference():
    gen = torch.Generator().manual_seed(6)
    for trial in range(40):
        batch, width, length, vocab = 3, 4, 4, 2 + trial % 2  # vocab 2: many duplicate beams
        beams = torch.randint(0, vocab, (batch, width, length), generator=gen)
        beams[:, :, 0] = 0
        tree = build_tree(beams, torch.randint(1, width + 1, (batch,), generator=gen))
        if trial % 3 == 0:
            tree = truncate_tree(tree, torch.randint(1, 10, (batch,), generator=gen))
        logits = torch.randn(*tree.tokens.shape, vocab, generator=gen) * 2
        draft = (torch.randn(batch, width, length - 1, vocab, generator=gen) * 2).log_softmax(-1)
        seeds = [trial * 10 + b for b in range(batch)]
        params = SamplingParamsBatch.from_lists([1.0] * batch, seeds=seeds)
        acc = verify_rejection(tree, logits, params, draft)
        check_invariants(tree, acc, length)
        for b, (path, bonus) in enumerate(replay_rejection(tree, logits, draft, 1.0, seeds)):
            assert acc.path[b].tolist() == path + [-1] * (length - len(path))
            assert int(acc.bonus[b]) == bonus


# --- Medusa typical acceptance --------------------------------------------------------------------


def test_typical_hand_example():
    """Root: tokens 1 and 4 pass; under 1 both children fail (0.05 < 0.09); under 4, token 6 passes."""
    probs = torch.full((7, 10), 1e-9)
    probs[0, [1, 4, 0]] = torch.tensor([0.2, 0.6, 0.2])
    probs[1, [2, 3, 0]] = torch.tensor([0.05, 0.05, 0.9])  # low entropy: threshold = 0.09
    probs[4, [2, 6, 0]] = torch.tensor([0.02, 0.5, 0.48])
    probs[6, 9] = 1.0
    tree = build_tree(torch.tensor([DOC_BEAMS]))
    params = SamplingParamsBatch.from_lists([1.0])
    acc = verify_typical(tree, probs.log()[None], params)
    assert acc.path.tolist() == [[0, 4, 6]] and acc.tokens.tolist() == [[4, 6, 9]]
    # Ties between equally deep paths go to the first in packed order: now token 2 under 1 passes.
    probs[1, [2, 3, 0]] = torch.tensor([0.5, 0.05, 0.45])
    acc = verify_typical(tree, probs.log()[None], params)
    assert acc.path.tolist() == [[0, 1, 2]] and acc.num_accepted.tolist() == [2]
    # threshold = min(posterior_threshold, posterior_alpha * exp(-entropy)): raising both to 0.7 /
    # 100 puts it at 0.7 everywhere, which rejects everything (0.6 at the root): only the bonus.
    acc = verify_typical(
        tree, probs.log()[None], params, posterior_threshold=0.7, posterior_alpha=100.0
    )
    assert acc.path.tolist() == [[0, -1, -1]] and acc.num_accepted.tolist() == [0]
    assert (MEDUSA_POSTERIOR_THRESHOLD, MEDUSA_POSTERIOR_ALPHA) == (0.09, 0.3)


def test_typical_matches_reference_on_random_trees():
    gen = torch.Generator().manual_seed(7)
    for trial in range(30):
        batch, width, length, vocab = 3, 4, 4, 4
        beams = torch.randint(0, vocab, (batch, width, length), generator=gen)
        beams[:, :, 0] = 0
        tree = build_tree(beams)
        logits = torch.randn(*tree.tokens.shape, vocab, generator=gen) * 1.5
        seeds = [trial * 10 + b for b in range(batch)]
        params = SamplingParamsBatch.from_lists([1.0] * batch, seeds=seeds)
        acc = verify_typical(tree, logits, params)
        check_invariants(tree, acc, length)
        for b in range(batch):
            n = int(tree.num_packed[b])
            parent, tokens = tree.parent[b].tolist(), tree.tokens[b].tolist()
            probs = [reference_dist(row, 1.0, 1.0) for row in logits[b, :n].tolist()]
            entropy = [-sum(p * math.log(p + 1e-5) for p in row) for row in probs]
            threshold = [
                min(MEDUSA_POSTERIOR_THRESHOLD, MEDUSA_POSTERIOR_ALPHA * math.exp(-h)) for h in entropy
            ]
            reached = [True] + [False] * (n - 1)
            for c in range(1, n):
                up = parent[c]
                reached[c] = reached[up] and probs[up][tokens[c]] > threshold[up]
            depth = tree.depth[b].tolist()
            chosen = max((c for c in range(n) if reached[c]), key=lambda c: (depth[c], -c))
            path = [chosen]
            while parent[path[-1]] >= 0:
                path.append(parent[path[-1]])
            assert acc.path[b].tolist() == path[::-1] + [-1] * (length - len(path))
            seeded = torch.Generator().manual_seed(seeds[b])
            expo = torch.empty(1, vocab).exponential_(generator=seeded)[0]
            assert int(acc.bonus[b]) == int((torch.tensor(probs[chosen]) / expo).argmax())


# --- seeds, dispatch, errors ----------------------------------------------------------------------


def test_seeded_request_reproducible_irrespective_of_batch_composition():
    a_beams = torch.tensor([[1, 2, 0], [1, 0, 2], [1, 2, 2]])  # request A: 6 packed tokens
    x_beams = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]])  # request X: 4 (P set by A)
    gen = torch.Generator().manual_seed(8)
    a_logits = torch.randn(6, 3, generator=gen)
    alone_tree = build_tree(a_beams[None])
    params = SamplingParamsBatch.from_lists([1.0], seeds=[42])
    alone = verify_sampling(alone_tree, a_logits[None], params)
    torch.manual_seed(9)
    pair_tree = build_tree(torch.stack([x_beams, a_beams]))
    pair_logits = torch.stack([torch.randn(6, 3, generator=gen), a_logits])
    pair_params = SamplingParamsBatch.from_lists([1.0, 1.0], seeds=[None, 42])
    pair = verify_sampling(pair_tree, pair_logits, pair_params)
    assert pair.tokens[1].tolist() == alone.tokens[0].tolist()
    assert pair.path[1].tolist() == alone.path[0].tolist()


def test_bad_inputs_raise():
    tree = build_tree(torch.tensor([DOC_BEAMS]))
    logits = doc_logits({0: 4})
    params = SamplingParamsBatch.from_lists([1.0])
    with pytest.raises(ValueError, match="exact, rejection, typical; got 'medusa'"):
        verify(tree, logits, params, mode="medusa")
    needs = r"draft_log_probs \[B, W, L-1, V\] = \[1, 4, 2, 10\].*got None"
    with pytest.raises(ValueError, match=needs):
        verify(tree, logits, params, mode="rejection")
    shapes = r"logits must be \[B, P, V\] with \[B, P\] = \[1, 7\].*\(1, 6, 10\)"
    with pytest.raises(ValueError, match=shapes):
        verify_greedy(tree, logits[:, :6])
    with pytest.raises(ValueError, match="sampling params are for 2 requests, the tree for 1"):
        verify_sampling(tree, logits, SamplingParamsBatch.from_lists([1.0, 1.0]))
