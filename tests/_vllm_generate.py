"""Run vLLM's offline ``LLM.generate`` in a fresh process: ``python _vllm_generate.py JOB OUT``.

The tests' "vLLM alone" baseline runs here with ``VLLM_PLUGINS=""`` (once a process loaded the
plugin, its patches stay), and the plain plugin-loaded run with the plugin allowed.

JOB (json): {"engine": {LLM kwargs}, "runs": [{"prompts": [[token ids]], "params": {...}}]}
            ("params" may also be a list: one dict per prompt; "metrics": true adds vLLM's
            metrics to OUT)
OUT (json): {"plugin_patched": bool, "outputs": [[[token ids] per prompt] per run]}
"""

from __future__ import annotations

import json
import sys


def main(job_file: str, out_file: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.inputs import TokensPrompt

    job = json.loads(open(job_file).read())
    llm = LLM(**job["engine"])
    outputs = []
    for run in job["runs"]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in run["prompts"]]
        params = ([SamplingParams(**p) for p in run["params"]] if isinstance(run["params"], list)
                  else SamplingParams(**run["params"]))
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs.append([list(r.outputs[0].token_ids) for r in results])
    patched = hasattr(EngineArgs.create_speculative_config, "_vllm_redrafter_patched")
    result = {"plugin_patched": patched, "outputs": outputs}
    if job.get("metrics"):  # counters and gauges (needs disable_log_stats=False)
        result["metrics"] = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    with open(out_file, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
