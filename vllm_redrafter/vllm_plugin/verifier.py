"""The tree verifier that takes the place of vLLM's rejection sampler on a ReDrafter engine.

vLLM computes logits for every scheduled draft position plus the root of each request
(``SpecDecodeMetadata``): for a packed tree, row j of a request is the target's next-token
distribution after node j given j's ancestors. :class:`TreeVerifier` walks each request's tree on
them (``verify.py``: greedy, exact tree sampling under the request's temperature / top-k / top-p /
min-p and seed, or the opt-in typical / p/q rejection modes), moves the accepted nodes' KV into
sequence order, remembers each request's last accepted node (the next draft's hidden state), and
returns vLLM's ``SamplerOutput``: per request the accepted drafts then the bonus token, -1
padded, which the runner's ``parse_output`` and the scheduler's rollback read as a chain.

Requests that verify no drafts this step (prefill chunks, requests whose features assume a chain:
penalties, bad words, logit bias, grammars, logprobs; see ``proposer.tree_eligible``) are sampled
by vLLM's own sampler, exactly as without speculation. A chain (W = 1) is the one-beam tree: the
same path. Dummy runs (start-up) go to vLLM's rejection sampler.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from itertools import accumulate
from typing import Any

import torch
from torch import Tensor, nn

from vllm_redrafter.sampling import SamplingParamsBatch, greedy_rows
from vllm_redrafter.tree import PackedTree, truncate_tree
from vllm_redrafter.verify import (
    Acceptance,
    verify_greedy,
    verify_greedy_choice,
    verify_rejection,
    verify_sampling,
    verify_typical,
)
from vllm_redrafter.vllm_plugin import mutations
from vllm_redrafter.vllm_plugin.timing import timed
from vllm_redrafter.vllm_plugin.tree_step import RequestTree, TreeStep

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and level


class TreeVerifier(nn.Module):
    def __init__(self, runner: Any, rejection_sampler: nn.Module):
        super().__init__()
        self.rejection_sampler = rejection_sampler  # vLLM's, for dummy runs
        self.sampler = rejection_sampler.sampler
        self._runner = [runner]  # a list: not an nn.Module attribute, no reference cycle in repr
        self.pending: TreeStep | None = None  # set by the runner patch for the step's forward
        self.last_step: TreeStep | None = None  # the verified step (its last_nodes feed drafting)
        self.num_tree_verifications = 0  # requests verified with drafts
        self.num_branching_verifications = 0  # of those, trees that branch (not chains)
        self.num_kv_moves = 0  # of those, the ones whose accepted path left beam 0 (KV moved)

    @property
    def runner(self) -> Any:
        return self._runner[0]

    def forward(self, metadata, draft_probs, logits: Tensor, sampling_metadata):
        step, self.pending = self.pending, None
        if step is None and metadata.max_spec_len == 0:
            # No drafts in the batch: the call vLLM alone makes (vLLM's rejection sampler would
            # copy the logits twice and, for sampled requests, draw a vocabulary of noise).
            return self.sampler(logits=logits, sampling_metadata=sampling_metadata)
        if step is None:  # not a ReDrafter verify step (vLLM's dummy sampler run)
            return self.rejection_sampler(metadata, draft_probs, logits, sampling_metadata)
        with timed(getattr(self.runner.drafter, "timings", None), "accept", logits.device):
            return self._verify(step, metadata, logits, sampling_metadata)

    def _verify(self, step: TreeStep, metadata, logits: Tensor, sampling_metadata):
        """Accepted drafts + bonus per request (-1 padded), KV moved, last nodes recorded."""
        from vllm.v1.outputs import SamplerOutput

        starts = list(accumulate((k + 1 for k in metadata.num_draft_tokens), initial=0))[:-1]
        plain = self._plain_tokens(metadata, logits, sampling_metadata, step)
        width = metadata.max_spec_len + 1
        rows = []
        for b, tree in enumerate(step.trees):
            rows.append([plain[b]] if tree is None else None)
        paths = self._walk_trees(step, logits, starts, sampling_metadata)
        for b, (tokens, path) in paths.items():
            rows[b] = tokens
            step.last_nodes[b] = path[-1]
        out = torch.full((len(rows), width), -1, dtype=torch.int32)
        for b, tokens in enumerate(rows):
            out[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        self._move_accepted_kv(step, {b: path for b, (_, path) in paths.items()})
        self.last_step = step
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(logits, starts, rows, paths, sampling_metadata.max_num_logprobs, width)
        return SamplerOutput(sampled_token_ids=out.to(logits.device), logprobs_tensors=logprobs)

    # -- the parts ---------------------------------------------------------------------------

    def _plain_tokens(self, metadata, logits: Tensor, sampling_metadata, step: TreeStep) -> list[int]:
        """vLLM's own sample at each request's last row: the output of requests without drafts.

        Every row is sampled, not only the draft-less ones: ``sampling_metadata`` (penalties,
        generators, allowed-token masks) is laid out per batch row, and one sampler call over
        B rows costs less than slicing all of it consistently.
        """
        if all(tree is not None for tree in step.trees):
            return [-1] * len(step.trees)
        result = self.sampler(
            logits=logits[metadata.bonus_logits_indices],
            sampling_metadata=replace(sampling_metadata, max_num_logprobs=None),
            predict_bonus_token=True,
        )
        return result.sampled_token_ids[:, 0].tolist()

    def _walk_trees(self, step: TreeStep, logits: Tensor, starts: list[int],
                    sampling_metadata) -> dict[int, tuple[list[int], list[int]]]:
        """Per tree request: (accepted drafts + bonus, accepted path root first)."""
        reqs = step.tree_requests()
        if not reqs:
            return {}
        trees = [step.trees[b] for b in reqs]
        params = self._params(reqs, sampling_metadata, logits.device)
        if all(t.mode == "exact" for t in trees):  # the default: one batched walk
            tree = PackedTree.from_lists([t.tokens for t in trees], [t.parent for t in trees],
                                         [t.depth for t in trees], device=logits.device)
            rows = _tree_rows(logits, [starts[b] for b in reqs], trees)  # [R, P]
            if bool(greedy_rows(params).all()):  # no [R, P, V] copy: the argmax per row
                acceptance = verify_greedy_choice(tree, logits.argmax(dim=-1)[rows])
            else:
                acceptance = verify_sampling(tree, logits[rows].float(), params)
            results = _accepted_lists(acceptance)
        else:  # opt-in modes (for comparison): one request at a time
            results = []
            for r, (b, t) in enumerate(zip(reqs, trees)):
                tree = PackedTree.from_lists([t.tokens], [t.parent], [t.depth], device=logits.device)
                one = _verify_one(tree, t, logits[_tree_rows(logits, [starts[b]], [t])].float(),
                                  params.row(r))
                results.extend(_accepted_lists(one))
        if mutations.BONUS_AT_DEPTH_ROW:  # test-only switch, off in production
            _bonus_at_depth_row(results, logits, [starts[b] for b in reqs], params)
        return dict(zip(reqs, results))

    def _params(self, reqs: list[int], sampling_metadata, device) -> SamplingParamsBatch:
        """The tree requests' sampling parameters (from each request's ``SamplingParams``)."""
        runner = self.runner
        states = [runner.requests[runner.input_batch.req_ids[b]].sampling_params for b in reqs]
        generators = sampling_metadata.generators or {}
        top_k = [p.top_k if p.top_k and p.top_k > 0 else 0 for p in states]
        top_p, min_p = [p.top_p for p in states], [p.min_p for p in states]
        return SamplingParamsBatch.from_lists(  # a filter no request uses is left off (no sort)
            temperature=[p.temperature for p in states],
            top_k=top_k if any(top_k) else None,
            top_p=top_p if any(v < 1.0 for v in top_p) else None,
            min_p=min_p if any(v > 0.0 for v in min_p) else None,
            device=device,
        ).with_generators({r: generators[b] for r, b in enumerate(reqs) if b in generators})

    def _move_accepted_kv(self, step: TreeStep, paths: dict[int, list[int]]) -> None:
        src, dst = step.kv_moves(paths)
        self.num_tree_verifications += len(paths)
        self.num_branching_verifications += sum(not step.trees[b].is_chain for b in paths)
        self.num_kv_moves += sum(any(node != d for d, node in enumerate(p)) for p in paths.values())
        if not src or mutations.SKIP_KV_MOVE:  # (test-only switch, off in production)
            return
        slots = step.slot_mapping
        src_slots = slots[torch.tensor(src, device=slots.device)].long()
        dst_slots = slots[torch.tensor(dst, device=slots.device)].long()
        for layer in self.runner.redrafter_attention_layers.values():
            layer.impl.move_kv(layer, layer.kv_cache, src_slots, dst_slots)

    def _logprobs(self, logits: Tensor, starts: list[int], rows: list[list[int]],
                  paths: dict[int, tuple[list[int], list[int]]], num_logprobs: int, width: int):
        """Raw logprobs of every emitted token (vLLM's default ``raw_logprobs`` mode), -1 padded."""
        index, token_ids = [], []
        for b, tokens in enumerate(rows):
            nodes = paths[b][1] if b in paths else [0]
            for i in range(width):
                node = nodes[i] if i < len(nodes) else nodes[-1]
                index.append(starts[b] + node)
                token_ids.append(tokens[i] if i < len(tokens) else 0)
        picked = logits[torch.tensor(index, device=logits.device)]
        logprobs = self.sampler.compute_logprobs(picked)
        return self.sampler.gather_logprobs(logprobs, num_logprobs,
                                            torch.tensor(token_ids, device=logits.device))


def _tree_rows(logits: Tensor, starts: list[int], trees: list[RequestTree]) -> Tensor:
    """[R, P] long: logits row of node j of request r, ``starts[r] + j`` (padding repeats)."""
    width = max(len(t.tokens) for t in trees)
    index = [[start + min(j, len(t.tokens) - 1) for j in range(width)] for start, t in zip(starts, trees)]
    return torch.tensor(index, device=logits.device)


def _accepted_lists(acceptance: Acceptance) -> list[tuple[list[int], list[int]]]:
    """Per request: (accepted drafts then the bonus, accepted path root first); one host sync."""
    tokens, num, path = (acceptance.tokens.tolist(), acceptance.num_accepted.tolist(),
                         acceptance.path.tolist())
    return [(t[: n + 1], p[: n + 1]) for t, n, p in zip(tokens, num, path)]


def _bonus_at_depth_row(results: list[tuple[list[int], list[int]]], logits: Tensor,
                        starts: list[int], params: SamplingParamsBatch) -> None:
    """Test-only mutation (``mutations.BONUS_AT_DEPTH_ROW``): redraw each bonus at packed row d,
    the accepted depth, instead of at the last accepted node (a chain's row, wrong off beam 0)."""
    from vllm_redrafter.sampling import sample_from_probs, target_probs

    for r, (tokens, path) in enumerate(results):
        row = logits[starts[r] + len(path) - 1][None, None].float()  # [1, 1, V]
        one = params.row(r)
        if bool(greedy_rows(one)[0]):
            tokens[-1] = int(row.argmax())
        else:
            tokens[-1] = int(sample_from_probs(target_probs(row, one), one)[0, 0])


def _verify_one(tree: PackedTree, request: RequestTree, logits: Tensor,
                params: SamplingParamsBatch) -> Acceptance:
    """One request in its own verification mode (greedy requests always take the greedy walk)."""
    if bool(params.temperature[0] < 1e-5):
        return verify_greedy(tree, logits)
    if request.mode == "typical":
        return verify_typical(tree, logits, params)
    if request.mode == "rejection" and request.extra is not None:
        dynamic_tree, draft_log_probs = request.extra  # the beams and their q (the proposer's)
        dynamic_tree = truncate_tree(dynamic_tree, len(request.tokens))  # what was scheduled
        return verify_rejection(dynamic_tree, logits, params, draft_log_probs)
    return verify_sampling(tree, logits, params)
