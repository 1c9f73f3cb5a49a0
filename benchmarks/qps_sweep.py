"""Serving under load: ``vllm serve`` alone and with ReDrafter (policy on, off), ``vllm bench serve``.

Three servers run side by side (the same target, flags and KV space): vLLM alone, ReDrafter with
its beam policy (``auto``: it picks W <= --beam-width, L <= --beam-length per step from the
measured step cost and whole-step times, drafting only where it pays) and ReDrafter with the
shape fixed. Each server first answers a warm-up round (not counted: a server in production is
long past its first requests, and the policy has learnt this machine). Then at each load, a
concurrency (closed loop: C requests in flight) or a request rate, vLLM's own benchmark client
sends the same MT-Bench questions (first turn, the server applies the chat template) to each
server, ``--repeats`` times with the order of the servers rotating and reversing, so that drift
hits all alike; the servers are started anew for each repeat, one after another, in an order
reversed every other repeat (identical engines differ by a few percent for their whole life, the
later-started one faster in our measurement: use an even ``--repeats``; with an odd
``--fixed-repeats`` the policy-off server starts last more often). Per load and server, pooled
over the repeats: output throughput (all tokens / all seconds), TTFT and TPOT (mean, median,
p99 over every request), request latency (mean, median), and for ReDrafter the fraction of
request-steps that drafted (from the server's /metrics). Printed as a table, written as JSON with
every run's scalars, and drawn as ratios to vLLM alone vs load. The policy learns the step
cost from the server's own steps; a cached curve (``vllm-redrafter step-cost``) is only its
prior, and ``--step-cost FILE`` gives it another one. The servers inherit this script's
environment: ``VLLM_CPU_NUM_OF_RESERVED_CPU=0 python benchmarks/qps_sweep.py`` serves on every
core (vLLM reserves one for its engine core by default; the JSON records the ``VLLM_CPU_*``
variables).

    python benchmarks/qps_sweep.py [--drafter DIR] [--concurrency 1,2,4,8,16] [--rates R,...]
        [--prompts-per-level 6] [--repeats 2] [--fixed-repeats N] [--warmup-prompts 16]
        [--max-tokens 64]
        [--beam-width 4 --beam-length 4] [--fixed-shape W,L] [--fixed-extra JSON] [--cold]
        [--step-log DIR]
        [--step-cost CURVE.json]
        [--out benchmarks/results/qps_sweep.json]
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
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from vllm_redrafter.envs import CACHE, STEP_LOG
from vllm_redrafter.eval_sets import MT_BENCH, first_turns  # noqa: E402
from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import (
    DEFAULT_DRAFTER,
    engine_kwargs,
    machine,
    metric_totals,
)

PORTS = {"alone": 8100, "policy": 8101, "fixed": 8102}
ARMS = ("policy", "fixed")  # the ReDrafter servers
NUM_QUESTIONS = 80  # MT-Bench's


def cli(*args: str) -> list[str]:
    """``vllm ARGS`` through our entry point (vllm-cpu's own ``vllm`` command cannot start)."""
    return [sys.executable, "-m", "vllm_redrafter.cli", *args]


def start_server(name: str, target: str, spec: dict | None, log: Path,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    args = ["serve", target, "--port", str(PORTS[name])]
    for key, value in engine_kwargs(target).items():  # the demo's engine, as CLI flags
        if key != "model":
            flag = "--" + key.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return subprocess.Popen(cli(*args), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})


def exit_report(name: str, server: subprocess.Popen, log: Path) -> str:
    """What a server that exited leaves to read: its exit code and the end of its log."""
    return f"server {name} exited ({server.returncode}); its log ends:\n{log.read_text()[-5000:]}"


def wait_healthy(server: subprocess.Popen, port: int, log: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(exit_report(f"on {port}", server, log))
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(2)
    raise TimeoutError(f"server on {port} not healthy after {timeout} s")


def bench(name: str, target: str, dataset: Path, load: dict, args, work: Path) -> dict:
    """One ``vllm bench serve`` run against server ``name`` at ``load`` (concurrency or rate)."""
    result = work / f"{name}_{load['label']}.json"
    level = (["--max-concurrency", str(load["concurrency"]), "--request-rate", "inf"]
             if "concurrency" in load else ["--request-rate", load["rate"]])
    run = subprocess.run(cli(
        "bench", "serve", "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", f"http://127.0.0.1:{PORTS[name]}", "--model", target, "--tokenizer", target,
        "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
        "--num-prompts", str(load["num_prompts"]), "--sharegpt-output-len", str(args.max_tokens),
        "--ignore-eos", *level, "--temperature", "0",
        "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(work),
        "--result-filename", result.name,
        "--seed", "0", "--disable-tqdm",
    ), capture_output=True, text=True, timeout=3600)
    if run.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({name}, {load['label']}):\n"
                           f"{(run.stdout + run.stderr)[-3000:]}")
    return json.loads(result.read_text())


def counters(name: str) -> dict[str, float]:
    """The server's spec-decode and generation counters (summed over labels) from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{PORTS[name]}/metrics", timeout=30) as r:
        return metric_totals(r.read().decode(), (
            "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total",
            "vllm:generation_tokens_total"))


def drafted_fraction(delta: dict[str, float]) -> float | None:
    """Request-steps that carried drafts / all request-steps (each emits 1 + its accepted),
    from the growth of a server's counters over the runs of one load."""
    steps = (delta["vllm:generation_tokens_total"]
             - delta["vllm:spec_decode_num_accepted_tokens_total"])
    return delta["vllm:spec_decode_num_drafts_total"] / steps if steps > 0 else None


def empty_cache(work: Path, name: str, repeat: int) -> str:
    """A new, empty cache directory for server ``name`` in ``repeat`` (VLLM_REDRAFTER_CACHE): no
    step-cost curve, so the beam policy starts from nothing, as after ``pip install``."""
    cache = work / f"cache_{name}_{repeat}"
    cache.mkdir()
    return str(cache)


def start_order(names: list[str], repeat: int) -> list[str]:
    """The servers' start order in one repeat: rotated by one every second repeat, reversed
    every other repeat.

    Identical engines side by side on a CPU differ for their whole life, the later-started one
    faster (measured: 1.04x between two vLLM-alone engines in one script, about 1.06x between
    servers; three in one script on the 2-core Xeon, 2026-11-30: 10.1 / 10.7 / 11.2 tokens/s in
    start order; vLLM binds and configures them alike, the cause lies outside it and is not
    found), so the servers start anew each repeat. Each pair of repeats reverses the order, so
    every server's positions add up alike (a linear start-order part cancels); the rotation puts
    each server at each end in turn (with three, the middle one would never start first or last).
    """
    shift = (repeat // 2) % max(1, len(names))
    order = names[shift:] + names[:shift]
    return order[::-1] if repeat % 2 else order


@contextmanager
def serving(order: list[str], target: str, specs: dict, work: Path,
            envs: dict[str, dict[str, str]]) -> Iterator[None]:
    """The servers of ``order``, each started after the one before is healthy, with its
    ``envs`` entry added to the environment; stopped on exit (all their processes gone, so the
    next repeat starts on free ports and idle cores)."""
    servers: dict[str, subprocess.Popen] = {}
    try:
        for name in order:
            log = work / f"{name}.log"
            servers[name] = start_server(name, target, specs.get(name), log, envs.get(name))
            wait_healthy(servers[name], PORTS[name], log)
        yield
    except Exception:
        for name, server in servers.items():  # a server that died: its log says why
            if server.poll() is not None:
                print(exit_report(name, server, work / f"{name}.log"), file=sys.stderr)
        raise
    finally:
        for server in servers.values():
            stop(server)


def stop(server: subprocess.Popen, timeout: float = 60) -> None:
    """SIGINT to the server's process group, SIGKILL after ``timeout``; returns when the whole
    group (API server, engine core, workers) has exited."""
    for sig in (signal.SIGINT, signal.SIGKILL):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            server.poll()  # reap the leader, or the group never empties
            try:
                os.killpg(server.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.5)


def rotation(names: list[str], level: int, repeat: int) -> list[str]:
    """The servers' order at one load and repeat: rotated per load, reversed every other repeat."""
    order = names[level % len(names):] + names[: level % len(names)]
    return order[::-1] if repeat % 2 else order


def pooled(runs: list[dict]) -> dict[str, float]:
    """Throughput, TTFT and TPOT of one server at one load over its runs, each request once.

    TPOT per request as ``vllm bench serve`` computes it: (latency - TTFT) / (output tokens - 1).
    """
    import numpy as np

    ok = [(ttft, latency, n) for r in runs
          for ttft, latency, n, error in zip(r["ttfts"], r["latencies"], r["output_lens"],
                                             r["errors"]) if not error]
    ttft = np.array([t for t, _, _ in ok]) * 1e3
    tpot = np.array([(lat - t) / (n - 1) for t, lat, n in ok if n > 1]) * 1e3
    e2el = np.array([lat for _, lat, _ in ok]) * 1e3
    return {
        "output_throughput": sum(r["total_output_tokens"] for r in runs)
        / sum(r["duration"] for r in runs),
        "mean_ttft_ms": float(ttft.mean()), "median_ttft_ms": float(np.median(ttft)),
        "p99_ttft_ms": float(np.percentile(ttft, 99)),
        "mean_tpot_ms": float(tpot.mean()), "median_tpot_ms": float(np.median(tpot)),
        "p99_tpot_ms": float(np.percentile(tpot, 99)),
        "mean_e2el_ms": float(e2el.mean()), "median_e2el_ms": float(np.median(e2el)),
    }


def level_row(label: str, runs: dict[str, list[dict]], drafted: dict) -> dict:
    """One load's figures: each server's pooled metrics, the arms' ratios to vLLM alone."""
    metrics = {name: pooled(rs) for name, rs in runs.items()}
    alone = metrics["alone"]
    row = {"load": label, **{f"alone_{m}": v for m, v in alone.items()}}
    for arm in ARMS:
        row.update({f"{arm}_{m}": v for m, v in metrics[arm].items()})
        row[f"{arm}_throughput_ratio"] = metrics[arm]["output_throughput"] / alone["output_throughput"]
        row[f"{arm}_tpot_ratio"] = alone["median_tpot_ms"] / metrics[arm]["median_tpot_ms"]
        # a request's whole time: closed-loop waves move vLLM alone's prefills into TTFT, ours
        # into TPOT (docs/results.md), which the TPOT ratio alone reads as a loss
        row[f"{arm}_latency_ratio"] = alone["median_e2el_ms"] / metrics[arm]["median_e2el_ms"]
        pairs = list(zip(runs[arm], runs["alone"]))  # per repeat: the bar is their mean
        row[f"{arm}_throughput_ratio_per_repeat"] = [
            r["output_throughput"] / a["output_throughput"] for r, a in pairs]
        row[f"{arm}_tpot_ratio_per_repeat"] = [
            pooled([a])["median_tpot_ms"] / pooled([r])["median_tpot_ms"] for r, a in pairs]
        row[f"{arm}_drafted_fraction"] = drafted[arm]
    return row


def loads(args) -> list[dict]:
    if args.rates:
        return [{"label": f"rate {r}", "rate": r, "num_prompts": args.num_prompts or 40}
                for r in args.rates.split(",")]
    return [{"label": f"c{c}", "concurrency": int(c),
             "num_prompts": args.num_prompts or min(NUM_QUESTIONS, args.prompts_per_level * int(c))}
            for c in args.concurrency.split(",")]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["load"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, style in (("policy", "-"), ("fixed", ":")):
        ax.plot(labels, [r[f"{arm}_throughput_ratio"] for r in rows], "o" + style,
                label=f"{arm}: output throughput")
        ax.plot(labels, [r[f"{arm}_tpot_ratio"] for r in rows], "s" + style,
                label=f"{arm}: 1 / median TPOT")
        ax.plot(labels, [r[f"{arm}_latency_ratio"] for r in rows], "^" + style,
                label=f"{arm}: 1 / median request latency")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xlabel("load")
    ax.set_ylabel("ReDrafter / vLLM alone")
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(rows: list[dict]) -> None:
    print(f"\n{'load':>8} | {'throughput tok/s alone/policy/fixed':>36} | "
          f"{'median TPOT ms alone/policy/fixed':>34} | {'p99 TPOT ms':>20} | "
          f"{'ratio policy/fixed':>18} | {'latency ratio':>13} | drafted policy/fixed")
    for row in rows:
        arms = ("alone", *ARMS)
        tput = "/".join(f"{row[f'{a}_output_throughput']:.1f}" for a in arms)
        tpot = "/".join(f"{row[f'{a}_median_tpot_ms']:.1f}" for a in arms)
        p99 = "/".join(f"{row[f'{a}_p99_tpot_ms']:.0f}" for a in arms)
        ratio = "/".join(f"{row[f'{a}_throughput_ratio']:.2f}" for a in ARMS)
        latency = "/".join(f"{row[f'{a}_latency_ratio']:.2f}" for a in ARMS)
        drafted = "/".join(f"{row[f'{a}_drafted_fraction'] or 0:.2f}" for a in ARMS)
        print(f"{row['load']:>8} | {tput:>36} | {tpot:>34} | {p99:>20} | {ratio:>18} | "
              f"{latency:>13} | {drafted}")


@dataclass
class Sweep:
    """What every run shares, and what the runs measured so far."""

    args: argparse.Namespace
    target: str
    specs: dict
    levels: list[dict]
    work: Path
    runs: dict = field(init=False)  # load label -> server -> its ``vllm bench serve`` results
    deltas: dict = field(init=False)  # load label -> arm -> growth of its /metrics counters

    def __post_init__(self) -> None:
        self.runs = {load["label"]: {name: [] for name in PORTS} for load in self.levels}
        self.deltas = {load["label"]: {} for load in self.levels}

    def envs(self, k: int) -> dict[str, dict[str, str]]:
        """Per ReDrafter server of repeat ``k``: with --cold, a cache directory of its own, empty
        (no step-cost curve: the policy starts from nothing); with --step-log, its step log."""
        envs: dict[str, dict[str, str]] = {arm: {} for arm in ARMS}
        for arm in ARMS:
            if self.args.cold:
                envs[arm][CACHE] = empty_cache(self.work, arm, k)
            if self.args.step_log is not None:
                self.args.step_log.mkdir(parents=True, exist_ok=True)
                envs[arm][STEP_LOG] = str(self.args.step_log / f"{arm}_{k}.jsonl")
        return envs

    @property
    def dataset(self) -> Path:
        return self.work / "prompts.json"

    def run_repeat(self, k: int) -> None:
        """Repeat ``k``: its servers started anew, warmed up, then every load in turn."""
        args = self.args
        names = [n for n in PORTS if n != "fixed" or k < args.fixed_repeats]
        with serving(start_order(names, k), self.target, self.specs, self.work, self.envs(k)):
            warmup = {"label": "warmup", "concurrency": 2, "num_prompts": args.warmup_prompts}
            for name in names:
                bench(name, self.target, self.dataset, warmup, args, self.work)
            for i, load in enumerate(self.levels):
                runs = self.runs[load["label"]]
                before = {name: counters(name) for name in ARMS if name in names}
                for name in rotation(names, i, k):
                    runs[name].append(bench(name, self.target, self.dataset, load, args, self.work))
                for name, counts in before.items():
                    total = self.deltas[load["label"]].setdefault(name, dict.fromkeys(counts, 0.0))
                    for key, value in counters(name).items():
                        total[key] += value - counts[key]
                print(f"repeat {k + 1}/{args.repeats}, {load['label']}: " + ", ".join(
                    f"{name} {runs[name][-1]['output_throughput']:.1f}" for name in names)
                    + " tok/s", flush=True)

    def rows(self) -> list[dict]:
        return [level_row(label, runs, {arm: drafted_fraction(delta)
                                        for arm, delta in self.deltas[label].items()})
                for label, runs in self.runs.items()]

    def write_results(self) -> None:
        """The JSON (every run's scalars too) and the plot of what was measured so far."""
        args, rows = self.args, self.rows()
        raw = {label: {name: [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rs]
                       for name, rs in by_name.items()}
               for label, by_name in self.runs.items()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        vllm_env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU_")}
        args.out.write_text(json.dumps(portable({
            "machine": machine(), "vllm_cpu_env": vllm_env, "specs": self.specs,
            "loads": self.levels, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "repeats_done": len(raw[self.levels[0]["label"]]["alone"]),
            "fixed_repeats": args.fixed_repeats, "warmup_prompts": args.warmup_prompts,
            "cold": getattr(args, "cold", False),
            "rows": rows, "raw": raw}), indent=1, default=str))
        plot(rows, args.out.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--rates", default=None, help="request rates instead of concurrencies")
    parser.add_argument("--prompts-per-level", type=int, default=6, help="x the concurrency")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server and load")
    parser.add_argument("--fixed-repeats", type=int, default=None,
                        help="runs of the policy-off server per load (default: --repeats; it is "
                             "the slowest by far, and its gap to vLLM alone far wider than noise)")
    parser.add_argument("--warmup-prompts", type=int, default=16,
                        help="each server's uncounted first round (concurrency 2)")
    parser.add_argument("--num-prompts", type=int, default=None, help="the same at every load")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--fixed-shape", default=None, metavar="W,L",
                        help="the policy-off server's shape (default: --beam-width, --beam-length)")
    parser.add_argument("--fixed-extra", type=json.loads, default=None, metavar="JSON",
                        help="keys merged into the policy-off server's speculative config (e.g. "
                             "'{\"beam_policy\": \"auto\", \"context_candidates\": 0}': a "
                             "second policy arm)")
    parser.add_argument("--cold", action="store_true",
                        help="each ReDrafter server gets an empty cache directory: no cached "
                             "step-cost curve, the policy learns from nothing")
    parser.add_argument("--step-log", type=Path, default=None, metavar="DIR",
                        help="each ReDrafter server's step log (VLLM_REDRAFTER_STEP_LOG) in DIR")
    parser.add_argument("--step-cost", type=Path, default=None,
                        help="the policy arm's step-cost curve (default: this machine's cached one)")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "qps_sweep.json")
    args = parser.parse_args()
    if args.repeats < 1 or (args.fixed_repeats is not None and args.fixed_repeats < 1):
        parser.error("--repeats and --fixed-repeats must be at least 1")
    if args.fixed_repeats is None or args.fixed_repeats > args.repeats:
        args.fixed_repeats = args.repeats

    from vllm_redrafter.target import prepare_target

    if not (args.drafter / "config.json").is_file():
        raise SystemExit(f"no drafter at {args.drafter} (pass --drafter DIR)")
    target = str(prepare_target())
    specs = {arm: {"method": "redrafter", "model": str(args.drafter.resolve()),
                   "beam_width": args.beam_width, "beam_length": args.beam_length,
                   "beam_policy": "auto" if arm == "policy" else "fixed"} for arm in ARMS}
    if args.fixed_shape is not None:
        width, length = (int(x) for x in args.fixed_shape.split(","))
        specs["fixed"].update(beam_width=width, beam_length=length)
    if args.fixed_extra:
        specs["fixed"].update(args.fixed_extra)
    if args.step_cost is not None:
        specs["policy"]["step_cost"] = str(args.step_cost.resolve())
    questions = first_turns(args.prompts or MT_BENCH, NUM_QUESTIONS)
    with tempfile.TemporaryDirectory() as tmp:
        sweep = Sweep(args, target, specs, loads(args), Path(tmp))
        sweep.dataset.write_text(json.dumps([  # ShareGPT's format (read without pandas)
            {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": ""}]}
            for q in questions]))
        for k in range(args.repeats):
            sweep.run_repeat(k)
            sweep.write_results()  # after each repeat: a later failure keeps what was measured
    print_table(sweep.rows())
    print(f"\nJSON and plot: {args.out.with_suffix('')}.*")


if __name__ == "__main__":
    main()
