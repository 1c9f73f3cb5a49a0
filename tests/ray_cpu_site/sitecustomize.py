"""Installs tests/ray_cpu_shims.py in every Python process started with this folder on PYTHONPATH
(test scaffolding for vLLM's Ray executor on CPU; see that module). Does nothing unless
REDRAFTER_RAY_CPU_RESOURCE is set."""

import os
import sys

if os.environ.get("REDRAFTER_RAY_CPU_RESOURCE"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        import ray_cpu_shims
    finally:
        sys.path.pop(0)
    ray_cpu_shims.install_from_env()
