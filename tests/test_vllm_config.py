"""ReDrafter's speculative-config settings: validation, the rewrite for vLLM, request overrides.

Fast (no engine): these run the same functions the plugin runs inside vLLM before any model loads.
"""

from __future__ import annotations

import json
import pickle

import pytest

from vllm_redrafter.drafter import DrafterCheckpointError, DrafterMismatchError
from vllm_redrafter.vllm_plugin.config import (
    PROPOSER_CLASS,
    ReDrafterConfigError,
    ReDrafterSettings,
    request_settings,
    rewrite_speculative_config,
    settings_from_extra_config,
    validate_settings,
)

H, V = 576, 49152


@pytest.fixture
def drafter_dir(tmp_path):
    """A drafter directory: only config.json is read by the validation."""
    config = {"model_type": "recurrent_drafting_drafter", "vocab_size": V, "hidden_size": H,
              "exit_dim": 2 * H, "num_draft_layers": 1, "rnn": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def spec(drafter_dir, **kw):
    return {"method": "redrafter", "model": str(drafter_dir), **kw}


def test_rewrite_into_custom_class_keeps_vllm_keys(drafter_dir):
    out = rewrite_speculative_config(
        spec(drafter_dir, beam_width=2, beam_length=4, enforce_eager=True), H, V
    )
    assert out["method"] == "custom_class"
    assert out["model"] == PROPOSER_CLASS
    assert out["num_speculative_tokens"] == 2 * 3 + 1 * 5  # W (L - 1) + C x prompt_lookup_tokens
    assert out["enforce_eager"] is True  # vLLM's own keys pass through to vLLM
    assert not {"beam_width", "beam_length", "verification", "beam_policy"} & out.keys()
    extra = out["draft_load_config"]["model_loader_extra_config"]
    settings = settings_from_extra_config(extra)
    assert settings == ReDrafterSettings(str(drafter_dir.resolve()), 2, 4, 11, "exact", "auto",
                                         context_candidates=1)
    # the settings travel to the workers inside the pickled VllmConfig
    assert pickle.loads(pickle.dumps(extra)) == extra


def test_the_proposer_class_path_resolves():
    import importlib

    module, name = PROPOSER_CLASS.rsplit(".", 1)
    assert getattr(importlib.import_module(module), name).__name__ == name


def test_default_num_speculative_tokens_is_capped_at_vllms_limit(drafter_dir):
    settings = validate_settings(spec(drafter_dir, beam_width=64, beam_length=5))
    assert settings.num_speculative_tokens == 128


def test_explicit_num_speculative_tokens_is_kept(drafter_dir):
    settings = validate_settings(spec(drafter_dir, beam_width=8, beam_length=4,
                                      num_speculative_tokens=24))
    shape = (settings.beam_width, settings.beam_length, settings.num_speculative_tokens)
    assert shape == (8, 4, 24)


@pytest.mark.parametrize(
    "overrides, field, allowed",
    [
        ({"beam_width": 0}, "beam_width", "an integer >= 1, got 0"),
        ({"beam_width": 2.0}, "beam_width", "an integer >= 1, got 2.0"),
        ({"beam_width": True}, "beam_width", "an integer >= 1, got True"),
        ({"beam_length": 1}, "beam_length", "an integer >= 2, got 1"),
        ({"beam_length": 6, "num_speculative_tokens": 4}, "beam_length",
         "[2, num_speculative_tokens + 1 = 5], got 6"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens", "[1, 128], got 0"),
        ({"num_speculative_tokens": 129}, "num_speculative_tokens", "[1, 128], got 129"),
        ({"verification": "greedy"}, "verification",
         "one of 'exact', 'rejection', 'typical', got 'greedy'"),
        ({"beam_policy": "dynamic"}, "beam_policy", "one of 'auto', 'fixed', got 'dynamic'"),
        ({"step_cost": "/nowhere/curve.json"}, "step_cost", "no such file"),
        ({"min_gain": 0.9}, "min_gain", "a number in [1.0, 10.0], got 0.9"),
        ({"min_gain": "1.2"}, "min_gain", "a number in [1.0, 10.0], got '1.2'"),
        ({"context_candidates": -1}, "context_candidates", "an integer in [0, 16], got -1"),
        ({"context_candidates": 1.5}, "context_candidates", "an integer in [0, 16], got 1.5"),
        ({"context_candidates": 2, "verification": "rejection"}, "context_candidates",
         "must be 0 with 'rejection' verification, got 2"),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min", "an integer >= 1, got 0"),
        ({"prompt_lookup_tokens": 0}, "prompt_lookup_tokens", "[1, 128], got 0"),
        ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max",
         "an integer >= 3, got 2"),
    ],
)
def test_bad_values_name_the_field_and_the_allowed_range(drafter_dir, overrides, field, allowed):
    with pytest.raises(ReDrafterConfigError) as err:
        validate_settings(spec(drafter_dir, **overrides), H, V)
    assert f"speculative_config['{field}']" in str(err.value)
    assert allowed in str(err.value)


def test_min_gain_reaches_the_settings(drafter_dir):
    out = rewrite_speculative_config(spec(drafter_dir, min_gain=1.2), H, V)
    assert "min_gain" not in out  # ours, not vLLM's
    settings = settings_from_extra_config(out["draft_load_config"]["model_loader_extra_config"])
    assert settings.min_gain == 1.2


def test_missing_drafter_dir(tmp_path):
    with pytest.raises(DrafterCheckpointError, match="does not exist"):
        validate_settings(spec(tmp_path / "nowhere"), H, V)
    with pytest.raises(DrafterCheckpointError, match="config.json is missing"):
        validate_settings(spec(tmp_path), H, V)  # a directory, but not a drafter
    with pytest.raises(ReDrafterConfigError, match=r"\['model'\] must be the drafter directory"):
        validate_settings({"method": "redrafter"}, H, V)


def test_drafter_target_mismatch_names_both_shapes(drafter_dir):
    with pytest.raises(DrafterMismatchError) as err:
        validate_settings(spec(drafter_dir), target_hidden_size=1024, target_vocab_size=32000)
    message = str(err.value)
    assert f"hidden_size={H} / vocab_size={V}" in message
    assert "hidden_size=1024 / vocab_size=32000" in message


def test_a_target_dir_given_as_drafter_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": H}))
    with pytest.raises(DrafterCheckpointError, match="model_type is 'llama'"):
        validate_settings(spec(tmp_path), H, V)


def test_draft_load_config_is_refused(drafter_dir):
    with pytest.raises(ReDrafterConfigError, match="draft_load_config"):
        rewrite_speculative_config(spec(drafter_dir, draft_load_config={}), H, V)


def test_request_overrides(drafter_dir):
    settings = validate_settings(spec(drafter_dir, beam_width=4, beam_length=4,
                                      context_candidates=0), H, V)  # N = 12
    base = request_settings(None, settings)
    assert (base.beam_width, base.beam_length, base.verification) == (4, 4, "exact")
    mine = request_settings({"redrafter_beam_width": 1, "redrafter_beam_length": 13,
                             "redrafter_verification": "typical", "other": "x"}, settings)
    assert (mine.beam_width, mine.beam_length, mine.verification) == (1, 13, "typical")
    assert mine.own_shape and not base.own_shape  # the beam policy leaves a chosen shape alone
    assert not request_settings({"redrafter_verification": "typical"}, settings).own_shape


def test_context_candidates_settings_and_overrides(drafter_dir):
    settings = validate_settings(spec(drafter_dir, beam_width=2, beam_length=4), H, V)
    assert (settings.context_candidates, settings.lookup_min, settings.lookup_max,
            settings.lookup_tokens) == (1, 2, 5, 5)
    assert settings.num_speculative_tokens == 2 * 3 + 5  # room for the candidates' nodes
    eight = validate_settings(spec(drafter_dir, beam_width=2, beam_length=4, context_candidates=2,
                                   prompt_lookup_tokens=8), H, V)
    assert (eight.lookup_tokens, eight.num_speculative_tokens) == (8, 2 * 3 + 2 * 8)
    four = validate_settings(spec(drafter_dir, context_candidates=4, prompt_lookup_min=3), H, V)
    assert (four.context_candidates, four.lookup_min, four.lookup_max) == (4, 3, 5)
    out = rewrite_speculative_config(spec(drafter_dir, context_candidates=2, prompt_lookup_max=3))
    assert not {"context_candidates", "prompt_lookup_min", "prompt_lookup_max",
                "prompt_lookup_tokens"} & out.keys()
    # rejection verification takes no candidates (no q): 0 by default, refused if asked
    assert validate_settings(spec(drafter_dir, verification="rejection")).context_candidates == 0
    base = request_settings(None, settings)
    assert base.context_candidates == 1 and not base.own_candidates
    mine = request_settings({"redrafter_context_candidates": 3}, settings)
    assert mine.context_candidates == 3 and mine.own_candidates and not mine.own_shape
    assert request_settings({"redrafter_verification": "rejection"},
                            settings).context_candidates == 0  # the documented rule
    with pytest.raises(ReDrafterConfigError, match=r"extra_args\['redrafter_context_candidates'\] "
                                                   r"must be 0 with 'rejection'"):
        request_settings({"redrafter_verification": "rejection",
                          "redrafter_context_candidates": 1}, settings)
    with pytest.raises(ReDrafterConfigError, match=r"\['redrafter_context_candidates'\] must be "
                                                   r"an integer in \[0, 16\], got 17"):
        request_settings({"redrafter_context_candidates": 17}, settings)


@pytest.mark.parametrize(
    "extra, key, allowed",
    [
        ({"redrafter_beam_width": 0}, "redrafter_beam_width", "an integer >= 1, got 0"),
        ({"redrafter_beam_width": "4"}, "redrafter_beam_width", "an integer >= 1, got '4'"),
        ({"redrafter_beam_length": 1}, "redrafter_beam_length", "an integer >= 2, got 1"),
        ({"redrafter_beam_length": 14}, "redrafter_beam_length",
         "[2, num_speculative_tokens + 1 = 13], got 14"),
        ({"redrafter_verification": "fast"}, "redrafter_verification", "got 'fast'"),
    ],
)
def test_bad_request_overrides_name_the_key(drafter_dir, extra, key, allowed):
    settings = validate_settings(spec(drafter_dir, beam_width=4, beam_length=4,
                                      context_candidates=0), H, V)
    with pytest.raises(ReDrafterConfigError) as err:
        request_settings(extra, settings)
    assert f"extra_args['{key}']" in str(err.value)
    assert allowed in str(err.value)


def test_not_a_redrafter_extra_config():
    assert settings_from_extra_config({}) is None
    assert settings_from_extra_config(None) is None
