"""The training pipeline (vllm_redrafter/train): data formats, labels, training, resume, errors.

Most tests replace vLLM by a stub generator whose "responses" follow a learnable rule, so the
pipeline's mechanics (positions, labels, hidden states, loss, checkpoints) run in seconds; one
slow test builds the quick recipe's data with vLLM itself (one engine start) and trains on it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_redrafter.drafter import DrafterConfig, DrafterMismatchError, RecurrentDrafter
from vllm_redrafter.train.data import (DatasetError, Example, read_dataset, render_chat,
                                       tokenize_example)
from vllm_redrafter.train.distill import BUILTIN, DataSpec, build_data
from vllm_redrafter.train.generate import GenRequest
from vllm_redrafter.train.pipeline import OutputDirError, run_training
from vllm_redrafter.train.recipes import get_recipe, with_overrides
from vllm_redrafter.train.vocab import coverage, select_draft_vocab, target_to_draft_map

T = 5
RESPONSE = 24
BASE = 1000  # stub responses count up from BASE + (prompt length % 40): "next = previous + 1"


def stub_generate(requests: list[GenRequest], name: str) -> list[list[int]]:
    """A deterministic stand-in for vLLM: a counting sequence, learnable from g0 alone."""
    out = []
    for r in requests:
        start = BASE + len(r.prompt_token_ids) % 40
        out.append([start + i for i in range(r.max_tokens)])
    return out


def never_generate(requests, name):
    raise AssertionError("generation must not start for bad input")


@pytest.fixture(scope="module")
def tokenizer(target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "prompts.jsonl"
    questions = ["Say hi.", "Name a colour.", "What is two plus two?", "Write one word.",
                 "Count to three.", "Name a fruit, please.", "Tell me a fact.", "Give a number."]
    path.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    return path


def small_recipe(dataset: Path, **train):
    recipe = get_recipe("quick")
    return with_overrides(
        recipe,
        data=dict(dataset=str(dataset), response_tokens=RESPONSE, max_len=128, heldout_fraction=0.25),
        drafter=dict(draft_vocab_size=256),
        train={"batch_size": 32, "lr": 3e-3, "warmup_steps": 2, **train},
    )


@pytest.fixture(scope="module")
def shared_data_dir(tmp_path_factory, prompts_file, target_dir) -> Path:
    data_dir = tmp_path_factory.mktemp("data")
    build_data(small_recipe(prompts_file).data, target_dir, data_dir, generator=stub_generate)
    return data_dir


@pytest.fixture(scope="module")
def trained(tmp_path_factory, prompts_file, target_dir, shared_data_dir):
    out = tmp_path_factory.mktemp("run") / "drafter"
    record = run_training(small_recipe(prompts_file, max_steps=30, save_every=10), target_dir, out,
                          data_dir=shared_data_dir, generator=never_generate)
    return out, record


# -- data formats ----------------------------------------------------------------------------------


def test_reads_every_format(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"prompt": "a question"}, {"text": "some text"}, {"input_ids": [1, 2, 3]},
    ]
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    kinds = [ex.kind for ex in read_dataset(jsonl)]
    assert kinds == ["chat", "chat", "chat", "text", "tokens"]
    sharegpt = read_dataset(jsonl)[1]
    assert sharegpt.messages == ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"})
    as_json = tmp_path / "d.json"
    as_json.write_text(json.dumps(rows))
    assert [ex.kind for ex in read_dataset(as_json)] == kinds
    text = tmp_path / "d.txt"
    text.write_text("First paragraph.\n\nSecond one.\n")
    assert [ex.text for ex in read_dataset(text)] == ["First paragraph.\n\nSecond one."]


def test_chat_training_positions_are_the_assistant_tokens(tokenizer):
    ex = Example("x:1", messages=({"role": "user", "content": "hi"},
                                  {"role": "assistant", "content": "hello there"}))
    tok = tokenize_example(ex, tokenizer, tokenizer.vocab_size, max_len=512)
    next_tokens = [tok.input_ids[t + 1] for t, m in enumerate(tok.train_mask) if m]
    assert tokenizer.decode(next_tokens).startswith("hello there<|im_end|>")
    prompt_len = len(render_chat(tokenizer, ex.messages[:1], "x", add_generation_prompt=True))
    assert tok.train_mask.index(True) == prompt_len - 1  # h at the generation prompt's end


# -- labels ------------------------------------------------------------------------------------------


def test_self_labels_are_the_responses_next_tokens(shared_data_dir):
    from vllm_redrafter.train.distill import load_data

    data = load_data(shared_data_dir)
    # stub responses count up by one: g0 = x, labels = x+1 .. x+T, -1 past the response's end
    first = data.labels[:, 0]
    assert torch.equal(first[first >= 0], data.g0[first >= 0] + 1)
    valid = data.labels >= 0
    steps = data.labels[:, 1:] - data.labels[:, :-1]
    assert bool((steps[valid[:, 1:]] == 1).all())
    assert data.num_positions == 8 * RESPONSE  # every response position
    assert int(valid.sum()) == 8 * sum(min(T, RESPONSE - 1 - j) for j in range(RESPONSE))
    assert 0 < int(data.heldout.sum()) < data.num_positions
    assert data.h.shape == (data.num_positions, 576)


def test_distill_and_ground_truth_labels(tmp_path, target_dir, tokenizer):
    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"input_ids": list(range(300, 320))}) + "\n"
                    + json.dumps({"input_ids": list(range(500, 512))}) + "\n")
    seen: list[GenRequest] = []

    def continuation(requests, name):
        seen.extend(requests)
        return [[r.prompt_token_ids[-1] + 7 + i for i in range(r.max_tokens)] for r in requests]

    spec = DataSpec(dataset=str(text), labels="distill", position_stride=3, heldout_fraction=0.0)
    data = build_data(spec, target_dir, tmp_path / "distill", generator=continuation)
    assert all(r.max_tokens == T + 1 for r in seen)
    last = torch.tensor([r.prompt_token_ids[-1] for r in seen])  # the token at t
    assert torch.equal(data.g0, last + 7)
    assert torch.equal(data.labels, last[:, None] + 8 + torch.arange(T))
    assert [len(r.prompt_token_ids) for r in seen[:3]] == [1, 4, 7]  # every 3rd position

    gt = build_data(replace(spec, labels="ground-truth", position_stride=1), target_dir,
                    tmp_path / "gt", generator=never_generate)
    assert torch.equal(gt.g0[:3], torch.tensor([301, 302, 303]))
    assert gt.labels[0].tolist() == [302, 303, 304, 305, 306]
    assert gt.labels[-1].tolist() == [-1] * T  # position 10 of the second text: 511 is its last token


# -- training ----------------------------------------------------------------------------------------


def test_loss_falls_and_drafter_loads_in_apple_layout(trained, target_dir):
    out, record = trained
    losses = record["train_losses_every_10"]
    assert record["finished"] and record["steps_done"] == 30
    assert record["final_train_loss"] < 0.5 * losses[0], losses
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == {"rnn_w.weight", "rnn_u.weight", "rnn_u.bias", "lm_head.0.linear.weight",
                            "lm_head.0.linear.bias", "lm_head.1.weight", "draft_vocab_ids"}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "recurrent_drafting_drafter" and config["draft_vocab_size"] == 256
    drafter = RecurrentDrafter.from_pretrained(out, target_hidden_size=576, target_vocab_size=49152)
    assert tensors["lm_head.1.weight"].shape == (256, 2 * 576)
    # K = 256 holds every label token of the training split (the stub uses few distinct tokens)
    assert record["draft_vocab_coverage"]["train_labels"] == 1.0
    assert torch.equal(drafter.draft_vocab_ids, tensors["draft_vocab_ids"])
    with pytest.raises(DrafterMismatchError, match="576"):
        RecurrentDrafter.from_pretrained(out, target_hidden_size=1024, target_vocab_size=49152)
    result = json.loads((out / "eval.json").read_text())
    assert len(result["top1"]) == T and result["positions"] > 0
    assert result["top1"][0] > 0.5  # "next = previous + 1" is learnt in 30 steps


def test_killed_run_resumes_to_the_same_weights(tmp_path, prompts_file, target_dir, shared_data_dir):
    recipe = small_recipe(prompts_file, max_steps=12, save_every=4)
    whole = tmp_path / "whole"
    run_training(recipe, target_dir, whole, data_dir=shared_data_dir, generator=never_generate)
    split = tmp_path / "split"
    first = run_training(recipe, target_dir, split, data_dir=shared_data_dir,
                         generator=never_generate, stop_after_steps=7)
    assert not first["finished"] and first["steps_done"] == 7
    assert not (split / "model.safetensors").exists()
    second = run_training(recipe, target_dir, split, data_dir=shared_data_dir, generator=never_generate)
    assert second["finished"] and second["steps_done"] == 12
    a, b = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_resume_refuses_other_settings(tmp_path, prompts_file, target_dir, shared_data_dir):
    out = tmp_path / "run"
    run_training(small_recipe(prompts_file, max_steps=6), target_dir, out,
                 data_dir=shared_data_dir, generator=never_generate, stop_after_steps=2)
    with pytest.raises(OutputDirError, match="other settings"):
        run_training(small_recipe(prompts_file, max_steps=6, lr=1e-2), target_dir, out,
                     data_dir=shared_data_dir, generator=never_generate)


def test_a_recipe_with_two_datasets_trains_on_both(tmp_path, prompts_file, target_dir, shared_data_dir):
    """Each dataset is built in its own data/part<i> (one built before is reused by linking it
    there); the drafter trains on all their positions, each part keeping its held-out split."""
    from vllm_redrafter.train.distill import concat_data, load_data

    base = small_recipe(prompts_file, max_steps=4)
    recipe = replace(base, extra_data=(replace(base.data, response_tokens=RESPONSE // 2),))
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "part1").symlink_to(shared_data_dir)
    record = run_training(recipe, target_dir, tmp_path / "out", data_dir=data_dir,
                          generator=stub_generate)
    one, two = load_data(shared_data_dir), load_data(data_dir / "part2")
    assert two.num_positions == 8 * (RESPONSE // 2)
    assert record["finished"] and record["data"]["num_positions"] == one.num_positions + two.num_positions
    assert [p["fingerprint"] for p in record["data"]["parts"]] == [one.meta["fingerprint"],
                                                                   two.meta["fingerprint"]]
    both = concat_data([one, two])
    n = one.num_positions
    assert (both.h[n:] == two.h).all() and (both.h[:n] == one.h).all()
    assert torch.equal(both.sequence[n:], two.sequence + 8) and torch.equal(both.heldout[n:], two.heldout)
    assert torch.equal(both.token_counts, one.token_counts + two.token_counts)
    # settings apply to every dataset; a dataset given, or --builtin counts, replace them all
    assert all(d.response_tokens == 7
               for d in with_overrides(recipe, data=dict(response_tokens=7)).datasets)
    assert with_overrides(recipe, data=dict(dataset="x.jsonl")).extra_data == ()


def test_switching_between_one_and_several_datasets_keeps_the_wanted_build(
        tmp_path, prompts_file, target_dir, shared_data_dir):
    """A run's own data cache in the other layout: the build this recipe wants moves into place
    (one build -> data/part1, and back), nothing is generated again, the rest is cleared."""
    import shutil

    one = small_recipe(prompts_file, max_steps=2)
    two = replace(one, extra_data=(replace(one.data, response_tokens=RESPONSE // 2),))
    out = tmp_path / "run"
    data = out / "work" / "data"
    shutil.copytree(shared_data_dir, data)  # as a one-dataset run left it
    built = (data / "h.f16").stat().st_mtime_ns
    run_training(two, target_dir, out, generator=stub_generate)  # generates part 2 only
    assert (data / "part1" / "h.f16").stat().st_mtime_ns == built
    assert not (data / "h.f16").exists() and (data / "part2" / "h.f16").is_file()
    run_training(one, target_dir, out, overwrite=True, generator=never_generate)
    assert (data / "h.f16").stat().st_mtime_ns == built and not list(data.glob("part*"))


# -- nothing trained is overwritten; bad input ---------------------------------------------------------


def test_refuses_to_overwrite_a_trained_drafter(trained, prompts_file, target_dir, shared_data_dir):
    out, _ = trained
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(OutputDirError, match="already holds a trained drafter.*--overwrite"):
        run_training(small_recipe(prompts_file, max_steps=30, save_every=10), target_dir, out,
                     data_dir=shared_data_dir, generator=never_generate)
    assert (out / "model.safetensors").read_bytes() == before


def test_overwrite_replaces_a_trained_drafter(tmp_path, prompts_file, target_dir, shared_data_dir):
    out = tmp_path / "d"
    run_training(small_recipe(prompts_file, max_steps=2), target_dir, out,
                 data_dir=shared_data_dir, generator=never_generate)
    record = run_training(small_recipe(prompts_file, max_steps=3), target_dir, out, overwrite=True,
                          data_dir=shared_data_dir, generator=never_generate)
    assert record["steps_done"] == 3
    assert json.loads((out / "training.json").read_text())["steps_done"] == 3


def test_fine_tuning_starts_from_the_given_drafter(trained, tmp_path, prompts_file, target_dir,
                                                    shared_data_dir):
    """init_from: the run starts from a trained drafter's weights (its first loss is the trained
    drafter's last, far below a fresh start's) and keeps its shape and draft vocabulary, whatever
    the recipe's drafter says; the fingerprint follows the starting weights; a run never writes
    over the drafter it starts from."""
    from vllm_redrafter.train.pipeline import run_fingerprint

    start, _ = trained
    recipe = small_recipe(prompts_file, max_steps=3)
    tuned = with_overrides(recipe, drafter=dict(init_from=str(start), draft_vocab_size=64,
                                                num_draft_layers=3))
    fresh = run_training(recipe, target_dir, tmp_path / "fresh", data_dir=shared_data_dir,
                         generator=never_generate)
    record = run_training(tuned, target_dir, tmp_path / "tuned", data_dir=shared_data_dir,
                          generator=never_generate)
    assert record["train_losses_every_10"][0] < 0.5 * fresh["train_losses_every_10"][0]
    before = RecurrentDrafter.from_pretrained(start, target_hidden_size=576)
    after = RecurrentDrafter.from_pretrained(tmp_path / "tuned", target_hidden_size=576)
    assert after.config == before.config and torch.equal(after.draft_vocab_ids, before.draft_vocab_ids)
    assert not torch.equal(after.lm_head[-1].weight, before.lm_head[-1].weight)  # it trained
    other = with_overrides(recipe, drafter=dict(init_from=str(tmp_path / "fresh")))
    assert run_fingerprint(other, target_dir) != record["fingerprint"] != fresh["fingerprint"]
    with pytest.raises(OutputDirError, match="replace the drafter it starts from"):
        run_training(tuned, target_dir, start, overwrite=True, generator=never_generate)
    assert (start / "model.safetensors").is_file()
    with pytest.raises(FileNotFoundError, match="holds no trained drafter"):
        run_training(with_overrides(recipe, drafter=dict(init_from=str(tmp_path))), target_dir,
                     tmp_path / "x", generator=never_generate)


def test_fine_tuning_can_swap_draft_tokens(trained, tmp_path, prompts_file, target_dir, tokenizer,
                                            shared_data_dir):
    """draft_vocab_swap m: the fine-tuned head scores m other tokens (the EOS stays), every kept
    token keeps its trained row (lr 0 here, so rows are as the swap left them), the new rows are
    the ridge map of the target's rows; the fingerprint says so; without init_from it is refused."""
    from vllm_redrafter.train.pipeline import run_fingerprint

    start, _ = trained
    frozen = with_overrides(small_recipe(prompts_file, max_steps=1, lr=0.0),
                            drafter=dict(init_from=str(start)))
    swapped = with_overrides(frozen, drafter=dict(draft_vocab_swap=32))
    run_training(swapped, target_dir, tmp_path / "s", data_dir=shared_data_dir,
                 generator=never_generate)
    before = RecurrentDrafter.from_pretrained(start, target_hidden_size=576)
    after = RecurrentDrafter.from_pretrained(tmp_path / "s", target_hidden_size=576)
    old, new = before.draft_vocab_ids, after.draft_vocab_ids
    kept = torch.isin(new, old)
    assert int((~kept).sum()) == 32 and new.numel() == old.numel()
    assert tokenizer.eos_token_id in new.tolist()
    old_rows = dict(zip(old.tolist(), before.lm_head[-1].weight.float()))
    for token, row in zip(new[kept].tolist(), after.lm_head[-1].weight.float()[kept]):
        torch.testing.assert_close(row, old_rows[token], atol=1e-3, rtol=1e-3)  # float16 saved
    assert after.lm_head[-1].weight[~kept].abs().sum() > 0
    assert run_fingerprint(swapped, target_dir) != run_fingerprint(frozen, target_dir)
    with pytest.raises(ValueError, match="only with init_from"):
        with_overrides(small_recipe(prompts_file), drafter=dict(draft_vocab_swap=4))


def test_swap_draft_vocab_takes_the_most_counted_outside_in():
    from vllm_redrafter.train.vocab import carry_head_rows, swap_draft_vocab

    freq = torch.tensor([9., 0., 1., 8., 7., 0., 5.])
    assert swap_draft_vocab(torch.tensor([0, 1, 2]), freq, 2).tolist() == [0, 3, 4]
    assert swap_draft_vocab(torch.tensor([0, 1, 2]), freq, 2, always=[1]).tolist() == [1, 3, 4]
    assert swap_draft_vocab(torch.tensor([0, 1, 2]), freq, 0).tolist() == [0, 1, 2]
    with pytest.raises(ValueError, match="must be in"):
        swap_draft_vocab(torch.tensor([0, 1, 2]), freq, 4)
    rows = carry_head_rows(torch.tensor([0, 1, 2]), torch.tensor([[1.], [2.], [3.]]),
                           torch.tensor([0, 2, 6]), torch.tensor([[7.], [8.], [9.]]))
    assert rows.tolist() == [[1.], [3.], [9.]]


def test_a_recipe_fine_tuning_another_recipes_drafter_trains_both(tmp_path, prompts_file,
                                                                  target_dir, monkeypatch):
    """init_from="recipe:NAME": one command trains the base recipe's drafter first (in
    OUTPUT/work/base), then fine-tunes it; a rerun finds the base finished and reuses it; the
    fingerprint follows the base recipe's settings."""
    from vllm_redrafter.train import recipes
    from vllm_redrafter.train.pipeline import run_fingerprint

    base = replace(small_recipe(prompts_file, max_steps=20), name="test-base")
    monkeypatch.setitem(recipes.RECIPES, "test-base", base)
    tuned = with_overrides(small_recipe(prompts_file, max_steps=2),
                           drafter=dict(init_from="recipe:test-base"))
    out = tmp_path / "out"
    record = run_training(tuned, target_dir, out, generator=stub_generate)
    base_record = json.loads((out / "work" / "base" / "training.json").read_text())
    assert base_record["finished"] and base_record["steps_done"] == 20
    assert record["train_losses_every_10"][0] < 0.7 * base_record["train_losses_every_10"][0]
    built = (out / "work" / "base" / "model.safetensors").stat().st_mtime_ns
    again = run_training(tuned, target_dir, out, overwrite=True, generator=never_generate)
    assert (out / "work" / "base" / "model.safetensors").stat().st_mtime_ns == built
    assert again["fingerprint"] == record["fingerprint"]
    monkeypatch.setitem(recipes.RECIPES, "test-base", with_overrides(base, train=dict(lr=1e-2)))
    assert run_fingerprint(tuned, target_dir) != record["fingerprint"]


def test_refuses_another_models_drafter(tmp_path, prompts_file, target_dir):
    out = tmp_path / "other"
    RecurrentDrafter(DrafterConfig(vocab_size=1000, hidden_size=64, exit_dim=128,
                                   num_draft_layers=1)).save_pretrained(out)
    with pytest.raises(DrafterMismatchError, match=r"hidden_size=64.*vocab_size=1000.*hidden_size=576"):
        run_training(small_recipe(prompts_file), target_dir, out, generator=never_generate)
    with pytest.raises(OutputDirError, match="not a drafter"):
        run_training(small_recipe(prompts_file), target_dir, target_dir, generator=never_generate)


BAD_DATASETS = {
    "empty.jsonl": ("", "no examples"),
    "blank.txt": ("\n\n  \n", "no examples"),
    "broken.jsonl": ('{"prompt": "ok"}\n{"prompt": \n', r"broken.jsonl:2: not valid JSON"),
    "nokey.jsonl": ('{"question": "hi"}\n', "exactly one of the keys"),
    "turns.jsonl": ('{"messages": [{"role": "user", "content": ["a", "list"]}]}\n',
                    "turn 0 content must be a string.*cannot render"),
    "role.jsonl": ('{"messages": [{"role": "tool", "content": "x"}]}\n', "role 'tool'"),
    "sharegpt.jsonl": ('{"conversations": [{"from": "alien", "value": "x"}]}\n', "from 'alien'"),
    "tokens.jsonl": ('{"input_ids": [5, 49152, 7]}\n', r"outside the target's vocabulary \[0, 49152\)"),
    "text_for_self.jsonl": ('{"text": "plain"}\n', "labels 'self' need prompts"),
}


@pytest.mark.parametrize("name", sorted(BAD_DATASETS))
def test_bad_dataset_gives_one_clear_error(tmp_path, target_dir, name):
    content, message = BAD_DATASETS[name]
    path = tmp_path / name
    path.write_text(content)
    labels = "distill" if name == "tokens.jsonl" else "self"
    recipe = with_overrides(small_recipe(path), data=dict(labels=labels))
    with pytest.raises(DatasetError, match=message):
        run_training(recipe, target_dir, tmp_path / "out", generator=never_generate)


def test_chat_template_failure_is_a_dataset_error(tokenizer):
    import copy

    strict = copy.copy(tokenizer)
    strict.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(DatasetError, match="x.jsonl:3: the target's chat template cannot render.*alternate"):
        render_chat(strict, [{"role": "user", "content": "a"}], "x.jsonl:3", True)


def test_data_dir_of_other_settings_or_foreign_files_is_never_wiped(tmp_path, prompts_file,
                                                                     target_dir, shared_data_dir):
    other = replace(small_recipe(prompts_file).data, response_tokens=RESPONSE + 1)
    with pytest.raises(ValueError, match="other settings"):
        build_data(other, target_dir, shared_data_dir, generator=never_generate)
    assert (shared_data_dir / "h.f16").is_file()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not made by vllm-redrafter"):
        build_data(other, target_dir, foreign, generator=never_generate)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_missing_dataset_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_dataset(tmp_path / "nope.jsonl")


# -- the built-in prompts ----------------------------------------------------------------------------


def test_builtin_prompts_are_reproducible_varied_and_never_the_evaluation_set(mt_bench_questions):
    from vllm_redrafter.train import prompts as builtin
    from vllm_redrafter.train.detailed_prompts import detailed_prompts
    from vllm_redrafter.train.specific_prompts import specific_prompts
    from vllm_redrafter.train.written_prompts import (STOCK_FILES, source_name, written_prompts,
                                                      written_stock)

    sources = {"templated": builtin.templated_prompts, "text": builtin.text_prompts,
               "documents": builtin.document_prompts, "constrained": builtin.constrained_prompts,
               "detailed": detailed_prompts, "specific": specific_prompts,
               "written": written_prompts,
               **{source_name(n): partial(written_prompts, stock=n) for n in STOCK_FILES if n > 1}}
    made = {name: make(40, 0) for name, make in sources.items()}
    assert made == {name: make(40, 0) for name, make in sources.items()}  # the seed decides
    assert made["documents"] != builtin.document_prompts(40, 1)
    for many in (detailed_prompts, specific_prompts):  # distinct however many are asked for
        assert len(set(many(2000, 0))) == 2000
    for name, prompts in made.items():
        assert len(prompts) == 40 and len(set(prompts)) >= 36, name

    def words(text: str) -> list[str]:
        return text.lower().split()

    windows = {" ".join(words(q)[i:i + 6]) for q in mt_bench_questions
               for i in range(max(1, len(words(q)) - 5))}
    windows.discard("take on the role of a")  # a phrase, not a question: the roles differ
    made["all written"] = [prompt for stock in STOCK_FILES for _, prompt in written_stock(stock)]
    texts = {" ".join(words(p)) for prompts in made.values() for p in prompts}
    short = [w for w in windows if len(w.split()) < 6]  # a question under 6 words: as a substring
    leaked = [w for text in texts for w in short if w in text] + [
        w for text in texts for w in windows.intersection(
            " ".join(ws[i:i + 6]) for ws in [text.split()] for i in range(len(ws) - 5))]
    assert not leaked, f"built-in prompts repeat MT-Bench questions: {leaked[:3]}"


def test_written_prompts_take_the_kinds_in_turn_and_refuse_more_than_the_stock():
    from vllm_redrafter.train.written_prompts import STOCK_FILES, written_prompts, written_stock

    seen: set[str] = set()
    for stock in sorted(STOCK_FILES):
        requests = written_stock(stock)
        kinds = {prompt: kind for kind, prompt in requests}
        assert len(kinds) == len(requests) and not seen & set(kinds)  # no request twice
        seen |= set(kinds)
        n_kinds = len({kind for kind, _ in requests})
        assert n_kinds == {7: 7, 8: 6, 9: 4}.get(stock, 8)  # MT-Bench's eight; 7-9: other kinds
        every = written_prompts(len(requests), seed=3, stock=stock)
        assert sorted(every) == sorted(kinds)
        assert every != written_prompts(len(requests), seed=4, stock=stock)
        rounds = min(Counter(kinds.values()).values())
        for r in range(rounds):  # one of each kind before any kind's next
            assert len({kinds[p] for p in every[n_kinds * r: n_kinds * (r + 1)]}) == n_kinds
        with pytest.raises(ValueError, match=f"stock {stock} holds {len(requests)} "):
            written_prompts(len(requests) + 1, seed=0, stock=stock)
    with pytest.raises(ValueError, match=f"no written stock {max(STOCK_FILES) + 1}"):
        written_prompts(1, seed=0, stock=max(STOCK_FILES) + 1)
    with pytest.raises(ValueError, match="written_2=-1"):
        written_prompts(-1, seed=0, stock=2)


# A dataset's fingerprint counts the written requests it takes, not their text: a stock that
# changed would leave cached builds and the shipped drafter's record looking current.
WRITTEN_STOCK_SHA256 = {
    "written_prompts.jsonl": "45fd5437229ab368052d66ec93b2292a08effdb63cfedbb599bb29c1b634ec45",
    "written_prompts_2.jsonl": "d26b570f08472806ca967ef2f281fe3789fa66f98687e8d718da1532da7dbdfb",
    "written_prompts_3.jsonl": "bf9dfe14949e1eab032fdd98077c36612d86287dc3e560d3590952e9dd607c72",
    "written_prompts_4.jsonl": "2e521425d91ba206048e5ef109389915b0034b128cc1ec9f1cfb87fa7f012ae8",
    "written_prompts_5.jsonl": "05fd6118153b923d6c50de82014bc97d818c04be1d20cc422c803a8fdb120fc0",
    "written_prompts_6.jsonl": "916166d1c54d8535c64ccc49571f17153f0bad2cf54382d084ea9a687db2c4f9",
    "written_prompts_7.jsonl": "c9f02484883af408f9c8ac4212eb0e993d003974f5186ef914a708267ac2f29d",
    "written_prompts_8.jsonl": "5c2c004a34af2d7f6bc56d8b27e2aba91e321020fabdfa73e26e63aca67275c7",
    "written_prompts_9.jsonl": "846294960e5595ae29533f119247ff238270e9c08eded00af1eddce75171c7db",
}


def test_written_stocks_are_as_they_were_trained_on():
    from vllm_redrafter.train.written_prompts import STOCK_FILES

    assert {f.name for f in STOCK_FILES.values()} == set(WRITTEN_STOCK_SHA256)
    for file in STOCK_FILES.values():
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        assert digest == WRITTEN_STOCK_SHA256[file.name], f"{file.name} changed: add a new stock"


# Two requests of stock 3 (a reasoning and a math helper's) ask the same chessboard question;
# the stock trained the shipped drafter, so the pair stays and no other may join it.
KNOWN_NEAR_DUPLICATES = {("How many squares are on a standard chessboard, counting ever",
                          "How many squares are on a standard chessboard if you count e")}


def test_no_two_written_requests_are_near_duplicates():
    """No two requests in all the stocks share more than 60% of their word sets (Jaccard), the
    rule each new stock was assembled by (requests of 6 words or more: short ones may share
    most of their few words). Every pair, as sparse word-count products in blocks of rows."""
    import re

    import numpy as np
    from scipy.sparse import csr_matrix

    from vllm_redrafter.train.written_prompts import STOCK_FILES, written_stock

    prompts = [p for stock in STOCK_FILES for _, p in written_stock(stock)]
    sets = [frozenset(re.findall(r"[a-z0-9']+", p.lower())) for p in prompts]
    vocab = {w: k for k, w in enumerate({w for s in sets for w in s})}
    rows = [i for i, s in enumerate(sets) for _ in s]
    words = csr_matrix((np.ones(len(rows), np.float32), (rows, [vocab[w] for s in sets for w in s])),
                       shape=(len(sets), len(vocab)))
    size = np.array([len(s) for s in sets], dtype=np.float32)
    near = set()
    for start in range(0, len(sets), 2048):
        shared = (words[start:start + 2048] @ words.T).toarray()
        union = size[start:start + 2048, None] + size[None, :] - shared
        for i, j in zip(*np.nonzero(shared > 0.6 * union)):
            i += start
            if j < i and min(size[i], size[j]) >= 6:
                near.add((prompts[j][:60], prompts[i][:60]))
    assert near == KNOWN_NEAR_DUPLICATES


def test_recorded_datasets_keep_their_fingerprints_as_sources_are_added(target_dir):
    """A built-in source at 0 is left out of a dataset's fingerprint, so the shipped drafter's
    datasets, recorded before later sources (written_2, written_3, ...) existed, stay current."""
    import vllm_redrafter
    from vllm_redrafter.train.distill import BuiltinSpec, GenSettings, data_fingerprint

    record = json.loads((Path(vllm_redrafter.__file__).parent / "default_drafter" /
                         "training.json").read_text())
    for part in record["data"]["parts"]:
        spec = {**part["spec"], "builtin": BuiltinSpec(**part["spec"]["builtin"]),
                "gen": GenSettings(**part["spec"]["gen"])}
        assert data_fingerprint(DataSpec(**spec), target_dir) == part["fingerprint"]


def test_fingerprints_do_not_depend_on_the_transformers_version(target_dir, tmp_path):
    """The target saved by another transformers version (v4's names: torch_dtype, a top-level
    rope_theta, another transformers_version) has the same data fingerprint and identity; another
    architecture or other tensors do not."""
    from vllm_redrafter.train.distill import data_fingerprint
    from vllm_redrafter.train.pipeline import target_identity

    def saved_as(name: str, edit) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        for file in target_dir.iterdir():
            if file.name != "config.json":
                (folder / file.name).symlink_to(file)
        config = json.loads((target_dir / "config.json").read_text())
        edit(config)
        (folder / "config.json").write_text(json.dumps(config, indent=4))
        return folder

    def as_v4(config: dict) -> None:
        config["torch_dtype"] = config.pop("dtype", None) or config.pop("torch_dtype")
        rope = config.pop("rope_parameters", None) or {"rope_theta": config.pop("rope_theta")}
        config["rope_theta"] = rope["rope_theta"]
        config["transformers_version"] = "4.57.1"

    spec = DataSpec(dataset=BUILTIN)
    v4 = saved_as("v4", as_v4)
    assert data_fingerprint(spec, v4) == data_fingerprint(spec, target_dir)
    assert target_identity(v4)["config_sha256"] == target_identity(target_dir)["config_sha256"]
    wider = saved_as("wider", lambda c: c.update(intermediate_size=2048))
    assert data_fingerprint(spec, wider) != data_fingerprint(spec, target_dir)
    other_tensors = saved_as("other_tensors", lambda c: None)
    (other_tensors / "model.safetensors").unlink()
    save_file({"w": torch.zeros(2)}, other_tensors / "model.safetensors")
    assert data_fingerprint(spec, other_tensors) != data_fingerprint(spec, target_dir)


def test_shipped_drafter_fits_its_budget_and_is_the_shipped_recipes(target_dir):
    """The package's drafter: at most 20 MB, and made by ``train --recipe shipped`` as it stands
    (its recorded run fingerprint is the recipe's: data, drafter shape and training settings, and
    those of the base recipe it fine-tunes)."""
    import vllm_redrafter
    from vllm_redrafter.train.pipeline import run_fingerprint

    shipped = Path(vllm_redrafter.__file__).parent / "default_drafter"
    assert (shipped / "model.safetensors").stat().st_size <= 20_000_000
    record = json.loads((shipped / "training.json").read_text())
    assert record["recipe"] == "shipped" and record["finished"]
    assert record["fingerprint"] == run_fingerprint(get_recipe("shipped"), target_dir)


# -- the draft vocabulary ------------------------------------------------------------------------------


def test_select_draft_vocab_most_frequent_ties_to_smaller_id():
    freq = torch.tensor([3.0, 7.0, 3.0, 0.0, 7.0, 1.0])
    assert select_draft_vocab(freq, 3).tolist() == [0, 1, 4]
    assert select_draft_vocab(freq, 3, always=[3]).tolist() == [1, 3, 4]
    with pytest.raises(ValueError, match="K=7"):
        select_draft_vocab(freq, 7)
    ids = torch.tensor([2, 5])
    assert target_to_draft_map(ids, 6).tolist() == [-100, -100, 0, -100, -100, 1]
    assert coverage(ids, torch.tensor([2, 5, 1, -1])) == pytest.approx(2 / 3)


def test_head_init_from_the_target_copies_its_lm_head_rows(target_dir):
    from vllm_redrafter.train.pipeline import build_drafter, load_target_embedding
    from vllm_redrafter.train.recipes import DrafterSpec

    embedding = load_target_embedding(target_dir)  # tied: the target's LM head
    ids = torch.tensor([2, 17, 300, 49151])
    drafter = build_drafter(DrafterSpec(draft_vocab_size=4, head_init="target"), target_dir,
                            embedding, ids, seed=0)
    head = drafter.lm_head[-1].weight  # [K, 2H]: h-half first
    assert torch.equal(head[:, :576], embedding.weight[ids])
    assert torch.equal(drafter.draft_vocab_ids, ids)
    again = build_drafter(DrafterSpec(draft_vocab_size=4), target_dir, embedding, ids, seed=0)
    assert not torch.equal(again.lm_head[-1].weight[:, :576], embedding.weight[ids])
    assert torch.equal(again.rnn_w.weight, drafter.rnn_w.weight)  # same seed, same init


def test_cli_parser_overrides_the_recipe():
    import argparse

    from vllm_redrafter.train.cli import add_train_parser, recipe_from_args

    parser = argparse.ArgumentParser()
    add_train_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--recipe", "quick", "--output-dir", "x",
                              "--draft-vocab-size", "full", "--lr", "0.01", "--labels", "distill"])
    recipe = recipe_from_args(args)
    assert recipe.drafter.draft_vocab_size is None and recipe.train.lr == 0.01
    assert recipe.data.labels == "distill" and recipe.train.max_steps == get_recipe("quick").train.max_steps
    assert recipe.data.builtin == get_recipe("quick").data.builtin
    args = parser.parse_args(["train", "--output-dir", "x", "--builtin", "templated=150,documents=90"])
    builtin = recipe_from_args(args).data.builtin
    default_text = get_recipe("default").data.builtin.text
    assert (builtin.templated, builtin.documents, builtin.text) == (150, 90, default_text)
    assert recipe_from_args(args).extra_data == ()  # one built-in dataset with these counts
    with pytest.raises(SystemExit):  # argparse: one error line naming the bad source
        parser.parse_args(["train", "--output-dir", "x", "--builtin", "poems=3"])


# -- with vLLM (one engine start) ----------------------------------------------------------------------


@pytest.mark.slow
def test_quick_data_with_vllm_is_the_targets_own_greedy_text(tmp_path, prompts_file, target_dir):
    """vLLM answers 8 prompts; at every response position the frozen target's argmax of h_t is
    g0 (vLLM greedy == the transformers target), and a drafter learns something from it."""
    recipe = with_overrides(small_recipe(prompts_file, max_steps=20),
                            data=dict(response_tokens=32))
    record = run_training(recipe, target_dir, tmp_path / "out")
    assert record["data"]["g0_agreement_first_batches"] >= 0.97
    losses = record["train_losses_every_10"]
    assert record["final_train_loss"] < losses[0]
    RecurrentDrafter.from_pretrained(tmp_path / "out", target_hidden_size=576, target_vocab_size=49152)


# -- soft labels -------------------------------------------------------------------------------------


def test_soft_labels_are_the_targets_own_logits_at_each_label(shared_data_dir, target_dir):
    """Each label's soft target is the target model's distribution where it produced that label
    (checked against a transformers forward of the target), and every in-response label has one."""
    from transformers import AutoModelForCausalLM

    from vllm_redrafter.train.distill import load_data
    from vllm_redrafter.train.soft_labels import soft_label_index, teacher_logits

    data = load_data(shared_data_dir)
    index = soft_label_index(data)
    assert torch.equal(index >= 0, data.labels >= 0)  # labels=self: every label has its position
    rows = index[index >= 0]
    assert torch.equal(data.g0[rows], data.labels[data.labels >= 0])
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = model.get_output_embeddings().weight.detach()
    sequences = [json.loads(line) for line in (shared_data_dir / "sequences.jsonl").read_text().splitlines()]
    i, k = int(torch.nonzero(data.sequence == data.sequence[0]).max()) - T, 3  # late in sequence 0
    logits, valid = teacher_logits(data, index[i: i + 1], head)
    assert bool(valid.all())
    t = int(data.t[i]) + k + 1  # label k (from 0) is the token the target produced at t + k + 1
    with torch.no_grad():
        expected = model(torch.tensor([sequences[int(data.sequence[i])][: t + 1]])).logits[0, t]
    torch.testing.assert_close(logits[0, k], expected, atol=0.05, rtol=0.01)  # h stored in fp16


def test_training_with_soft_labels(tmp_path, prompts_file, target_dir, shared_data_dir):
    recipe = small_recipe(prompts_file, max_steps=20, save_every=10, soft_label_weight=0.5)
    record = run_training(recipe, target_dir, tmp_path / "soft", data_dir=shared_data_dir,
                          generator=never_generate)
    losses = record["train_losses_every_10"]
    assert record["finished"] and record["final_train_loss"] < 0.7 * losses[0], losses
    assert record["eval"]["top1"][0] > 0.3


def test_soft_labels_refuse_distill_labels(tmp_path, target_dir):
    """labels=distill continues the target's generation, not the text h was computed on."""
    from vllm_redrafter.train.trainer import TrainConfig

    text = tmp_path / "t.jsonl"
    text.write_text(json.dumps({"input_ids": list(range(300, 340))}) + "\n")

    def continuation(requests, name):
        return [[r.prompt_token_ids[-1] + 7 + i for i in range(r.max_tokens)] for r in requests]

    recipe = with_overrides(get_recipe("quick"),
                            data=dict(dataset=str(text), labels="distill", heldout_fraction=0.0),
                            train=dict(max_steps=2, soft_label_weight=0.5))
    with pytest.raises(ValueError, match="labels=distill"):
        run_training(recipe, target_dir, tmp_path / "out", generator=continuation)
    joined = replace(recipe, data=replace(recipe.data, labels="ground-truth"),
                     extra_data=(recipe.data,))
    with pytest.raises(ValueError, match="labels=distill"):  # in any of several datasets
        run_training(joined, target_dir, tmp_path / "joined", generator=continuation)
    with pytest.raises(ValueError, match="soft_label_weight"):
        TrainConfig(soft_label_weight=1.5)
