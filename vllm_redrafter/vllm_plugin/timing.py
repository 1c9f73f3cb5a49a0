"""Where a ReDrafter step's time goes: draft, pack, verify (the target's forward), accept.

A benchmark hook, off by default: set ``proposer.timings = StepTimings()`` on an in-process engine
(``benchmarks/speedup.py`` does) and each phase is timed, the device synchronised around it (so it
costs a little and is never on in serving).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class StepTimings:
    """Summed seconds and call counts per phase name."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str, device: torch.device | None = None) -> Iterator[None]:
        _sync(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync(device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        return {name: {"seconds": s, "calls": self.calls[name]} for name, s in self.seconds.items()}


@contextmanager
def timed(timings: StepTimings | None, name: str,
          device: torch.device | None = None) -> Iterator[None]:
    """``timings.phase(name)``, or nothing when timing is off."""
    if timings is None:
        yield
        return
    with timings.phase(name, device):
        yield


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)
