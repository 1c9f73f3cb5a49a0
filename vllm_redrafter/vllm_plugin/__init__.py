"""ReDrafter as a speculative method of vLLM: ``{"method": "redrafter", "model": DRAFTER_DIR}``.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in every process
(the one building the engine config, the engine core, each worker). It applies the few patches in
``vllm_redrafter.patches``; each does nothing unless a speculative config asks for redrafter, so
vLLM with the package installed but redrafter not asked for behaves as without it.

The seam (see docs/design.md, One step through vLLM 0.32):

- ``config``: the settings, their validation, the rewrite into vLLM's ``custom_class`` method;
- ``proposer``: :class:`~vllm_redrafter.vllm_plugin.proposer.ReDrafterProposer`, the drafter's
  beam search on the target's hidden state, packed into a dynamic tree per request;
- ``tree_step``: a step's trees lined up with what vLLM scheduled (positions, masks, KV moves);
- ``attention``: vLLM's CPU attention plus the tree mask on verify steps (``flash_attention``:
  the same on CUDA);
- ``verifier``: the tree verifier in place of vLLM's rejection sampler.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(f"vllm.{__name__}")  # under vLLM's logger: its handler and level


def _register_tree_attention() -> None:
    """Put the tree-capable subclass of vLLM's attention backend in its place.

    ``CPU_ATTN`` on CPU (``vllm_plugin/attention.py``), ``FLASH_ATTN`` on CUDA
    (``vllm_plugin/flash_attention.py``). Each behaves as vLLM's own outside ReDrafter tree
    steps; with another backend, ReDrafter drafts chains.
    """
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        from vllm_redrafter.vllm_plugin.attention import BACKEND_PATH

        register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND_PATH)
    elif current_platform.is_cuda():
        from vllm_redrafter.vllm_plugin.flash_attention import BACKEND_PATH

        register_backend(AttentionBackendEnum.FLASH_ATTN, BACKEND_PATH)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: apply the patches (idempotent)."""
    from vllm_redrafter.patches import (
        PINNED_VLLM_VERSION,
        VllmVersionError,
        check_vllm_version,
        draft_handoff,
        request_params,
        runner_hidden_states,
        runner_tree,
        seeded_chunks_cpu,
        speculative_config,
    )

    try:
        check_vllm_version()
    except VllmVersionError as err:  # never break a vLLM that does not ask for redrafter
        logger.warning("%s; method 'redrafter' is unavailable", err)
        return
    speculative_config.apply()
    runner_hidden_states.apply()
    runner_tree.apply()
    draft_handoff.apply()
    seeded_chunks_cpu.apply()
    request_params.apply()
    _register_tree_attention()
    logger.debug("vllm-redrafter: patches for vLLM %s applied", PINNED_VLLM_VERSION)
