"""ReDrafter under vLLM's Ray executor (``distributed_executor_backend="ray"``), TP = 3 on CPU.

vLLM 0.32's Ray executor (``RayExecutorV2``, its default) places one Ray actor per TP rank; each
actor runs vLLM's own worker, which loads the plugin (``vllm.general_plugins``) and with it the
drafter, the tree attention and the tree verifier, as under multiprocessing. Here: greedy output is
vLLM alone's (TP = 1, plugin not loaded) on MT-Bench prompts, every worker verified the same
branching trees and moved the same KV slots (of its own heads), the drafts reached the scheduler
inside the step output (``patches/draft_handoff.py``), and seeded sampling gives what the
single-worker ReDrafter engine gives.

vLLM's CPU platform declares no Ray device: ``tests/ray_cpu_shims.py`` (test scaffolding, see
there) stands a custom Ray resource in for one, in this process (the engine core runs in-process)
and in every Ray worker (through ``tests/ray_cpu_site/sitecustomize.py`` on PYTHONPATH). On a GPU
none of that is needed. The two-node cluster and the worker-kill checks are
``benchmarks/ray_cluster.py`` (docs/ray.md).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import ray_cpu_shims
from _vllm_generate import finish_job, start_job, stop_job
from conftest import DEFAULT_DRAFTER, chat_prompts

pytestmark = pytest.mark.slow

NUM_PROMPTS, MAX_TOKENS = 4, 32  # a wrong KV slot in one worker shows within tokens
TP = 3  # the embedded target's 9 query / 3 KV heads split as 1 or 3
GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
SEEDED = [dict(temperature=0.8, seed=100 + i, max_tokens=24, ignore_eos=True)
          for i in range(NUM_PROMPTS)]
COUNTERS = ("num_tree_verifications", "num_branching_verifications", "num_kv_moves")


def engine_kwargs(target_dir: Path) -> dict:
    return dict(model=str(target_dir), dtype="float32", enforce_eager=True, max_model_len=1024,
                kv_cache_memory_bytes=256 << 20, seed=0)


def spec_config(drafter_dir: Path) -> dict:
    return {"method": "redrafter", "model": str(drafter_dir), "beam_width": 4, "beam_length": 3,
            "beam_policy": "fixed"}


@pytest.fixture(scope="module")
def prompts(target_dir, mt_bench_questions) -> list[list[int]]:
    """The first NUM_PROMPTS MT-Bench first turns in the target's chat template, as token ids."""
    return chat_prompts(target_dir, mt_bench_questions[:NUM_PROMPTS])


@pytest.fixture(scope="module")
def references(target_dir, drafter_dir, prompts, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Greedy of vLLM alone (TP = 1, plugin not loaded); seeded sampling of the single-worker
    ReDrafter engine. Each in a fresh process (tests/_vllm_generate.py), side by side: one
    OpenMP thread each, the two cores."""
    work = tmp_path_factory.mktemp("ray_references")
    jobs = {
        "alone": ({"engine": engine_kwargs(target_dir),
                   "runs": [{"prompts": prompts, "params": GREEDY}]}, {"VLLM_PLUGINS": ""}),
        "one_worker": ({"engine": {**engine_kwargs(target_dir),
                                   "speculative_config": spec_config(drafter_dir)},
                        "runs": [{"prompts": prompts, "params": SEEDED}]}, {}),
    }
    start = time.monotonic()
    running = {name: start_job(job, work / name, {"OMP_NUM_THREADS": "1", **extra_env})
               for name, (job, extra_env) in jobs.items()}
    outputs = {}
    try:
        for name, run in running.items():
            result = finish_job(run, work / name, timeout=600)
            assert result["plugin_patched"] is (name != "alone")
            outputs[name] = result["outputs"][0]
    finally:
        for run in running.values():
            stop_job(run)
    print(f"\nreferences: {time.monotonic() - start:.0f} s")
    return outputs


@pytest.fixture(scope="module")
def ray_llm(target_dir, drafter_dir, references):
    """A ReDrafter engine over vLLM's Ray executor, TP = 3, on a one-node Ray started here.

    The engine core runs in this process (its executor and metrics are reachable); the three
    workers are Ray actors. The shims are switched on in this process and, through the
    environment Ray's processes inherit, in each worker."""
    try:
        import ray
    except ImportError:
        pytest.fail("Ray is not installed: install the extra vllm-redrafter[ray] "
                    "(scripts/install.sh does)")

    keys = (*ray_cpu_shims.worker_env(env={}), "VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_NUM_THREADS")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(ray_cpu_shims.worker_env())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread per worker: 3 workers on 2 cores
    ray_cpu_shims.install()
    start = time.monotonic()
    # Ray schedules the workers by the custom resource (one per TP rank); its own CPU count only
    # admits them (vLLM asks num_cpus=0 for its actors, Ray's helpers need a few).
    ray.init(num_cpus=8, resources={ray_cpu_shims.RESOURCE: TP}, include_dashboard=False,
             object_store_memory=150 << 20, log_to_driver=False)  # vLLM passes no big objects
    from vllm import LLM

    llm = None
    try:
        llm = LLM(**engine_kwargs(target_dir), tensor_parallel_size=TP,
                  distributed_executor_backend="ray", disable_log_stats=False,
                  speculative_config=spec_config(drafter_dir))
        print(f"\nRay and the TP={TP} engine started in {time.monotonic() - start:.0f} s")
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
        ray.shutdown()
        ray_cpu_shims.uninstall()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def worker_states(llm) -> list[dict]:
    """Each TP worker's view, gathered through vLLM's collective RPC (rank order)."""

    def state(wrapper):  # runs in each worker; a local function: cloudpickle sends it by value
        import os

        import ray
        import torch
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner

        runner = wrapper.worker.model_runner
        verifier = runner.rejection_sampler
        drafter = runner.drafter
        return {
            "pid": os.getpid(),
            "ray_actor": ray.get_runtime_context().get_actor_id(),
            "ray_node": ray.get_runtime_context().get_node_id(),
            "plugin_patched": all(getattr(getattr(GPUModelRunner, name), "_vllm_redrafter_patched",
                                          False) for name in ("_prepare_inputs", "sample_tokens")),
            "proposer": type(drafter).__name__,
            "drafter_loaded": getattr(drafter, "drafter", None) is not None,
            "num_threads": torch.get_num_threads(),
            **{name: getattr(verifier, name, 0)
               for name in ("num_tree_verifications", "num_branching_verifications",
                            "num_kv_moves")},
        }

    return llm.collective_rpc(state)


def generate(llm, prompts, params: dict | list[dict]) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = ([SamplingParams(**p) for p in params] if isinstance(params, list)
                else SamplingParams(**params))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling,
                           use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def spec_counts(llm) -> dict[str, int]:
    return {m.name: m.value for m in llm.get_metrics()
            if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens")}


def test_ray_tp3_greedy_is_vllm_alone_with_trees_in_every_worker(ray_llm, drafter_dir, prompts,
                                                                 references, monkeypatch):
    executor = ray_llm.llm_engine.engine_core.engine_core.model_executor
    assert type(executor).__name__ == "RayExecutorV2"
    round_trips = []
    take = executor.take_draft_token_ids
    monkeypatch.setattr(executor, "take_draft_token_ids", lambda: round_trips.append(1) or take())
    before, counts_before = worker_states(ray_llm), spec_counts(ray_llm)

    assert generate(ray_llm, prompts, GREEDY) == references["alone"]

    after, counts = worker_states(ray_llm), spec_counts(ray_llm)
    drafts = counts["vllm:spec_decode_num_drafts"] - counts_before["vllm:spec_decode_num_drafts"]
    accepted = (counts["vllm:spec_decode_num_accepted_tokens"]
                - counts_before["vllm:spec_decode_num_accepted_tokens"])
    deltas = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    print(f"\nRay TP={TP}: {drafts} steps with drafts, {accepted} accepted; per worker {deltas}")
    # three Ray actors in three processes, each with the plugin's patches and the drafter
    assert len(after) == TP and len({w["pid"] for w in after}) == TP
    assert all(w["ray_actor"] and w["plugin_patched"] and w["proposer"] == "ReDrafterProposer"
               and w["drafter_loaded"] for w in after), after
    # every worker verified the same trees (branching ones, not the chain fallback) and moved the
    # same KV slots, each in its own heads' cache
    assert all(d == deltas[0] for d in deltas), deltas
    assert deltas[0]["num_branching_verifications"] > 0
    assert deltas[0]["num_tree_verifications"] == drafts
    if drafter_dir == DEFAULT_DRAFTER:
        assert deltas[0]["num_kv_moves"] > 0 and accepted > drafts / 2
    assert drafts > 0 and round_trips == []  # drafts handed over inside the step output


def test_ray_tp3_seeded_sampling_is_the_single_worker_engine(ray_llm, prompts, references):
    before = worker_states(ray_llm)
    assert generate(ray_llm, prompts, SEEDED) == references["one_worker"]
    after = worker_states(ray_llm)
    deltas = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before)]
    assert all(d == deltas[0] for d in deltas) and deltas[0]["num_branching_verifications"] > 0
