"""Realized tokens/s per batch size and beam shape, from a server's ReDrafter step log.

Serve with ``VLLM_REDRAFTER_STEP_LOG=FILE`` (one JSON line per engine step, written by the
proposer) and run a load; then ``python benchmarks/step_log.py FILE``. Several engines may write
one file (``peers.py`` at batch 1): each is summed apart, by its process id. A step is the time
from one line to the next; its batch and the tokens it emitted are in the next line. Decode steps
(no request joined, none prefilling) are grouped by batch size and the shape the policy chose; each
group shows the realized tokens/s and its ratio to plain decode steps of the same batch size,
beside the ratio the policy expected when it chose. Steps in which a request joined (its prefill
ran in them) are summed apart: their time is part of what drafting must win back. The policy's
reasons (which rule chose each step: best, explore, plain-refresh, no-shape-pays, ...) are counted,
and the steps where a request's lookup found a context candidate, by what the policy did with it.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from vllm_redrafter.results import portable


def steps(lines: list[dict]) -> list[dict]:
    """One row per step: batch, shape, seconds, tokens emitted, whether a request joined or was
    prefilling, the policy's expected tokens/s of the shape and of a plain step, its reason."""
    rows = []
    for before, after in zip(lines, lines[1:]):
        joined = bool(set(after["ids"]) - set(before["ids"]))
        rows.append({
            "batch": len(after["ids"]),
            "shape": tuple(before.get("shape") or (0, 0)) if before.get("drafted") else (0, 0),
            "seconds": after["t"] - before["t"],
            "tokens": sum(after["emitted"]),
            "kind": "join" if joined else "prefill" if 0 in after["emitted"] else "decode",
            "expected_tps": before.get("expected_tps"),
            "plain_tps": before.get("plain_tps"),
            "reason": before.get("reason"),
            "candidates": before.get("candidates") or [],
            "used": before.get("used"),  # the step's final candidate counts
        })
    return rows


def summary(rows: list[dict], min_batch: int = 1, gap: float = 1.0) -> dict:
    """Per (batch, shape) of decode steps: realized and expected tokens/s and gains; the time
    spent in join / prefill steps. Steps longer than ``gap`` seconds (the server idle between
    benchmark runs) are left out."""
    rows = [r for r in rows if r["seconds"] < gap and r["batch"] >= min_batch]
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        if r["kind"] == "decode":
            groups[(r["batch"], r["shape"])].append(r)
    plain = {b: sum(r["tokens"] for r in g) / sum(r["seconds"] for r in g)
             for (b, shape), g in groups.items() if shape == (0, 0)}
    cells = []
    for (batch, shape), g in sorted(groups.items()):
        tps = sum(r["tokens"] for r in g) / sum(r["seconds"] for r in g)
        expected = [r["expected_tps"] / r["plain_tps"] for r in g
                    if r["expected_tps"] and r["plain_tps"]]
        cells.append({
            "batch": batch, "shape": list(shape), "steps": len(g),
            "ms_per_step": 1e3 * sum(r["seconds"] for r in g) / len(g),
            "tokens_per_step": sum(r["tokens"] for r in g) / len(g),
            "tokens_per_s": tps,
            "realized_gain": tps / plain[batch] if batch in plain else None,
            "expected_gain": sum(expected) / len(expected) if expected else None,
        })
    total = sum(r["seconds"] for r in rows)
    by_kind = {k: sum(r["seconds"] for r in rows if r["kind"] == k) / total
               for k in ("decode", "join", "prefill")} if total else {}
    reasons = Counter(r["reason"] for r in rows if r.get("reason"))
    return {"cells": cells, "time_share": by_kind, "reasons": dict(sorted(reasons.items())),
            "tokens_per_s": sum(r["tokens"] for r in rows) / total if total else 0.0,
            "candidates": candidate_counts(rows)}


def candidate_counts(rows: list[dict]) -> dict[str, int]:
    """Requests' steps where the lookup found a context candidate, by what the policy decided
    (its ``why``: taken, unscored, below_floor, below_price); ``share_rule``: taken by the
    request but left out by the step (``candidate_share`` or the safety net)."""
    counts: Counter = Counter()
    for r in rows:
        for c, used in zip(r["candidates"], r.get("used") or [None] * len(r["candidates"])):
            if not c.get("found"):
                continue
            counts["found"] += 1
            why = c.get("why", "unrecorded")  # logs before 2026-11-29 have no why
            counts[why] += 1
            if why == "taken" and used == 0:
                counts["share_rule"] += 1
    return dict(counts)


def print_summary(s: dict) -> None:
    print(f"{'batch':>5} {'W,L':>5} {'steps':>6} {'ms/step':>8} {'tok/step':>8} {'tok/s':>7} "
          f"{'realized':>8} {'expected':>8}")
    for c in s["cells"]:
        def fmt(x):
            return f"{x:8.2f}" if x is not None else f"{'-':>8}"
        print(f"{c['batch']:>5} {'%d,%d' % tuple(c['shape']):>5} {c['steps']:>6} "
              f"{c['ms_per_step']:8.1f} {c['tokens_per_step']:8.2f} {c['tokens_per_s']:7.1f} "
              f"{fmt(c['realized_gain'])} {fmt(c['expected_gain'])}")
    share = ", ".join(f"{k} {v:.0%}" for k, v in s["time_share"].items())
    print(f"time in steps: {share}; tokens/s over all steps {s['tokens_per_s']:.1f}")
    if s.get("reasons"):
        print("the policy's reasons: " + ", ".join(f"{k} {v}" for k, v in s["reasons"].items()))
    if s.get("candidates"):
        print("steps that found a context candidate: "
              + ", ".join(f"{k} {v}" for k, v in s["candidates"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--min-batch", type=int, default=1)
    parser.add_argument("--min-steps", type=int, default=5, help="hide rarer (batch, shape) cells")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    lines = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    out = {}
    for pid, own in engines(lines).items():
        out[pid] = s = summary(steps(own), args.min_batch)
        policy = "auto" if any(line.get("reason") for line in own) else "fixed"
        print(f"engine {pid} (beam policy {policy}, {len(own)} steps)")
        print_summary(dict(s, cells=[c for c in s["cells"] if c["steps"] >= args.min_steps]))
    if args.json:
        args.json.write_text(json.dumps(portable(out), indent=1))


def engines(lines: list[dict]) -> dict[str, list[dict]]:
    """The log's lines per engine (the engine core's process id; logs before 2026-11-30 have
    none: one engine)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        out[str(line.get("pid", "?"))].append(line)
    return dict(out)


if __name__ == "__main__":
    main()
