"""Validate a request's ReDrafter overrides (``SamplingParams.extra_args``) at admission.

Wraps ``vllm.v1.engine.input_processor.InputProcessor._validate_params``: vLLM validates
``extra_args`` only through logits processors' ``validate_params`` hooks, which would mean
registering a logits processor that runs every step for nothing. The wrapper runs vLLM's own
checks, then, on a redrafter engine, ``vllm_redrafter.vllm_plugin.config.request_settings``; a
bad value fails that request alone (``VLLMValidationError``: HTTP 400 on the server), never the
engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_redrafter.patches import wrap_method


def apply() -> None:
    from vllm.v1.engine.input_processor import InputProcessor

    wrap_method(InputProcessor, "_validate_params", ("self", "params", "supported_tasks"), _wrapper)


def _wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from vllm_redrafter.vllm_plugin.config import (
        REQUEST_KEYS,
        ReDrafterConfigError,
        request_settings,
        settings_from_extra_config,
    )

    def _validate_params(self, params, supported_tasks):
        result = original(self, params, supported_tasks)
        spec = self.vllm_config.speculative_config
        load = getattr(spec, "draft_load_config", None)
        settings = settings_from_extra_config(getattr(load, "model_loader_extra_config", None))
        if settings is not None and isinstance(params, SamplingParams):
            try:
                request_settings(params.extra_args, settings)
            except ReDrafterConfigError as err:
                key = next((k for k in REQUEST_KEYS if f"'{k}'" in str(err)), None)
                value = (params.extra_args or {}).get(key) if key else None
                raise VLLMValidationError(str(err), parameter=key, value=value) from err
        return result

    return _validate_params
