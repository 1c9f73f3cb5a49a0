"""ReDrafter's settings inside vLLM's ``speculative_config``, validated before any model loads.

A user writes one JSON object (docs/design.md, The speculative config)::

    {"method": "redrafter", "model": "DRAFTER_DIR",
     "beam_width": 8, "beam_length": 4, "verification": "exact", "beam_policy": "auto",
     "num_speculative_tokens": 24, "step_cost": "CURVE.json", "min_gain": 1.05,
     "context_candidates": 1, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
     "prompt_lookup_tokens": 5}

vLLM 0.32.0 knows neither the method nor the extra keys, so :func:`rewrite_speculative_config`
turns the object into one vLLM accepts: ``method: "custom_class"`` with ``model`` naming our
proposer class, and :class:`ReDrafterSettings` riding along inside a free dict of vLLM's own
(``draft_load_config.model_loader_extra_config["redrafter"]``), which is pickled with the rest of
the ``VllmConfig`` into the engine-core and worker processes. Every other key (``enforce_eager``,
``max_model_len``, ...) is left for vLLM to validate.

A request may override the beam shape, verification mode and context candidates for itself through
``SamplingParams.extra_args`` (OpenAI API: ``vllm_xargs``), with the keys of
:data:`REQUEST_KEYS`; :func:`request_settings` validates them like the engine settings.

This module does not import vLLM: the validation is testable in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_redrafter.beam_policy import DEFAULT_MIN_GAIN
from vllm_redrafter.drafter import (
    CONFIG_FILE,
    DrafterCheckpointError,
    DrafterConfig,
    DrafterMismatchError,
)

METHOD = "redrafter"
PROPOSER_CLASS = "vllm_redrafter.vllm_plugin.proposer.ReDrafterProposer"
"""What ``speculative_config.model`` becomes: vLLM's ``custom_class`` method imports it."""
EXTRA_CONFIG_KEY = "redrafter"
"""Key of the settings inside ``draft_load_config.model_loader_extra_config``."""

VERIFICATION_MODES = ("exact", "rejection", "typical")
BEAM_POLICIES = ("auto", "fixed")
DEFAULT_BEAM_WIDTH = 4
DEFAULT_BEAM_LENGTH = 4
DEFAULT_CONTEXT_CANDIDATES = 1
"""Context candidates (prompt lookup) per request and step, at most: docs/context_candidates.md
gives the measurement behind 1."""
MAX_CONTEXT_CANDIDATES = 16
DEFAULT_LOOKUP_MIN, DEFAULT_LOOKUP_MAX = 2, 5
"""The n-gram lengths a context candidate's match may have (vLLM's ngram defaults to 5, 5)."""
DEFAULT_LOOKUP_TOKENS = 5
"""Tokens a context candidate carries, at most, apart from the beam length: the text after a
match is copied on for as long as it matches, so a candidate pays beyond the drafter's L - 1
(vLLM's n-gram example drafts 5; docs/context_candidates.md gives the measurement)."""
MAX_SPECULATIVE_TOKENS = 128
"""vLLM's rejection sampler refuses more draft tokens per request (``MAX_SPEC_LEN``)."""

REQUEST_KEYS = {
    "redrafter_beam_width": "beam_width",
    "redrafter_beam_length": "beam_length",
    "redrafter_verification": "verification",
    "redrafter_context_candidates": "context_candidates",
}
"""``SamplingParams.extra_args`` key -> the setting it overrides for that request."""


class ReDrafterConfigError(ValueError):
    """A ReDrafter setting is out of range; the message names the field and the allowed values."""


@dataclass(frozen=True)
class ReDrafterSettings:
    """The engine-wide ReDrafter settings (every request's default beam shape)."""

    drafter_dir: str  # absolute path of the drafter checkpoint (Apple layout)
    beam_width: int  # W, candidates per step
    beam_length: int  # L, tokens per candidate including the root g0 (Apple's convention)
    num_speculative_tokens: int  # N, the most draft tokens per request per step
    verification: str = "exact"  # exact | rejection | typical (the last two: tree verification)
    beam_policy: str = "auto"  # auto: per-step shape up to (W, L) (beam_policy.py) | fixed
    step_cost: str | None = None  # the policy's step-cost curve (None: this machine's cached one)
    min_gain: float = DEFAULT_MIN_GAIN  # the policy drafts where it expects this x a plain step
    context_candidates: int = 0  # most context candidates per request and step (0: none)
    lookup_min: int = DEFAULT_LOOKUP_MIN  # n-gram lengths of a candidate's match
    lookup_max: int = DEFAULT_LOOKUP_MAX
    lookup_tokens: int = DEFAULT_LOOKUP_TOKENS  # most tokens of a context candidate

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReDrafterSettings:
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})


@dataclass(frozen=True)
class RequestSettings:
    """One request's beam shape and verification mode (engine defaults or its own overrides)."""

    beam_width: int
    beam_length: int
    verification: str
    own_shape: bool = False  # the request chose W or L itself: the beam policy leaves it alone
    context_candidates: int = 0  # most context candidates (0 under rejection: they have no q)
    own_candidates: bool = False  # the request chose its count itself: the policy leaves it


# -- engine settings -----------------------------------------------------------------------------


def validate_settings(
    raw: Mapping[str, Any],
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
) -> ReDrafterSettings:
    """The ReDrafter part of a ``speculative_config`` dict -> settings, or one clear error.

    Reads ``model`` (the drafter dir), ``beam_width``, ``beam_length``, ``verification``,
    ``beam_policy``, ``step_cost``, ``min_gain``, ``num_speculative_tokens``,
    ``context_candidates``, ``prompt_lookup_min``, ``prompt_lookup_max`` and
    ``prompt_lookup_tokens``; other keys are
    ignored here. The drafter's ``config.json`` is checked against the target's dims when they are
    given (no weights read). Context candidates have no draft distribution, so ``rejection``
    verification takes none: 0 by default there, and an explicit count > 0 is refused.
    """
    W = _int_field("beam_width", raw.get("beam_width", DEFAULT_BEAM_WIDTH), low=1)
    L = _int_field("beam_length", raw.get("beam_length", DEFAULT_BEAM_LENGTH), low=2)
    verification = _choice_field(
        "verification", raw.get("verification", "exact"), VERIFICATION_MODES
    )
    C = _candidate_count(raw.get("context_candidates"), verification, "context_candidates",
                         "speculative_config", default=DEFAULT_CONTEXT_CANDIDATES)
    lookup_min = _int_field("prompt_lookup_min", raw.get("prompt_lookup_min", DEFAULT_LOOKUP_MIN),
                            low=1)
    lookup_max = _int_field("prompt_lookup_max",
                            raw.get("prompt_lookup_max", max(lookup_min, DEFAULT_LOOKUP_MAX)),
                            low=lookup_min)
    lookup_tokens = _int_field("prompt_lookup_tokens",
                               raw.get("prompt_lookup_tokens", DEFAULT_LOOKUP_TOKENS), low=1,
                               high=MAX_SPECULATIVE_TOKENS)
    N = raw.get("num_speculative_tokens")
    if N is None:  # the whole beam set and the candidates, as far as vLLM's sampler allows
        N = min(W * (L - 1) + C * lookup_tokens, MAX_SPECULATIVE_TOKENS)
    N = _int_field("num_speculative_tokens", N, low=1, high=MAX_SPECULATIVE_TOKENS)
    _check_length_fits(L, N, where="speculative_config")
    policy = _choice_field("beam_policy", raw.get("beam_policy", "auto"), BEAM_POLICIES)
    drafter_dir = _drafter_dir(raw.get("model"))
    check_drafter_fits_target(drafter_dir, target_hidden_size, target_vocab_size)
    step_cost = raw.get("step_cost")
    if step_cost is not None:
        if not Path(str(step_cost)).is_file():
            raise ReDrafterConfigError(
                f"speculative_config['step_cost'] must be a step-cost JSON file "
                f"(`vllm-redrafter step-cost` writes one), got {step_cost!r}: no such file")
        step_cost = str(Path(str(step_cost)).resolve())
    min_gain = _float_field("min_gain", raw.get("min_gain", DEFAULT_MIN_GAIN), low=1.0, high=10.0)
    return ReDrafterSettings(str(drafter_dir), W, L, N, verification, policy, step_cost, min_gain,
                             C, lookup_min, lookup_max, lookup_tokens)


def rewrite_speculative_config(
    raw: Mapping[str, Any],
    target_hidden_size: int | None = None,
    target_vocab_size: int | None = None,
) -> dict[str, Any]:
    """``{"method": "redrafter", ...}`` -> a dict vLLM 0.32.0's ``SpeculativeConfig`` accepts.

    >>> d = rewrite_speculative_config({"method": "redrafter", "model": DIR, "beam_width": 2})
    >>> d["method"], d["model"], d["num_speculative_tokens"]
    ('custom_class', 'vllm_redrafter.vllm_plugin.proposer.ReDrafterProposer', 11)

    ``d["draft_load_config"]`` is a dict ``{"model_loader_extra_config": {"redrafter": {...}}}``
    that vLLM turns into its ``LoadConfig``.
    """
    settings = validate_settings(raw, target_hidden_size, target_vocab_size)
    ours = {"method", "model", "beam_width", "beam_length", "verification", "beam_policy",
            "step_cost", "min_gain", "context_candidates", "prompt_lookup_min",
            "prompt_lookup_max", "prompt_lookup_tokens"}
    out = {key: value for key, value in raw.items() if key not in ours}
    if "draft_load_config" in out:
        raise ReDrafterConfigError(
            "speculative_config['draft_load_config'] is not supported with method 'redrafter': "
            "the drafter is loaded from 'model' on the target's device and dtype"
        )
    out.update(
        method="custom_class",
        model=PROPOSER_CLASS,
        num_speculative_tokens=settings.num_speculative_tokens,
        draft_load_config={"model_loader_extra_config": {EXTRA_CONFIG_KEY: settings.to_dict()}},
    )
    return out


def settings_from_extra_config(extra: Mapping[str, Any] | None) -> ReDrafterSettings | None:
    """The settings :func:`rewrite_speculative_config` stored, or None (not a redrafter engine)."""
    if not isinstance(extra, Mapping) or EXTRA_CONFIG_KEY not in extra:
        return None
    return ReDrafterSettings.from_dict(extra[EXTRA_CONFIG_KEY])


def check_drafter_fits_target(
    drafter_dir: Path, target_hidden_size: int | None, target_vocab_size: int | None
) -> DrafterConfig:
    """Read the drafter's ``config.json`` only; refuse a drafter built for another target."""
    file = drafter_dir / CONFIG_FILE
    if not file.is_file():
        raise DrafterCheckpointError(
            f"{file} is missing: speculative_config['model'] must be a drafter directory "
            "(config.json + model.safetensors, Apple's ml-recurrent-drafter layout)"
        )
    try:
        config = DrafterConfig.from_dict(json.loads(file.read_text()))
    except (ValueError, TypeError) as err:  # JSONDecodeError is a ValueError
        raise DrafterCheckpointError(f"{file}: {err}") from err
    hidden_ok = target_hidden_size is None or config.hidden_size == target_hidden_size
    vocab_ok = target_vocab_size is None or config.vocab_size == target_vocab_size
    if not (hidden_ok and vocab_ok):
        raise DrafterMismatchError(
            f"drafter ({drafter_dir}) hidden_size={config.hidden_size} / "
            f"vocab_size={config.vocab_size} does not match the target's "
            f"hidden_size={target_hidden_size} / vocab_size={target_vocab_size}"
        )
    return config


# -- per-request overrides -----------------------------------------------------------------------


def request_settings(
    extra_args: Mapping[str, Any] | None, settings: ReDrafterSettings
) -> RequestSettings:
    """A request's beam shape: the engine defaults, overridden by its ``extra_args``.

    Raises :class:`ReDrafterConfigError` naming the ``extra_args`` key for a bad value; the
    engine's ``num_speculative_tokens`` bounds the beam length (a chain of L-1 drafts must fit).
    A request verified by ``rejection`` takes no context candidates (they have no draft
    distribution): the engine's count becomes 0, and its own count > 0 is refused.
    """
    values = {
        "beam_width": settings.beam_width,
        "beam_length": settings.beam_length,
        "verification": settings.verification,
        "context_candidates": None,
    }
    for key, field in REQUEST_KEYS.items():
        if extra_args and key in extra_args:
            values[field] = extra_args[key]
    where = "extra_args"
    W = _int_field("redrafter_beam_width", values["beam_width"], low=1, where=where)
    L = _int_field("redrafter_beam_length", values["beam_length"], low=2, where=where)
    _check_length_fits(L, settings.num_speculative_tokens, where=where, key="redrafter_beam_length")
    mode = _choice_field(
        "redrafter_verification", values["verification"], VERIFICATION_MODES, where=where
    )
    own = bool(extra_args) and any(k in extra_args for k in ("redrafter_beam_width",
                                                              "redrafter_beam_length"))
    C = _candidate_count(values["context_candidates"], mode, "redrafter_context_candidates", where,
                         default=settings.context_candidates)
    return RequestSettings(W, L, mode, own, C, values["context_candidates"] is not None)


# -- helpers -------------------------------------------------------------------------------------


def _int_field(
    name: str, value: Any, *, low: int, high: int | None = None, where: str = "speculative_config"
) -> int:
    allowed = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise ReDrafterConfigError(f"{where}['{name}'] must be {allowed}, got {value!r}")
    if value < low or (high is not None and value > high):
        raise ReDrafterConfigError(f"{where}['{name}'] must be {allowed}, got {value}")
    return value


def _float_field(name: str, value: Any, *, low: float, high: float,
                 where: str = "speculative_config") -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ReDrafterConfigError(f"{where}['{name}'] must be a number in [{low}, {high}], "
                                   f"got {value!r}")
    return float(value)


def _choice_field(
    name: str, value: Any, choices: tuple[str, ...], *, where: str = "speculative_config"
) -> str:
    if value not in choices:
        raise ReDrafterConfigError(
            f"{where}['{name}'] must be one of {', '.join(map(repr, choices))}, got {value!r}"
        )
    return value


def _candidate_count(value: Any, verification: str, name: str, where: str, default: int) -> int:
    """A context-candidate count; None: ``default``, or 0 under ``rejection`` verification."""
    if value is None:
        return 0 if verification == "rejection" else default
    count = _int_field(name, value, low=0, high=MAX_CONTEXT_CANDIDATES, where=where)
    if count and verification == "rejection":
        raise ReDrafterConfigError(
            f"{where}['{name}'] must be 0 with 'rejection' verification, got {count}: context "
            "candidates have no draft distribution q for the p/q test (use 'exact' or 'typical')")
    return count


def _check_length_fits(L: int, N: int, *, where: str, key: str = "beam_length") -> None:
    """A chain of L-1 draft tokens (the best beam) must fit in N scheduled draft tokens."""
    if L - 1 > N:
        raise ReDrafterConfigError(
            f"{where}['{key}'] must be in [2, num_speculative_tokens + 1 = {N + 1}], got {L} "
            f"(a beam of length L carries L - 1 draft tokens)"
        )


def _drafter_dir(model: Any) -> Path:
    if not isinstance(model, str | Path) or not str(model):
        raise ReDrafterConfigError(
            "speculative_config['model'] must be the drafter directory (a path), "
            f"got {model!r}"
        )
    directory = Path(model).expanduser().resolve()
    if not directory.is_dir():
        raise DrafterCheckpointError(
            f"speculative_config['model']: drafter directory {directory} does not exist"
        )
    return directory
