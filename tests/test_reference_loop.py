"""The reference speculative loop reproduces the embedded target's own greedy output exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_redrafter.context_candidates import find_candidates
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter
from vllm_redrafter.reference_loop import (
    ContextCandidatesProposer,
    DrafterProposer,
    TeacherForcedProposer,
    chat_prompt_ids,
    greedy_generate,
    speculative_generate,
)

NUM_PROMPTS = 6  # the loop takes 5-25 s per 64-token answer on 2 cores (a recompute per step)
MAX_NEW_TOKENS = 64


@pytest.fixture(scope="module")
def target(target_dir, every_core):
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return model, tokenizer


@pytest.fixture(scope="module")
def prompts_and_references(target, mt_bench_questions):
    """The first NUM_PROMPTS MT-Bench first turns and the target's own greedy answers to them."""
    model, tokenizer = target
    prompts = [chat_prompt_ids(tokenizer, q) for q in mt_bench_questions[:NUM_PROMPTS]]
    eos = tokenizer.eos_token_id
    references = [greedy_generate(model, p, MAX_NEW_TOKENS, eos) for p in prompts]
    return prompts, references


class RecordingProposer:
    """Wraps a proposer and records the (h, g0) pairs it is handed."""

    def __init__(self, inner):
        self.inner, self.seen = inner, []

    def __call__(self, h, g0, generated):
        self.seen.append((h.clone(), g0))
        return self.inner(h, g0, generated)


def test_teacher_forced_tree_loop_matches_target_greedy(target, prompts_and_references):
    model, tokenizer = target
    prompts, references = prompts_and_references
    steps, handed = [], []
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        proposer = RecordingProposer(TeacherForcedProposer(
            reference, beam_width=4, beam_length=5, vocab_size=model.config.vocab_size, seed=i))
        result = speculative_generate(model, prompt, proposer, MAX_NEW_TOKENS,
                                      tokenizer.eos_token_id)
        assert result.tokens == reference, f"prompt {i} diverged from the target's greedy output"
        steps += result.steps
        handed += proposer.seen
    accepted_2 = sum(s.num_accepted >= 2 for s in steps) / len(steps)
    off_beam_0 = sum(s.winning_beam != 0 for s in steps) / len(steps)
    assert accepted_2 >= 0.3, f"only {accepted_2:.0%} of steps accepted >= 2 tokens"
    assert off_beam_0 >= 0.3, f"the winning path was off beam 0 in only {off_beam_0:.0%} of steps"
    assert any(s.num_packed < s.beam_tokens for s in steps), "no step shared a prefix"
    # The drafter is handed the target's hidden state at the last accepted token: the target's
    # own LM head applied to it gives back the token the target produced there (g0).
    h = torch.stack([h for h, _ in handed])
    g0 = torch.tensor([g for _, g in handed])
    assert torch.equal(model.lm_head(h).argmax(-1), g0)


def untrained_drafter(model) -> RecurrentDrafter:
    """A drafter with random weights (seed 0) for the target: it accepts next to nothing."""
    config = model.config
    torch.manual_seed(0)
    return RecurrentDrafter(
        DrafterConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                      exit_dim=2 * config.hidden_size, num_draft_layers=1, draft_vocab_size=512),
        embedding=model.get_input_embeddings(),
    ).eval()


def test_drafter_tree_loop_matches_target_greedy(target, prompts_and_references):
    """A real (untrained) drafter's beams through the same loop: still the target's output."""
    model, tokenizer = target
    prompts, references = prompts_and_references
    drafter = untrained_drafter(model)
    proposer = DrafterProposer(drafter, beam_width=4, beam_length=3)
    for prompt, reference in list(zip(prompts, references))[:3]:
        result = speculative_generate(model, prompt, proposer, 24, tokenizer.eos_token_id)
        assert result.tokens == reference[:24]


class OneTokenLate(ContextCandidatesProposer):
    """Negative control: each candidate starts one token after where the lookup says."""

    def find(self, context):
        return [c[1:] for c in find_candidates(context, self.count, self.tokens + 1, self.min_n,
                                                self.max_n) if len(c) > 1]


def test_context_candidates_keep_the_target_greedy_output(target, prompts_and_references):
    """An untrained drafter's beams (it accepts next to nothing) and 2 context candidates in one
    tree: the target's own greedy output; the accepted path lay on a candidate alone in some
    steps (4 prompts), and far less often per step with candidates one token late (the first 2
    of them: a control; same output)."""
    model, tokenizer = target
    prompts, references = prompts_and_references
    drafter = untrained_drafter(model)
    won, steps = {}, {}
    for name, kind, count in (("right", ContextCandidatesProposer, 4), ("late", OneTokenLate, 2)):
        won[name] = steps[name] = 0
        for prompt, reference in list(zip(prompts, references))[:count]:
            proposer = kind(DrafterProposer(drafter, 2, 4), prompt, 2, 3, min_n=2, max_n=5)
            result = speculative_generate(model, prompt, proposer, MAX_NEW_TOKENS,
                                          tokenizer.eos_token_id)
            assert result.tokens == reference, name
            won[name] += sum(s.num_accepted > 0 and s.winning_beam >= rows
                             for s, rows in zip(result.steps, proposer.rows))
            steps[name] += len(result.steps)
    print(f"\nsteps whose accepted path only a candidate held: {won} of {steps}")
    assert won["right"] >= 5, won
    assert won["late"] / steps["late"] <= won["right"] / steps["right"] / 3, (won, steps)
