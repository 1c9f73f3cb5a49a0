"""The few patches vllm-redrafter makes to the pinned vLLM (0.32.0), applied at plugin load.

Installed as ``vllm_redrafter.patches`` (see pyproject.toml's package-dir mapping). Each patch is a
small module that says which vLLM function it wraps and why no extension point serves.
"""

PINNED_VLLM_VERSION = "0.32.0"
