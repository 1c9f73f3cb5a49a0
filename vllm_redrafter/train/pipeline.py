"""A whole training run: check the output dir, build the data, pick K, train, evaluate, save.

Output directory layout:

    OUTPUT/config.json, model.safetensors   the drafter, Apple layout (+ draft_vocab_ids)
    OUTPUT/eval.json                        held-out per-position top-1 accuracy
    OUTPUT/training.json                    the command, recipe, data size, times, figures
    OUTPUT/work/checkpoint.pt               resumable training state
    OUTPUT/work/run.json                    what the checkpoint belongs to (target, fingerprint)
    OUTPUT/work/data/                       the distillation dataset (a cache, reused on resume;
                                            with several datasets, data/part1, data/part2, ...)
    OUTPUT/work/base/                       init_from="recipe:NAME": the base run (same layout)

Nothing trained is ever replaced without ``overwrite``; a directory holding another model's
drafter, or something that is not a drafter, is refused.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from vllm_redrafter.demo import DEFAULT_DRAFTER
from vllm_redrafter.drafter import DrafterConfig, DrafterMismatchError, RecurrentDrafter
from vllm_redrafter.train.distill import (
    DistillData,
    build_data,
    concat_data,
    data_fingerprint,
    target_signature,
)
from vllm_redrafter.train.generate import Generator
from vllm_redrafter.train.recipes import DrafterSpec, Recipe, get_recipe
from vllm_redrafter.train.trainer import evaluate, format_eval, train_loop, write_json
from vllm_redrafter.train.vocab import (
    carry_head_rows,
    coverage,
    select_draft_vocab,
    swap_draft_vocab,
    token_frequencies,
)

WORK, CHECKPOINT, RUN_FILE, SAFETENSORS = "work", "checkpoint.pt", "run.json", "model.safetensors"
BASE, RECIPE_PREFIX = "base", "recipe:"
FINAL_FILES = ("config.json", SAFETENSORS, "eval.json", "training.json")
# ridge of the map from target LM-head rows to a trained head's rows (swap_head_vocab); on the
# shipped head, 10 fitted best of 0.1-100 on held-out rows (cosine 0.44, raw target rows: 0.24)
ROW_MAP_RIDGE = 10.0


class OutputDirError(ValueError):
    """The output directory holds something a run must not overwrite."""


def target_identity(target_dir: Path) -> dict:
    config = json.loads((target_dir / "config.json").read_text())
    return {"path": str(target_dir), "hidden_size": config["hidden_size"],
            "vocab_size": config["vocab_size"],
            "config_sha256": hashlib.sha256(json.dumps(target_signature(target_dir), sort_keys=True)
                                            .encode()).hexdigest()[:16]}


def run_fingerprint(recipe: Recipe, target_dir: Path) -> str:
    """What a checkpoint belongs to: the data, the drafter and the training settings."""
    train = asdict(recipe.train)
    for key in ("save_every", "eval_batch_size", "eval_max_positions", "device"):
        train.pop(key)
    if train["soft_label_weight"] == 0.0:  # off: the fingerprint of runs from before the option
        train.pop("soft_label_weight")
    data = [data_fingerprint(spec, target_dir) for spec in recipe.datasets]
    drafter = asdict(recipe.drafter)
    if drafter["draft_vocab_swap"] == 0:  # K kept: the fingerprint of runs before the option
        drafter.pop("draft_vocab_swap")
    if drafter["init_from"] is None:  # a fresh drafter: the fingerprint of runs before the option
        drafter.pop("init_from")
    elif drafter["init_from"].startswith(RECIPE_PREFIX):  # a base run: its own fingerprint
        base = get_recipe(drafter["init_from"].removeprefix(RECIPE_PREFIX))
        drafter["init_from"] = RECIPE_PREFIX + run_fingerprint(base, target_dir)
    else:  # the starting weights, wherever they lie
        drafter["init_from"] = _file_sha256(init_drafter_dir(recipe.drafter.init_from) / SAFETENSORS)
    blob = json.dumps({"data": data[0] if len(data) == 1 else data,  # one: as before the option
                       "drafter": drafter, "train": train}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def init_drafter_dir(init_from: str) -> Path:
    """The drafter directory a fine-tuning run starts from ("default": the package's); for a
    base recipe see :func:`train_base`."""
    directory = DEFAULT_DRAFTER if init_from == "default" else Path(init_from)
    if not (directory / SAFETENSORS).is_file():
        raise FileNotFoundError(f"init_from: {directory} holds no trained drafter ({SAFETENSORS} "
                                "missing); give a drafter directory, or 'default'")
    return directory


def train_base(recipe: Recipe, target_dir: Path, output_dir: Path,
               generator: Generator | None) -> Path:
    """``init_from="recipe:NAME"``: the base recipe's drafter, trained first (resumably) in
    OUTPUT/work/base, or found there finished (a copy of its run, training.json included, may be
    put there); the one command then makes both stages."""
    base = get_recipe(recipe.drafter.init_from.removeprefix(RECIPE_PREFIX))
    base_dir = output_dir / WORK / BASE
    record_file = base_dir / "training.json"
    run_file = base_dir / WORK / RUN_FILE
    fingerprint = run_fingerprint(base, target_dir)
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    if not (record.get("finished") and record.get("fingerprint") == fingerprint):
        print(f"training the base drafter (recipe {base.name!r}) in {base_dir}")
        resumable = run_file.is_file() and json.loads(run_file.read_text())["fingerprint"] == fingerprint
        run_training(base, target_dir, base_dir, overwrite=not resumable, generator=generator)
    return base_dir


def _file_sha256(file: Path) -> str:
    return hashlib.sha256(file.read_bytes()).hexdigest()[:16]


def check_output_dir(output_dir: Path, identity: dict, fingerprint: str, overwrite: bool) -> None:
    """Refuse to clobber a trained drafter (without overwrite), another model's drafter, or a
    directory that holds something else; with overwrite, clear the previous run's files."""
    config_file = output_dir / "config.json"
    if not overwrite and _killed_while_saving(output_dir, fingerprint):
        for name in FINAL_FILES:  # a torn final save: redone from the last checkpoint
            (output_dir / name).unlink(missing_ok=True)
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise OutputDirError(f"{config_file} exists and is not a drafter config ({err}); "
                                 "choose another --output-dir") from err
        if config.get("model_type") != DrafterConfig.model_type:
            raise OutputDirError(
                f"{output_dir} holds a {config.get('model_type', 'non-drafter')!r} model, not a "
                "drafter (is it the target's directory?); choose another --output-dir")
        if not overwrite:
            _refuse_existing_drafter(output_dir, config, identity)
    run_file = output_dir / WORK / RUN_FILE
    if run_file.is_file() and (output_dir / WORK / CHECKPOINT).is_file() and not overwrite:
        run = json.loads(run_file.read_text())
        if run["target"]["config_sha256"] != identity["config_sha256"]:
            raise DrafterMismatchError(
                f"{output_dir} holds an unfinished run for another target ({run['target']['path']}, "
                f"hidden_size={run['target']['hidden_size']}, vocab_size={run['target']['vocab_size']}); "
                f"this target is {identity['path']} (hidden_size={identity['hidden_size']}, "
                f"vocab_size={identity['vocab_size']}). Pass --overwrite to start over")
        if run["fingerprint"] != fingerprint:
            raise OutputDirError(f"{output_dir} holds an unfinished run with other settings; "
                                 "rerun with the same settings to resume it, or pass --overwrite")
    if overwrite:
        for name in FINAL_FILES:
            (output_dir / name).unlink(missing_ok=True)
        for name in (CHECKPOINT, RUN_FILE):
            (output_dir / WORK / name).unlink(missing_ok=True)
    (output_dir / WORK).mkdir(parents=True, exist_ok=True)
    write_json(run_file, {"target": identity, "fingerprint": fingerprint})


def _killed_while_saving(output_dir: Path, fingerprint: str) -> bool:
    """This run's checkpoint and run.json are there but no training.json: the run was killed
    after its last checkpoint, while writing the drafter (training.json is written last)."""
    run_file = output_dir / WORK / RUN_FILE
    return ((output_dir / WORK / CHECKPOINT).is_file() and run_file.is_file()
            and not (output_dir / "training.json").is_file()
            and json.loads(run_file.read_text()).get("fingerprint") == fingerprint)


def _refuse_existing_drafter(output_dir: Path, config: dict, identity: dict) -> None:
    record_file = output_dir / "training.json"
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    other_sha = record.get("target", {}).get("config_sha256")
    dims = (config.get("hidden_size"), config.get("vocab_size"))
    if dims != (identity["hidden_size"], identity["vocab_size"]) or (
            other_sha is not None and other_sha != identity["config_sha256"]):
        raise DrafterMismatchError(
            f"{output_dir} holds a drafter for a different model (hidden_size={dims[0]}, "
            f"vocab_size={dims[1]}, target {record.get('target', {}).get('path', 'unknown')}); this "
            f"target is {identity['path']} (hidden_size={identity['hidden_size']}, vocab_size="
            f"{identity['vocab_size']}). Choose another --output-dir, or pass --overwrite")
    raise OutputDirError(f"{output_dir} already holds a trained drafter; pass --overwrite to "
                         "replace it, or choose another --output-dir")


# -- the drafter -----------------------------------------------------------------------------------


def load_target_weight(target_dir: Path, names: tuple[str, ...]) -> torch.Tensor | None:
    """One tensor of the target's safetensors checkpoint (sharded or not), without the rest."""
    from safetensors import safe_open

    index = target_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: target_dir / weight_map[name] for name in names if name in weight_map}
    else:
        files = {name: target_dir / "model.safetensors" for name in names}
    for name, file in files.items():
        if not file.is_file():
            continue
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def load_target_embedding(target_dir: Path) -> nn.Embedding:
    """The target's input embedding [V, H], frozen (float32)."""
    weight = load_target_weight(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    if weight is None:  # not a Llama-style checkpoint: ask transformers
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
        weight = model.get_input_embeddings().weight.detach()
    embedding = nn.Embedding.from_pretrained(weight.float(), freeze=True)
    return embedding


def build_drafter(spec: DrafterSpec, target_dir: Path, embedding: nn.Embedding,
                  draft_ids: torch.Tensor | None, seed: int) -> RecurrentDrafter:
    """A fresh drafter; with head_init='target' the head's h-half is the target's LM head rows."""
    vocab, hidden = embedding.num_embeddings, embedding.embedding_dim
    config = DrafterConfig(vocab_size=vocab, hidden_size=hidden, exit_dim=spec.exit_dim or 2 * hidden,
                           num_draft_layers=spec.num_draft_layers, rnn=spec.rnn,
                           draft_vocab_size=None if draft_ids is None else int(draft_ids.numel()))
    torch.manual_seed(seed)
    drafter = RecurrentDrafter(config, embedding)
    if draft_ids is not None:
        drafter.draft_vocab_ids.copy_(draft_ids)
    if spec.head_init == "target" and not config.uses_input_proj:
        with torch.no_grad():
            drafter.lm_head[-1].weight[:, :hidden].copy_(target_head_rows(target_dir, embedding,
                                                                          draft_ids))
    return drafter


def target_head_rows(target_dir: Path, embedding: nn.Embedding,
                     draft_ids: torch.Tensor | None) -> torch.Tensor:
    """The target's LM-head rows of the draft tokens [K, H] (all V rows without a reduced
    vocabulary), float32; the input embedding where the target ties them."""
    lm_head = load_target_weight(target_dir, ("lm_head.weight",))
    lm_head = embedding.weight if lm_head is None else lm_head.float()
    return (lm_head if draft_ids is None else lm_head[draft_ids.to(lm_head.device)]).detach()


def swap_head_vocab(drafter: RecurrentDrafter, data: DistillData, spec: DrafterSpec,
                    target_dir: Path, embedding: nn.Embedding,
                    eos_token_id: int | None) -> torch.Tensor:
    """Swap m of a trained drafter's K draft tokens by this run's training counts (in place);
    returns the new ids. Kept tokens keep their head rows; a new token's row starts as the ridge
    map from the target's LM-head rows onto the trained rows, fitted on the old head's tokens."""
    if not drafter.config.draft_vocab_size:
        raise ValueError("draft_vocab_swap needs a drafter with a reduced draft vocabulary")
    old_ids = drafter.draft_vocab_ids.clone()
    m = spec.draft_vocab_swap
    new_ids = swap_draft_vocab(old_ids, _training_frequencies(data, spec), m,
                               _always(eos_token_id))
    head = drafter.lm_head[-1].weight
    with torch.no_grad():
        target_rows = target_head_rows(target_dir, embedding, None)  # [V, H], read once
        source = target_rows[old_ids.to(target_rows.device)]  # [K, H]
        gram = source.T @ source + ROW_MAP_RIDGE * torch.eye(source.shape[1])
        row_map = torch.linalg.solve(gram, source.T @ head)  # [H, E]
        fresh = target_rows[new_ids.to(target_rows.device)] @ row_map
        head.copy_(carry_head_rows(old_ids, head, new_ids, fresh))
        drafter.draft_vocab_ids.copy_(new_ids)
    print(f"draft vocabulary: {m} of K = {old_ids.numel()} tokens swapped for this run's data")
    return drafter.draft_vocab_ids


def choose_draft_vocab(data: DistillData, spec: DrafterSpec, eos_token_id: int | None) -> torch.Tensor | None:
    if spec.draft_vocab_size is None:
        return None
    return select_draft_vocab(_training_frequencies(data, spec), spec.draft_vocab_size,
                              _always(eos_token_id))


def _training_frequencies(data: DistillData, spec: DrafterSpec) -> torch.Tensor:
    """The draft-vocabulary counts of the training split (``train.vocab``)."""
    return token_frequencies(data.labels[~data.heldout], data.token_counts, spec.vocab_text_weight)


def _always(eos_token_id: int | None) -> list[int] | None:
    """The tokens every draft vocabulary keeps: the EOS."""
    return [eos_token_id] if eos_token_id is not None else None


# -- the run ---------------------------------------------------------------------------------------


def run_training(recipe: Recipe, target_dir: str | Path, output_dir: str | Path, *,
                 overwrite: bool = False, stop_after_steps: int | None = None,
                 data_dir: str | Path | None = None, generator: Generator | None = None) -> dict:
    """Train a drafter as ``recipe`` says; returns the training record (also written to JSON).

    ``data_dir`` shares a distillation dataset between runs (default: OUTPUT/work/data).
    ``stop_after_steps`` stops after that many steps with a checkpoint (a "killed" run); the same
    call without it resumes and finishes.
    """
    from transformers import AutoTokenizer

    target_dir, output_dir = Path(target_dir), Path(output_dir)
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target model directory {target_dir} has no config.json")
    identity = target_identity(target_dir)
    fingerprint = run_fingerprint(recipe, target_dir)
    init_from = recipe.drafter.init_from
    from_base_recipe = init_from is not None and init_from.startswith(RECIPE_PREFIX)
    init_dir = init_drafter_dir(init_from) if init_from and not from_base_recipe else None
    if init_dir and init_dir.resolve() == output_dir.resolve():
        raise OutputDirError(f"init_from and the output dir are both {output_dir}: the run would "
                             "replace the drafter it starts from; choose another --output-dir")
    check_output_dir(output_dir, identity, fingerprint, overwrite)  # before any slow work
    if from_base_recipe:
        init_dir = train_base(recipe, target_dir, output_dir, generator)
    started = time.time()
    train = recipe.train
    device = train.resolved_device()
    data = build_datasets(recipe, target_dir, data_dir or output_dir / WORK / "data",
                          generator=generator, device=str(device), rebuild_stale=data_dir is None)
    data_seconds = time.time() - started
    embedding = load_target_embedding(target_dir).to(device)
    if init_dir:
        drafter = RecurrentDrafter.from_pretrained(init_dir, embedding, dtype=torch.float32)
        draft_ids = drafter.draft_vocab_ids if drafter.config.draft_vocab_size else None
        if recipe.drafter.draft_vocab_swap:
            eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
            draft_ids = swap_head_vocab(drafter, data, recipe.drafter, target_dir, embedding, eos)
        torch.manual_seed(train.seed)
    else:
        eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
        draft_ids = choose_draft_vocab(data, recipe.drafter, eos)
        drafter = build_drafter(recipe.drafter, target_dir, embedding, draft_ids, train.seed)
    teacher_head = (target_head_rows(target_dir, embedding, draft_ids)
                    if train.soft_label_weight > 0 else None)
    state = train_loop(drafter, data, train, output_dir / WORK / CHECKPOINT, fingerprint,
                       stop_after_steps, teacher_head)
    record = {"recipe": recipe.name, "command": [Path(sys.argv[0]).name, *sys.argv[1:]], "target": identity,
              "fingerprint": fingerprint, "steps_done": state.step,
              "train_seconds_this_session": round(state.seconds, 1),
              "data_seconds_this_session": round(data_seconds, 1)}
    heldout_idx = torch.nonzero(data.heldout).squeeze(1)
    if stop_after_steps is not None and state.step < _total(recipe, data):
        print(f"stopped after {state.step} steps; rerun the same command to resume")
        return {**record, "finished": False}
    result = evaluate(drafter, data, heldout_idx, train, device) if heldout_idx.numel() else None
    if result is not None:
        print(format_eval(result))
        write_json(output_dir / "eval.json", result)
    save_drafter(drafter, output_dir, recipe.save_dtype)
    record.update({
        "finished": True, "data": data.meta, "drafter": asdict(recipe.drafter),
        "train": asdict(train), "save_dtype": recipe.save_dtype,
        "draft_vocab_coverage": _coverage(draft_ids, data),
        "final_train_loss": sum(state.losses[-10:]) / max(len(state.losses[-10:]), 1),
        "train_losses_every_10": state.losses[::10], "eval": result,
    })
    write_json(output_dir / "training.json", record)
    return record


def build_datasets(recipe: Recipe, target_dir: Path, data_dir: Path, *,
                   generator: Generator | None = None, device: str = "cpu",
                   rebuild_stale: bool = False) -> DistillData:
    """The recipe's dataset in ``data_dir``, or its datasets as one, each built in its own
    ``data_dir/part<i>`` (a build made elsewhere can be reused by linking it there).

    ``rebuild_stale`` (the run's own OUTPUT/work/data): a dir left in the other layout by an
    earlier run is rearranged first, a build that is one of this recipe's datasets kept.
    """
    specs, data_dir = recipe.datasets, Path(data_dir)
    if rebuild_stale:
        relayout_data_dir(data_dir, [data_fingerprint(spec, target_dir) for spec in specs])
    kwargs = dict(generator=generator, device=device, rebuild_stale=rebuild_stale)
    if len(specs) == 1:
        return build_data(specs[0], target_dir, data_dir, **kwargs)
    return concat_data([build_data(spec, target_dir, data_dir / f"part{i}", **kwargs)
                        for i, spec in enumerate(specs, start=1)])


def relayout_data_dir(data_dir: Path, fingerprints: list[str]) -> None:
    """Turn one build into parts or parts into one build: the build whose fingerprint is wanted
    moves where this run looks for it (one dataset: ``data_dir``, several: ``part<i>``); the
    other builds of the old layout are deleted (the dir is the run's own cache)."""
    stamp, parts = data_dir / "fingerprint", sorted(data_dir.glob("part*"))
    if len(fingerprints) > 1 and stamp.is_file():  # one build -> parts
        files = [f for f in data_dir.iterdir() if not f.name.startswith("part")]
        if stamp.read_text() in fingerprints:
            dest = data_dir / f"part{fingerprints.index(stamp.read_text()) + 1}"
            if not dest.exists():
                dest.mkdir()
                for f in files:
                    f.rename(dest / f.name)
                return
        for f in files:
            shutil.rmtree(f) if f.is_dir() else f.unlink()
    elif len(fingerprints) == 1 and parts and not stamp.is_file():  # parts -> one build
        keep = next((d for d in parts if not d.is_symlink() and (d / "fingerprint").is_file()
                     and (d / "fingerprint").read_text() == fingerprints[0]), None)
        for d in parts:  # a linked build is unlinked, never deleted
            if d is not keep:
                d.unlink() if d.is_symlink() else shutil.rmtree(d)
        if keep is not None:
            for f in list(keep.iterdir()):
                f.rename(data_dir / f.name)
            keep.rmdir()


def _total(recipe: Recipe, data: DistillData) -> int:
    from vllm_redrafter.train.trainer import total_steps

    return total_steps(recipe.train, int((~data.heldout).sum()))


def _coverage(draft_ids: torch.Tensor | None, data: DistillData) -> dict | None:
    if draft_ids is None:
        return None
    return {"train_labels": coverage(draft_ids, data.labels[~data.heldout]),
            "heldout_labels": coverage(draft_ids, data.labels[data.heldout])}


def save_drafter(drafter: RecurrentDrafter, output_dir: Path, dtype_name: str) -> None:
    """The final drafter in the Apple layout, in ``dtype_name`` (the embedding is not saved)."""
    dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype_name]
    copy = RecurrentDrafter(drafter.config)
    copy.load_state_dict({k: v.detach().cpu() for k, v in drafter.state_dict().items()})
    copy.to(dtype).save_pretrained(output_dir)
