"""The ReDrafter proposer inside vLLM's model runner: hidden state in, drafts out.

vLLM builds it as a ``custom_class`` proposer (``ReDrafterProposer(vllm_config)``) and calls
``load_model(target)`` once. Then, every step, the runner patch
(``vllm_redrafter.patches.runner_hidden_states``) calls
:meth:`ReDrafterProposer.propose_with_hidden_states` with, per request of the batch, the tokens
the target just emitted (accepted drafts + the bonus token g0), the target's last-layer hidden
state h (after the final norm) at g0's position, and the request's state. The proposer runs the
drafter's batched beam search on the target's device and returns the best beam as a chain of
L-1 draft tokens per request, which vLLM's own rejection sampler verifies (tree verification
replaces this in the next step of the project; a chain is the W=1 tree).

A step where the drafter raises or produces non-finite scores proposes nothing (empty drafts):
vLLM then decodes those requests one token at a time, so no request fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from vllm_redrafter.beam_search import BeamSearchOutput, beam_search
from vllm_redrafter.drafter import RecurrentDrafter
from vllm_redrafter.vllm_plugin.config import (
    ReDrafterConfigError,
    ReDrafterSettings,
    RequestSettings,
    request_settings,
    settings_from_extra_config,
)

logger = logging.getLogger(__name__)


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
    drafts: tuple[int, ...]  # what was proposed (empty: nothing, e.g. the drafter failed)


class ReDrafterProposer:
    """vLLM ``custom_class`` proposer running the recurrent drafter's beam search.

    Debug hooks (reachable when the engine runs in-process, e.g. in tests):
    ``trace`` (set it to a list to record a :class:`DraftRecord` per request per step) and
    ``beam_source`` (replace the drafter's beam search, e.g. by a teacher-forced stand-in).
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
        self.drafter: RecurrentDrafter | None = None
        self.target: nn.Module | None = None
        self.beam_source: BeamSource = self._drafter_beam_search
        self.trace: list[DraftRecord] | None = None
        self.num_failed_steps = 0

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
        self.target = target
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

    # -- the step --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose_with_hidden_states(
        self,
        sampled_token_ids: list[list[int]],  # [B] ragged: accepted drafts + bonus, per request
        hidden_states: Tensor,  # [B, H] at each request's last emitted token (see the patch)
        requests: Sequence[Any],  # [B] the runner's CachedRequestState, same order
        max_num_drafts: int | None = None,  # the scheduler's cap this step
    ) -> list[list[int]]:
        """The best beam of each request as its chain of draft tokens ([] for none).

        A request gets no more drafts than ``max_num_drafts`` nor than it may still emit minus
        one (the bonus token), so every verified draft token can reach the output.
        """
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        cap = self.settings.num_speculative_tokens if max_num_drafts is None else max_num_drafts
        budgets = [min(cap, _tokens_left(r) - 1) for r in requests]
        active = [i for i, tokens in enumerate(sampled_token_ids) if tokens and budgets[i] > 0]
        if active:
            index = torch.tensor(active, device=hidden_states.device)
            h = hidden_states[index]  # [A, H], the A requests that draft this step
            g0 = [sampled_token_ids[i][-1] for i in active]
            shapes = [self._request_settings(requests[i]) for i in active]
            try:
                chains = self._best_chains(h, g0, shapes, [requests[i] for i in active])
            except Exception:  # a failing drafter costs this step's drafts, never a request
                self._note_failure("raised", exc_info=True)
                chains = [[] for _ in active]
            for i, chain in zip(active, chains):
                drafts[i] = chain[: budgets[i]]
        if self.trace is not None:
            self._record(sampled_token_ids, hidden_states, requests, drafts)
        return drafts

    def _best_chains(
        self, h: Tensor, last_tokens: list[int], shapes: list[RequestSettings],
        requests: Sequence[Any],
    ) -> list[list[int]]:
        """Beam search for B requests (h [B, H]); per request the best beam minus its root."""
        device = h.device
        g0 = torch.tensor(last_tokens, device=device, dtype=torch.long)  # [B]
        out = self.beam_source(
            h, g0, _int_or_tensor([s.beam_width for s in shapes], device),
            _int_or_tensor([s.beam_length for s in shapes], device), requests,
        )
        best = out.scores.argmax(dim=-1)  # [B]
        chain = out.beams[torch.arange(len(shapes), device=device), best, 1:]  # [B, Lmax-1]
        finite = out.scores.gather(-1, best[:, None]).squeeze(-1).isfinite()  # [B]
        chain_list, finite_list = chain.tolist(), finite.tolist()  # the step's one host transfer
        vocab = self.model_config.get_vocab_size()
        chains = []
        for c, good, s in zip(chain_list, finite_list, shapes):
            c = c[: s.beam_length - 1]
            chains.append(c if good and all(0 <= t < vocab for t in c) else [])
        if any(not c for c in chains):
            self._note_failure("produced non-finite scores or out-of-vocabulary tokens")
        return chains

    def _drafter_beam_search(
        self, h: Tensor, g0: Tensor, beam_width: int | Tensor, beam_length: int | Tensor,
        requests: Sequence[Any],
    ) -> BeamSearchOutput:
        assert self.drafter is not None, "load_model() was not called"
        return beam_search(self.drafter, h, g0, beam_width, beam_length)

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
            ))


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
