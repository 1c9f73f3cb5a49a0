"""Beam-free training of the drafter on a distillation dataset (the target stays frozen).

Loss (docs/design.md, Training the drafter; the paper's Eq. 2): teacher forcing through the RNN,

    s_1 = f(s_0 = 0, e(g0))                   g0 = the target's token at t (the draft's root)
    s_k = f(s_{k-1}, e(y_{k-1}))              y_1..y_T = the distilled tokens after g0
    loss = sum_{k=1..T} mean_positions CE(draft_logits(h_t, s_k), y_k)

A label outside the reduced draft vocabulary cannot be drafted: it is left out of the CE (and
counts as a miss in the accuracy), while the RNN still reads it as the next input.

Resumable: every ``save_every`` steps the model, the optimizer, the step (which fixes the data
order: epoch e's order is a permutation seeded by (seed, e)) and the RNG states go to one file,
written atomically. A killed run restarted with the same settings resumes there and ends with the
same weights as an uninterrupted run.

Defaults: bf16 autocast with fp32 master weights on a GPU and on CPUs with AMX (bf16 tiles: 3x
faster than float32 there); float32 on other CPUs (bf16 matmuls can be 30x slower on AVX2 CPUs,
docs/costs.md, CPU: the drafter's LM head).
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from vllm_redrafter.cpu_features import has_amx_bf16
from vllm_redrafter.drafter import RecurrentDrafter
from vllm_redrafter.train.distill import DistillData
from vllm_redrafter.train.soft_labels import soft_label_index, soft_label_loss, teacher_logits
from vllm_redrafter.train.vocab import target_to_draft_map

IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    epochs: float = 3.0
    max_steps: int | None = None  # when set, overrides epochs
    batch_size: int = 1024  # positions per step
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * min_lr_ratio
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100  # steps between checkpoints
    eval_batch_size: int = 2048
    eval_max_positions: int = 50_000
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA and AMX CPUs, else float32
    # loss = (1 - w) CE(hard labels) + w KL(the target's distribution || the drafter's), w > 0
    # with labels=self or ground-truth (soft_labels.py)
    soft_label_weight: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.soft_label_weight <= 1.0:
            raise ValueError(f"soft_label_weight must be in [0, 1], got {self.soft_label_weight}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        name = self.dtype
        if name == "auto":
            name = "bfloat16" if device.type == "cuda" or has_amx_bf16() else "float32"
        if name not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {name!r}")
        return None if name == "float32" else getattr(torch, name)


@dataclass
class TrainState:
    step: int = 0
    losses: list[float] | None = None  # per step, training loss
    seconds: float = 0.0  # wall time of this session's training loop

    def __post_init__(self) -> None:
        self.losses = self.losses or []


def total_steps(config: TrainConfig, num_train: int) -> int:
    if config.max_steps is not None:
        return config.max_steps
    return max(1, math.ceil(config.epochs * num_train / config.batch_size))


def learning_rate(config: TrainConfig, step: int, total: int) -> float:
    """Linear warm-up, then cosine decay to ``lr * min_lr_ratio`` at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


class BatchOrder:
    """The data order: epoch e is a permutation of the training positions seeded by (seed, e).

    A step number alone fixes its batch, so resuming at step s needs no saved iterator.
    """

    def __init__(self, train_idx: Tensor, batch_size: int, seed: int) -> None:
        self.train_idx, self.batch_size, self.seed = train_idx, batch_size, seed
        self.steps_per_epoch = math.ceil(train_idx.numel() / batch_size)
        self._epoch, self._perm = -1, None

    def batch(self, step: int) -> Tensor:
        epoch, i = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.train_idx.numel(), generator=gen)
        return self.train_idx[self._perm[i * self.batch_size: (i + 1) * self.batch_size]]


def gather(data: DistillData, idx: Tensor, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """h [B, H] float32, g0 [B], labels [B, T] for positions ``idx``."""
    return data.hidden(idx).to(device), data.g0[idx].to(device), data.labels[idx].to(device)


def teacher_forced_logits(drafter: RecurrentDrafter, h: Tensor, g0: Tensor, labels: Tensor) -> Tensor:
    """Draft logits [B, T, K] for the T label positions, the RNN fed g0 then the labels."""
    B, T = labels.shape
    inputs = torch.cat([g0[:, None], labels[:, : T - 1].clamp(min=0)], dim=1)  # [B, T] target ids
    state = drafter.init_state((B,))  # [B, H]
    states = []
    for k in range(T):
        state = drafter.update_state(state, inputs[:, k])
        states.append(state)
    return drafter.draft_logits(h[:, None, :], torch.stack(states, dim=1))  # [B, T, K]


def distill_loss(logits: Tensor, draft_labels: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over the T positions of the mean CE: (loss [], per-position CE [T]).

    ``draft_labels`` [B, T] are draft-vocabulary ids, IGNORE where there is no usable label.
    """
    B, T, K = logits.shape
    ce = F.cross_entropy(logits.reshape(B * T, K).float(), draft_labels.reshape(B * T),
                         ignore_index=IGNORE, reduction="none").view(B, T)
    valid = (draft_labels != IGNORE).float()
    per_position = (ce * valid).sum(0) / valid.sum(0).clamp(min=1.0)  # [T]
    return per_position.sum(), per_position


@torch.no_grad()
def evaluate(drafter: RecurrentDrafter, data: DistillData, idx: Tensor, config: TrainConfig,
             device: torch.device) -> dict:
    """Held-out per-position top-1 accuracy (and the chain accuracy that predicts acceptance).

    top1[k]: the drafter's argmax at position k equals label k (labels of earlier positions fed,
    as in training). chain_top1[k]: positions 1..k all right, the share of draft chains of
    length k that a width-1 beam would get accepted.
    """
    drafter.eval()
    idx = idx[: config.eval_max_positions]
    lookup = target_to_draft_map(drafter.draft_vocab_ids if drafter.config.draft_vocab_size
                                 else torch.arange(drafter.config.vocab_size),
                                 drafter.config.vocab_size).to(device)
    T = data.labels.shape[1]
    correct = torch.zeros(T, dtype=torch.float64)
    chain = torch.zeros(T, dtype=torch.float64)
    counted = torch.zeros(T, dtype=torch.float64)
    in_vocab = torch.zeros(T, dtype=torch.float64)
    loss_sum = torch.zeros(T, dtype=torch.float64)
    autocast = config.autocast_dtype(device)
    for start in range(0, idx.numel(), config.eval_batch_size):
        h, g0, labels = gather(data, idx[start: start + config.eval_batch_size], device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = teacher_forced_logits(drafter, h, g0, labels)
        draft_labels = _draft_labels(labels, lookup)
        valid = labels >= 0  # [B, T]
        pred = drafter.to_target_ids(logits.argmax(-1))  # [B, T]
        hit = (pred == labels) & valid
        counted += valid.sum(0).double().cpu()
        correct += hit.sum(0).double().cpu()
        chain += (hit.cumprod(dim=1).bool() & valid).sum(0).double().cpu()
        in_vocab += (draft_labels != IGNORE).sum(0).double().cpu()
        _, per_pos = distill_loss(logits, draft_labels)
        loss_sum += per_pos.double().cpu() * (draft_labels != IGNORE).sum(0).double().cpu()
    drafter.train()
    n = counted.clamp(min=1)
    chain_acc = (chain / n).tolist()
    return {
        "positions": int(idx.numel()),
        "top1": (correct / n).tolist(),
        "chain_top1": chain_acc,
        # 1 + expected accepted drafts for a width-1 beam of length k+1, from the chain accuracy
        "expected_tokens_per_step_w1": [1 + sum(chain_acc[: k + 1]) for k in range(T)],
        "label_in_draft_vocab": (in_vocab / n).tolist(),
        "loss_per_position": (loss_sum / in_vocab.clamp(min=1)).tolist(),
        "loss": float((loss_sum / in_vocab.clamp(min=1)).sum()),
    }


def _draft_labels(labels: Tensor, lookup: Tensor) -> Tensor:
    """Target ids [B, T] (-1 = none) -> draft ids, IGNORE where none or outside the vocabulary."""
    return torch.where(labels >= 0, lookup[labels.clamp(min=0)], torch.full_like(labels, IGNORE))


def format_eval(result: dict) -> str:
    head = "position  " + "  ".join(f"{k + 1:>6}" for k in range(len(result["top1"])))
    rows = [head]
    for name in ("top1", "chain_top1", "label_in_draft_vocab"):
        rows.append(f"{name:<10}" + "  ".join(f"{v:6.3f}" for v in result[name]))
    rows.append(f"held-out loss {result['loss']:.4f} over {result['positions']} positions")
    return "\n".join(rows)


# -- checkpoints -----------------------------------------------------------------------------------


def save_checkpoint(path: Path, drafter: nn.Module, optimizer: torch.optim.Optimizer,
                    state: TrainState, fingerprint: str) -> None:
    """Everything a resumed run needs, written atomically (tmp file + rename)."""
    payload = {
        "model": drafter.state_dict(), "optimizer": optimizer.state_dict(), "step": state.step,
        "losses": state.losses, "fingerprint": fingerprint, "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(payload, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, drafter: nn.Module, optimizer: torch.optim.Optimizer,
                    fingerprint: str) -> TrainState:
    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload["fingerprint"] != fingerprint:
        raise ValueError(f"{path} belongs to a run with other settings (fingerprint "
                         f"{payload['fingerprint']} != {fingerprint}); pass --overwrite to start over")
    drafter.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    if payload["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda_rng"])
    return TrainState(step=payload["step"], losses=list(payload["losses"]))


# -- the loop --------------------------------------------------------------------------------------


def make_optimizer(drafter: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    params = [p for p in drafter.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)


def train_loop(drafter: RecurrentDrafter, data: DistillData, config: TrainConfig,
               checkpoint: Path, fingerprint: str, stop_after_steps: int | None = None,
               teacher_head: Tensor | None = None) -> TrainState:
    """Train from the checkpoint (if any) to the last step; returns the state at exit.

    ``stop_after_steps`` stops early (after saving a checkpoint) once that many steps are done:
    what a killed run leaves behind, for tests and for splitting a long run into sessions.
    ``teacher_head``: the target's LM-head rows of the draft tokens [K, H], needed when
    ``config.soft_label_weight`` > 0.
    """
    device = config.resolved_device()
    drafter.to(device).train()
    optimizer = make_optimizer(drafter, config)
    state = TrainState()
    if checkpoint.is_file():
        state = load_checkpoint(checkpoint, drafter, optimizer, fingerprint)
        print(f"resuming from {checkpoint} at step {state.step}")
    train_idx = torch.nonzero(~data.heldout).squeeze(1)
    if train_idx.numel() == 0:
        raise ValueError("no training positions left after the held-out split")
    order = BatchOrder(train_idx, config.batch_size, config.seed)
    total = total_steps(config, train_idx.numel())
    lookup = target_to_draft_map(drafter.draft_vocab_ids.cpu() if drafter.config.draft_vocab_size
                                 else torch.arange(drafter.config.vocab_size),
                                 drafter.config.vocab_size).to(device)
    autocast = config.autocast_dtype(device)
    soft = _soft_labels(data, config, teacher_head, device)
    end = total if stop_after_steps is None else min(total, stop_after_steps)
    bar = tqdm(range(state.step, end), desc="training", unit="step", initial=state.step, total=total)
    started = time.time()
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(config, step, total)
        batch = order.batch(step)
        h, g0, labels = gather(data, batch, device)
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = teacher_forced_logits(drafter, h, g0, labels)
            teacher = None if soft is None else teacher_logits(data, soft[0][batch], soft[1])
        loss, _ = distill_loss(logits, _draft_labels(labels, lookup))
        if teacher is not None:
            w = config.soft_label_weight
            loss = (1 - w) * loss + w * soft_label_loss(logits, *teacher)[0]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if config.grad_clip:
            nn.utils.clip_grad_norm_(drafter.parameters(), config.grad_clip)
        optimizer.step()
        state.step = step + 1
        state.losses.append(float(loss.detach()))  # one host sync a step: the progress bar's figure
        bar.set_postfix(loss=f"{state.losses[-1]:.3f}", epoch=f"{state.step / order.steps_per_epoch:.2f}")
        if state.step % config.save_every == 0 or state.step == end:
            save_checkpoint(checkpoint, drafter, optimizer, state, fingerprint)
    bar.close()
    state.seconds = time.time() - started
    return state


def _soft_labels(data: DistillData, config: TrainConfig, teacher_head: Tensor | None,
                 device: torch.device) -> tuple[Tensor, Tensor] | None:
    """(soft-label index [N, T], teacher head on ``device``), or None with hard labels only."""
    if config.soft_label_weight == 0.0:
        return None
    if teacher_head is None:
        raise ValueError("soft_label_weight > 0 needs the target's LM head (teacher_head)")
    return soft_label_index(data), teacher_head.to(device)


def write_json(path: Path, obj: dict) -> None:
    """``obj`` at ``path`` atomically, its paths made portable (``vllm_redrafter.results``)."""
    from vllm_redrafter.results import portable

    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(portable(obj), indent=1) + "\n")
    os.replace(tmp, path)
