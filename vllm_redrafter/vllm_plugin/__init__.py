"""ReDrafter as a speculative method of vLLM: ``{"method": "redrafter", "model": DRAFTER_DIR}``.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in every process
(the one building the engine config, the engine core, each worker). It applies the few patches in
``vllm_redrafter.patches``; each does nothing unless a speculative config asks for redrafter, so
vLLM with the package installed but redrafter not asked for behaves as without it.

The seam (see ../shared/VLLM_SEAM.md):

- ``config``: the settings, their validation, the rewrite into vLLM's ``custom_class`` method;
- ``proposer``: :class:`~vllm_redrafter.vllm_plugin.proposer.ReDrafterProposer`, the drafter's
  beam search on the target's hidden state; drafts verified by vLLM's rejection sampler.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """The ``vllm.general_plugins`` entry point: apply the patches (idempotent)."""
    from vllm_redrafter.patches import (
        PINNED_VLLM_VERSION,
        VllmVersionError,
        check_vllm_version,
        request_params,
        runner_hidden_states,
        speculative_config,
    )

    try:
        check_vllm_version()
    except VllmVersionError as err:  # never break a vLLM that does not ask for redrafter
        logger.warning("%s; method 'redrafter' is unavailable", err)
        return
    speculative_config.apply()
    runner_hidden_states.apply()
    request_params.apply()
    logger.debug("vllm-redrafter: patches for vLLM %s applied", PINNED_VLLM_VERSION)
