"""The ReDrafter proposer inside vLLM's model runner: hidden state in, packed draft trees out.

vLLM builds it as a ``custom_class`` proposer (``ReDrafterProposer(vllm_config)``) and calls
``load_model(target)`` once. Then, every step, the runner patch
(``vllm_redrafter.patches.runner_tree``) calls :meth:`ReDrafterProposer.propose_with_hidden_states`
with, per request of the batch, the tokens the target just emitted (accepted drafts + the bonus
token g0), the target's last-layer hidden state h (after the final norm) at the last accepted
node, and the request's state. The proposer runs the drafter's batched beam search on the
target's device, packs each request's W beams into its dynamic tree (``tree.py``) and returns the
packed nodes after the root as the request's draft list; it keeps each tree's shape
(:attr:`ReDrafterProposer.trees`) for the verify step (``verifier.py``). W = 1 is a chain.

Debug: with ``VLLM_REDRAFTER_STEP_LOG=FILE`` every step appends one JSON line to FILE (the time
of the call, the requests and the tokens each emitted, the beam shape chosen, the policy's
expected tokens/s for it and for a plain step, the rule that chose it, what it knows of this
batch size: ``BeamPolicy.describe``, and its pricing of each request's context candidates:
``BeamPolicy.priced``): ``benchmarks/step_log.py``
turns it into realized tokens/s per batch size and shape, beside what the policy expected.

Context candidates (``context_candidates.py``): up to ``context_candidates`` continuations found
by prompt lookup in each request's prompt + output join its tree after the drafter's beams (rows
starting with g0, shorter ones padded); the tree's dedup merges them with the beams. The beam
policy chooses per request how many a step takes (none, where they do not pay), and whether the
drafter drafts at all, so a step drafts the beams, the candidates, both, or nothing. Requests
verified by ``rejection`` take none (no draft distribution q). Counters:
``num_candidate_trees`` (trees with nodes only candidates added), ``num_candidate_wins`` (steps
that accepted deeper than the drafter's beams reached), ``num_candidate_tokens`` (those extra
accepted tokens).

A request whose features assume a chain (penalties, bad words, logit bias, allowed tokens,
min_tokens still pending, structured output, logprobs) gets no drafts: vLLM samples it as without
speculation (:func:`tree_eligible`). A step where the drafter or the lookup raises, or the drafter
produces non-finite scores, proposes nothing for the requests concerned: no request fails.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from vllm_redrafter import envs
from vllm_redrafter.beam_policy import (
    BeamPolicy,
    Choice,
    PolicyConfig,
    RequestText,
    StepObservation,
    VerifiedTree,
    acceptance_kind,
)
from vllm_redrafter.beam_search import BeamSearchOutput, beam_search
from vllm_redrafter.context_candidates import (
    ContextIndex,
    find_candidates,
    merge_candidates,
)
from vllm_redrafter.drafter import RecurrentDrafter, held_out_chain_acceptance
from vllm_redrafter.step_cost_curve import load_step_cost, step_cost_path
from vllm_redrafter.tree import build_tree, truncate_tree
from vllm_redrafter.vllm_plugin.config import (
    ReDrafterConfigError,
    ReDrafterSettings,
    RequestSettings,
    request_settings,
    settings_from_extra_config,
)
from vllm_redrafter.vllm_plugin.cpu_gemm import use_vllm_cpu_gemm
from vllm_redrafter.vllm_plugin.timing import StepTimings, timed
from vllm_redrafter.vllm_plugin.tree_step import RequestTree, lowest_beams

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and level


class BeamSource(Protocol):
    """What proposes the beams of a step; the drafter's beam search unless a test swaps it."""

    def __call__(
        self,
        h: Tensor,  # [B, H] target hidden state at each request's last accepted position
        g0: Tensor,  # [B] long, the token the target produced there (the root)
        beam_width: int | Tensor,  # W for all, or [B] long W_b
        beam_length: int | Tensor,  # L for all, or [B] long L_b
        requests: Sequence[Any],  # [B] the runner's CachedRequestState of each request
    ) -> BeamSearchOutput: ...


@dataclass(frozen=True)
class DraftRecord:
    """One request's draft at one step, recorded when :attr:`ReDrafterProposer.trace` is a list."""

    req_id: str
    num_output_tokens: int  # tokens the request had emitted, g0 included, when it drafted
    g0: int
    target_argmax: int  # argmax of the target's LM head applied to the h the drafter received
    drafts: tuple[int, ...]  # the packed tree after its root (empty: nothing proposed)
    parents: tuple[int, ...] = ()  # packed parent of each node, root first (-1, ...)
    candidate_nodes: int = 0  # nodes only context candidates added


class CandidateSource(Protocol):
    """What finds a request's context candidates; the prompt lookup unless a test swaps it."""

    def __call__(self, request: Any, count: int, length: int) -> list[tuple[int, ...]]: ...


class ReDrafterProposer:
    """vLLM ``custom_class`` proposer running the recurrent drafter's beam search.

    Debug hooks (reachable when the engine runs in-process, e.g. in tests):
    ``trace`` (set it to a list to record a :class:`DraftRecord` per request per step),
    ``beam_source`` (replace the drafter's beam search, e.g. by a teacher-forced stand-in) and
    ``candidate_source`` (replace the context lookup).
    """

    def __init__(self, vllm_config: Any) -> None:
        spec = vllm_config.speculative_config
        settings = settings_from_extra_config(spec.draft_load_config.model_loader_extra_config)
        if settings is None:
            raise ReDrafterConfigError(
                f"{type(self).__name__} is built by method 'redrafter' only: the speculative "
                "config carries no ReDrafter settings (use {'method': 'redrafter', 'model': "
                "DRAFTER_DIR, ...})"
            )
        self.settings: ReDrafterSettings = settings
        self.model_config = vllm_config.model_config
        parallel = vllm_config.parallel_config
        self.num_workers = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
        self.drafter: RecurrentDrafter | None = None
        self.target: nn.Module | None = None
        self.beam_source: BeamSource = self._drafter_beam_search
        self.trace: list[DraftRecord] | None = None
        self.timings: StepTimings | None = None  # benchmark hook (vllm_plugin/timing.py)
        self.num_failed_steps = 0
        self.trees: dict[str, RequestTree] = {}  # req_id -> the tree proposed this step
        self.allow_trees = True  # False: the attention backend cannot mask trees; chains only
        self.policy: BeamPolicy | None = None  # beam_policy "auto" (the default)
        self.choice: Choice | None = None  # the policy's choice this step
        self.draft_seconds = 0.0  # drafting time of this step, for the policy's next observation
        self.shapes: dict[str, tuple[int, int]] = {}  # req_id -> (W, L) of its tree this step
        self.step_log = envs.step_log_path()  # debug (module doc)
        self.candidate_source: CandidateSource = self._lookup
        self.contexts: dict[str, ContextIndex] = {}  # req_id -> its prompt + output, for lookups
        self.num_candidate_trees = 0  # trees with nodes only context candidates added
        self.num_candidate_wins = 0  # verified trees that accepted deeper than the drafter's part
        self.num_candidate_tokens = 0  # the drafts accepted beyond the drafter's part

    # -- vLLM's proposer interface -------------------------------------------------------------

    def load_model(self, target: nn.Module) -> None:
        """Load the drafter on the target's device and dtype, sharing its input embedding."""
        weight = next(target.parameters())
        embedding = TargetEmbedding(
            target.embed_input_ids,
            vocab_size=self.model_config.get_vocab_size(),
            hidden_size=self.model_config.get_hidden_size(),
        )
        self.drafter = RecurrentDrafter.from_pretrained(
            self.settings.drafter_dir,
            embedding,
            device=weight.device,
            dtype=weight.dtype,
        ).eval()
        if weight.device.type == "cpu":
            use_vllm_cpu_gemm(self.drafter)  # ~3.5x faster beam steps than torch's linear here
        self.target = target
        self.policy = self._load_policy(weight)
        logger.info(
            "ReDrafter: drafter %s loaded (%s, %s), W=%d L=%d, num_speculative_tokens=%d",
            self.settings.drafter_dir, weight.device, weight.dtype, self.settings.beam_width,
            self.settings.beam_length, self.settings.num_speculative_tokens,
        )

    def propose(self, *args: Any, **kwargs: Any) -> list[list[int]]:
        """vLLM's ``custom_class`` call, which carries no hidden states: the patch is missing."""
        raise RuntimeError(
            "ReDrafter needs the target's hidden states: vllm_redrafter's runner patch is not "
            "applied in this process (is the vllm.general_plugins entry point 'redrafter' "
            "loaded? VLLM_PLUGINS must not exclude it)"
        )

    def _load_policy(self, weight: Tensor) -> BeamPolicy | None:
        """The beam policy, unless beam_policy is "fixed": it learns this machine's costs from
        the engine's own steps; a step-cost curve, given or cached here, is only its prior."""
        if self.settings.beam_policy != "auto":
            return None
        if self.num_workers > 1:  # each worker would time its own steps and choose its own shape
            logger.warning("ReDrafter: beam_policy 'auto' is not supported with %d workers yet "
                           "(they would choose apart); drafting the fixed W=%d L=%d",
                           self.num_workers, self.settings.beam_width, self.settings.beam_length)
            return None
        device = torch.cuda.get_device_name(weight.device) if weight.is_cuda else weight.device.type
        path = Path(self.settings.step_cost or step_cost_path(
            self.model_config.model, str(weight.dtype), device, torch.get_num_threads()))
        prior = load_step_cost(path) if path.is_file() else None
        logger.info("ReDrafter: beam policy on (W <= %d, L <= %d), %s",
                    self.settings.beam_width, self.settings.beam_length,
                    f"step-cost prior {path}" if prior is not None else
                    "learning this machine's step costs from its own steps")
        return BeamPolicy(self.settings.beam_width, self.settings.beam_length,
                          PolicyConfig(min_gain=self.settings.min_gain), prior,
                          held_out_chain_acceptance(self.settings.drafter_dir))

    # -- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_with_hidden_states(
        self,
        sampled_token_ids: list[list[int]],  # [B] ragged: accepted drafts + bonus, per request
        hidden_states: Tensor,  # [B, H] at each request's last accepted node (see the patch)
        requests: Sequence[Any],  # [B] the runner's CachedRequestState, same order
        max_num_drafts: int | None = None,  # the scheduler's cap this step
    ) -> list[list[int]]:
        """Each request's packed tree after its root, as its draft list ([] for none).

        A request gets at most ``max_num_drafts`` draft nodes (the scheduler's cap) and beams no
        deeper than the tokens it may still emit, so every accepted token can reach the output.
        """
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        now = time.perf_counter()
        cap = self.settings.num_speculative_tokens if max_num_drafts is None else max_num_drafts
        active = [i for i, tokens in enumerate(sampled_token_ids)
                  if tokens and cap > 0 and _tokens_left(requests[i]) > 1 and tree_eligible(requests[i])]
        pending = [requests[i] for i in active]
        last_trees, last_shapes, last_draft_seconds = self.trees, self.shapes, self.draft_seconds
        self.trees, self.shapes, self.choice, self.draft_seconds = {}, {}, None, 0.0
        try:  # what the last step showed, the candidates, the policy's choice: a failure costs drafts
            verified, drafter_accepted = self._observe_verified(sampled_token_ids, requests,
                                                                last_trees, last_shapes)
            observed = None
            if self.policy is not None:  # what the step that just ended showed (its trees verified)
                observed = StepObservation(now, tuple(r.req_id for r in requests),
                                           not all(sampled_token_ids), verified,
                                           last_draft_seconds,
                                           emitted=sum(map(len, sampled_token_ids)))
            settings = [self._request_settings(r) for r in pending]  # once per request and step
            found = self._find_candidates(pending, settings)
            shapes = self._shapes(pending, settings, cap,
                                  others=len(sampled_token_ids) - len(active), observed=observed,
                                  found=found, drafter_accepted=drafter_accepted)
        except Exception:
            self._note_failure("'s step planning raised", exc_info=True)
            self.choice = None
            found, shapes = [], [None] * len(active)
        found = [f[: s.context_candidates] for f, s in zip(found, shapes) if s is not None]
        active = [i for i, s in zip(active, shapes) if s is not None]
        shapes = [s for s in shapes if s is not None]
        if active:
            index = torch.tensor(active, device=hidden_states.device)
            g0 = [sampled_token_ids[i][-1] for i in active]
            start = time.perf_counter()
            try:
                trees = self._trees(hidden_states[index], g0, shapes,
                                    [requests[i] for i in active], cap, found)
            except Exception:  # a failing drafter costs this step's drafts, never a request
                self._note_failure("raised", exc_info=True)
                trees = [None] * len(active)
            self.draft_seconds = time.perf_counter() - start  # _trees synchronised (host copy)
            for i, tree, shape in zip(active, trees, shapes):
                if tree is not None and len(tree.tokens) > 1:
                    drafts[i] = tree.drafts
                    self.trees[requests[i].req_id] = tree
                    self.shapes[requests[i].req_id] = (shape.beam_width, shape.beam_length)
        self.contexts = {r.req_id: self.contexts[r.req_id] for r in requests
                         if r.req_id in self.contexts}  # finished requests' contexts go
        if self.trace is not None:
            self._record(sampled_token_ids, hidden_states, requests, drafts)
        if self.step_log is not None:
            self._log_step(now, sampled_token_ids, requests, drafts)
        return drafts

    def _shapes(self, requests: Sequence[Any], settings: Sequence[RequestSettings], cap: int,
                others: int = 0,
                observed: StepObservation | None = None,
                found: Sequence[Sequence[tuple[int, ...]]] | None = None,
                drafter_accepted: dict[str, int] | None = None) -> list[RequestSettings | None]:
        """Each request's beam shape this step (None: no drafts; ``beam_width`` 0: no drafter
        beams) and its count of context candidates (``context_candidates``).

        A request's own W / L / candidate count (``extra_args``) are kept; the others take the
        beam policy's choice when the policy is on (``observed``: the step that just ended, given
        to it once per step; ``found``: each request's candidates, ``drafter_accepted``: what its
        drafter beams accepted last step), else the engine's. Beams never go deeper than the
        tokens a request may still emit; without tree attention they are chains (a request's
        candidates then only where the drafter drafts nothing, one).
        """
        shapes = list(settings)  # each request's own (extra_args) or the engine's
        found = found if found is not None else [[] for _ in requests]
        if self.policy is not None and observed is not None:
            kinds = tuple(_kind(r) for r, s in zip(requests, shapes) if not s.own_shape)
            chosen = [i for i, s in enumerate(shapes)
                      if s.context_candidates and not s.own_candidates]
            texts = tuple(RequestText(requests[i].req_id, requests[i].output_token_ids,
                                      tuple(found[i]), shapes[i].context_candidates,
                                      (drafter_accepted or {}).get(requests[i].req_id, 0))
                          for i in chosen)
            self.choice = choice = self.policy.step(dataclasses.replace(
                observed, kinds=kinds, others=others + len(requests) - len(kinds), max_nodes=cap,
                texts=texts))
            counts = dict(zip(chosen, choice.candidates))
            shapes = [dataclasses.replace(
                          s, context_candidates=counts.get(i, s.context_candidates),
                          **({} if s.own_shape else
                             {"beam_width": choice.width, "beam_length": choice.length or 2}))
                      for i, s in enumerate(shapes)]
        out: list[RequestSettings | None] = []
        for s, r, f in zip(shapes, requests, found):
            width, count = s.beam_width, min(s.context_candidates, len(f))
            if not self.allow_trees:
                width, count = min(width, 1), (min(count, 1) if width == 0 else 0)
            out.append(None if width == 0 and count == 0 else dataclasses.replace(
                s, beam_width=width, beam_length=min(s.beam_length, _tokens_left(r)),
                context_candidates=count))
        return out

    def _find_candidates(self, requests: Sequence[Any], settings: Sequence[RequestSettings]
                         ) -> list[list[tuple[int, ...]]]:
        """Each request's context candidates, up to its most, each at most
        ``prompt_lookup_tokens`` long and not past ``max_tokens``; a failing lookup costs that
        request's candidates, never the request."""
        found = []
        for r, s in zip(requests, settings):
            length = min(self.settings.lookup_tokens, _tokens_left(r) - 1)
            try:
                found.append(list(self.candidate_source(r, s.context_candidates, length))
                             if s.context_candidates and length > 0 else [])
            except Exception:
                self._note_failure("context lookup raised", exc_info=True)
                found.append([])
        return found

    def _lookup(self, request: Any, count: int, length: int) -> list[tuple[int, ...]]:
        """Prompt lookup in the request's prompt + output (``context_candidates.py``)."""
        prompt = getattr(request, "prompt_token_ids", None)
        if prompt is None:  # a prompt given as embeddings: no tokens to look up
            return []
        index = self.contexts.get(request.req_id)
        if index is None:
            index = self.contexts[request.req_id] = ContextIndex(prompt)
        context = index.update(request.output_token_ids)
        return find_candidates(context, count, length, self.settings.lookup_min,
                               self.settings.lookup_max)

    def _observe_verified(self, sampled_token_ids: list[list[int]], requests: Sequence[Any],
                          trees: dict[str, RequestTree], shapes: dict[str, tuple[int, int]]
                          ) -> tuple[tuple[VerifiedTree, ...], dict[str, int]]:
        """Last step's ``trees`` (drafted in ``shapes``), each with what got accepted (emitted -
        the bonus) along the drafter's beams and the nodes candidates added (for the policy); per
        request, the drafts accepted along drafter beams. Counts what candidates added (class
        counters)."""
        verified, drafter_accepted = [], {}
        for tokens, request in zip(sampled_token_ids, requests):
            shape = shapes.get(request.req_id)
            if not tokens or shape is None:
                continue
            tree = trees[request.req_id]
            extra = tree.candidate_nodes
            path = tree.accepted_path(tokens[:-1])
            depth = tree.drafter_depth(path)
            drafter_accepted[request.req_id] = depth
            self.num_candidate_trees += extra > 0
            self.num_candidate_wins += len(path) - 1 > depth
            self.num_candidate_tokens += len(path) - 1 - depth
            verified.append(VerifiedTree(_kind(request), *shape, len(tree.tokens) - extra, depth,
                                         extra, tree.depth_by_beams(path, shape[0])))
        return tuple(verified), drafter_accepted

    def _trees(
        self, h: Tensor, last_tokens: list[int], shapes: list[RequestSettings],
        requests: Sequence[Any], cap: int, found: Sequence[Sequence[tuple[int, ...]]] | None = None,
    ) -> list[RequestTree | None]:
        """Beam search for the B requests (h [B, H]) whose width is not 0, their beams and the
        context candidates in ``found`` packed into trees of at most cap + 1 nodes."""
        if found is not None and any(found):
            return self._merged_trees(h, last_tokens, shapes, requests, cap, found)
        device = h.device
        g0 = torch.tensor(last_tokens, device=device, dtype=torch.long)  # [B]
        widths = [s.beam_width for s in shapes]
        lengths = [s.beam_length for s in shapes]
        with timed(self.timings, "draft", device):
            out = self.beam_source(h, g0, _int_or_tensor(widths, device),
                                   _int_or_tensor(lengths, device), requests)
        with timed(self.timings, "pack", device):
            W_max, L_max = max(widths), max(lengths)
            beams = out.beams[:, :W_max, :L_max]
            tree = truncate_tree(build_tree(beams, _int_or_tensor(widths, device),
                                            _int_or_tensor(lengths, device)), cap + 1)
            real = torch.arange(W_max, device=device) < torch.tensor(widths, device=device)[:, None]
            finite = (out.scores[:, :W_max].isfinite() | ~real).all(dim=1)  # [B]
            tokens, parent, depth, num, new, ok = (
                tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist(),
                tree.num_packed.tolist(), tree.is_new.sum(-1).tolist(),
                finite.tolist())  # the step's host transfer
        packed = (tokens, parent, depth, num, new)
        return [self._request_tree(packed, b, ok[b], shape.verification,
                                   self._rejection_extra(tree, out, b, W_max, L_max)
                                   if shape.verification == "rejection" else None)
                for b, shape in enumerate(shapes)]

    def _merged_trees(
        self, h: Tensor, last_tokens: list[int], shapes: list[RequestSettings],
        requests: Sequence[Any], cap: int, found: Sequence[Sequence[tuple[int, ...]]],
    ) -> list[RequestTree | None]:
        """:meth:`_trees` where some request takes context candidates: the drafter's beams (for
        the requests with a width) and the candidates as one beam tensor (``merge_candidates``),
        packed together; a node is the drafter's where a drafter row carries it."""
        device = h.device
        drafting = [b for b, s in enumerate(shapes) if s.beam_width]
        widths = [s.beam_width for s in shapes]
        lengths = [s.beam_length for s in shapes]
        out, ok = None, [True] * len(shapes)
        if drafting:
            sub = torch.tensor(drafting, device=device)
            g0 = torch.tensor([last_tokens[b] for b in drafting], device=device, dtype=torch.long)
            with timed(self.timings, "draft", device):
                out = self.beam_source(h[sub], g0, _int_or_tensor([widths[b] for b in drafting], device),
                                       _int_or_tensor([lengths[b] for b in drafting], device),
                                       [requests[b] for b in drafting])
        with timed(self.timings, "pack", device):
            beams = None
            if out is not None:
                W_max = max(widths[b] for b in drafting)
                real = torch.arange(W_max, device=device) < torch.tensor(
                    [widths[b] for b in drafting], device=device)[:, None]
                finite = (out.scores[:, :W_max].isfinite() | ~real).all(dim=1).tolist()
                for j, b in enumerate(drafting):
                    ok[b] = finite[j]
                beams = torch.zeros((len(shapes), *out.beams.shape[1:]), dtype=torch.long)
                beams[drafting] = out.beams.cpu()
            merged, rows = merge_candidates(beams, widths, lengths, last_tokens, found)
            tree = truncate_tree(build_tree(merged.to(device), torch.tensor(rows, device=device)),
                                 cap + 1)
            tokens, parent, depth, num, unpack, new = (
                tree.tokens.tolist(), tree.parent.tolist(), tree.depth.tolist(),
                tree.num_packed.tolist(), tree.unpack_index.tolist(),
                tree.is_new.sum(-1).tolist())
        packed = (tokens, parent, depth, num, new)
        trees: list[RequestTree | None] = []
        for b, shape in enumerate(shapes):
            mine = {0} | {j for row in unpack[b][: widths[b]] for j in row if 0 <= j < num[b]}
            extra = None
            if shape.verification == "rejection" and out is not None:
                j = drafting.index(b)
                extra = self._rejection_extra(
                    build_tree(out.beams[j: j + 1], torch.tensor([widths[b]], device=device),
                               torch.tensor([lengths[b]], device=device)),
                    out, j, out.beams.shape[1], out.beams.shape[2], one_request=True)
            trees.append(self._request_tree(packed, b, ok[b], shape.verification, extra, mine))
        return trees

    def _request_tree(
        self, packed: tuple[list, list, list, list, list], b: int, ok: bool, mode: str,
        extra: object, drafter_nodes: set[int] | None = None,
    ) -> RequestTree | None:
        """Request b's tree from the batch's packed lists (tokens, parent, depth, num_packed,
        new nodes per beam row), with ``drafter_nodes`` the packed nodes a drafter beam carries
        (None: all); None, and the failure noted, where the drafter gave non-finite scores or a
        token outside the vocabulary (the request then steps without drafts)."""
        tokens, parent, depth, num, new = packed
        n = num[b]
        vocab = self.model_config.get_vocab_size()
        if not ok or not all(0 <= t < vocab for t in tokens[b][:n]):
            self._note_failure("produced non-finite scores or out-of-vocabulary tokens")
            return None
        from_drafter = () if drafter_nodes is None else tuple(j in drafter_nodes for j in range(n))
        return RequestTree(tuple(tokens[b][:n]), tuple(parent[b][:n]), tuple(depth[b][:n]), mode,
                           extra, from_drafter, lowest_beams(new[b], n))

    @staticmethod
    def _rejection_extra(tree, out: BeamSearchOutput, b: int, width: int, length: int,
                         one_request: bool = False):
        """What p/q rejection needs besides the shape: request b's beams and their q (``tree``:
        the batch's, or request b's alone with ``one_request``)."""
        if out.log_probs is None:
            return None  # the beam source gave no q: the request is verified exactly
        one = tree if one_request else type(tree)(**{
            f: (getattr(tree, f)[b: b + 1] if getattr(tree, f) is not None else None)
            for f in tree.__dataclass_fields__})
        return one, out.log_probs[b: b + 1, :width, : length - 1]

    def _drafter_beam_search(
        self, h: Tensor, g0: Tensor, beam_width: int | Tensor, beam_length: int | Tensor,
        requests: Sequence[Any],
    ) -> BeamSearchOutput:
        assert self.drafter is not None, "load_model() was not called"
        want_q = any(self._request_settings(r).verification == "rejection" for r in requests)
        return beam_search(self.drafter, h, g0, beam_width, beam_length, return_log_probs=want_q)

    def _request_settings(self, request: Any) -> RequestSettings:
        params = getattr(request, "sampling_params", None)
        extra_args = getattr(params, "extra_args", None)
        try:
            return request_settings(extra_args, self.settings)
        except ReDrafterConfigError:  # admission validates these; never fail a request here
            return request_settings(None, self.settings)

    def _note_failure(self, what: str, exc_info: bool = False) -> None:
        self.num_failed_steps += 1
        if self.num_failed_steps in (1, 10, 100) or self.num_failed_steps % 1000 == 0:
            logger.warning(
                "ReDrafter: the drafter %s; those requests get no drafts this step "
                "(%d failed steps so far)", what, self.num_failed_steps, exc_info=exc_info,
            )

    def _log_step(self, now: float, sampled_token_ids: list[list[int]],
                  requests: Sequence[Any], drafts: list[list[int]]) -> None:
        """Debug: one JSON line per step (``VLLM_REDRAFTER_STEP_LOG``, module doc)."""
        assert self.step_log is not None
        record: dict[str, Any] = {"t": now, "pid": os.getpid(),  # one file, several engines
                                  "ids": [r.req_id for r in requests],
                                  "emitted": [len(t) for t in sampled_token_ids],
                                  "drafted": sum(bool(d) for d in drafts),
                                  "nodes": sum(len(d) for d in drafts),
                                  "candidate_nodes": sum(t.candidate_nodes
                                                         for t in self.trees.values())}
        if self.policy is not None and self.choice is not None:
            choice = self.choice
            record.update(shape=[choice.width, choice.length], reason=choice.reason,
                          expected_tps=choice.tokens_per_second,
                          plain_tps=choice.plain_tokens_per_second,
                          policy=self.policy.describe(len(requests)),
                          candidates=self.policy.priced, used=list(choice.candidates))
        with open(self.step_log, "a") as f:
            f.write(json.dumps(record) + "\n")

    def _record(
        self, sampled_token_ids: list[list[int]], hidden_states: Tensor,
        requests: Sequence[Any], drafts: list[list[int]],
    ) -> None:
        """Debug: per request that emitted tokens, the target's own LM head on the handed h."""
        assert self.target is not None and self.trace is not None
        emitted = [i for i, tokens in enumerate(sampled_token_ids) if tokens]
        if not emitted:
            return
        h = hidden_states[torch.tensor(emitted, device=hidden_states.device)]
        argmax = self.target.compute_logits(h).argmax(dim=-1).tolist()  # [E]
        for i, top in zip(emitted, argmax):
            self.trace.append(DraftRecord(
                req_id=requests[i].req_id,
                num_output_tokens=len(requests[i].output_token_ids),
                g0=sampled_token_ids[i][-1],
                target_argmax=top,
                drafts=tuple(drafts[i]),
                parents=self.trees[requests[i].req_id].parent if drafts[i] else (),
                candidate_nodes=self.trees[requests[i].req_id].candidate_nodes if drafts[i] else 0,
            ))


def tree_eligible(request: Any) -> bool:
    """Whether a request's sampling is only temperature / top-k / top-p / min-p (and a seed).

    Penalties, bad words, logit bias, allowed token ids, a pending min_tokens, structured output
    and logprobs all read or change the distribution along a chain of earlier tokens, which vLLM
    applies per draft position; such a request gets no drafts and is sampled by vLLM itself.
    """
    p = getattr(request, "sampling_params", None)
    if p is None:
        return True
    return not (
        p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        or p.bad_words or p.logit_bias or p.allowed_token_ids
        or (p.min_tokens and len(request.output_token_ids) < p.min_tokens)
        or p.structured_outputs is not None or p.logprobs is not None
    )


def _kind(request: Any) -> str:
    """Greedy or sampled: the beam policy counts their acceptance apart."""
    return acceptance_kind(getattr(getattr(request, "sampling_params", None), "temperature", None))


def _tokens_left(request: Any) -> int:
    """Tokens the request may still emit: drafts past ``max_tokens`` would be thrown away."""
    params = getattr(request, "sampling_params", None)
    max_tokens = getattr(params, "max_tokens", None)
    if max_tokens is None:
        return 1 << 30
    return max_tokens - len(request.output_token_ids)


def _int_or_tensor(values: list[int], device: torch.device) -> int | Tensor:
    """One int when every request shares it (beam search's fast path), else a [B] tensor."""
    if all(v == values[0] for v in values):
        return values[0]
    return torch.tensor(values, device=device)


class TargetEmbedding(nn.Module):
    """The target's input embedding as the drafter sees it: ``ids -> e(ids)``, shape [V, H].

    vLLM models expose ``embed_input_ids`` (its VocabParallelEmbedding may be padded and sharded
    under tensor parallelism, and computes the lookup with the needed all-reduce); this adapter
    calls it, so the drafter shares the target's embedding without copying it.
    """

    def __init__(self, embed: Callable[[Tensor], Tensor], vocab_size: int, hidden_size: int):
        super().__init__()
        self.embed = embed
        self.num_embeddings = vocab_size
        self.embedding_dim = hidden_size

    def forward(self, token_ids: Tensor) -> Tensor:  # [...] -> [..., H]
        shape = token_ids.shape
        return self.embed(token_ids.reshape(-1)).reshape(*shape, self.embedding_dim)
