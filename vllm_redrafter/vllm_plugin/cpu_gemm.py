"""The drafter's linear layers on vLLM's CPU GEMM (oneDNN, weights prepacked once).

``torch.nn.functional.linear`` on a CPU reads a [K, 2H] fp32 head at about a third of the speed
vLLM's prepacked oneDNN path does at beam-search shapes (4 rows x 1152 x 6144 on a 2-core AVX2
machine: 4.0 ms vs 1.1 ms), and the head is read once per beam step. vLLM already chooses the
best CPU GEMM for each of its own linear layers (``dispatch_cpu_unquantized_gemm``: oneDNN,
sgl-kernel on AMX, zentorch on Zen); the drafter's layers take the same choice here. The result
is the same fp32 product up to summation order.
"""

from __future__ import annotations

from torch import Tensor, nn


def use_vllm_cpu_gemm(module: nn.Module) -> int:
    """Route every CPU ``nn.Linear`` in ``module`` through vLLM's CPU GEMM; returns how many."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    count = 0
    for linear in module.modules():
        if type(linear) is nn.Linear and linear.weight.device.type == "cpu":
            dispatch_cpu_unquantized_gemm(linear, remove_weight=False)  # sets linear.cpu_linear
            linear.forward = _PrepackedForward(linear)
            count += 1
    return count


class _PrepackedForward:
    """``linear.forward`` calling the GEMM vLLM chose for ``linear`` (its ``cpu_linear``)."""

    def __init__(self, linear: nn.Linear) -> None:
        self.linear = linear

    def __call__(self, x: Tensor) -> Tensor:
        linear = self.linear
        return linear.cpu_linear(x.contiguous(), linear.weight, linear.bias)
