"""The held-out beam simulation (train/heldout_beams.py): acceptance from beams and labels."""

import doctest

import numpy as np
import pytest
import torch
from test_beam_search import real_drafter

from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.train import heldout_beams
from vllm_redrafter.train.distill import DistillData
from vllm_redrafter.train.heldout_beams import accepted_drafts, heldout_tokens_per_step


def test_doctests():
    assert doctest.testmod(heldout_beams).failed == 0


def test_accepted_drafts_is_the_longest_matching_prefix_of_any_beam():
    beams = torch.tensor([[[7, 1, 2, 3], [7, 1, 5, 6], [7, 4, 2, 3]],    # best: beam 1, 2 drafts
                          [[7, 9, 9, 9], [7, 8, 8, 8], [7, 9, 8, 8]]])   # none: 0
    labels = torch.tensor([[1, 5, 0, 3, 3], [1, 9, 8, 8, 8]])
    assert accepted_drafts(beams, labels).tolist() == [2, 0]
    labels[0, 1] = -1  # no label at depth 2: the first draft alone
    assert accepted_drafts(beams, labels).tolist() == [1, 0]


def synthetic_data(drafter, own_drafts: bool, n: int = 40) -> DistillData:
    """n positions, every other one held out; float16 h as built datasets hold; labels random, or
    the drafter's own best beam of length 6 (its 5 drafts) when ``own_drafts``."""
    gen = torch.Generator().manual_seed(2)
    data = DistillData(h=torch.randn(n, 8, generator=gen).numpy().astype(np.float16),
                       g0=torch.randint(0, 64, (n,), generator=gen),
                       labels=torch.randint(0, 64, (n, 5), generator=gen),
                       sequence=torch.arange(n), heldout=torch.arange(n) % 2 == 0,
                       token_counts=torch.zeros(64, dtype=torch.long), meta={})
    if own_drafts:
        own = beam_search(drafter, data.hidden(torch.arange(n)), data.g0, 1, 6)
        data.labels = own.beams[:, 0, 1:]
    return data


def test_a_drafter_that_drafts_the_targets_continuation_gets_every_draft_accepted():
    drafter = real_drafter(dtype=torch.float32)
    data = synthetic_data(drafter, own_drafts=True)
    full = heldout_tokens_per_step(drafter, data, beam_width=1, beam_length=4)
    assert full["positions"] == 20 and full["tokens_per_step"] == 4.0
    assert full["acceptance_at_least"] == [1.0, 1.0, 1.0]
    data.labels[:, 2] = -1  # nothing to accept at depth 3: two drafts at most
    assert heldout_tokens_per_step(drafter, data, 1, 4)["tokens_per_step"] == 3.0
    wider = heldout_tokens_per_step(drafter, synthetic_data(drafter, own_drafts=False), 4, 4)
    assert wider["tokens_per_step"] < 1.5  # random labels: next to nothing accepted
    with pytest.raises(ValueError, match="beam_length 7 needs 6 labels"):
        heldout_tokens_per_step(drafter, data, 1, 7)
