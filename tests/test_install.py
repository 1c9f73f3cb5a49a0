"""The pinned stack installs and loads, and the wheel carries what a user needs."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

from vllm_redrafter.eval_sets import MT_BENCH, MT_BENCH_SHA256, read_questions

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
              "humanities")

REPO = Path(__file__).resolve().parents[1]


def test_transformers_and_vllm_import_together():
    # PyPI's torchvision/torchaudio/torchcodec break `import transformers` beside the CPU torch:
    # the install step removes them. A fresh interpreter shows the result as a user gets it.
    code = "import transformers, vllm, torch; print(vllm.__version__, torch.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    vllm_version, torch_version = out.stdout.split()[-2:]
    assert vllm_version == "0.32.0"
    assert torch_version.startswith("2.13.0")


def test_wheel_ships_patches_as_a_subpackage(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("vllm_redrafter-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "vllm_redrafter/patches/__init__.py" in names
    assert not any(name.startswith("patches/") for name in names)
    # the demo's evaluation set is package data, with its attribution and licence note
    with zipfile.ZipFile(wheel) as archive:
        data = archive.read("vllm_redrafter/data/mt_bench_questions.jsonl")
        note = archive.read("vllm_redrafter/data/README.md").decode()
    assert hashlib.sha256(data).hexdigest() == MT_BENCH_SHA256
    assert "Apache License 2.0" in note and "FastChat" in note


def test_mt_bench_is_the_80_questions_in_8_categories():
    questions = read_questions(MT_BENCH)
    assert hashlib.sha256(MT_BENCH.read_bytes()).hexdigest() == MT_BENCH_SHA256
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    assert Counter(q.category for q in questions) == {c: 10 for c in CATEGORIES}


def test_nothing_in_the_repository_reads_or_cites_a_path_outside_it():
    """A user's clone has nothing beside it: no tracked file names the team's folder beside the
    checkout, and no tracked file records an absolute path of the machine it was made on."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True,
                           check=True).stdout.split()
    outside = re.compile(r"\.\./shared|(?<![\w.~])/(root|work|home/\w+)/|\bDESIGN\.md|VLLM_SEAM|"
                         r"CPU_COSTS|H100_VERIFY_COST|DRAFTER_FEASIBILITY")
    # the written training requests are users' texts (a backup script may name /home/maria/...)
    exempt = re.compile(r"(\.safetensors|\.png|train/written_prompts.*\.jsonl|tests/test_install\.py)$")
    hits = [f"{name}:{n}" for name in files if (REPO / name).is_file() and not exempt.search(name)
            for n, line in enumerate((REPO / name).read_text(errors="replace").splitlines(), 1)
            if outside.search(line)]
    assert not hits, hits[:20]
