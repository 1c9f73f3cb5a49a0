"""CPU-only test scaffolding: let vLLM 0.32's Ray executor run on vLLM's CPU platform.

Not part of the product. ReDrafter's Ray path is the GPU one (``CudaPlatform.ray_device_key ==
"GPU"``); its worker code is the same on CPU, so these shims let the CPU test suite drive vLLM's
Ray executor (``RayExecutorV2``) end to end. vLLM 0.32's CPU platform declares no Ray device, so
without them ``initialize_ray_cluster`` raises "current platform cpu does not support ray".

Two patches, applied in every process that runs vLLM's Ray code (the engine core, each Ray
worker):

1. ``CpuPlatform.ray_device_key = RESOURCE``: a custom Ray resource stands for a device. The
   placement group asks for one ``{RESOURCE: 1}`` bundle per TP rank, so every Ray node (head,
   ``ray start``, ``Cluster.add_node``) must be started with ``resources={RESOURCE: n}``.
2. ``RayWorkerProc.get_node_and_physical_gpu_ids`` (and the legacy executor's
   ``RayWorkerWrapper.get_node_and_physical_gpu_ids``) return ``(node id, [0])``: vLLM looks the
   device key up among Ray's *accelerator* ids, which a custom resource is not (KeyError). On CPU
   the id only fills ``parallel_config.assigned_physical_gpu_ids``, which the CPU worker ignores.

How they reach Ray's worker processes: ``tests/ray_cpu_site/sitecustomize.py`` calls
:func:`install_from_env` at interpreter start when ``ray_cpu_site`` is on ``PYTHONPATH`` and
:data:`RESOURCE_ENV` is set (:func:`worker_env` gives both). Ray workers inherit the environment
of the raylet, which inherits the one of the process that started it (``ray.init``,
``Cluster``, ``ray start``), so set it before starting Ray. The patches are post-import hooks:
nothing imports vLLM at interpreter start (Ray's own helper processes stay light).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

RESOURCE = "redrafter_cpu_device"
"""The custom Ray resource standing for one CPU "device" (one TP rank) in these tests."""
RESOURCE_ENV = "REDRAFTER_RAY_CPU_RESOURCE"
"""Environment variable carrying the resource name into every process; unset: no shims."""
SITE_DIR = Path(__file__).resolve().parent / "ray_cpu_site"
"""Put on PYTHONPATH: its sitecustomize.py installs the shims in every new Python process."""
_PATCHED = "_redrafter_ray_cpu_shim"


def worker_env(resource: str = RESOURCE, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default ``os.environ``) with the shims switched on for every Python started
    from it: the site dir first on PYTHONPATH, :data:`RESOURCE_ENV` set; Ray's memory monitor
    off."""
    env = dict(os.environ if env is None else env)
    paths = [str(SITE_DIR), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                              if p and p != str(SITE_DIR)]]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env[RESOURCE_ENV] = resource
    # Ray's memory monitor kills workers when the whole machine nears its memory limit; on a
    # shared 2-core test machine that is other jobs' memory, and a killed worker fails the test.
    env.setdefault("RAY_memory_monitor_refresh_ms", "0")
    return env


def _patch_platform(module: ModuleType, resource: str) -> None:
    module.CpuPlatform.ray_device_key = resource


def _patch_worker_class(cls: type) -> None:
    if getattr(cls.get_node_and_physical_gpu_ids, _PATCHED, False):
        return

    def get_node_and_physical_gpu_ids(self) -> tuple[str, list[int]]:
        import ray

        return ray.get_runtime_context().get_node_id(), [0]

    setattr(get_node_and_physical_gpu_ids, _PATCHED, True)
    get_node_and_physical_gpu_ids.__wrapped__ = cls.get_node_and_physical_gpu_ids
    cls.get_node_and_physical_gpu_ids = get_node_and_physical_gpu_ids


def _patch_executor(module: ModuleType) -> None:
    _patch_worker_class(module.RayWorkerProc)  # RayExecutorV2, vLLM's default Ray executor


def _patch_legacy_worker(module: ModuleType) -> None:
    if getattr(module, "ray", None) is not None:  # RayWorkerWrapper exists only with Ray installed
        _patch_worker_class(module.RayWorkerWrapper)  # the legacy RayDistributedExecutor


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs ``patch(module)`` right after one of the named modules is first executed."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]):
        self.patches = patches

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        patch = self.patches[fullname]

        class PatchingLoader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                patch(module)

        spec.loader = PatchingLoader()
        return spec


def install(resource: str = RESOURCE) -> None:
    """Apply both patches in this process: now for modules already imported, else on import."""
    patches: dict[str, Callable[[ModuleType], None]] = {
        "vllm.platforms.cpu": lambda m: _patch_platform(m, resource),
        "vllm.v1.executor.ray_executor_v2": _patch_executor,
        "vllm.v1.executor.ray_utils": _patch_legacy_worker,
    }
    pending = {}
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            pending[name] = patch
    if pending and not any(isinstance(f, _PostImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportHook(pending))


def install_from_env() -> None:
    """:func:`install` with the resource named by :data:`RESOURCE_ENV`; nothing if it is unset."""
    resource = os.environ.get(RESOURCE_ENV)
    if resource:
        install(resource)


def uninstall() -> None:
    """Undo :func:`install` in this process (vLLM's own values back, no import hook)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PostImportHook)]
    if "vllm.platforms.cpu" in sys.modules:
        sys.modules["vllm.platforms.cpu"].CpuPlatform.ray_device_key = ""
    for module_name, class_name in (("vllm.v1.executor.ray_executor_v2", "RayWorkerProc"),
                                    ("vllm.v1.executor.ray_utils", "RayWorkerWrapper")):
        cls = getattr(sys.modules.get(module_name), class_name, None)
        method = getattr(cls, "get_node_and_physical_gpu_ids", None)
        if getattr(method, _PATCHED, False):
            cls.get_node_and_physical_gpu_ids = method.__wrapped__
