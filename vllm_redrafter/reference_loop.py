"""The reference speculative loop: ReDrafter on a transformers target, one request at a time.

This is the oracle that the vLLM integration and the drafter training measure against. It is the
whole algorithm in a few functions and nothing else: per step

    beams = propose(h, g0)                  # [1, W, L], beams[:, :, 0] = g0
    tree = build_tree(beams)                # shared prefixes removed (dynamic tree attention)
    logits, hidden = verify_forward(tree)   # ONE target pass over the packed tree, tree mask
    acceptance = verify_greedy(tree, logits)
    keep only the accepted path's KV, emit accepted tokens + bonus; h = hidden[last node]

Greedy output is token-identical to the target's own greedy ``generate``: every emitted token is
the target's argmax given exactly the tokens before it (each packed token sees the context plus
its tree ancestors at RoPE position ``n + depth``).

Proposers are callables ``propose(h [H], g0: int, generated: list[int]) -> beams [1, W, L]``:
:class:`DrafterProposer` runs the real drafter's beam search; :class:`TeacherForcedProposer` is a
test stand-in that knows the target's continuation and hides it on one random beam, cut at a
random depth, so that acceptance, the tree mask, the positions and the path selection are all
exercised (a random drafter accepts nothing). :class:`ContextCandidatesProposer` adds context
candidates (prompt lookup, ``context_candidates.py``) to another proposer's beams, or proposes
them alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.context_candidates import find_candidates, merge_candidates
from vllm_redrafter.tree import DynamicTree, build_tree
from vllm_redrafter.verify import verify_greedy


class Proposer(Protocol):
    def __call__(self, h: Tensor, g0: int, generated: list[int]) -> Tensor: ...


@dataclass
class StepRecord:
    num_accepted: int  # draft tokens accepted (the bonus not counted)
    winning_beam: int  # smallest beam holding the accepted path (0 when nothing was accepted)
    num_packed: int  # tokens the target verified this step (root included)
    beam_tokens: int  # W * L, the tokens before dedup


@dataclass
class ReferenceResult:
    tokens: list[int]  # generated tokens, the prefill's first token included
    steps: list[StepRecord] = field(default_factory=list)

    @property
    def tokens_per_step(self) -> float:
        """Tokens per target forward after the prefill (accepted + bonus), the paper's figure."""
        return sum(s.num_accepted + 1 for s in self.steps) / max(len(self.steps), 1)


class DrafterProposer:
    """Proposes the drafter's beam search with a fixed beam shape."""

    def __init__(self, drafter: torch.nn.Module, beam_width: int, beam_length: int) -> None:
        self.drafter, self.beam_width, self.beam_length = drafter, beam_width, beam_length

    @torch.no_grad()
    def __call__(self, h: Tensor, g0: int, generated: list[int]) -> Tensor:
        g0_t = torch.tensor([g0], device=h.device)
        out = beam_search(self.drafter, h[None], g0_t, self.beam_width, self.beam_length)
        return out.beams


class ContextCandidatesProposer:
    """``inner``'s W beams (None: none) followed by up to ``count`` context candidates of up to
    ``tokens`` tokens found in ``prompt_ids`` + the generated tokens (one prompt's proposer).
    Rows shorter than the beams end in ``PAD``; ``rows[i]`` is the drafter's beam count at step i
    (a step's accepted path came from a candidate when ``StepRecord.winning_beam`` >= it)."""

    def __init__(self, inner: Proposer | None, prompt_ids: list[int], count: int, tokens: int,
                 min_n: int = 2, max_n: int = 5) -> None:
        self.inner, self.prompt = inner, list(prompt_ids)
        self.count, self.tokens, self.min_n, self.max_n = count, tokens, min_n, max_n
        self.rows: list[int] = []

    def __call__(self, h: Tensor, g0: int, generated: list[int]) -> Tensor:
        beams = self.inner(h, g0, generated) if self.inner is not None else None
        found = self.find(np.asarray(self.prompt + generated))
        width, length = (0, 1) if beams is None else (beams.shape[1], beams.shape[2])
        merged, _ = merge_candidates(beams, [width], [length], [g0], [found])
        self.rows.append(width)
        return merged.to(h.device)

    def find(self, context: np.ndarray) -> list[tuple[int, ...]]:
        """The candidates after ``context`` (prompt + generated, g0 last)."""
        return find_candidates(context, self.count, self.tokens, self.min_n, self.max_n)


def teacher_forced_beams(reference: list[int], num_generated: int, g0: int, beam_width: int,
                         beam_length: int, vocab_size: int,
                         rng: torch.Generator) -> tuple[Tensor, int]:
    """One request's stand-in beams [W, L] (CPU, ``beams[:, 0] = g0``) and the true beam's index.

    ``reference`` is the target's own continuation and ``num_generated`` the tokens emitted so
    far, g0 the last, so the truth after g0 is ``reference[num_generated:]``. The true beam
    (``winner``, random) carries it cut at a random depth in [0, L-1] (noise after the cut); every
    other beam is noise sharing a random prefix of the true beam, so the tree branches below the
    root and the winning path is often not beam 0. Noise almost never matches the target, so
    greedy verification accepts about the cut depth.
    """
    W, L = beam_width, beam_length
    truth = reference[num_generated: num_generated + L - 1]
    beams = torch.randint(vocab_size, (W, L), generator=rng)  # noise  # [W, L]
    beams[:, 0] = g0
    winner = int(torch.randint(W, (), generator=rng))
    depth = min(int(torch.randint(L, (), generator=rng)), len(truth))
    beams[winner, 1: depth + 1] = torch.tensor(truth[:depth], dtype=torch.long)
    for k in range(W):  # noise beams share a random prefix of the true beam
        if k != winner:
            shared = int(torch.randint(depth + 1, (), generator=rng))
            beams[k, : shared + 1] = beams[winner, : shared + 1]
    return beams, winner


class TeacherForcedProposer:
    """A stand-in drafter that knows the target's own continuation ``reference``.

    Each step it proposes :func:`teacher_forced_beams`: the true continuation on one random beam,
    cut at a random depth, noise sharing random prefixes of it on the others.
    """

    def __init__(self, reference: list[int], beam_width: int, beam_length: int,
                 vocab_size: int, seed: int = 0) -> None:
        self.reference = reference
        self.beam_width, self.beam_length, self.vocab_size = beam_width, beam_length, vocab_size
        self.rng = torch.Generator().manual_seed(seed)

    def __call__(self, h: Tensor, g0: int, generated: list[int]) -> Tensor:
        beams, _ = teacher_forced_beams(self.reference, len(generated), g0, self.beam_width,
                                        self.beam_length, self.vocab_size, self.rng)
        return beams[None].to(h.device)  # [1, W, L]


def tree_attention_bias(tree: DynamicTree, context_len: int, dtype: torch.dtype) -> Tensor:
    """Additive 4-D mask [1, 1, P, context + P]: every packed token sees the whole context and,
    inside the tree, only itself and its ancestors."""
    allowed = torch.cat(
        [torch.ones_like(tree.attention_mask[:, :, :1]).expand(-1, -1, context_len),
         tree.attention_mask], dim=-1)  # [1, P, context + P]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


@torch.no_grad()
def verify_forward(model, tree: DynamicTree, cache, context_len: int) -> tuple[Tensor, Tensor]:
    """One target pass over the packed tree: logits [1, P, V], last hidden states [1, P, H]."""
    out = model(
        input_ids=tree.tokens,
        position_ids=context_len + tree.depth,  # RoPE at n + depth, not n + packed index
        attention_mask=tree_attention_bias(tree, context_len, model.dtype),
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
    )
    return out.logits, out.hidden_states[-1]


def keep_accepted_kv(cache, context_len: int, path: Tensor) -> None:
    """KV compaction: keep the context and the accepted path's packed slots, in path order."""
    keep = torch.cat([torch.arange(context_len, device=path.device), context_len + path])
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, keep]
        layer.values = layer.values[:, :, keep]


def _winning_beam(tree: DynamicTree, path: Tensor) -> int:
    depth = path.numel()
    on_path = (tree.unpack_index[0, :, :depth] == path).all(dim=-1)  # [W]
    return int(on_path.int().argmax())


@torch.no_grad()
def speculative_generate(model, prompt_ids: list[int], propose: Proposer, max_new_tokens: int,
                         eos_token_id: int | None = None) -> ReferenceResult:
    """Greedy ReDrafter generation of up to ``max_new_tokens`` tokens after ``prompt_ids``."""
    from transformers import DynamicCache

    device = model.device
    cache = DynamicCache()
    out = model(input_ids=torch.tensor([prompt_ids], device=device), past_key_values=cache,
                use_cache=True, output_hidden_states=True)
    context_len = len(prompt_ids)
    g0, h = int(out.logits[0, -1].argmax()), out.hidden_states[-1][0, -1]
    result = ReferenceResult(tokens=[g0])
    while len(result.tokens) < max_new_tokens and g0 != eos_token_id:
        tree = build_tree(propose(h, g0, result.tokens))
        logits, hidden = verify_forward(model, tree, cache, context_len)
        acceptance = verify_greedy(tree, logits)
        a = int(acceptance.num_accepted[0])
        path = acceptance.path[0, : a + 1]
        keep_accepted_kv(cache, context_len, path)
        context_len += a + 1
        emitted = acceptance.tokens[0, : a + 1].tolist()
        result.steps.append(StepRecord(a, _winning_beam(tree, path), int(tree.num_packed[0]),
                                       tree.beams.shape[1] * tree.beams.shape[2]))
        result.tokens.extend(emitted)
        g0, h = emitted[-1], hidden[0, int(acceptance.last_node[0])]
        if eos_token_id is not None and eos_token_id in emitted:
            break
    return _cut(result, max_new_tokens, eos_token_id)


def _cut(result: ReferenceResult, max_new_tokens: int, eos_token_id: int | None) -> ReferenceResult:
    """Stop exactly where the target alone stops: at max_new_tokens or just after EOS."""
    tokens = result.tokens[:max_new_tokens]
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    return ReferenceResult(tokens=tokens, steps=result.steps)


@torch.no_grad()
def greedy_generate(model, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """The target alone, greedy (transformers' own ``generate``): what ReDrafter must reproduce."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return out[0, len(prompt_ids):].tolist()


def chat_prompt_ids(tokenizer, question: str) -> list[int]:
    """A user question as the target's chat-template prompt (first turn, generation prompt)."""
    messages = [{"role": "user", "content": question}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


