"""Shared by the training benchmarks: tokens/step of a drafter with the reference speculative loop.

``run_reference(target_dir, drafter_dir, prompts, beam_width, beam_length, max_new_tokens)``
runs vllm_redrafter.reference_loop (the target alone decides every token, greedy) on chat
prompts and returns tokens per target forward (accepted + bonus), per-position acceptance, the
drafting time per step (beam search only) and the share of the target's response tokens inside
the drafter's draft vocabulary. With ``context_candidates`` C > 0 each step's tree also holds up
to C context candidates (prompt lookup, ``vllm_redrafter/context_candidates.py``); beam_width 0
drafts the candidates alone.

The evaluation prompts are the MT-Bench first turns shipped in the package (``eval_sets``):
evaluation only, never training data, never used to choose K or any setting.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from vllm_redrafter.drafter import RecurrentDrafter
from vllm_redrafter.eval_sets import MT_BENCH, read_questions
from vllm_redrafter.reference_loop import (
    ContextCandidatesProposer,
    DrafterProposer,
    chat_prompt_ids,
    speculative_generate,
)



def mt_bench_prompts(limit: int | None = None, path: Path = MT_BENCH) -> list[str]:
    return [turn for _, turn in mt_bench_questions(limit, path)]


def mt_bench_questions(limit: int | None = None, path: Path = MT_BENCH) -> list[tuple[str, str]]:
    """(category, first turn) of the first ``limit`` questions, in the file's order.

    The file is ordered by category, ten questions each: writing, roleplay, reasoning, math,
    coding, extraction, stem, humanities. The first 20 are writing and role play only.
    """
    return [(q.category, q.first_turn) for q in read_questions(path, limit)]


class TimedProposer(DrafterProposer):
    """DrafterProposer that records the wall time of every beam search."""

    def __init__(self, drafter, beam_width: int, beam_length: int) -> None:
        super().__init__(drafter, beam_width, beam_length)
        self.seconds: list[float] = []

    def __call__(self, h, g0, generated):
        if h.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        beams = super().__call__(h, g0, generated)
        if h.is_cuda:
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - start)
        return beams


def load_target(target_dir: str | Path, device: str = "cpu"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    return model, AutoTokenizer.from_pretrained(target_dir)


@torch.no_grad()
def run_reference(target_dir: str | Path, drafter_dir: str | Path, prompts: list[str],
                  beam_width: int, beam_length: int, max_new_tokens: int,
                  model_and_tokenizer=None, categories: list[str] | None = None,
                  context_candidates: int = 0, lookup: tuple[int, int] = (2, 5),
                  candidate_tokens: int | None = None) -> dict:
    """tokens/step etc. of the drafter in ``drafter_dir`` over ``prompts`` (see module doc).

    With ``categories`` (one per prompt) the result also has tokens/step per category. With
    ``context_candidates`` (lookup: its n-gram lengths, min and max; ``candidate_tokens`` their
    most tokens, default L - 1) it also has the share of steps whose accepted path only a
    candidate held (``candidate_won``).
    """
    model, tokenizer = model_and_tokenizer or load_target(target_dir)
    drafter = RecurrentDrafter.from_pretrained(drafter_dir, model.get_input_embeddings(),
                                               device=model.device, dtype=torch.float32).eval()
    proposer = TimedProposer(drafter, beam_width, beam_length) if beam_width else None
    candidate_tokens = candidate_tokens or beam_length - 1
    depth = max(beam_length, 1 + candidate_tokens if context_candidates else 0)
    steps, accepted, hist, won = 0, 0, [0] * depth, 0
    response_tokens: list[int] = []
    by_category: dict[str, list[int]] = {}  # category -> [steps, accepted]
    tokens_by_category: dict[str, list[int]] = {}
    for i, question in enumerate(prompts):
        prompt_ids = chat_prompt_ids(tokenizer, question)
        propose = proposer
        if context_candidates:
            propose = ContextCandidatesProposer(proposer, prompt_ids, context_candidates,
                                                candidate_tokens, *lookup)
        result = speculative_generate(model, prompt_ids, propose, max_new_tokens,
                                      tokenizer.eos_token_id)
        if context_candidates:
            won += sum(s.num_accepted > 0 and s.winning_beam >= rows
                       for s, rows in zip(result.steps, propose.rows))
        response_tokens += result.tokens
        category = categories[i] if categories else "all"
        tokens_by_category.setdefault(category, []).extend(result.tokens)
        tally = by_category.setdefault(category, [0, 0])
        for step in result.steps:
            steps += 1
            accepted += step.num_accepted
            hist[step.num_accepted] += 1
            tally[0] += 1
            tally[1] += step.num_accepted
    draft_ids = (drafter.draft_vocab_ids if drafter.config.draft_vocab_size
                 else torch.arange(drafter.config.vocab_size)).cpu()

    def in_draft_vocab(ids: list[int]) -> float:
        return float(torch.isin(torch.tensor(ids), draft_ids).double().mean())

    return {
        "beam_width": beam_width, "beam_length": beam_length, "prompts": len(prompts),
        "steps": steps, "tokens_per_step": (accepted + steps) / max(steps, 1),
        # share of steps that accepted at least k draft tokens, k = 1..L-1 (or candidate length)
        "acceptance_at_least": [sum(hist[k:]) / max(steps, 1) for k in range(1, depth)],
        "context_candidates": context_candidates, "candidate_won": won / max(steps, 1),
        **({"candidate_tokens": candidate_tokens} if context_candidates else {}),
        "draft_ms_per_step": (1000 * sum(proposer.seconds) / max(len(proposer.seconds), 1)
                              if proposer else 0.0),
        "response_tokens_in_draft_vocab": in_draft_vocab(response_tokens),
        "draft_vocab_size": int(draft_ids.numel()),
        **({"tokens_per_step_by_category": {c: (a + n) / max(n, 1) for c, (n, a) in by_category.items()},
            "response_tokens_in_draft_vocab_by_category": {
                c: in_draft_vocab(ids) for c, ids in tokens_by_category.items()}}
           if categories else {}),
    }
