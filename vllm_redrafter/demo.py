"""``vllm-redrafter demo``: vLLM alone vs vLLM with ReDrafter, in one run, on the embedded target.

Prepares the embedded SmolLM2-135M-Instruct target, loads the drafter shipped with the package
(or ``--drafter DIR``), then answers MT-Bench questions (first turn, chat template, greedy) one
request at a time (batch 1, what a user waits for) through vLLM alone and through vLLM with
ReDrafter. Prints tokens/s of each, the speedup, tokens per step, per-position acceptance and
whether both gave the same tokens; exits 1 if any output differs (greedy output must be exact).

The questions are the MT-Bench set shipped in the package (``eval_sets.MT_BENCH``) or
``--prompts FILE`` (same jsonl format). vLLM's log is kept at WARNING unless ``--verbose``.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vllm_redrafter.eval_sets import MT_BENCH, first_turns
from vllm_redrafter.results import portable

PACKAGE = Path(__file__).resolve().parent
DEFAULT_DRAFTER = PACKAGE / "default_drafter"
def engine_kwargs(target: str) -> dict:
    """One engine setting for both runs: float32 and a small KV space on a CPU."""
    import torch

    if torch.cuda.is_available():
        return {"model": target, "seed": 0, "max_model_len": 2048}
    return {"model": target, "dtype": "float32", "enforce_eager": True, "seed": 0,
            "max_model_len": 2048, "kv_cache_memory_bytes": 1 << 30}


def int_list(text: str) -> list[int]:
    """A comma-separated list of ints, as benchmark flags take them: ``"1,2,4"`` -> [1, 2, 4]."""
    return [int(x) for x in text.split(",")]


def machine() -> str:
    """Where figures were measured: the GPU's name, or the CPU's architecture, cores and ISA."""
    import os
    import platform

    import torch

    from vllm_redrafter.cpu_features import cpu_isa

    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"{platform.machine()} CPU, {os.cpu_count()} cores {cpu_isa()}".strip()


@dataclass
class Run:
    name: str
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    spec: dict[str, object] = field(default_factory=dict)  # vLLM's spec-decode counters

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds

    def tokens_per_step(self) -> float | None:
        """Mean tokens emitted per verify step (accepted drafts + 1), over steps with drafts."""
        drafts = self.spec.get("vllm:spec_decode_num_drafts") or 0
        if not drafts:
            return None
        return 1 + self.spec["vllm:spec_decode_num_accepted_tokens"] / drafts

    def acceptance_per_position(self) -> list[float]:
        drafts = self.spec.get("vllm:spec_decode_num_drafts") or 0
        per_pos = self.spec.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []
        return [a / drafts for a in per_pos if drafts] if drafts else []


def metric_totals(text: str, names: Sequence[str]) -> dict[str, float]:
    """Each named sample of a Prometheus ``/metrics`` page, summed over its labels (0 if absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


def spec_counters(llm) -> dict[str, object]:
    """This engine's spec-decode counters (per-position ones as lists); needs
    disable_log_stats=False. Read from the engine's own Prometheus logger: each engine started in
    a process unregisters the earlier ones' collectors, so ``llm.get_metrics()`` (the registry)
    shows only the last-started engine's counters."""
    prom = _spec_decoding_prom(llm)
    if prom is None:  # no Prometheus logger of its own found: the registry, as vLLM reads it
        return {m.name: getattr(m, "values", getattr(m, "value", None))
                for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}
    if not prom.spec_decoding_enabled:
        return {}
    value = lambda counter: counter._value.get()  # noqa: E731 (prometheus_client's child value)
    return {"vllm:spec_decode_num_drafts": value(prom.counter_spec_decode_num_drafts[0]),
            "vllm:spec_decode_num_draft_tokens": value(prom.counter_spec_decode_num_draft_tokens[0]),
            "vllm:spec_decode_num_accepted_tokens":
                value(prom.counter_spec_decode_num_accepted_tokens[0]),
            "vllm:spec_decode_num_accepted_tokens_per_pos":
                [value(c) for c in prom.counter_spec_decode_num_accepted_tokens_per_pos.get(0, [])]}


def _spec_decoding_prom(llm):
    """The engine's ``SpecDecodingProm`` (vLLM 0.32: LLMEngine.logger_manager's
    PrometheusStatLogger), or None."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    manager = getattr(llm.llm_engine, "logger_manager", None)
    for logger_ in getattr(manager, "stat_loggers", []):
        if isinstance(logger_, PrometheusStatLogger):
            return logger_.spec_decoding_prom
    return None


def counter_diff(after: dict, before: dict) -> dict:
    """``after - before`` for each counter (element-wise for lists)."""
    return {k: ([a - b for a, b in zip(v, before.get(k) or [0] * len(v))] if isinstance(v, list)
                else v - (before.get(k) or 0)) for k, v in after.items()}


def run_batch1(name: str, engine: dict, prompts: list[list[int]], params) -> Run:
    """Every prompt alone (batch 1), timed; vLLM's spec-decode counters over the run."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(**engine, disable_log_stats=False)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0])], params, use_tqdm=False)  # warm-up
    before = spec_counters(llm)
    run = Run(name)
    for ids in tqdm(prompts, desc=name):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        run.seconds += time.perf_counter() - start
        run.outputs.append(list(out[0].outputs[0].token_ids))
    run.spec = counter_diff(spec_counters(llm), before)
    del llm
    gc.collect()
    return run


def report(alone: Run, ours: Run) -> dict:
    same = sum(a == b for a, b in zip(alone.outputs, ours.outputs))
    tps = ours.tokens_per_step()
    figures = {
        "prompts": len(alone.outputs),
        "identical_outputs": same,
        "alone_tokens_per_s": alone.tokens_per_second,
        "redrafter_tokens_per_s": ours.tokens_per_second,
        "speedup": ours.tokens_per_second / alone.tokens_per_second,
        "tokens_per_step": tps,
        "acceptance_per_position": ours.acceptance_per_position(),
    }
    print(f"\n{'':24}{'vLLM alone':>12}{'+ ReDrafter':>14}")
    print(f"{'tokens/s (batch 1)':24}{alone.tokens_per_second:>12.1f}{ours.tokens_per_second:>14.1f}")
    print(f"{'speedup':24}{'':>12}{figures['speedup']:>13.2f}x")
    print(f"{'tokens per step':24}{1.0:>12.2f}{(tps or 1.0):>14.2f}")
    accept = ", ".join(f"{a:.2f}" for a in figures["acceptance_per_position"][:8])
    print(f"acceptance by draft position: {accept or 'no drafts'}")
    print(f"identical greedy outputs: {same}/{len(alone.outputs)}")
    return figures


def quiet_vllm(verbose: bool) -> None:
    """vLLM's log at WARNING (INFO with ``--verbose``); set before vLLM is first imported, and
    inherited by its engine processes."""
    import os

    if not verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def main(args: argparse.Namespace) -> int:
    drafter = Path(args.drafter) if args.drafter else DEFAULT_DRAFTER
    if not (drafter / "config.json").is_file():  # said before the heavy imports (seconds)
        why = "no config.json there" if args.drafter else "this install ships no default drafter"
        raise SystemExit(
            f"no drafter at {drafter} ({why}). Train one (vllm-redrafter train --recipe medium "
            "--output-dir runs/medium) and pass --drafter runs/medium")
    questions = first_turns(Path(args.prompts) if args.prompts else MT_BENCH, args.num_prompts)
    quiet_vllm(args.verbose)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_redrafter.reference_loop import chat_prompt_ids
    from vllm_redrafter.target import prepare_target

    target = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [chat_prompt_ids(tokenizer, q) for q in questions]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine = engine_kwargs(target)
    spec = {"method": "redrafter", "model": str(drafter), "beam_width": args.beam_width,
            "beam_length": args.beam_length, "beam_policy": "fixed"}
    alone = run_batch1("vLLM alone", engine, prompts, params)
    ours = run_batch1("vLLM + ReDrafter", {**engine, "speculative_config": spec}, prompts, params)
    figures = report(alone, ours)
    if args.json:
        Path(args.json).write_text(json.dumps(portable({**figures, "machine": machine(), "drafter": str(drafter),
                                               "beam_width": args.beam_width,
                                               "beam_length": args.beam_length}), indent=1))
    return 0 if figures["identical_outputs"] == len(prompts) else 1


def add_demo_parser(sub) -> None:
    demo = sub.add_parser("demo", help="vLLM alone vs vLLM + ReDrafter on the embedded target")
    demo.add_argument("--drafter", default=None, help="drafter dir (default: the shipped one)")
    demo.add_argument("--prompts", default=None, help="MT-Bench-format jsonl (default: the "
                      "80 MT-Bench questions shipped in the package)")
    demo.add_argument("--num-prompts", type=int, default=20)
    demo.add_argument("--max-tokens", type=int, default=64)
    # Chains of 3 by default: measured fastest at batch 1 on a 2-core CPU with the shipped
    # drafter (W=1 L=3 1.08x vLLM alone, W=4 L=4 0.70x): there every verified token costs.
    demo.add_argument("--beam-width", type=int, default=1)
    demo.add_argument("--beam-length", type=int, default=3)
    demo.add_argument("--json", default=None, help="also write the figures here")
    demo.add_argument("--verbose", action="store_true", help="vLLM's log at INFO (default WARNING)")
    demo.set_defaults(func=main)
