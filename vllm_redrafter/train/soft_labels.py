"""Soft labels: the target's whole next-token distribution at each label, not only its argmax.

With ``labels=self`` every label y_k of position t (the token at t+1+k) is itself a training
position's root: the position t+k, whose h is the target's last hidden state when it produced
y_k. So the target's distribution over y_k is ``softmax(h_{t+k} @ W_lm^T)``, for free from the
stored hidden states: no extra target forward, no extra data. The trainer adds

    soft_loss = sum_k mean_positions KL(p_target(. | h_{t+k}) restricted to the K draft tokens
                                        || q_drafter(. | h_t, s_k))

to the hard CE with weight ``soft_label_weight`` (loss = (1 - w) CE + w KL). With labels=self
the hard label is the teacher's argmax, so the two agree on what to rank first; the KL adds how
the target ranks the rest, which the beam search's other W - 1 beams draw on. A label has a soft
target where position t+k is there and holds y_k as its root (same sequence, t+k, same token).
The same holds for ``labels=ground-truth`` (the labels are the text's next tokens: classic
distillation on a text); with ``labels=distill`` the labels continue the target's own generation,
not the text, so the text's next positions read another prefix and there are no soft labels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_redrafter.train.distill import DistillData


def soft_label_index(data: DistillData) -> Tensor:
    """[N, T] long: the position whose h gives the target's distribution over label k, -1 = none."""
    modes = {part.get("spec", {}).get("labels") for part in data.meta.get("parts", [data.meta])}
    if "distill" in modes:
        raise ValueError("soft labels need labels=self or ground-truth: with labels=distill the "
                         "labels continue the target's generation, not the text the hidden states "
                         "were computed on")
    if data.t is None:
        raise ValueError("this dataset has no per-position t (built by an older version); "
                         "rebuild it to train with soft labels")
    n, T = data.labels.shape
    p = torch.arange(n)
    index = torch.full((n, T), -1, dtype=torch.long)
    for k in range(1, T + 1):
        q = (p + k).clamp(max=n - 1)
        label = data.labels[:, k - 1]
        ok = ((p + k < n) & (label >= 0) & (data.sequence[q] == data.sequence)
              & (data.t[q] == data.t + k) & (data.g0[q] == label))
        index[:, k - 1] = torch.where(ok, q, -1)
    return index


def teacher_logits(data: DistillData, rows: Tensor, head: Tensor) -> tuple[Tensor, Tensor]:
    """The target's logits over the draft vocabulary [B, T, K] at ``rows`` [B, T] (from
    :func:`soft_label_index`), and where they exist [B, T]. ``head``: the target's LM-head rows of
    the K draft tokens [K, H], on the device to compute on."""
    h = data.hidden(rows.clamp(min=0)).to(head.device, head.dtype)  # [B, T, H]
    return h @ head.T, (rows >= 0).to(head.device)


def soft_label_loss(logits: Tensor, teacher: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Sum over the T positions of the mean KL(teacher || drafter): (loss [], per-position [T])."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    log_p = F.log_softmax(teacher.float(), dim=-1)
    kl = F.kl_div(log_q, log_p, log_target=True, reduction="none").sum(-1)  # [B, T]
    mask = valid.float()
    per_position = (kl * mask).sum(0) / mask.sum(0).clamp(min=1.0)
    return per_position.sum(), per_position
