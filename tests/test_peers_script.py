"""benchmarks/peers.py: its flags, the tables it builds from runs, its engine order (no engine),
and one end-to-end run of vLLM alone beside vLLM's n-gram proposer (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["peers"] = module
    spec.loader.exec_module(module)
    return module


def test_flags(peers):
    args = peers.parse_args(["--sets", "mt_bench,translation", "--arms", "ngram,redrafter",
                             "--ngram-sweep", "3:2:4,5:1:3", "--ngram-best", "4:2:5",
                             "--concurrency", "1,4", "--repeats", "4"])
    assert args.sets == ["mt_bench", "translation"]
    assert args.arms == ["alone", "ngram", "redrafter"]  # vLLM alone always first
    assert [peers.ngram_label(s) for s in args.ngram_sweep] == ["3:2:4", "5:1:3"]
    assert args.ngram_best == {"method": "ngram", "num_speculative_tokens": 4,
                               "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert args.concurrency == [1, 4] and args.repeats == 4
    defaults = peers.parse_args([])
    assert defaults.sets == ["mt_bench", "translation", "summarization", "qa", "math", "rag",
                             "code_edit"]
    assert defaults.arms == list(peers.ARMS) and defaults.suffix_cached_requests == 0
    assert peers.ngram_label(defaults.ngram_doc) == "5:4:4"
    for bad in (["--sets", "mt_bench,nope"], ["--arms", "eagle"], ["--ngram-best", "3:4:2"],
                ["--ngram-sweep", "3:2"], ["--repeats", "0"]):
        with pytest.raises(SystemExit):
            peers.parse_args(bad)


def test_categories_in_turn(peers):
    from vllm_redrafter.eval_sets import MT_BENCH, Question, read_questions

    picked = peers.categories_in_turn(read_questions(MT_BENCH), 16)
    assert Counter(q.category for q in picked) == {c: 2 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    one = [Question("qa", (f"q{i}",)) for i in range(5)]
    assert peers.categories_in_turn(one, 3) == one[:3]
    assert peers.categories_in_turn(one, 9) == one


def test_engine_order_rotates_per_prompt_and_reverses_per_repeat(peers):
    names = ["alone", "ngram", "suffix", "redrafter"]
    for k in (0, 1):
        orders = [peers.qps.rotation(names, i, k) for i in range(len(names))]
        assert Counter(o[0] for o in orders) == Counter(names)  # each arm first as often
        assert all(sorted(o) == sorted(names) for o in orders)
    assert peers.qps.rotation(names, 0, 1) == names[::-1]
    starts = [peers.qps.start_order(names, k) for k in range(2)]
    assert starts == [names, names[::-1]]


def _records():
    """Two repeats, two MT-Bench categories (one prompt each) and a one-category set."""
    records = []
    for k in (0, 1):
        for s, category, prompt in (("mt_bench", "writing", 0), ("mt_bench", "math", 1),
                                    ("qa", "qa", 0)):
            out = [1, 2, 3, 4]
            records += [
                {"set": s, "category": category, "prompt": prompt, "repeat": k, "arm": "alone",
                 "seconds": 2.0, "tokens": 4, "drafts": 0, "accepted": 0, "output": out},
                {"set": s, "category": category, "prompt": prompt, "repeat": k, "arm": "ngram",
                 "seconds": 1.0 if k == 0 else 2.0, "tokens": 4, "drafts": 2, "accepted": 2,
                 "output": out if category != "math" else [1, 2, 3, 5]},
                {"set": s, "category": category, "prompt": prompt, "repeat": k, "arm": "redrafter",
                 "seconds": 4.0, "tokens": 4, "drafts": 0, "accepted": 0, "output": out}]
    return records


def test_table_from_fake_runs(peers):
    records = peers.mark_identity(_records())
    assert all("output" not in r for r in records)
    assert [r["identical"] for r in records if r["arm"] == "ngram"] == [True, False, True] * 2
    rows = peers.table(records)
    assert [(r["set"], r["category"]) for r in rows] == [
        ("mt_bench", "writing"), ("mt_bench", "math"), ("mt_bench", "all"), ("qa", "qa")]
    writing, math, everything, qa = rows
    ngram = writing["arms"]["ngram"]
    assert ngram["tokens_per_s"] == pytest.approx(8 / 3)  # 8 tokens in 1 + 2 s
    assert ngram["speedup"] == pytest.approx((8 / 3) / 2.0)  # alone: 8 tokens in 4 s
    assert ngram["speedup_per_repeat"] == pytest.approx([2.0, 1.0])
    assert ngram["tokens_per_step"] == pytest.approx(2.0)  # 1 + 4 accepted / 4 drafting steps
    assert ngram["drafted_step_fraction"] == pytest.approx(4 / 4)  # 4 steps, all drafted
    assert (ngram["identical"], ngram["answers"]) == (2, 2)
    assert (math["arms"]["ngram"]["identical"], math["arms"]["ngram"]["answers"]) == (0, 2)
    assert (everything["arms"]["ngram"]["identical"], everything["prompts"]) == (2, 2)
    assert everything["arms"]["redrafter"]["speedup"] == pytest.approx(0.5)
    assert everything["arms"]["redrafter"]["tokens_per_step"] is None
    assert everything["arms"]["alone"]["speedup"] == 1.0
    assert qa["arms"]["ngram"]["identical"] == 2


def test_hog_pass_answers_again_with_a_busy_process(peers, monkeypatch):
    """--hog: the prompts are answered a second time with a CPU hog running, which is killed at
    the repeat's end; identity is judged against vLLM alone in the same phase; the table's rows
    per set are the two phases."""
    import types

    hogs = []

    class Hog:
        def __init__(self):
            self.killed = False
            hogs.append(self)

        def kill(self):
            self.killed = True

        def wait(self):
            pass

    def generate_one(llm, ids, params):
        hogged = bool(hogs and not hogs[-1].killed)
        return (2.0 if llm.name == "alone" else 1.0 + 2.0 * hogged,
                [1, 2] if hogged and llm.name == "redrafter" else [1, 2, 3], {})

    monkeypatch.setattr(peers, "start_hog", Hog)
    monkeypatch.setattr(peers, "start_engines", lambda order, target, specs: {
        n: types.SimpleNamespace(name=n, generate=lambda *a, **k: None) for n in order})
    monkeypatch.setattr(peers, "stop_engines", lambda engines: None)
    monkeypatch.setattr(peers, "resolved_spec", lambda llm: None)
    monkeypatch.setattr(peers, "generate_one", generate_one)
    items = [{"set": "qa", "category": "qa", "prompt": i, "ids": [5]} for i in range(3)]
    records = peers.mark_identity(peers.interleaved({"alone": None, "redrafter": {}}, "t", items,
                                                    [5], None, repeats=2, hog=True))
    assert len(records) == 2 * 2 * 2 * 3 and len(hogs) == 2 and all(h.killed for h in hogs)
    assert [r["hog"] for r in records if r["arm"] == "alone"] == ([False] * 3 + [True] * 3) * 2
    assert all(r["identical"] == (r["arm"] == "alone" or not r["hog"]) for r in records)
    rows = peers.table(peers.by_hog_phase(records))
    assert [r["category"] for r in rows] == ["no hog", "hog", "all"]
    assert rows[0]["arms"]["redrafter"]["speedup"] == pytest.approx(2.0)  # 3 tokens: 1 s vs 2
    assert rows[1]["arms"]["redrafter"]["speedup"] == pytest.approx((2 / 3) / 1.5)
    assert peers.parse_args(["--hog"]).hog and not peers.parse_args([]).hog


def test_pick_best_and_plots(peers, tmp_path):
    sweep = [{"setting": "3:2:4", "speedup": 1.05}, {"setting": "5:2:4", "speedup": 1.2},
             {"setting": "2:3:5", "speedup": 0.9}]
    assert peers.pick_best(sweep)["setting"] == "5:2:4"
    rows = peers.table(peers.mark_identity(_records()))
    written = peers.plot_batch1(rows, lambda s: tmp_path / f"b1_{s}.png")
    assert [Path(p).name for p in written] == ["b1_mt_bench.png", "b1_qa.png"]
    assert all(Path(p).stat().st_size > 0 for p in written)


def test_serving_rows_pair_each_arm_with_vllm_alone(peers, tmp_path):
    def run(tokens, seconds, texts):
        return {"duration": seconds, "total_output_tokens": tokens,
                "output_throughput": tokens / seconds, "output_lens": [tokens // 2] * 2,
                "ttfts": [0.1, 0.2], "latencies": [1.0, 2.0], "errors": ["", ""],
                "generated_texts": texts}

    runs = {"alone": [run(100, 10.0, ["a", "b"]), run(100, 8.0, ["a", "b"])],
            "ngram": [run(100, 5.0, ["a", "x"]), run(100, 8.0, ["a", "b"])]}
    delta = {"vllm:spec_decode_num_drafts_total": 30.0,
             "vllm:spec_decode_num_accepted_tokens_total": 50.0,
             "vllm:generation_tokens_total": 150.0}
    row = peers.serving_row("qa", "c2", runs, {"ngram": delta})
    ngram = row["arms"]["ngram"]
    assert ngram["throughput_ratio"] == pytest.approx(18.0 / 13.0)
    assert ngram["throughput_ratio_per_repeat"] == pytest.approx([2.0, 1.0])
    assert (ngram["identical"], ngram["compared"]) == (3, 4)
    assert ngram["tokens_per_step"] == pytest.approx(1 + 50 / 30)
    assert ngram["drafted_fraction"] == pytest.approx(0.3)
    assert peers.serving_levels([1, 4, 16], 6, 24) == [
        {"label": "c1", "concurrency": 1, "num_prompts": 6},
        {"label": "c4", "concurrency": 4, "num_prompts": 24},
        {"label": "c16", "concurrency": 16, "num_prompts": 24}]
    assert peers.plot_serving([row], lambda s: tmp_path / f"s_{s}.png") == [str(tmp_path / "s_qa.png")]


def test_suffix_arm_left_out_with_a_note_without_its_package(peers, monkeypatch):
    monkeypatch.setattr(peers, "suffix_available", lambda: False)
    notes: list[str] = []
    specs = peers.arm_specs(peers.parse_args(["--arms", "ngram,suffix"]), notes)
    assert list(specs) == ["alone", "ngram"] and "arctic_inference" in notes[0]
    monkeypatch.setattr(peers, "suffix_available", lambda: True)
    specs = peers.arm_specs(peers.parse_args(["--arms", "suffix", "--suffix-cached-requests", "7"]),
                            [])
    assert specs["suffix"] == {"method": "suffix", "suffix_decoding_max_cached_requests": 7}


@pytest.mark.slow
def test_smoke_alone_and_ngram(tmp_path):
    """End to end on 2 translation prompts x 8 tokens: both engines, the table, JSON and PNG.
    The engines' cores run in the script's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
    script's code unchanged): on a 2-core AVX2 CPU 37 s, against 111 s with an engine-core
    process started per engine."""
    out = tmp_path / "peers.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--sets", "translation", "--num-prompts", "2",
                          "--max-tokens", "8", "--arms", "alone,ngram", "--repeats", "1",
                          "--out", str(out)], capture_output=True, text=True, timeout=900,
                         check=False, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["resolved_specs"]["ngram"] == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 4,
        "prompt_lookup_max": 4}
    (row,) = result["batch1"]["rows"]
    assert (row["set"], row["category"], row["prompts"]) == ("translation", "translation", 2)
    for arm in ("alone", "ngram"):
        assert row["arms"][arm]["tokens"] == 16 and row["arms"][arm]["answers"] == 2
    # greedy n-gram speculation must not change vLLM's output
    assert row["arms"]["ngram"]["identical"] == 2
    assert (tmp_path / "peers_translation.png").stat().st_size > 0
    assert "batch 1: tokens/s" in run.stdout
