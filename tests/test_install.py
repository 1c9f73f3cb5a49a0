"""The pinned stack installs and loads, and the wheel carries what a user needs."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

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
