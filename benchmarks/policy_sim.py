"""The beam policy on simulated engines (``vllm_redrafter/policy_sim.py``), no curve given:

- GPU: two step tables of Vicuna-7B (target and drafter), interpolated between measured batch
  sizes only: the H100's (``gpu_kernels_h100.json``, B = 1, 8, 32) and the H200's
  (``gpu_steps_h200.json``, B = 1, 2, 4, 8, 16, 20, 32, 40: every batch size of the paper's
  Table 5). Acceptance per width is fixed from a stated source (the shipped drafter's measured
  tokens/step at W <= 16, the ReDrafter paper's 4.2 at W = 64). Per table: the width drafted
  most at each batch size, under a load that grows (batch 1 for 2000 steps, then 600 steps at
  each larger size) and from a cold start at each batch size, beside the paper's Table 5 (64 at
  batch 1-2, 16 at 8, 4 at 20-40); its tokens/s over plain decoding; the best fixed shape.
- CPU: ``benchmarks/results/step_cost_xeon_amx.json`` (2 Xeon cores, every verified token
  costs): the policy's tokens/s over plain decoding from a cold start (1500 steps) beside the
  fixed W = 4, L = 4 that every step drafted without a curve before.
- A machine that changes: on the CPU at batch 8, verified tokens turn 6x dearer for steps
  600-1200: the shape drafted per step.

Writes ``benchmarks/results/policy_sim.{json,png}``; about two minutes on one core.

    python benchmarks/policy_sim.py [--seeds 5] [--out benchmarks/results/policy_sim.json]
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

from vllm_redrafter.beam_policy import BeamPolicy
from vllm_redrafter.policy_sim import (
    PAPER_TABLE5,
    Machine,
    cpu_machine,
    gpu_machine,
    rate,
    run,
    shipped_acceptance,
)

RESULTS = Path(__file__).parent / "results"
GPU_TABLES = {  # name: (step table, the batch sizes of the growing load)
    "h100": ("gpu_kernels_h100.json", (1, 2, 4, 8, 16, 20, 32)),
    "h200": ("gpu_steps_h200.json", (1, 2, 4, 8, 16, 20, 32, 40)),
}


def most_drafted_width(log) -> int:
    """The width of most steps in the second half of a run (0: plain)."""
    return collections.Counter(s.width for s in log[len(log) // 2:]).most_common(1)[0][0]


def plain(machine, acceptance, batch: int) -> float:
    return rate(run((0, 0), machine, acceptance, batch, 50))


def gpu(table: str, batches: tuple[int, ...], seeds: int) -> dict:
    machine = gpu_machine(json.loads((RESULTS / table).read_text())["rows"])
    acceptance = shipped_acceptance()
    growing, cold = [], []
    for seed in range(seeds):
        policy, widths, gains = BeamPolicy(64, 5), {}, {}
        for batch in batches:
            steps = 2000 if batch == 1 else 600
            log = run(policy, machine, acceptance, batch, steps, seed=seed, tag=f"b{batch}-")
            widths[batch] = most_drafted_width(log)
            gains[batch] = rate(log) / plain(machine, acceptance, batch)
        growing.append({"seed": seed, "width": widths, "gain_over_plain": gains})
        widths, gains = {}, {}
        for batch in batches:
            log = run(BeamPolicy(64, 5), machine, acceptance, batch, 1500, seed=seed)
            widths[batch] = most_drafted_width(log)
            gains[batch] = rate(log) / plain(machine, acceptance, batch)
        cold.append({"seed": seed, "width": widths, "gain_over_plain": gains})
    best = {}
    for batch in batches:  # the best fixed shape on the same table, for reference
        shapes = [(w, l) for w in acceptance.at_least for l in range(2, 6)]
        rates = {s: rate(run(s, machine, acceptance, batch, 300)) for s in shapes}
        top = max(rates, key=rates.get)
        best[batch] = {"shape": list(top),
                       "gain_over_plain": rates[top] / plain(machine, acceptance, batch)}
    return {"table": table, "growing_load": growing, "cold_start": cold, "best_fixed_shape": best}


def cpu(seeds: int) -> dict:
    cells = json.loads((RESULTS / "step_cost_xeon_amx.json").read_text())["cells"]
    machine, acceptance = cpu_machine(cells), shipped_acceptance((1, 2, 4))
    rows = []
    for batch in (1, 2, 4, 8, 16, 32):
        p = plain(machine, acceptance, batch)
        gains = [rate(run(BeamPolicy(4, 4), machine, acceptance, batch, 1500, seed=s)) / p
                 for s in range(seeds)]
        rows.append({"batch": batch, "policy_gain_over_plain": gains,
                     "fixed_w4_l4_gain_over_plain":
                         rate(run((4, 4), machine, acceptance, batch, 200)) / p})
    dear = Machine(lambda b, n: machine.verify(b, b) + 6 * (machine.verify(b, n)
                                                            - machine.verify(b, b)), machine.draft)
    log = run(BeamPolicy(4, 4), lambda i: dear if 600 <= i < 1200 else machine, acceptance, 8,
              1800)
    return {"by_batch": rows, "dearer_tokens_steps_600_1200": {
        "width": [s.width for s in log], "length": [s.length for s in log],
        "reason": [s.reason for s in log]}}


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for ax, name in zip(axes, GPU_TABLES):
        batches = list(GPU_TABLES[name][1])
        for run_ in result[name]["growing_load"]:
            ax.plot(batches, [max(run_["width"][b], 0.5) for b in batches], "o-", alpha=0.4,
                    color="C0")
        ax.plot(list(PAPER_TABLE5), list(PAPER_TABLE5.values()), "s--", color="C3",
                label="paper, Table 5")
        ax.plot([], [], "o-", color="C0",
                label=f"policy, simulated {name.upper()} (one line per seed)")
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="beam width drafted most",
               title=f"{name.upper()} step table, no curve: width by batch")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_yticks([0.5, 1, 2, 4, 8, 16, 32, 64], ["plain", 1, 2, 4, 8, 16, 32, 64])
        ax.legend(fontsize=8)
    ax = axes[2]
    rows = result["cpu"]["by_batch"]
    xs = [r["batch"] for r in rows]
    ax.plot(xs, [min(r["policy_gain_over_plain"]) for r in rows], "o-",
            label="policy (worst of the seeds)")
    ax.plot(xs, [r["fixed_w4_l4_gain_over_plain"] for r in rows], "s--",
            label="fixed W=4 L=4 (no curve, before)")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(0.98, color="k", lw=0.5, ls=":")
    ax.set(xscale="log", xlabel="batch size", ylabel="tokens/s over plain decoding",
           title="2-core Xeon step table: first 1500 steps")
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend(fontsize=8)
    ax = axes[3]
    change = result["cpu"]["dearer_tokens_steps_600_1200"]
    steps = range(len(change["width"]))
    ax.scatter(steps, [w * 10 + l if w else 0 for w, l in zip(change["width"],
                                                                   change["length"])], s=2)
    ax.axvspan(600, 1200, color="C3", alpha=0.1, label="verified tokens 6x dearer")
    ax.set(xlabel="step", ylabel="shape drafted (10 W + L; 0: plain)",
           title="CPU, batch 8: the machine changes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS / "policy_sim.json")
    args = parser.parse_args()
    result = {"sources": "vllm_redrafter/policy_sim.py's docstring",
              "paper_table5_width_by_batch": PAPER_TABLE5}
    for name, (table, batches) in GPU_TABLES.items():
        result[name] = gpu(table, batches, args.seeds)
        print(f"{name.upper()}, growing load: width drafted most by batch size (paper's Table 5: "
              f"{PAPER_TABLE5})")
        for r in result[name]["growing_load"]:
            print(f"  seed {r['seed']}: {r['width']}  gain "
                  + " ".join(f"{g:.2f}" for g in r["gain_over_plain"].values()))
        print(f"{name.upper()}, cold start at each batch size:")
        for r in result[name]["cold_start"]:
            print(f"  seed {r['seed']}: {r['width']}")
        print("best fixed shape: " + ", ".join(
            f"{b}: {v['shape']} {v['gain_over_plain']:.2f}"
            for b, v in result[name]["best_fixed_shape"].items()))
    result["cpu"] = cpu(args.seeds)
    print("CPU (Xeon table): policy / plain (worst seed), fixed W=4 L=4 / plain")
    for r in result["cpu"]["by_batch"]:
        print(f"  batch {r['batch']:>2}: {min(r['policy_gain_over_plain']):.3f}  "
              f"{r['fixed_w4_l4_gain_over_plain']:.3f}")
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(f"written: {args.out}, {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
