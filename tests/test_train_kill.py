"""Training resume after a real SIGKILL (issue 40, item 8).

test_train.py's resume test stops the run cooperatively (``stop_after_steps`` writes a checkpoint
first). Here a training subprocess is SIGKILLed with its in-memory state ahead of the last
checkpoint, or in the middle of writing one; the same command then runs again to the end, and the
drafter must be bitwise the one an uninterrupted run makes (docs/training.md: "a killed run ...
ends with the same weights as an uninterrupted run"; the trainer documents no tolerance).

Every run is a subprocess running the script below (one intra-op thread, as the test process).
The script wraps two trainer calls without changing what they compute, so a test knows where the
run is: ``trainer.learning_rate``, called once at the start of each step, records the steps the run
takes (how a restart shows it resumed from the checkpoint, not from step 0) and can hold the run
at the start of a given step; ``torch.save`` can hold it after writing half of a checkpoint's
``.tmp`` file. A held run sleeps until the test SIGKILLs it, so the kill point is exact, not a
race; one test also kills a free-running run found between checkpoints by polling.

The data are test_train.py's (a generator stand-in, no vLLM): 8 prompts, 192 positions.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_train import prompts_file, shared_data_dir  # noqa: F401  (fixtures, rebuilt here)

TESTS = Path(__file__).resolve().parent
STEPS, SAVE_EVERY = 12, 3
RECIPE = {"max_steps": STEPS, "save_every": SAVE_EVERY}  # small_recipe(prompts_file, **RECIPE)

CHILD = r'''
import io, json, os, sys, time
from pathlib import Path

import torch

torch.set_num_threads(1)
cfg = json.loads(Path(sys.argv[1]).read_text())
sys.path.insert(0, cfg["tests_dir"])
from test_train import never_generate, small_recipe
from vllm_redrafter.train import trainer
from vllm_redrafter.train.pipeline import run_training

run = Path(cfg["run_dir"])


def write(name, obj):  # atomically: the test reads these while the run goes on, or after a kill
    tmp = run / (name + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, run / name)


def tell(**what):  # the marker the test polls
    write("marker.json", what)


def hold():  # wait here for the test's SIGKILL
    while True:
        time.sleep(60)


steps = []
real_learning_rate = trainer.learning_rate


def learning_rate(config, step, total):  # called at the start of each step, once per param group
    if not steps or steps[-1] != step:
        steps.append(step)
        write("steps.json", steps)
    if step == cfg.get("hold_at_step"):
        tell(held_at_step=step)
        hold()
    return real_learning_rate(config, step, total)


trainer.learning_rate = learning_rate
real_save = torch.save


def save(obj, f, *args, **kwargs):
    if (str(f).endswith(".tmp") and isinstance(obj, dict)
            and obj.get("step") == cfg.get("hold_in_checkpoint_write")):
        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        blob = buffer.getvalue()
        with open(f, "wb") as out:  # half of the checkpoint, as a kill in the write leaves it
            out.write(blob[: len(blob) // 2])
        tell(writing_checkpoint=obj["step"], bytes=len(blob))
        hold()
    return real_save(obj, f, *args, **kwargs)


torch.save = save
if cfg.get("hold_in_final_save"):
    import safetensors.torch

    def save_file(*args, **kwargs):  # the drafter's config.json is written, its weights not yet
        tell(final_save=True)
        hold()

    safetensors.torch.save_file = save_file

recipe = small_recipe(Path(cfg["prompts_file"]), **cfg["train"])
record = run_training(recipe, cfg["target_dir"], run / "out", data_dir=cfg["data_dir"],
                      generator=never_generate)
(run / "record.json").write_text(json.dumps({k: record[k] for k in ("finished", "steps_done")}))
'''


class Run:
    """One training subprocess writing to ``<run_dir>/out`` (a killed run and its restart share
    run_dir: the restart is the same command on the same output directory)."""

    def __init__(self, run_dir: Path, target_dir: Path, prompts: Path, data_dir: Path, **hooks):
        run_dir.mkdir(parents=True, exist_ok=True)
        for name in ("marker.json", "steps.json", "record.json"):
            (run_dir / name).unlink(missing_ok=True)
        self.dir, self.out = run_dir, run_dir / "out"
        self.checkpoint = self.out / "work" / "checkpoint.pt"
        cfg = {"tests_dir": str(TESTS), "run_dir": str(run_dir), "target_dir": str(target_dir),
               "prompts_file": str(prompts), "data_dir": str(data_dir), "train": RECIPE, **hooks}
        script, config = run_dir / "child.py", run_dir / "child.json"
        script.write_text(CHILD)
        config.write_text(json.dumps(cfg))
        self.log = run_dir / f"log{len(list(run_dir.glob('log*')))}.txt"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([sys.executable, str(script), str(config)], stdout=log,
                                         stderr=subprocess.STDOUT, cwd=TESTS.parent)

    def output(self) -> str:
        return self.log.read_text()

    def steps(self) -> list[int]:
        file = self.dir / "steps.json"
        return json.loads(file.read_text()) if file.is_file() else []

    def wait_for(self, ready, timeout: float = 90.0):
        """Poll until ``ready()`` returns something true; fail if the run exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = ready()
            if found:
                return found
            if self.proc.poll() is not None:
                pytest.fail(f"the run exited ({self.proc.returncode}) before the kill point:\n"
                            + self.output()[-3000:])
            time.sleep(0.002)
        self.proc.kill()
        pytest.fail("timed out waiting for the kill point:\n" + self.output()[-3000:])

    def marker(self) -> dict | None:
        file = self.dir / "marker.json"
        return json.loads(file.read_text()) if file.is_file() else None

    def sigkill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        assert self.proc.wait(timeout=30) == -signal.SIGKILL

    def finish(self, timeout: float = 120.0) -> dict:
        rc = self.proc.wait(timeout=timeout)
        assert rc == 0, f"run failed ({rc}):\n" + self.output()[-3000:]
        return json.loads((self.dir / "record.json").read_text())


def checkpoint_step(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["step"])


def assert_same_weights(a_dir: Path, b_dir: Path) -> None:
    a, b = load_file(str(a_dir / "model.safetensors")), load_file(str(b_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def assert_unfinished(run: Run, checkpoint: int) -> None:
    """The killed run left checkpoint ``checkpoint`` (loadable) and no drafter."""
    assert checkpoint_step(run.checkpoint) == checkpoint < STEPS
    assert not (run.out / "model.safetensors").exists() and not (run.out / "training.json").exists()


def resume_to_the_end(run: Run, args: tuple, checkpoint: int, uninterrupted: Path) -> None:
    """Run the same command again: it resumes at ``checkpoint`` and ends with the uninterrupted
    run's weights (and its training record's losses: the losses before the kill are restored)."""
    again = Run(run.dir, *args)
    record = again.finish()
    assert record == {"finished": True, "steps_done": STEPS}
    assert again.steps() == list(range(checkpoint, STEPS))  # not from step 0
    assert f"resuming from {run.checkpoint} at step {checkpoint}" in again.output()
    assert_same_weights(uninterrupted, run.out)
    whole, resumed = (json.loads((d / "training.json").read_text()) for d in (uninterrupted, run.out))
    assert resumed["train_losses_every_10"] == whole["train_losses_every_10"]
    assert resumed["final_train_loss"] == whole["final_train_loss"]
    assert not run.checkpoint.with_name("checkpoint.pt.tmp").exists()


@pytest.fixture(scope="module")
def args(target_dir, prompts_file, shared_data_dir) -> tuple:  # noqa: F811
    return target_dir, prompts_file, shared_data_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, args) -> Path:
    run = Run(tmp_path_factory.mktemp("whole"), *args)
    assert run.finish() == {"finished": True, "steps_done": STEPS}
    assert run.steps() == list(range(STEPS))
    return run.out


def test_sigkill_between_checkpoints_resumes_to_the_same_weights(tmp_path, args, uninterrupted):
    """Killed at the start of step 8: steps 6 and 7 are done in memory, checkpoint 6 is on disk
    (the next one, 9, is not written yet); the restart redoes steps 6 and 7."""
    run = Run(tmp_path, *args, hold_at_step=8)
    assert run.wait_for(run.marker) == {"held_at_step": 8}
    assert checkpoint_step(run.checkpoint) == 6  # read while the run is alive, then kill it
    run.sigkill()
    assert run.steps() == list(range(9))  # 0..7 done, 8 begun
    assert_unfinished(run, 6)
    resume_to_the_end(run, args, 6, uninterrupted)


def test_sigkill_in_a_checkpoint_write_leaves_the_last_checkpoint(tmp_path, args, uninterrupted):
    """Killed with half of checkpoint 9 in checkpoint.pt.tmp: checkpoint.pt is still checkpoint
    6, whole and loadable (tmp file + rename); the restart resumes there and overwrites the tmp."""
    run = Run(tmp_path, *args, hold_in_checkpoint_write=9)
    assert run.wait_for(run.marker)["writing_checkpoint"] == 9
    run.sigkill()
    tmp = run.checkpoint.with_name("checkpoint.pt.tmp")
    assert 0 < tmp.stat().st_size < run.checkpoint.stat().st_size * 0.75
    with pytest.raises(RuntimeError, match="zip archive"):  # the torn write is not a checkpoint
        torch.load(tmp, map_location="cpu", weights_only=True)
    assert_unfinished(run, 6)
    resume_to_the_end(run, args, 6, uninterrupted)


def test_sigkill_of_a_free_running_run_between_checkpoints(tmp_path, args, uninterrupted):
    """No hold: the test polls the run, and once checkpoint 3 is on disk and the run has begun the
    step after the next (step 3 done in memory, checkpoint 6 about two steps away), it kills it
    at once. Where the kill lands is whatever the timing made it; the checkpoint found after it
    must be loadable, not the last one, and the restart must resume there."""
    run = Run(tmp_path, *args)
    run.wait_for(lambda: max(run.steps(), default=0) >= 4 and checkpoint_step(run.checkpoint) >= 3)
    run.sigkill()
    killed_at = run.steps()[-1]  # the step begun last
    checkpoint = checkpoint_step(run.checkpoint)
    assert checkpoint % SAVE_EVERY == 0 and 3 <= checkpoint <= killed_at + 1
    assert_unfinished(run, checkpoint)
    print(f"killed in step {killed_at} with checkpoint {checkpoint} on disk")
    resume_to_the_end(run, args, checkpoint, uninterrupted)


def test_sigkill_while_saving_the_drafter_resumes(tmp_path, args, uninterrupted):
    """Killed in the final save: the last checkpoint (step 12) is written and so is the drafter's
    config.json, but not model.safetensors, eval.json or training.json. The same command should
    finish the save from the checkpoint (pipeline._killed_while_saving)."""
    run = Run(tmp_path, *args, hold_in_final_save=True)
    assert run.wait_for(run.marker) == {"final_save": True}
    run.sigkill()
    assert checkpoint_step(run.checkpoint) == STEPS
    assert (run.out / "config.json").is_file() and not (run.out / "model.safetensors").exists()
    again = Run(run.dir, *args)  # its checkpoint and run.json, no training.json: a torn save
    assert again.finish() == {"finished": True, "steps_done": STEPS}
    assert again.steps() == []  # nothing retrained: the checkpoint is the last step's
    assert_same_weights(uninterrupted, run.out)
