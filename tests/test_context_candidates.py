"""Context candidates (context_candidates.py): the lookup, and candidates merged into trees."""

from __future__ import annotations

import doctest
import json
import random
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from vllm_redrafter import context_candidates
from vllm_redrafter.context_candidates import PAD, ContextIndex, find_candidates, merge_candidates
from vllm_redrafter.tree import build_tree, truncate_tree
from vllm_redrafter.verify import verify_greedy_choice
from vllm_redrafter.vllm_plugin.tree_step import RequestTree


def test_doctests():
    assert doctest.testmod(context_candidates).failed == 0


def test_the_module_does_not_import_vllm():
    code = ("import sys, vllm_redrafter.context_candidates, vllm_redrafter.beam_policy; "
            "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- the lookup ----------------------------------------------------------------------------------


NGRAM_SETTINGS = [(1, 1), (1, 3), (2, 5), (3, 3)]  # (prompt_lookup_min, prompt_lookup_max)
VLLM_NGRAM = """import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens
find = _find_longest_matched_ngram_and_propose_tokens.py_func  # numba's function as plain Python
cases = json.load(sys.stdin)
print(json.dumps([find(np.array(c), lo, hi, 1 << 20, k).tolist() for c, lo, hi, k in cases]))
"""


def random_cases(min_n: int, max_n: int) -> list[tuple[list[int], int, int, int]]:
    """300 random contexts (small vocabularies: many matches, many ties) and draft lengths."""
    rng = random.Random(0)
    cases = []
    for _ in range(300):
        vocab = rng.choice([2, 3, 5, 20])
        context = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        cases.append((context, min_n, max_n, rng.randrange(1, 6)))
    return cases


@pytest.fixture(scope="module")
def vllm_proposals() -> dict[tuple[int, int], list[list[int]]]:
    """vLLM's own n-gram proposer on every random case, run in a subprocess: importing it (numba)
    here would break vLLM's kernel-override scan in engines this test process starts later."""
    cases = [case for lo, hi in NGRAM_SETTINGS for case in random_cases(lo, hi)]
    run = subprocess.run([sys.executable, "-c", VLLM_NGRAM], input=json.dumps(cases),
                         capture_output=True, text=True, check=True)
    proposals = json.loads(run.stdout.strip().splitlines()[-1])
    return {setting: proposals[i * 300:(i + 1) * 300] for i, setting in enumerate(NGRAM_SETTINGS)}


@pytest.mark.parametrize("min_n, max_n", NGRAM_SETTINGS)
def test_the_best_candidate_is_what_vllms_ngram_proposer_proposes(min_n, max_n, vllm_proposals):
    found = 0
    for (context, _, _, k), theirs in zip(random_cases(min_n, max_n),
                                         vllm_proposals[(min_n, max_n)], strict=True):
        ours = find_candidates(np.array(context), 1, k, min_n, max_n)
        assert (list(ours[0]) if ours else []) == theirs, (context, k)
        found += bool(ours)
    assert found > 100  # most trials had a match: the comparison meant something


def test_candidates_are_longer_matches_first_then_earlier_and_add_nodes():
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13
    context = [3, 1, 2, 7, 9, 1, 2, 8, 4, 1, 2, 7, 5, 1, 2]
    # "1 2" recurs at 1, 5, 9, 13 (the suffix); "7 ... 1 2" no: all matches have length 2,
    # so earliest first: after 1-2 at 1 comes 7 9, at 5 comes 8 4, at 9 comes 7 5
    assert find_candidates(context, 3, 2) == [(7, 9), (8, 4), (7, 5)]
    assert find_candidates(context, 3, 1) == [(7,), (8,)]  # (7,) again would add no node
    assert find_candidates(context, 0, 3) == [] and find_candidates(context, 2, 0) == []
    assert find_candidates(context, 2, 3, min_n=3) == []  # no 3-gram recurs
    # a longer match wins over an earlier one
    assert find_candidates([5, 6, 1, 9, 4, 6, 1, 3, 4, 6, 1], 2, 2) == [(3, 4), (9, 4)]
    # a candidate at the context's end is short (vLLM returns it short too)
    assert find_candidates([1, 2, 3, 1, 2], 1, 4) == [(3, 1, 2)]


def test_a_continuation_that_extends_a_chosen_one_replaces_it():
    # "2 2 2" recurs ending at 3 (followed by one token: (2,)), "2 2" at 2 (followed by (2, 2))
    assert find_candidates([1, 2, 2, 2, 2], 1, 3, max_n=3) == [(2,)]
    assert find_candidates([1, 2, 2, 2, 2], 2, 3, max_n=3) == [(2, 2)]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        find_candidates([1, 2, 1], 1, 2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="count >= 0"):
        find_candidates([1, 2, 1], -1, 2)


def test_the_context_index_grows_with_the_output():
    index = ContextIndex([1, 2, 3])
    output: list[int] = []
    for token in range(200):
        output.append(token % 7)
        assert index.update(output).tolist() == [1, 2, 3, *output]
    assert index.update(output[:5]).tolist() == [1, 2, 3, *output[:5]]  # shrank: rebuilt


def test_a_lookup_in_4k_tokens_finds_the_recurring_ngram():
    """(Its time is printed, not asserted: ~50 us on one core here.)"""
    rng = np.random.default_rng(0)
    context = rng.integers(0, 2000, 4096)
    context[-3:] = context[1000:1003]  # one 3-gram recurs
    start = time.perf_counter()
    found = find_candidates(context, 4, 4)
    print(f"\nlookup in 4096 tokens: {(time.perf_counter() - start) * 1e6:.0f} us")
    assert found[0] == tuple(context[1003:1007].tolist())


# -- candidates in the tree ------------------------------------------------------------------------


def test_candidates_merge_with_the_beams_shared_prefixes_once():
    beams = torch.tensor([[[5, 1, 2, 3],
                           [5, 4, 6, 7]]])
    # a candidate equal to beam 0, one sharing "5 1" with it, a short one
    merged, rows = merge_candidates(beams, [2], [4], [5], [[(1, 2, 3), (1, 9, 8), (4,)]])
    assert rows == [5]
    assert merged[0, 4].tolist() == [5, 4, PAD, PAD]
    tree = build_tree(merged, torch.tensor(rows))
    # 7 nodes of the beams, plus 9 and 8 below "5 1": the equal and the short candidate add none
    assert int(tree.num_packed[0]) == 9
    assert tree.tokens[0].tolist() == [5, 1, 2, 3, 4, 6, 7, 9, 8]
    assert tree.parent[0].tolist() == [-1, 0, 1, 2, 0, 4, 5, 1, 7]
    assert tree.depth[0].tolist() == [0, 1, 2, 3, 1, 2, 3, 2, 3]
    assert tree.unpack_index[0, 4].tolist() == [0, 4, -1, -1]  # the short row ends
    assert int(tree.valid[0].sum()) == 4 * 4 + 2  # padding is not a candidate token
    # the drafter's nodes come first: a cut keeps them before any candidate's
    assert truncate_tree(tree, 7).tokens[0].tolist() == [5, 1, 2, 3, 4, 6, 7]


def test_requests_with_candidates_only_beams_only_and_both_in_one_batch():
    beams = torch.tensor([[[5, 1, 2]], [[8, 3, 3]], [[0, 0, 0]]])  # request 2 does not draft
    merged, rows = merge_candidates(beams, [1, 1, 0], [3, 3, 3], [5, 8, 6],
                                    [[(1, 7, 7)], [], [(2, 2), (9,)]])
    assert rows == [2, 1, 2] and merged.shape == (3, 2, 4)
    tree = build_tree(merged, torch.tensor(rows))
    assert tree.num_packed.tolist() == [5, 3, 4]  # 5 1 2 | 7 7
    assert tree.tokens[1, :3].tolist() == [8, 3, 3]
    assert tree.tokens[2, :4].tolist() == [6, 2, 2, 9]
    assert tree.parent[2, :4].tolist() == [-1, 0, 1, 0]


def test_greedy_verification_follows_a_candidate_branch():
    merged, rows = merge_candidates(torch.tensor([[[5, 1, 2]]]), [1], [3], [5], [[(4, 6, 8)]])
    tree = build_tree(merged, torch.tensor(rows))  # 5 -> 1 -> 2 and 5 -> 4 -> 6 -> 8
    # the target's argmax after each node: 4 after the root, 6 after 4, 0 after 6
    choice = torch.tensor([[4, 0, 0, 6, 0, 0]])  # packed: 5 1 2 4 6 8
    acceptance = verify_greedy_choice(tree, choice)
    assert acceptance.tokens[0].tolist()[:3] == [4, 6, 0]
    path = acceptance.path[0, :3].tolist()
    request = RequestTree(tuple(tree.tokens[0].tolist()), tuple(tree.parent[0].tolist()),
                          tuple(tree.depth[0].tolist()), from_drafter=(True,) * 3 + (False,) * 3)
    assert request.accepted_path([4, 6]) == path == [0, 3, 4]
    assert request.drafter_depth(path) == 0  # the drafter's beam accepted nothing
    assert request.drafter_depth(request.accepted_path([1, 2])) == 2
    assert request.prefix(4).from_drafter == (True, True, True, False)
