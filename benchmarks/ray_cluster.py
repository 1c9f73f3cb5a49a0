"""ReDrafter over vLLM's Ray executor on a CPU: Ray vs multiprocessing, two nodes, a worker killed.

Three parts (``--parts``, default all), the embedded target with the shipped drafter (W=4, L=3,
fixed shape), TP = 3 (the target's 9 query / 3 KV heads split as 1 or 3):

- ``single``: one node. ReDrafter over Ray (``distributed_executor_backend="ray"``, vLLM's
  ``RayExecutorV2``) and over multiprocessing (``"mp"``), each engine in a fresh process: Ray's
  start, the engine's start (``LLM(...)``), greedy tokens/s over N MT-Bench prompts x M tokens in
  one batch; greedy output against vLLM alone (TP = 1, plugin not loaded), seeded sampling
  against the single-worker ReDrafter engine, each worker's tree-verifier counters.
- ``two_node``: a Ray cluster of two nodes simulated on this machine (``ray.cluster_utils.Cluster``:
  a head with 1 device slot, a second node with 2), the engine's driver on the head: the three
  TP workers are placed on both nodes; the same checks.
- ``kill``: ``vllm-redrafter serve ... --distributed-executor-backend ray --tensor-parallel-size 3``
  on that cluster, with concurrent chat requests (streamed and not) in flight; one Ray worker is
  SIGKILLed mid-generation (one on the second node, then, with a fresh server, the one on the
  driver's node): the seconds from the kill to the server's exit, its exit code, the error it
  logged, what each client received, and whether any worker process was left behind.

On a CPU, vLLM 0.32's Ray executor needs the test suite's shims (``tests/ray_cpu_shims.py``: a
custom Ray resource stands in for a device); they reach every process through
``tests/ray_cpu_site`` on PYTHONPATH. The Ray nodes here share one machine: the TP all-reduce
between "nodes" still goes through shared memory, only vLLM's control plane (placement, the
message queues over TCP to the second node, worker monitoring) sees two nodes.

    python benchmarks/ray_cluster.py [--parts single,two_node,kill] [--num-prompts 6]
        [--max-tokens 64] [--repeats 2] [--out benchmarks/results/ray_cluster.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
DEFAULT_DRAFTER = REPO / "vllm_redrafter" / "default_drafter"
TP = 3
COUNTERS = ("num_tree_verifications", "num_branching_verifications", "num_kv_moves")
PARTS = ("single", "two_node", "kill")


def shims():
    sys.path.insert(0, str(TESTS))
    import ray_cpu_shims

    return ray_cpu_shims


def shim_env() -> dict[str, str]:
    """The environment entries that switch the CPU shims on in every process started with them."""
    ray_cpu = shims()
    env = ray_cpu.worker_env()
    keys = ("PYTHONPATH", ray_cpu.RESOURCE_ENV, "RAY_memory_monitor_refresh_ms")
    return {k: env[k] for k in keys}


def engine_kwargs(target: str) -> dict:
    return dict(model=target, dtype="float32", enforce_eager=True, max_model_len=1024,
                kv_cache_memory_bytes=256 << 20, seed=0)


def spec_config(drafter: Path) -> dict:
    return {"method": "redrafter", "model": str(drafter), "beam_width": 4, "beam_length": 3,
            "beam_policy": "fixed"}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# -- one engine in a fresh process (``--child JOB OUT``) ------------------------------------------


def child(job_file: Path, out_file: Path) -> None:
    job = json.loads(job_file.read_text())
    result: dict = {"load_before": load()}
    if job.get("ray") is not None:
        shims().install_from_env()
        import ray

        start = time.perf_counter()
        if "address" in job["ray"]:
            ray.init(address=job["ray"]["address"], log_to_driver=False)
        else:
            ray.init(**job["ray"]["init"], include_dashboard=False, log_to_driver=False)
        result["ray_start_s"] = time.perf_counter() - start
        result["driver_ray_node"] = ray.get_runtime_context().get_node_id()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    llm = LLM(**job["engine"], disable_log_stats=False)
    result["engine_start_s"] = time.perf_counter() - start
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    result["executor"] = type(executor).__name__
    round_trips = []
    take = executor.take_draft_token_ids
    executor.take_draft_token_ids = lambda: round_trips.append(1) or take()
    spec = job["engine"].get("speculative_config") is not None

    def state(wrapper):  # runs in each worker (a local function: cloudpickle sends it by value)
        import os

        import torch

        node = actor = None
        try:
            import ray

            if ray.is_initialized():
                node = ray.get_runtime_context().get_node_id()
                actor = ray.get_runtime_context().get_actor_id()
        except ImportError:
            pass
        runner = wrapper.worker.model_runner
        return {"pid": os.getpid(), "ray_node": node, "ray_actor": actor,
                "proposer": type(runner.drafter).__name__ if hasattr(runner, "drafter") else None,
                "num_threads": torch.get_num_threads(),
                **{k: getattr(runner.rejection_sampler, k, 0) for k in COUNTERS}}

    def spec_counts() -> dict:
        return {m.name: m.value for m in llm.get_metrics()
                if m.name in ("vllm:spec_decode_num_drafts",
                              "vllm:spec_decode_num_accepted_tokens")}

    def generate(prompts, params):
        sampling = ([SamplingParams(**p) for p in params] if isinstance(params, list)
                    else SamplingParams(**params))
        out = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sampling,
                           use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    generate(job["runs"][0]["prompts"][:1], {"temperature": 0.0, "max_tokens": 4})  # warm-up
    result["runs"] = {}
    for run in job["runs"]:
        before = llm.collective_rpc(state) if spec else None
        counts = spec_counts()
        start = time.perf_counter()
        outputs = generate(run["prompts"], run["params"])
        seconds = time.perf_counter() - start
        record = {"outputs": outputs, "seconds": seconds,
                  "tokens": sum(map(len, outputs)),
                  "tokens_per_s": sum(map(len, outputs)) / seconds}
        if spec:
            after = llm.collective_rpc(state)
            record["workers"] = [{**{k: v for k, v in a.items() if k not in COUNTERS},
                                  **{k: a[k] - b[k] for k in COUNTERS}}
                                 for a, b in zip(after, before)]
            record.update({k.removeprefix("vllm:spec_decode_"): v - counts.get(k, 0)
                           for k, v in spec_counts().items()})
        result["runs"][run["name"]] = record
    result["take_draft_token_ids_calls"] = len(round_trips)
    result["load_after"] = load()
    out_file.write_text(json.dumps(result))
    llm.llm_engine.engine_core.shutdown()


def run_child(job: dict, env: dict[str, str], work: Path, name: str, timeout: float = 1800) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / f"{name}.json").write_text(json.dumps(job))
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1", **env})
    start = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        run = subprocess.run([sys.executable, __file__, "--child", str(work / f"{name}.json"),
                              str(work / f"{name}.out.json")], env=full_env, stdout=log,
                             stderr=subprocess.STDOUT, timeout=timeout)
    if run.returncode != 0:
        tail = (work / f"{name}.log").read_text()[-4000:]
        raise RuntimeError(f"{name} failed ({run.returncode}):\n{tail}")
    result = json.loads((work / f"{name}.out.json").read_text())
    result["process_s"] = time.perf_counter() - start
    print(f"  {name}: engine start {result['engine_start_s']:.1f} s, "
          f"{result['runs'][next(iter(result['runs']))]['tokens_per_s']:.1f} tokens/s", flush=True)
    return result


def check(result: dict, references: dict) -> dict:
    """Greedy vs vLLM alone, seeded vs the single-worker engine, trees in every worker."""
    greedy, seeded = result["runs"]["greedy"], result["runs"]["seeded"]
    figures = {
        "greedy_identical_to_vllm_alone": greedy["outputs"] == references["alone"],
        "greedy_prompts_identical": sum(a == b for a, b in zip(greedy["outputs"],
                                                                references["alone"])),
        "seeded_identical_to_one_worker": seeded["outputs"] == references["one_worker"],
        "drafts_handed_off_in_step_output": result["take_draft_token_ids_calls"] == 0,
    }
    for name, run in (("greedy", greedy), ("seeded", seeded)):
        workers = run["workers"]
        counters = [{k: w[k] for k in COUNTERS} for w in workers]
        figures[f"{name}_workers"] = len(workers)
        figures[f"{name}_worker_counters"] = counters[0]
        figures[f"{name}_same_trees_and_kv_moves_in_every_worker"] = all(
            c == counters[0] for c in counters)
        figures[f"{name}_branching_trees_in_every_worker"] = all(
            c["num_branching_verifications"] > 0 for c in counters)
        figures[f"{name}_steps_with_drafts"] = run.get("num_drafts")
        figures[f"{name}_accepted_tokens"] = run.get("num_accepted_tokens")
    figures["worker_pids_distinct"] = len({w["pid"] for w in greedy["workers"]}) == TP
    figures["ray_nodes_used"] = len({w["ray_node"] for w in greedy["workers"]} - {None})
    figures["worker_threads"] = [w["num_threads"] for w in greedy["workers"]]
    return figures


# -- the parts ----------------------------------------------------------------------------------


def jobs(target: str, drafter: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    greedy = {"temperature": 0.0, "max_tokens": max_tokens}
    seeded = [{"temperature": 0.8, "seed": 100 + i, "max_tokens": 32, "ignore_eos": True}
              for i in range(len(prompts))]
    spec = {**engine_kwargs(target), "speculative_config": spec_config(drafter)}
    return {
        "alone": {"engine": engine_kwargs(target),
                  "runs": [{"name": "greedy", "prompts": prompts, "params": greedy}]},
        "one_worker": {"engine": spec,
                       "runs": [{"name": "greedy", "prompts": prompts, "params": greedy},
                                {"name": "seeded", "prompts": prompts, "params": seeded}]},
        "tp3": lambda backend: {
            "engine": {**spec, "tensor_parallel_size": TP, "distributed_executor_backend": backend},
            "runs": [{"name": "greedy", "prompts": prompts, "params": greedy},
                     {"name": "seeded", "prompts": prompts, "params": seeded}]},
    }


def references(job: dict, work: Path) -> dict:
    alone = run_child(job["alone"], {"VLLM_PLUGINS": ""}, work, "alone")
    one = run_child(job["one_worker"], {}, work, "one_worker")
    return {"alone": alone["runs"]["greedy"]["outputs"],
            "one_worker": one["runs"]["seeded"]["outputs"],
            "alone_tokens_per_s": alone["runs"]["greedy"]["tokens_per_s"],
            "one_worker_tokens_per_s": one["runs"]["greedy"]["tokens_per_s"],
            "alone_engine_start_s": alone["engine_start_s"],
            "one_worker_engine_start_s": one["engine_start_s"]}


def part_single(job: dict, refs: dict, work: Path, repeats: int) -> dict:
    """Ray and multiprocessing, ``repeats`` engines each, alternating (ray, mp, mp, ray, ...):
    each run's figures, and the median of each figure over the runs."""
    import statistics

    runs: dict[str, list[dict]] = {"ray": [], "mp": []}
    for i in range(repeats):
        for backend in (("ray", "mp") if i % 2 == 0 else ("mp", "ray")):
            runs[backend].append(single_run(job, refs, work, backend, f"tp3_{backend}_{i}"))
    out = {}
    for backend, records in runs.items():
        out[backend] = {"runs": records, **{
            f"median_{k}": statistics.median(r[k] for r in records)
            for k in ("engine_start_s", "greedy_tokens_per_s", "seeded_tokens_per_s")}}
        if backend == "ray":
            out[backend]["median_ray_start_s"] = statistics.median(
                r["ray_start_s"] for r in records)
    return out


def single_run(job: dict, refs: dict, work: Path, backend: str, name: str) -> dict:
    ray_cpu = shims()
    if backend == "ray":
        env = shim_env()
        run_job = {**job["tp3"]("ray"), "ray": {"init": {
            "num_cpus": 8, "resources": {ray_cpu.RESOURCE: TP},
            "object_store_memory": 150 << 20}}}
    else:
        env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # 3 workers on 2 cores: no pinning
        run_job = job["tp3"]("mp")
    result = run_child(run_job, env, work, name)
    return {"ray_start_s": result.get("ray_start_s"),
            "engine_start_s": result["engine_start_s"],
            "greedy_tokens_per_s": result["runs"]["greedy"]["tokens_per_s"],
            "greedy_seconds": result["runs"]["greedy"]["seconds"],
            "seeded_tokens_per_s": result["runs"]["seeded"]["tokens_per_s"],
            "executor": result["executor"], "load_before": result["load_before"],
            "load_after": result["load_after"], **check(result, refs)}


def start_cluster(head_slots: int, second_slots: int):
    """Two Ray nodes on this machine, each with its device slots; the shims in their env."""
    ray_cpu = shims()
    os.environ.update(ray_cpu.worker_env())  # inherited by both nodes' raylets and workers
    from ray.cluster_utils import Cluster

    start = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 8, "resources": {ray_cpu.RESOURCE: head_slots}, "include_dashboard": False})
    second = cluster.add_node(num_cpus=8, resources={ray_cpu.RESOURCE: second_slots})
    cluster.wait_for_nodes()
    return cluster, second, time.perf_counter() - start


def part_two_node(job: dict, refs: dict, work: Path, cluster, start_s: float) -> dict:
    run_job = {**job["tp3"]("ray"), "ray": {"address": cluster.address}}
    env = shim_env()
    result = run_child(run_job, env, work, "tp3_ray_two_node")
    head = cluster.head_node.node_id
    placement = [("head" if w["ray_node"] == head else "second") + f" (rank {i})"
                 for i, w in enumerate(result["runs"]["greedy"]["workers"])]
    driver = "head" if result["driver_ray_node"] == head else "second"
    return {"cluster_start_s": start_s, "driver_node": driver,
            "engine_start_s": result["engine_start_s"],
            "greedy_tokens_per_s": result["runs"]["greedy"]["tokens_per_s"],
            "placement": placement, "executor": result["executor"], **check(result, refs)}


def worker_pids(node) -> list[int]:
    """PIDs of vLLM's Ray worker actors (``ray::RayWorkerProc``) under a node's raylet."""
    import psutil
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    pids = []
    for proc in psutil.Process(raylet).children(recursive=True):
        try:
            if "RayWorkerProc" in " ".join(proc.cmdline()):
                pids.append(proc.pid)
        except psutil.Error:
            pass
    return pids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client(base: str, model: str, question: str, stream: bool, temperature: float,
           max_tokens: int, progress: dict, key: int) -> dict:
    """One chat request; what came back: status, content tokens received, the error if any."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": temperature, "seed": key,
            "ignore_eos": True, "stream": stream}
    request = urllib.request.Request(f"{base}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    record = {"stream": stream, "status": None, "chunks": 0, "finished": False, "error": None}
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=900) as response:
            record["status"] = response.status
            if stream:
                for raw in response:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        record["done_marker"] = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        record["error"] = json.dumps(event["error"])[:300]
                        continue
                    choice = event["choices"][0]
                    record["chunks"] += bool(choice.get("delta", {}).get("content"))
                    progress[key] = record["chunks"]
                    if choice.get("finish_reason"):
                        record["finished"] = choice["finish_reason"]
            else:
                answer = json.loads(response.read())
                record["finished"] = answer["choices"][0]["finish_reason"]
                record["completion_tokens"] = answer["usage"]["completion_tokens"]
    except urllib.error.HTTPError as err:
        record["status"] = err.code
        record["error"] = err.read().decode(errors="replace")[:300]
    except Exception as err:  # connection reset or closed mid-stream: what the client saw
        record["error"] = f"{type(err).__name__}: {err}"[:300]
    record["seconds"] = time.monotonic() - start
    record["ended_after_kill_s"] = None
    record["end_time"] = time.monotonic()
    return record


def kill_scenario(cluster, second_node, target: str, drafter: Path, questions: list[str],
                  victim: str, work: Path, num_clients: int, max_tokens: int) -> dict:
    ray_cpu = shims()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    command = ["vllm-redrafter", "serve", target, "--speculative-config",
               json.dumps(spec_config(drafter)), "--dtype", "float32", "--enforce-eager",
               "--max-model-len", "1024", "--kv-cache-memory-bytes", str(256 << 20),
               "--tensor-parallel-size", str(TP), "--distributed-executor-backend", "ray",
               "--port", str(port)]
    env = {k: v for k, v in ray_cpu.worker_env().items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS")}
    env.update({"RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1"})
    log_path = work / f"server_kill_{victim}.log"
    log = log_path.open("w")
    start = time.monotonic()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    record: dict = {"victim": victim}
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"server exited {server.returncode}: "
                                   f"{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - start > 1500:
                raise RuntimeError("server not healthy in 1500 s")
            time.sleep(2)
        record["server_start_s"] = time.monotonic() - start
        nodes = {"second_node": second_node, "driver_node": cluster.head_node}
        pids = {name: worker_pids(node) for name, node in nodes.items()}
        record["worker_pids_per_node"] = {k: len(v) for k, v in pids.items()}
        progress: dict[int, int] = {}
        results: list[dict | None] = [None] * num_clients
        threads = []
        for i in range(num_clients):
            args = (base, target, questions[i % len(questions)], i % 2 == 0,
                    0.0 if i % 4 < 2 else 0.8, max_tokens, progress, i)
            thread = threading.Thread(target=lambda i=i, a=args: results.__setitem__(i, client(*a)),
                                      daemon=True)
            thread.start()
            threads.append(thread)
        deadline = time.monotonic() + 600
        while sum(progress.values()) < 8 * (num_clients // 2) and time.monotonic() < deadline:
            time.sleep(0.2)
        record["streamed_chunks_before_kill"] = sum(progress.values())
        from vllm_redrafter.demo import metric_totals

        with urllib.request.urlopen(f"{base}/metrics", timeout=60) as response:
            totals = metric_totals(response.read().decode(), (
                "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"))
        record["steps_with_drafts_before_kill"] = totals["vllm:spec_decode_num_drafts_total"]
        record["accepted_tokens_before_kill"] = totals["vllm:spec_decode_num_accepted_tokens_total"]
        pid = pids[victim][0]
        kill_time = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        record["killed_pid_node"] = victim
        try:
            server.wait(timeout=600)
            record["server_exit_after_kill_s"] = time.monotonic() - kill_time
            record["server_exit_code"] = server.returncode
            record["hung"] = False
        except subprocess.TimeoutExpired:
            record["hung"] = True
        for thread in threads:
            thread.join(timeout=120)
        record["clients_still_waiting"] = sum(t.is_alive() for t in threads)
        for r in results:
            if r is not None:
                r["ended_after_kill_s"] = r.pop("end_time") - kill_time
        record["clients"] = results
        time.sleep(10)
        record["worker_processes_left_after_10_s"] = sum(len(worker_pids(n))
                                                         for n in nodes.values())
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)  # our server's own session
            server.wait()
        log.close()
    text = log_path.read_text(errors="replace")
    keys = ("died unexpectedly", "EngineDeadError", "RayWorkerProc failed", "ActorDiedError",
            "Engine core", "shutdown", "Shutting down")
    record["server_log_lines"] = [line.strip()[:300] for line in text.splitlines()
                                  if any(k in line for k in keys)][:30]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2,
                        help="engines per backend in part single (alternating order)")
    parser.add_argument("--kill-clients", type=int, default=6)
    parser.add_argument("--kill-max-tokens", type=int, default=400)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "ray_cluster.json")
    parser.add_argument("--child", nargs=2, type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(*args.child)
    parts = args.parts.split(",")
    assert set(parts) <= set(PARTS), parts
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    from transformers import AutoTokenizer

    from vllm_redrafter.demo import machine
    from vllm_redrafter.eval_sets import first_turns
    from vllm_redrafter.reference_loop import chat_prompt_ids
    from vllm_redrafter.results import write_json
    from vllm_redrafter.target import prepare_target

    target = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    questions = first_turns()
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions[:args.num_prompts]]
    job = jobs(target, args.drafter, prompts, args.max_tokens)
    import ray

    results: dict = {
        "machine": machine(), "ray": ray.__version__, "tensor_parallel_size": TP,
        "drafter": str(args.drafter), "beam": {"width": 4, "length": 3, "policy": "fixed"},
        "prompts": args.num_prompts, "max_tokens": args.max_tokens,
        "note": "2-core machine shared with other jobs: see each run's load averages",
    }

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, results)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if {"single", "two_node"} & set(parts):
            print("references (vLLM alone, TP=1; single-worker ReDrafter)", flush=True)
            refs = references(job, work)
            results["references"] = {k: v for k, v in refs.items()
                                     if k not in ("alone", "one_worker")}
        if "single" in parts:
            print("single node, TP=3: Ray vs multiprocessing", flush=True)
            results["single_node"] = part_single(job, refs, work, args.repeats)
            save()
        if {"two_node", "kill"} & set(parts):
            cluster, second, start_s = start_cluster(head_slots=1, second_slots=2)
            try:
                if "two_node" in parts:
                    print("two-node Ray cluster, TP=3", flush=True)
                    results["two_node"] = part_two_node(job, refs, work, cluster, start_s)
                    save()
                if "kill" in parts:
                    results["worker_kill"] = []
                    for victim in ("second_node", "driver_node"):
                        print(f"serve on two nodes, kill a worker on the {victim}", flush=True)
                        results["worker_kill"].append(kill_scenario(
                            cluster, second, target, args.drafter, questions, victim, work,
                            args.kill_clients, args.kill_max_tokens))
                        save()
            finally:
                cluster.shutdown()
    save()
    print(json.dumps({k: v for k, v in results.items() if k != "worker_kill"}, indent=1))


if __name__ == "__main__":
    main()
