"""Every benchmark script imports and parses its flags (they are run by hand, never by the tests),
and the QPS sweep pools its runs as vLLM's own benchmark client computes one."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted(p for p in (Path(__file__).resolve().parents[1] / "benchmarks").glob("*.py")
                    if not p.name.startswith("_"))


# Every script's ``--help`` in one interpreter (torch and the project imported once, not 20
# times): {script name: (exit code, stdout, error)}.
_HELP_ALL = r"""
import contextlib, io, json, runpy, sys, traceback
out_file, results = sys.argv[1], {}
for path in sys.argv[2:]:
    out, code, error = io.StringIO(), None, ""
    sys.argv = [path, "--help"]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code or 0
    except BaseException:
        code, error = 1, traceback.format_exc()
    results[path] = [code, out.getvalue(), error]
json.dump(results, open(out_file, "w"))
"""


@pytest.fixture(scope="module")
def help_runs(tmp_path_factory) -> dict[str, list]:
    out = tmp_path_factory.mktemp("help") / "help.json"
    run = subprocess.run([sys.executable, "-c", _HELP_ALL, str(out), *map(str, BENCHMARKS)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.name)
def test_benchmark_help(script: Path, help_runs):
    code, stdout, error = help_runs[str(script)]
    assert code == 0, error[-2000:]
    assert "usage:" in stdout


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS[0].parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_qps_sweep_pools_runs_as_vllm_bench_serve_computes_one():
    """Pooled over runs, the QPS sweep's figures are vLLM's own over all their requests."""
    from vllm.benchmarks.lib.endpoint_request_func import RequestFuncOutput
    from vllm.benchmarks.serve import calculate_metrics

    qps = _load_script("qps_sweep")
    rng = random.Random(0)

    def run(num: int, duration: float):
        outputs = [RequestFuncOutput(success=ok, error="" if ok else "boom",
                                     output_tokens=rng.randint(1, 64) if ok else 0,
                                     ttft=rng.uniform(0.01, 0.5), latency=rng.uniform(0.6, 4.0),
                                     prompt_len=10)
                   for ok in (rng.random() > 0.1 for _ in range(num))]
        metrics, lens = calculate_metrics([], outputs, duration, None, [50, 99], {})
        result = {"duration": duration, "total_output_tokens": metrics.total_output,
                  "output_lens": lens, "ttfts": [o.ttft for o in outputs],
                  "latencies": [o.latency for o in outputs], "errors": [o.error for o in outputs]}
        return outputs, metrics, result

    (out_a, vllm_a, run_a), (out_b, _, run_b) = run(37, 12.0), run(21, 7.5)
    vllm_ab, _ = calculate_metrics([], out_a + out_b, 19.5, None, [50, 99], {})
    for runs, expected in (([run_a], vllm_a), ([run_a, run_b], vllm_ab)):
        ours = qps.pooled(runs)
        assert ours["output_throughput"] == pytest.approx(expected.output_throughput)
        for name in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                     "mean_e2el_ms", "median_e2el_ms"):
            assert ours[name] == pytest.approx(getattr(expected, name)), name
        assert ours["p99_ttft_ms"] == pytest.approx(dict(expected.percentiles_ttft_ms)[99])
        assert ours["p99_tpot_ms"] == pytest.approx(dict(expected.percentiles_tpot_ms)[99])


def test_qps_sweep_order_rotates_per_load_and_reverses_per_repeat():
    qps = _load_script("qps_sweep")
    names = ["alone", "policy", "fixed"]
    assert qps.rotation(names, 0, 0) == ["alone", "policy", "fixed"]
    assert qps.rotation(names, 0, 1) == ["fixed", "policy", "alone"]
    assert qps.rotation(names, 1, 0) == ["policy", "fixed", "alone"]
    firsts = {qps.rotation(names, level, 0)[0] for level in range(3)}
    assert firsts == set(names)


def test_qps_sweep_start_order_alternates_so_each_server_starts_last_as_often():
    qps = _load_script("qps_sweep")
    names = ["alone", "policy"]
    orders = [qps.start_order(names, k) for k in range(4)]
    assert orders[0] == names and orders[1] == names[::-1]
    assert sorted(order[-1] for order in orders) == ["alone", "alone", "policy", "policy"]
    three = ["alone", "fixed", "policy"]
    orders = [qps.start_order(three, k) for k in range(6)]
    assert all(sorted(o) == three for o in orders)
    for name in three:  # each starts first and last twice in 6 repeats; positions add up alike
        assert [o.index(name) for o in orders].count(0) == 2 == [o[-1] for o in orders].count(name)
        assert sum(o.index(name) for o in orders[:4]) == 4  # every even number of repeats


def test_qps_sweep_results_pair_each_arm_with_vllm_alone_of_the_same_repeat(tmp_path):
    """Two repeats, the policy-off server in the first only: rows, ratios per repeat, drafted
    fractions from the summed counters, and the JSON written."""
    import argparse
    import json

    qps = _load_script("qps_sweep")

    def run(tokens: int, seconds: float) -> dict:
        return {"duration": seconds, "total_output_tokens": tokens, "output_throughput": tokens / seconds,
                "output_lens": [tokens // 2] * 2,
                "ttfts": [0.01 * seconds, 0.02 * seconds],  # requests as slow as the run
                "latencies": [0.1 * seconds, 0.2 * seconds], "errors": ["", ""]}

    args = argparse.Namespace(out=tmp_path / "sweep.json", max_tokens=64, repeats=2,
                              fixed_repeats=1, warmup_prompts=4)
    sweep = qps.Sweep(args, "target", {}, [{"label": "c1", "concurrency": 1}], tmp_path)
    sweep.runs["c1"] = {"alone": [run(100, 10.0), run(100, 8.0)],
                        "policy": [run(100, 5.0), run(100, 8.0)], "fixed": [run(100, 20.0)]}
    for arm, drafts in (("policy", 30.0), ("fixed", 50.0)):
        sweep.deltas["c1"][arm] = {"vllm:spec_decode_num_drafts_total": drafts,
                                   "vllm:spec_decode_num_accepted_tokens_total": 50.0,
                                   "vllm:generation_tokens_total": 150.0}
    (row,) = sweep.rows()
    assert row["policy_throughput_ratio_per_repeat"] == [2.0, 1.0]
    assert row["fixed_throughput_ratio_per_repeat"] == [0.5]  # paired with alone's first repeat
    assert row["policy_tpot_ratio_per_repeat"] == pytest.approx([2.0, 1.0])  # as fast
    assert row["policy_throughput_ratio"] == pytest.approx(18.0 / 13.0)
    assert (row["policy_drafted_fraction"], row["fixed_drafted_fraction"]) == (0.3, 0.5)
    sweep.write_results()
    written = json.loads(args.out.read_text())
    assert written["rows"][0]["load"] == "c1" and len(written["raw"]["c1"]["alone"]) == 2
    assert args.out.with_suffix(".png").is_file()


def test_gpu_kernels_dry_run(tmp_path):
    """The GPU script's every section on the CPU (tiny shapes, float32, Triton's interpreter, in a
    fresh interpreter so TRITON_INTERPRET takes effect): it runs, its kernels agree with their
    references, and the step table comes last. What it measures on a GPU is not checked here."""
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, str(BENCHMARKS[0].parent / "gpu_kernels.py"), "--dry-run",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    import json

    result = json.loads(out.read_text())
    assert result["failed"] == {}
    kinds = {row["kernel"] for row in result["rows"]}
    assert {"tree_attention_triton", "sample_tiled", "beam_search_fused", "redrafter_step",
            "tune_tree_attention", "tune_fused_select"} <= kinds
    assert all(r["max_abs_err_vs_reference"] < 1e-4 for r in result["rows"]
               if r["kernel"] == "tree_attention_triton")
    assert all(r["beams_equal_to_torch"] == 1.0 for r in result["rows"] if r["kernel"] == "beam_search_fused")
    steps = [r for r in result["rows"] if r["kernel"] == "redrafter_step"]
    assert all(r["c"] == pytest.approx((r["draft_ms"] + r["pack_ms"] + r["verify_ms"]) / r["plain_ms"])
               for r in steps)
    assert all(r["verify_tokens"] == r["B"] * r["packed_tokens_mean"] for r in steps)
    assert run.stdout.rstrip().splitlines()[-1].startswith(f"| tiny | tiny-K128 | {steps[-1]['B']} |")
