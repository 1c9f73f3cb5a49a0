"""The drafter loads Apple-layout checkpoints exactly, computes its equations, refuses bad input.

The equations are those of docs/design.md, The drafter.

Checkpoints are written BY HAND here from the documented key names (a dict of tensors and a JSON
config), never through save_pretrained, and the golden logits come from a plain-tensor
implementation of the equations on the raw tensors: nothing is shared with the module.
"""

from __future__ import annotations

import doctest
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import vllm_redrafter.drafter as drafter_module
from vllm_redrafter.drafter import (
    DrafterCheckpointError,
    DrafterConfig,
    DrafterMismatchError,
    RecurrentDrafter,
)

H, V, N = 16, 50, 2  # hidden size, target vocabulary, ResBlocks
K = 7  # reduced draft vocabulary
PROJ_EXIT_DIM = 24  # != 2H: the checkpoint carries input_proj


# -- hand-written checkpoints --------------------------------------------------------------------


def apple_config(*, rnn: bool = True, exit_dim: int = 2 * H, draft_vocab: int | None = None):
    """A config.json dict as Apple's code writes it (extra keys included)."""
    config = {
        "architectures": ["Drafter"],
        "model_type": "recurrent_drafting_drafter",
        "vocab_size": V,
        "hidden_size": H,
        "exit_dim": exit_dim,
        "num_draft_layers": N,
        "rnn": rnn,
        "emb_norm": False,
        "torch_dtype": "float32",
        "transformers_version": "4.40.0",
    }
    if draft_vocab is not None:
        config["draft_vocab_size"] = draft_vocab
    return config


def apple_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors under the documented key names (ResBlocks non-zero so they matter)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.3

    hidden, exit_dim = config["hidden_size"], config["exit_dim"]
    out_rows = config.get("draft_vocab_size") or config["vocab_size"]
    tensors = {}
    if config["rnn"]:
        tensors["rnn_w.weight"] = rand(hidden, hidden)
        tensors["rnn_u.weight"] = rand(hidden, hidden)
        tensors["rnn_u.bias"] = rand(hidden)
    if exit_dim != 2 * hidden:
        tensors["input_proj.weight"] = rand(exit_dim, 2 * hidden)
        tensors["input_proj.bias"] = rand(exit_dim)
    for i in range(config["num_draft_layers"]):
        tensors[f"lm_head.{i}.linear.weight"] = rand(exit_dim, exit_dim)
        tensors[f"lm_head.{i}.linear.bias"] = rand(exit_dim)
    tensors[f"lm_head.{config['num_draft_layers']}.weight"] = rand(out_rows, exit_dim)
    if config.get("draft_vocab_size"):
        ids = torch.randperm(config["vocab_size"], generator=gen)[: config["draft_vocab_size"]]
        tensors["draft_vocab_ids"] = ids
    return tensors


def write_checkpoint(directory: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.fixture
def embedding() -> nn.Embedding:
    torch.manual_seed(1)
    return nn.Embedding(V, H)


@pytest.fixture
def apple_dir(tmp_path: Path) -> Path:
    config = apple_config()
    return write_checkpoint(tmp_path / "apple", config, apple_tensors(config))


VARIANTS = [
    pytest.param(rnn, exit_dim, draft_vocab, id=f"rnn={rnn}-exit={exit_dim}-K={draft_vocab}")
    for rnn in (True, False)
    for exit_dim in (2 * H, PROJ_EXIT_DIM)
    for draft_vocab in (None, K)
]


# -- the independent reference (docs/design.md, The drafter, on the raw tensors) ----------------


def reference_logits(
    raw: dict[str, torch.Tensor], config: dict, emb: torch.Tensor, h: torch.Tensor, xs: torch.Tensor
) -> torch.Tensor:
    """logits_t for t = 1..T: h [B, H], xs [B, T] target ids -> [B, T, K]."""
    s = torch.zeros(h.shape[0], config["hidden_size"])
    steps = []
    for t in range(xs.shape[1]):
        e = emb[xs[:, t]]
        if config["rnn"]:
            pre = e @ raw["rnn_w.weight"].T + s @ raw["rnn_u.weight"].T + raw["rnn_u.bias"]
            s = pre * torch.sigmoid(pre)  # SiLU written out
        else:
            s = e + s
        z = torch.cat([h, s], dim=1)
        if "input_proj.weight" in raw:
            z = z @ raw["input_proj.weight"].T + raw["input_proj.bias"]
        for i in range(config["num_draft_layers"]):
            a = z @ raw[f"lm_head.{i}.linear.weight"].T + raw[f"lm_head.{i}.linear.bias"]
            z = z + a * torch.sigmoid(a)
        steps.append(z @ raw[f"lm_head.{config['num_draft_layers']}.weight"].T)
    return torch.stack(steps, dim=1)


def module_logits(drafter: RecurrentDrafter, h: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    state = drafter.init_state((h.shape[0],))
    steps = []
    for t in range(xs.shape[1]):
        state = drafter.update_state(state, xs[:, t])
        steps.append(drafter.draft_logits(h, state))
    return torch.stack(steps, dim=1)


# -- 1. round trip -------------------------------------------------------------------------------


@pytest.mark.parametrize("rnn, exit_dim, draft_vocab", VARIANTS)
def test_save_load_round_trip_is_exact(tmp_path, embedding, rnn, exit_dim, draft_vocab):
    config = apple_config(rnn=rnn, exit_dim=exit_dim, draft_vocab=draft_vocab)
    raw = apple_tensors(config)
    directory = write_checkpoint(tmp_path / "a", config, raw)
    drafter = RecurrentDrafter.from_pretrained(directory, embedding)
    assert set(drafter.state_dict()) == set(raw)  # the parameter names ARE the checkpoint keys

    drafter.save_pretrained(tmp_path / "b")
    saved = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert set(saved) == set(raw)
    for key, tensor in raw.items():
        assert saved[key].dtype == tensor.dtype, key
        assert torch.equal(saved[key], tensor), key
    saved_config = json.loads((tmp_path / "b" / "config.json").read_text())
    assert saved_config["model_type"] == "recurrent_drafting_drafter"
    known = {"vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn", "draft_vocab_size"}
    assert {k: v for k, v in saved_config.items() if k in known} == {
        k: v for k, v in config.items() if k in known
    }
    assert ("draft_vocab_size" in saved_config) == (draft_vocab is not None)

    reloaded = RecurrentDrafter.from_pretrained(tmp_path / "b", embedding)
    assert reloaded.config == drafter.config
    for key, tensor in drafter.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], tensor), key


def test_round_trip_of_a_fresh_drafter(tmp_path, embedding):
    config = DrafterConfig(vocab_size=V, hidden_size=H, exit_dim=2 * H, num_draft_layers=N)
    drafter = RecurrentDrafter(config, embedding)
    drafter.save_pretrained(tmp_path / "fresh")
    reloaded = RecurrentDrafter.from_pretrained(tmp_path / "fresh", embedding)
    assert reloaded.config == config
    assert all(torch.equal(reloaded.state_dict()[k], t) for k, t in drafter.state_dict().items())


# -- 2 + 4. hand-written Apple checkpoint, golden logits -----------------------------------------


@pytest.mark.parametrize("rnn, exit_dim, draft_vocab", VARIANTS)
def test_golden_logits_match_plain_tensor_reference(
    tmp_path, embedding, rnn, exit_dim, draft_vocab
):
    config = apple_config(rnn=rnn, exit_dim=exit_dim, draft_vocab=draft_vocab)
    directory = write_checkpoint(tmp_path / "ckpt", config, apple_tensors(config, seed=3))
    drafter = RecurrentDrafter.from_pretrained(directory, embedding)
    raw = load_file(str(directory / "model.safetensors"))  # the file's tensors, not the module's

    gen = torch.Generator().manual_seed(5)
    h = torch.randn(3, H, generator=gen)
    xs = torch.randint(0, V, (3, 3), generator=gen)  # g0 then two drafted tokens: 3 steps
    expected = reference_logits(raw, config, embedding.weight.detach(), h, xs)
    with torch.no_grad():
        got = module_logits(drafter, h, xs)
    assert got.shape == (3, 3, draft_vocab or V)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert expected.abs().max() > 1e-2  # the comparison is not between near-zero tensors


def test_reduced_vocab_maps_draft_ids_to_target_ids(tmp_path, embedding):
    config = apple_config(draft_vocab=K)
    raw = apple_tensors(config)
    directory = write_checkpoint(tmp_path / "r", config, raw)
    drafter = RecurrentDrafter.from_pretrained(directory, embedding)
    assert drafter.draft_vocab_size == K
    ids = raw["draft_vocab_ids"].tolist()  # draft id d stands for target id ids[d]
    draft_ids = torch.tensor([[0, K - 1], [3, 3]])
    expected = torch.tensor([[ids[0], ids[K - 1]], [ids[3], ids[3]]])
    assert torch.equal(drafter.to_target_ids(draft_ids), expected)


def test_full_vocab_to_target_ids_is_identity(apple_dir, embedding):
    drafter = RecurrentDrafter.from_pretrained(apple_dir, embedding)
    ids = torch.tensor([[4, 49], [0, 7]])
    assert drafter.draft_vocab_size == V
    assert torch.equal(drafter.to_target_ids(ids), ids)
    assert "draft_vocab_ids" not in drafter.state_dict()


def test_draft_logits_broadcasts_h_over_beams(apple_dir, embedding):
    drafter = RecurrentDrafter.from_pretrained(apple_dir, embedding)
    h = torch.randn(2, H)
    state = drafter.update_state(drafter.init_state((2, 3)), torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert state.shape == (2, 3, H)
    with torch.no_grad():
        got = drafter.draft_logits(h[:, None, :], state)  # [B, 1, H] with [B, W, H]
        expected = drafter.draft_logits(h[:, None, :].expand(2, 3, H).contiguous(), state)
    assert got.shape == (2, 3, V)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"\(2, 15\)"):
        drafter.draft_logits(torch.randn(2, H - 1), state[:, 0])


def test_module_docstring_example_runs():
    result = doctest.testmod(drafter_module, verbose=False)
    assert result.attempted >= 1 and result.failed == 0


# -- 3. other spellings and file formats ---------------------------------------------------------


def test_tensorrt_llm_name_variants_load(tmp_path, embedding):
    config = apple_config(exit_dim=PROJ_EXIT_DIM)
    raw = apple_tensors(config)
    renamed = {}
    for key, tensor in raw.items():
        key = key.replace("lm_head.", "lm_heads.").replace("input_proj.", "input_projs.")
        renamed["drafter." + key] = tensor
    assert "drafter.lm_heads.0.linear.weight" in renamed and "drafter.input_projs.bias" in renamed
    drafter = RecurrentDrafter.from_pretrained(write_checkpoint(tmp_path / "trt", config, renamed))
    for key, tensor in raw.items():
        assert torch.equal(drafter.state_dict()[key], tensor), key


def test_colliding_spellings_are_refused(tmp_path):
    config = apple_config()
    raw = apple_tensors(config)
    raw["lm_heads.0.linear.bias"] = raw["lm_head.0.linear.bias"].clone()
    with pytest.raises(DrafterCheckpointError, match="lm_heads.0.linear.bias"):
        RecurrentDrafter.from_pretrained(write_checkpoint(tmp_path / "c", config, raw))


@pytest.mark.parametrize("name", ["model.pt", "pytorch_model.bin"])
def test_torch_checkpoint_loads_with_weights_only(tmp_path, embedding, name):
    config = apple_config()
    raw = apple_tensors(config)
    directory = tmp_path / "pt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(raw, directory / name)
    drafter = RecurrentDrafter.from_pretrained(directory, embedding)
    for key, tensor in raw.items():
        assert torch.equal(drafter.state_dict()[key], tensor), key


class NotATensor:
    """A pickled object that weights_only loading must refuse."""


def test_pickled_object_is_refused(tmp_path):
    config = apple_config()
    raw = apple_tensors(config)
    raw["rnn_u.bias"] = NotATensor()
    directory = tmp_path / "pickled"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(raw, directory / "model.pt")
    with pytest.raises(DrafterCheckpointError) as info:
        RecurrentDrafter.from_pretrained(directory)
    message = str(info.value)
    assert "model.pt" in message and "weights_only" in message and "NotATensor" in message


def test_torch_checkpoint_with_non_tensor_entries_is_refused(tmp_path):
    config = apple_config()
    raw = apple_tensors(config)
    raw["step"] = 100  # an int is allowed by weights_only, but is not a weight
    directory = tmp_path / "ints"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(raw, directory / "model.pt")
    with pytest.raises(DrafterCheckpointError, match=r"model\.pt.*step"):
        RecurrentDrafter.from_pretrained(directory)


def test_dtype_and_device_cast_the_drafter_not_the_embedding(apple_dir, embedding):
    drafter = RecurrentDrafter.from_pretrained(
        apple_dir, embedding, dtype=torch.float64, device="cpu"
    )
    assert {p.dtype for p in drafter.parameters()} == {torch.float64}
    assert {p.device.type for p in drafter.parameters()} == {"cpu"}
    assert embedding.weight.dtype == torch.float32
    state = drafter.update_state(drafter.init_state((2,)), torch.tensor([1, 2]))
    assert state.dtype == torch.float64
    assert drafter.draft_logits(torch.randn(2, H), state).dtype == torch.float64  # h (fp32) cast


def test_dtype_cast_keeps_draft_vocab_ids_integer(tmp_path):
    config = apple_config(draft_vocab=K)
    raw = apple_tensors(config)
    directory = write_checkpoint(tmp_path / "k", config, raw)
    drafter = RecurrentDrafter.from_pretrained(directory, dtype=torch.bfloat16)
    assert drafter.lm_head[-1].weight.dtype == torch.bfloat16
    assert drafter.draft_vocab_ids.dtype == torch.int64
    assert torch.equal(drafter.draft_vocab_ids, raw["draft_vocab_ids"])


# -- 5. errors -----------------------------------------------------------------------------------


def test_hidden_size_mismatch_names_both_shapes(apple_dir):
    with pytest.raises(DrafterMismatchError) as info:
        RecurrentDrafter.from_pretrained(apple_dir, nn.Embedding(V, 576))
    message = str(info.value)
    assert f"hidden_size={H} / vocab_size={V}" in message
    assert f"target's hidden_size=576 / vocab_size={V}" in message


def test_vocab_mismatch_names_both_shapes(apple_dir):
    with pytest.raises(DrafterMismatchError) as info:
        RecurrentDrafter.from_pretrained(apple_dir, target_hidden_size=H, target_vocab_size=49152)
    message = str(info.value)
    assert f"hidden_size={H} / vocab_size={V}" in message
    assert f"target's hidden_size={H} / vocab_size=49152" in message


def test_attach_embedding_checks_its_shape(apple_dir):
    drafter = RecurrentDrafter.from_pretrained(apple_dir)
    with pytest.raises(DrafterMismatchError, match="vocab_size=51"):
        drafter.attach_embedding(nn.Embedding(V + 1, H))
    assert drafter.embedding is None


def test_missing_directory(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DrafterCheckpointError, match=str(missing)):
        RecurrentDrafter.from_pretrained(missing)


def test_missing_config(apple_dir):
    (apple_dir / "config.json").unlink()
    with pytest.raises(DrafterCheckpointError, match="config.json"):
        RecurrentDrafter.from_pretrained(apple_dir)


def test_config_without_hidden_size(apple_dir):
    config = apple_config()
    del config["hidden_size"]
    (apple_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterCheckpointError) as info:
        RecurrentDrafter.from_pretrained(apple_dir)
    assert "config.json" in str(info.value) and "hidden_size" in str(info.value)


def test_corrupt_config(apple_dir):
    (apple_dir / "config.json").write_text('{"vocab_size": 50, "hidden_size": ')
    with pytest.raises(DrafterCheckpointError, match=r"config\.json is not valid JSON"):
        RecurrentDrafter.from_pretrained(apple_dir)


def test_config_of_another_model_type(apple_dir):
    config = apple_config() | {"model_type": "llama"}
    (apple_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterCheckpointError, match="'llama'"):
        RecurrentDrafter.from_pretrained(apple_dir)


def test_config_with_bad_value(apple_dir):
    config = apple_config() | {"num_draft_layers": 0}
    (apple_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterCheckpointError, match="num_draft_layers"):
        RecurrentDrafter.from_pretrained(apple_dir)


def test_missing_weights(apple_dir):
    (apple_dir / "model.safetensors").unlink()
    looked_for = r"model\.safetensors, pytorch_model\.bin, model\.pt"
    with pytest.raises(DrafterCheckpointError, match=looked_for):
        RecurrentDrafter.from_pretrained(apple_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(apple_dir, damage):
    file = apple_dir / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"not a safetensors file")
    with pytest.raises(DrafterCheckpointError, match=r"model\.safetensors"):
        RecurrentDrafter.from_pretrained(apple_dir)


def test_missing_and_unexpected_keys_are_listed(tmp_path):
    config = apple_config()
    raw = apple_tensors(config)
    del raw["rnn_u.bias"]
    raw["lm_head.9.weight"] = torch.zeros(2)
    with pytest.raises(DrafterCheckpointError) as info:
        RecurrentDrafter.from_pretrained(write_checkpoint(tmp_path / "k", config, raw))
    message = str(info.value)
    assert "model.safetensors" in message
    assert "missing keys ['rnn_u.bias']" in message
    assert "unexpected keys ['lm_head.9.weight']" in message


def test_wrong_shape_is_named(tmp_path):
    config = apple_config()
    raw = apple_tensors(config)
    raw["lm_head.2.weight"] = torch.zeros(V - 1, 2 * H)
    with pytest.raises(DrafterCheckpointError) as info:
        RecurrentDrafter.from_pretrained(write_checkpoint(tmp_path / "s", config, raw))
    message = str(info.value)
    assert "lm_head.2.weight" in message and f"({V}, {2 * H})" in message
    assert f"({V - 1}, {2 * H})" in message


@pytest.mark.parametrize(
    "ids, problem",
    [
        ([0, 1, 2, 3, 4, 5, V], f"outside [0, vocab_size={V})"),
        ([0, 1, 2, 3, 4, 5, -1], "outside"),
        ([0, 1, 2, 3, 3, 5, 6], "repeats target ids [3]"),
    ],
)
def test_bad_draft_vocab_ids_are_refused(tmp_path, ids, problem):
    config = apple_config(draft_vocab=K)
    raw = apple_tensors(config)
    raw["draft_vocab_ids"] = torch.tensor(ids)
    with pytest.raises(DrafterCheckpointError) as info:
        RecurrentDrafter.from_pretrained(write_checkpoint(tmp_path / "ids", config, raw))
    assert problem in str(info.value) and "draft_vocab_ids" in str(info.value)


def test_draft_vocab_larger_than_vocab_is_refused():
    with pytest.raises(ValueError, match="draft_vocab_size=51 exceeds vocab_size=50"):
        DrafterConfig(vocab_size=V, hidden_size=H, exit_dim=2 * H, num_draft_layers=N,
                      draft_vocab_size=V + 1)


def test_update_state_without_embedding_raises(apple_dir):
    drafter = RecurrentDrafter.from_pretrained(apple_dir)
    with pytest.raises(RuntimeError, match="attach_embedding"):
        drafter.update_state(drafter.init_state((1,)), torch.tensor([3]))


# -- 6. the embedding is shared ------------------------------------------------------------------


def test_embedding_is_shared_not_copied(apple_dir, embedding):
    drafter = RecurrentDrafter.from_pretrained(apple_dir, embedding)
    assert drafter.embedding is embedding
    assert not any("emb" in key for key in drafter.state_dict())
    assert all(p is not embedding.weight for p in drafter.parameters())

    tokens = torch.tensor([3, 8])
    before = drafter.update_state(drafter.init_state((2,)), tokens)
    with torch.no_grad():
        embedding.weight[3] += 1.0  # in place, on the target's tensor
    after = drafter.update_state(drafter.init_state((2,)), tokens)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(before[1], after[1], atol=0, rtol=0)  # token 8 untouched

    drafter.to(torch.float64)  # moving the drafter never casts or copies the target's embedding
    assert drafter.embedding is embedding and embedding.weight.dtype == torch.float32
