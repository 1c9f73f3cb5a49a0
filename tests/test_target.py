"""The embedded target: prepared once, float32, and a real chat model."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_redrafter.cli import main


def test_prepared_target_is_a_float32_llama(target_dir):
    config = json.loads((target_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["dtype"] == "float32"
    assert "quantization_config" not in config


def test_target_answers_the_capital_of_france(target_dir):
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_cli_prepare_target_is_idempotent(target_dir, capsys):
    before = (target_dir / "model.safetensors").stat().st_mtime
    assert main(["prepare-target"]) == 0
    assert capsys.readouterr().out.strip() == str(target_dir)
    assert (target_dir / "model.safetensors").stat().st_mtime == before
