"""The step-cost curve: seconds of one target forward by query tokens (and batch size), measured
by ``vllm-redrafter step-cost`` and cached per machine; an optional prior of the beam policy's
cost fit (the policy learns the machine's costs from its own steps without it).

Nothing here imports vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from vllm_redrafter.acceptance import monotone
from vllm_redrafter.cpu_features import cpu_isa


@dataclass(frozen=True)
class StepCost:
    """Seconds of one target forward over ``n`` query tokens in total (the whole batch).

    Piecewise linear between measured points, linear beyond the last two.

    >>> cost = StepCost((1, 8, 64), (0.010, 0.012, 0.040))
    >>> round(cost(4), 5), round(cost(128), 5)
    (0.01086, 0.072)
    """

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ValueError("a step-cost curve needs >= 2 points, as many tokens as seconds")
        if list(self.tokens) != sorted(set(self.tokens)) or min(self.seconds) <= 0:
            raise ValueError("step-cost tokens must increase strictly and seconds be positive")

    @classmethod
    def from_measurements(cls, points: Iterable[tuple[int, float]]) -> StepCost:
        """The median time per token count, made monotone (:func:`monotone`): a forward over
        more tokens never costs less, so where noise says it does the points are pooled."""
        by_n: dict[int, list[float]] = {}
        for n, seconds in points:
            by_n.setdefault(int(n), []).append(float(seconds))
        ns = sorted(by_n)
        return cls(tuple(ns), tuple(monotone([sorted(by_n[n])[len(by_n[n]) // 2] for n in ns])))

    def __call__(self, n: float, requests: int = 1) -> float:
        """``requests`` is ignored: one curve for every batch size (:class:`BatchStepCost`)."""
        xs, ys = self.tokens, self.seconds
        i = 1
        while i < len(xs) - 1 and n > xs[i]:
            i += 1
        slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
        return max(ys[0], ys[i - 1] + slope * (n - xs[i - 1]))

    def save(self, path: Path, **meta) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**meta, "tokens": list(self.tokens),
                                    "seconds": list(self.seconds)}, indent=1))


@dataclass(frozen=True)
class BatchStepCost:
    """Seconds of one target forward over ``n`` query tokens split among ``requests`` requests:
    one :class:`StepCost` per measured batch size, linear between batch sizes (one request's 4
    tokens cost less than two requests' 2 each).

    >>> cost = BatchStepCost(((1, StepCost((1, 8), (0.010, 0.012))),
    ...                       (4, StepCost((4, 32), (0.020, 0.040)))))
    >>> round(cost(4, 1), 5), round(cost(4, 4), 5), round(cost(8, 2), 5)
    (0.01086, 0.02, 0.01562)
    """

    curves: tuple[tuple[int, StepCost], ...]  # (batch size, its curve), batch sizes increasing

    def __post_init__(self) -> None:
        sizes = [b for b, _ in self.curves]
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"step-cost batch sizes must be >= 1 and increase strictly: {sizes}")

    @classmethod
    def from_cells(cls, cells: Iterable[dict]) -> BatchStepCost:
        """From ``vllm-redrafter step-cost``'s cells (``batch``, ``total_tokens``, ``seconds``)."""
        by_batch: dict[int, list[tuple[int, float]]] = {}
        for c in cells:
            by_batch.setdefault(int(c["batch"]), []).append((c["total_tokens"], c["seconds"]))
        return cls(tuple((b, StepCost.from_measurements(by_batch[b])) for b in sorted(by_batch)))

    def __call__(self, n: float, requests: int = 1) -> float:
        sizes = [b for b, _ in self.curves]
        i = next((i for i, b in enumerate(sizes) if b >= requests), len(sizes) - 1)
        if i == 0 or sizes[i] <= requests:
            return self.curves[i][1](n)
        (b0, lo), (b1, hi) = self.curves[i - 1], self.curves[i]
        w = (requests - b0) / (b1 - b0)
        return (1 - w) * lo(n) + w * hi(n)


def load_step_cost(path: Path) -> StepCost | BatchStepCost:
    """A saved curve: per batch size where its cells hold several, else the one curve."""
    data = json.loads(Path(path).read_text())
    if len({c["batch"] for c in data.get("cells", ())}) > 1:
        return BatchStepCost.from_cells(data["cells"])
    return StepCost(tuple(data["tokens"]), tuple(data["seconds"]))


def step_cost_path(model: str, dtype: str, device: str, threads: int) -> Path:
    """Where ``vllm-redrafter step-cost`` caches the curve of a model on this machine.

    The key names the CPU's ISA too (an AVX2 CPU and an AVX-512 one with as many cores have
    different curves) and, on a CPU, the model runner's torch threads (vLLM's CPU worker gets
    the cores its thread binding leaves it: by default one core is kept for the engine-core
    process; ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` gives it all)."""
    from vllm_redrafter.target import cache_dir

    machine = f"{platform.machine()}|{os.cpu_count()}|{cpu_isa()}|{device}"
    if device == "cpu":
        machine += f"|threads={threads}"
    key = hashlib.sha256(f"{model}|{dtype}|{machine}".encode()).hexdigest()[:16]
    return cache_dir() / "step_cost" / f"{key}.json"
