"""Accept ``{"method": "redrafter", ...}`` as a speculative config.

Wraps ``vllm.engine.arg_utils.EngineArgs.create_speculative_config``: vLLM 0.32.0's
``SpeculativeConfig.method`` is a closed pydantic ``Literal`` and the config refuses unknown keys
(``beam_width``, ...); there is no registry of speculative methods. Before vLLM builds its
``SpeculativeConfig``, the wrapper validates a redrafter dict against the target's config (no
weights are read) and rewrites it into vLLM's own ``custom_class`` machinery
(``vllm_redrafter.vllm_plugin.config.rewrite_speculative_config``). Any other dict passes
untouched. This runs in the process that builds the engine config, before any model loads.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm_redrafter.patches import wrap_method

logger = logging.getLogger(__name__)


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    wrap_method(
        EngineArgs, "create_speculative_config",
        ("self", "target_model_config", "target_parallel_config"), _wrapper,
    )


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm_redrafter.vllm_plugin.config import METHOD, rewrite_speculative_config

    def create_speculative_config(self, target_model_config, target_parallel_config):
        raw = self.speculative_config
        if isinstance(raw, dict) and raw.get("method") == METHOD:
            self.speculative_config = rewrite_speculative_config(
                raw,
                target_hidden_size=target_model_config.get_hidden_size(),
                target_vocab_size=target_model_config.get_vocab_size(),
            )
            _warn_inexact_modes(raw)
        return original(self, target_model_config, target_parallel_config)

    return create_speculative_config


def _warn_inexact_modes(raw: dict[str, Any]) -> None:
    mode = raw.get("verification", "exact")
    if mode != "exact":
        logger.warning(
            "ReDrafter: verification %r is not exact: sampled outputs will not follow the "
            "target's distribution exactly (greedy requests stay exact)", mode,
        )
