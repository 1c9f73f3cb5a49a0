"""Batch-1 speedup of vLLM + ReDrafter over vLLM alone on MT-Bench, greedy and temperature 1.0.

Part 1 (this process): both engines live side by side; every prompt is answered by each, one
request at a time, the order alternating per prompt so drift hits both alike. Tokens/s per engine,
the speedup, tokens per step (mean accepted + 1) and acceptance by draft position (vLLM's own
spec-decode counters), per temperature.
Part 2 (a child process with the engine in-process): the per-step time split of ReDrafter
(draft = beam search, pack = tree building, verify = the target's forward over the tree, accept =
the tree walk and KV moves) beside a plain step of vLLM alone (its seconds per token at batch 1),
and the compression ratio W*L / packed tokens of the trees actually verified.

Prints tables and writes JSON (``--out``). Prompts: the MT-Bench set shipped
in the package (first turns, chat template) or any file in that format (``--prompts``).

    python benchmarks/speedup.py --drafter DIR [--num-prompts 20] [--max-tokens 64]
        [--beam-width 1 --beam-length 3] [--beam-policy fixed|auto] [--step-cost CURVE.json]
        [--out benchmarks/results/speedup.json]

The default shape, a chain of 2 drafts, is the fastest measured at batch 1 on a 2-core CPU
(trees pay for their extra verified tokens only where a token costs little: a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from vllm_redrafter.eval_sets import MT_BENCH, first_turns  # noqa: E402
from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.demo import (
    DEFAULT_DRAFTER,
    counter_diff,
    engine_kwargs,
    machine,
    spec_counters,
)

MODES = {"greedy": {"temperature": 0.0}, "t1.0": {"temperature": 1.0}}


def interleaved(target: str, spec: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    """Part 1: per mode, tokens/s of each engine at batch 1 and ReDrafter's acceptance."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engines = {"alone": LLM(**engine_kwargs(target), disable_log_stats=False),
               "redrafter": LLM(**engine_kwargs(target), disable_log_stats=False,
                                speculative_config=spec)}
    results = {}
    for mode, sampling in MODES.items():
        seconds, tokens = {"alone": 0.0, "redrafter": 0.0}, {"alone": 0, "redrafter": 0}
        before = spec_counters(engines["redrafter"])
        for i, ids in enumerate(tqdm(prompts, desc=f"{mode}: alone / redrafter, interleaved")):
            params = SamplingParams(**sampling, max_tokens=max_tokens, seed=i)
            order = ("alone", "redrafter") if i % 2 == 0 else ("redrafter", "alone")
            for name in order:
                start = time.perf_counter()
                out = engines[name].generate([TokensPrompt(prompt_token_ids=ids)], params,
                                             use_tqdm=False)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out[0].outputs[0].token_ids)
        spec_stats = counter_diff(spec_counters(engines["redrafter"]), before)
        drafts = spec_stats.get("vllm:spec_decode_num_drafts") or 0
        accepted = spec_stats.get("vllm:spec_decode_num_accepted_tokens") or 0
        per_pos = spec_stats.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        rate = {name: tokens[name] / seconds[name] for name in seconds}
        results[mode] = {
            "alone_tokens_per_s": rate["alone"], "redrafter_tokens_per_s": rate["redrafter"],
            "speedup": rate["redrafter"] / rate["alone"],
            "alone_seconds_per_token": seconds["alone"] / tokens["alone"],
            "tokens_per_step": 1 + accepted / drafts if drafts else None,
            # each engine step emits 1 + its accepted drafts (the prefill step counts as one)
            "drafted_step_fraction": drafts / (tokens["redrafter"] - accepted),
            "acceptance_per_position": [a / drafts for a in per_pos] if drafts else [],
            "tokens": tokens,
        }
    return results


def split_child(job: dict) -> dict:
    """Part 2, in a child process (engine in-process): ReDrafter's time split per verify step."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_redrafter.vllm_plugin.timing import StepTimings

    llm = LLM(**engine_kwargs(job["target"]), speculative_config=job["spec"])
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    proposer = runner.drafter
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    llm.generate([TokensPrompt(prompt_token_ids=job["prompts"][0])], params, use_tqdm=False)
    proposer.timings, proposer.trace = StepTimings(), []
    for ids in job["prompts"]:
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    packed = [len(r.drafts) + 1 for r in proposer.trace if r.drafts]
    W, L = job["spec"]["beam_width"], job["spec"]["beam_length"]
    return {"timings": proposer.timings.as_dict(),
            "mean_packed_tokens": sum(packed) / len(packed) if packed else None,
            "compression_ratio": W * L / (sum(packed) / len(packed)) if packed else None}


def time_split(target: str, spec: dict, prompts: list[list[int]], max_tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as work:
        job = {"target": target, "spec": spec, "prompts": prompts, "max_tokens": max_tokens}
        (Path(work) / "job.json").write_text(json.dumps(job))
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        run = subprocess.run([sys.executable, __file__, "--child", work], env=env,
                             capture_output=True, text=True, timeout=3600)
        if run.returncode != 0:
            raise RuntimeError(f"time-split run failed:\n{(run.stdout + run.stderr)[-3000:]}")
        return json.loads((Path(work) / "split.json").read_text())


def print_tables(results: dict, split: dict, spec: dict) -> None:
    print(f"\nbatch 1, W={spec['beam_width']} L={spec['beam_length']}")
    print(f"{'mode':8}{'alone tok/s':>13}{'redrafter tok/s':>17}{'speedup':>9}{'tok/step':>10}"
          f"{'drafted':>9}  acceptance by position")
    for mode, r in results.items():
        accept = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"][:6])
        print(f"{mode:8}{r['alone_tokens_per_s']:>13.1f}{r['redrafter_tokens_per_s']:>17.1f}"
              f"{r['speedup']:>8.2f}x{(r['tokens_per_step'] or 1.0):>10.2f}"
              f"{r['drafted_step_fraction']:>9.0%}  {accept}")
    timings = split["timings"]
    steps = max(timings.get("accept", {}).get("calls", 0), 1)
    plain_ms = results["greedy"]["alone_seconds_per_token"] * 1e3
    print(f"\nper verify step (greedy, {steps} steps), ms; a plain step of vLLM alone: "
          f"{plain_ms:.1f} ms per token (engine overhead included)")
    for phase in ("draft", "pack", "verify", "accept"):
        ms = timings.get(phase, {}).get("seconds", 0.0) / steps * 1e3
        print(f"  {phase:8}{ms:>8.2f}   {ms / plain_ms:>5.2f} x plain step")
    if split["compression_ratio"]:
        print(f"compression ratio W*L / packed tokens: {split['compression_ratio']:.2f} "
              f"({split['mean_packed_tokens']:.1f} packed tokens per tree)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--prompts", type=Path, default=None)
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--beam-width", type=int, default=1)
    parser.add_argument("--beam-length", type=int, default=3)
    parser.add_argument("--beam-policy", default="fixed", choices=("fixed", "auto"))
    parser.add_argument("--step-cost", type=Path, default=None,
                        help="the policy's step-cost curve (default: this machine's cached one)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "speedup.json")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # part 2's process: job.json in, split.json out
        split = split_child(json.loads((args.child / "job.json").read_text()))
        (args.child / "split.json").write_text(json.dumps(split))
        return

    from transformers import AutoTokenizer

    from vllm_redrafter.reference_loop import chat_prompt_ids
    from vllm_redrafter.target import prepare_target

    if not (args.drafter / "config.json").is_file():
        raise SystemExit(f"no drafter at {args.drafter} (pass --drafter DIR)")
    target = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    questions = first_turns(args.prompts or MT_BENCH, args.num_prompts)
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    spec = {"method": "redrafter", "model": str(args.drafter.resolve()),
            "beam_width": args.beam_width, "beam_length": args.beam_length,
            "beam_policy": args.beam_policy}
    if args.step_cost:
        spec["step_cost"] = str(args.step_cost.resolve())
    results = interleaved(target, spec, prompts, args.max_tokens)
    split = time_split(target, spec, prompts, args.max_tokens)
    print_tables(results, split, spec)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(portable({"machine": machine(), "drafter": str(args.drafter), "spec": spec,
                                    "num_prompts": len(prompts), "max_tokens": args.max_tokens,
                                    "modes": results, "time_split": split}), indent=1))
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
