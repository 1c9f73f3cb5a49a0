"""Run vLLM's offline ``LLM.generate`` in a fresh process: ``python _vllm_generate.py JOB OUT``.

The tests' "vLLM alone" baseline runs here with ``VLLM_PLUGINS=""`` (once a process loaded the
plugin, its patches stay), and the plain plugin-loaded run with the plugin allowed.

JOB (json): {"engine": {LLM kwargs}, "runs": [run, ...], "metrics": bool, "env": {...}}
  ("env": environment variables set while this job's engine lives), or {"jobs": {name: job}}:
  each job's engine in turn in this one process (OUT is then {"jobs": {name: its OUT}}, each
  with "seconds": the job's time, engine start included; a job that raised has "error": its
  traceback, and the jobs after it still run). With "wait_for": a path, the process imports
  vLLM, then waits for that file to exist before it starts an engine. VLLM_PLUGINS is the
  process's, not a job's: vLLM loads plugins once a process, and the plugin loaded after an
  engine ran finds vLLM's attention backend already chosen (its trees fall back to chains).
  run: {"prompts": [[token ids]], "params": {...}} ("params" may also be a list: one dict per
       prompt, as :func:`sampling_params` reads it: "structured_outputs" holds
       StructuredOutputsParams kwargs, "logit_bias" JSON's string keys), or
       {"continue": [r, [i, ...]], "params": ...}: run r's prompt i + its output i (its first k
       tokens: [r, [i, ...], k]).
OUT (json): {"plugin_patched": bool, "outputs": [[token ids] per prompt] per run,
  "completions" (every completion, for n > 1), "logprobs" ([token, logprob, rank] lists per
  position), "num_cached_tokens" (prefix cache hits per request); with "metrics": true (needs
  ``disable_log_stats=False``), "metrics_per_run" (vLLM's metrics after each run) and "metrics"
  (after the last)}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

JOB_MARK = "::: _vllm_generate job "  # printed before each of several jobs' logs


def start_job(job: dict, work: Path, env: dict[str, str] | None = None,
              new_session: bool = False) -> subprocess.Popen:
    """For the tests: this script on ``job`` in a fresh process (its engine in that process;
    the plugin allowed unless ``env`` sets VLLM_PLUGINS), job, output and log in ``work``;
    :func:`finish_job` reads them. ``new_session``: :func:`stop_job` kills its whole group."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    full_env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    full_env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})})
    with (work / "log.txt").open("w") as log:
        return subprocess.Popen([sys.executable, __file__, str(work / "job.json"),
                                 str(work / "out.json")], env=full_env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=new_session)


def stop_job(run: subprocess.Popen) -> None:
    """Kill a started run if it still runs (its process group, if it leads one)."""
    if run.poll() is None:
        try:
            if os.getpgid(run.pid) == run.pid:
                os.killpg(run.pid, signal.SIGKILL)
            else:
                run.kill()
        except ProcessLookupError:
            pass
        run.wait()


def finish_job(run: subprocess.Popen, work: Path, timeout: float = 900) -> dict:
    """The started run's output json, with its log under "log" (for several jobs: {name: its
    output json with its part of the log}); killed if it outlives ``timeout`` seconds."""
    try:
        returncode = run.wait(timeout=timeout)
    finally:
        stop_job(run)
    log = (work / "log.txt").read_text(errors="replace")
    assert returncode == 0, f"{work.name} run failed:\n{log[-4000:]}"
    out = json.loads((work / "out.json").read_text())
    if "jobs" not in out:
        return {**out, "log": log}
    logs = dict(part.split("\n", 1) for part in log.split(JOB_MARK)[1:])
    return {name: {**result, "log": logs[name]} for name, result in out["jobs"].items()}


def sampling_params(p: dict):
    """``SamplingParams(**p)``, p as JSON holds it (the tests build their requests with it too)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    p = dict(p)
    if "structured_outputs" in p:
        p["structured_outputs"] = StructuredOutputsParams(**p["structured_outputs"])
    if "logit_bias" in p:
        p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
    return SamplingParams(**p)


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [sorted([t, lp.logprob, lp.rank] for t, lp in step.items())
            for step in completion.logprobs]


def run_job(job: dict) -> dict:
    """One engine (``job["env"]`` set while it lives) and its runs."""
    import os
    from unittest import mock

    from vllm import LLM, envs

    envs.disable_envs_cache()  # a previous engine froze vLLM's view of the environment
    with mock.patch.dict(os.environ, job.get("env", {})):  # set back after the job
        return _generate(LLM(**job["engine"]), job)


def _generate(llm, job: dict) -> dict:
    """``job``'s runs on ``llm``; the engine is let go at the end."""
    import gc

    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    prompts, outputs, completions, logprobs, cached, metrics = [], [], [], [], [], []
    for run in job["runs"]:
        if "continue" in run:
            r, index, *k = run["continue"]
            run_prompts = [prompts[r][i] + outputs[r][i][: k[0] if k else None] for i in index]
        else:
            run_prompts = run["prompts"]
        params = run["params"]
        params = ([sampling_params(p) for p in params] if isinstance(params, list)
                  else sampling_params(params))
        results = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in run_prompts],
                               params, use_tqdm=False)
        prompts.append(run_prompts)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
        completions.append([[list(c.token_ids) for c in r.outputs] for r in results])
        logprobs.append([[_logprobs(c) for c in r.outputs] for r in results])
        cached.append([r.num_cached_tokens for r in results])
        if job.get("metrics"):
            metrics.append({m.name: getattr(m, "value", getattr(m, "values", None))
                            for m in llm.get_metrics()})
    patched = hasattr(EngineArgs.create_speculative_config, "_vllm_redrafter_patched")
    result = {"plugin_patched": patched, "outputs": outputs, "completions": completions,
              "logprobs": logprobs, "num_cached_tokens": cached}
    if job.get("metrics"):
        result.update(metrics_per_run=metrics, metrics=metrics[-1] if metrics else {})
    del llm
    gc.collect()
    return result


def run_jobs(jobs: dict[str, dict]) -> dict[str, dict]:
    """One engine after another: vLLM imported once (~20 s a process here). A job that raises
    is reported under "error" and the next one runs."""
    import traceback

    results = {}
    for name, job in jobs.items():
        print(f"{JOB_MARK}{name}", flush=True)
        start = time.monotonic()
        try:
            results[name] = run_job(job)
        except Exception:
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc()}
        results[name]["seconds"] = time.monotonic() - start
    return results


def main(job_file: str, out_file: str) -> None:
    job = json.loads(open(job_file).read())
    if "wait_for" in job:  # import vLLM now (~20 s, one core), start the engines once told
        import os

        from vllm import LLM  # noqa: F401

        while not os.path.exists(job["wait_for"]):
            time.sleep(0.2)
    result = {"jobs": run_jobs(job["jobs"])} if "jobs" in job else run_job(job)
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
