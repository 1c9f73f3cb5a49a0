"""The project's own evaluation sets (``eval_sets.EVAL_SETS``, issue 38): their fingerprints, their
format, and that no training prompt overlaps them, as for MT-Bench (tests/test_train.py).

Overlap is checked against every prompt a training recipe can take without the target: each
model-free built-in source at the largest count any recipe asks of it (a source's first n prompts
are the first n of any larger count), every written stock in full, and every paragraph the text
and document sources draw from (those of the packages installed where the test runs). The
questions the target writes itself (``self_instruct``) cannot be made without it; the requests
that ask for them are checked.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import hashlib
import json
import math
import re
import tomllib
from collections import Counter
from functools import cache
from pathlib import Path

import pytest

from vllm_redrafter.eval_sets import (DATA_DIR, EVAL_SETS, MT_BENCH, read_eval_set,
                                      read_questions)

REPO = Path(__file__).resolve().parents[1]
TRAIN_DIR = REPO / "vllm_redrafter" / "train"
KINDS = {"translation", "summarization", "qa", "math", "rag", "code_edit"}


def words(text: str) -> list[str]:
    """Lower-case words without punctuation (stricter than splitting on spaces: "box." is "box")."""
    return re.findall(r"[\w']+", text.lower())


def windows(text: str, n: int = 6) -> set[str]:
    w = words(text)
    return {" ".join(w[i:i + n]) for i in range(len(w) - n + 1)}


def word_set(text: str) -> frozenset[str]:
    """The near-duplicate test's word set (tests/test_train.py)."""
    return frozenset(re.findall(r"[a-z0-9']+", text.lower()))


@cache
def eval_prompts() -> tuple[tuple[str, int, str], ...]:
    """(kind, index, first turn) of every question of every set."""
    return tuple((kind, i, q.first_turn) for kind in EVAL_SETS
                 for i, q in enumerate(read_questions(EVAL_SETS[kind][0])))


@pytest.fixture(scope="module")
def training_prompts() -> dict[str, list[str]]:
    """Every training prompt made without the target, by source."""
    from vllm_redrafter.train import prompts as builtin
    from vllm_redrafter.train.detailed_prompts import detailed_prompts
    from vllm_redrafter.train.distill import BuiltinSpec
    from vllm_redrafter.train.recipes import RECIPES
    from vllm_redrafter.train.specific_prompts import specific_prompts
    from vllm_redrafter.train.written_prompts import STOCK_FILES, source_name, written_stock

    makers = {"templated": builtin.templated_prompts, "text": builtin.text_prompts,
              "documents": builtin.document_prompts, "constrained": builtin.constrained_prompts,
              "detailed": detailed_prompts, "specific": specific_prompts,
              "self_instruct": builtin.self_instruct_requests}
    written = {source_name(n) for n in STOCK_FILES}
    counts = {f.name for f in dataclasses.fields(BuiltinSpec)} - {"seed"}
    assert counts <= set(makers) | written, (
        f"new built-in sources {sorted(counts - set(makers) - written)}: check them here too")

    largest: dict[tuple[str, int], int] = {(name, seed): 40 for name in makers for seed in (0, 1)}
    for recipe in RECIPES.values():
        for spec in recipe.datasets:
            for name in makers:
                key = (name, spec.builtin.seed)
                largest[key] = max(largest.get(key, 0), getattr(spec.builtin, name))

    # The text and document sources each read every local paragraph again: read them once.
    stdlib, licences = cache(builtin._stdlib_paragraphs), cache(builtin._licence_paragraphs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtin, "_stdlib_paragraphs", stdlib)
        mp.setattr(builtin, "_licence_paragraphs", licences)
        made = {f"{name}(seed={seed})": makers[name](n, seed)
                for (name, seed), n in sorted(largest.items())}
        made["local paragraphs"] = builtin.local_paragraphs(10 ** 9, 0)
    made["written"] = [prompt for n in STOCK_FILES for _, prompt in written_stock(n)]
    return made


def test_sets_are_as_recorded_and_read():
    assert set(EVAL_SETS) == KINDS
    ids = []
    for kind, (path, sha256) in EVAL_SETS.items():
        assert path.parent == DATA_DIR and path.name == f"eval_{kind}.jsonl"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha256, (
            f"{path.name} changed: sets are never edited, add a new one")
        questions = read_eval_set(kind)
        assert len(questions) >= 20 and questions == read_questions(path)
        assert {q.category for q in questions} == {kind}
        assert all(len(q.turns) == 1 for q in questions)
        assert len({q.first_turn for q in questions}) == len(questions)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert [set(row) for row in rows] == [{"question_id", "category", "turns"}] * len(rows)
        ids += [row["question_id"] for row in rows]
    assert len(set(ids)) == len(ids)  # a question_id names one question of one set
    with pytest.raises(ValueError, match="no evaluation set 'poetry'"):
        read_eval_set("poetry")


def test_sets_are_package_data_and_documented():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["vllm_redrafter"]
    note = (DATA_DIR / "README.md").read_text()
    for path, sha256 in EVAL_SETS.values():
        rel = path.relative_to(DATA_DIR.parent).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} is not package data"
        assert f"## {path.name}" in note and sha256 in note, f"README.md lacks {path.name}"


def test_prompts_fit_the_targets_context(target_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    for kind, i, prompt in eval_prompts():
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        n = len(tokenizer(text, add_special_tokens=False).input_ids)
        assert n <= 1200, f"{kind}[{i}]: {n} tokens, leaving too little of 2048 for the answer"


def test_no_training_prompt_or_mt_bench_question_repeats_an_evaluation_prompt(training_prompts):
    """No six-word window of an evaluation prompt appears in a training prompt or an MT-Bench turn
    (case and punctuation aside), and none is repeated across the sets."""
    mt_bench = [t for q in read_questions(MT_BENCH) for t in q.turns]
    seen: dict[str, str] = {}
    for source, prompts in {**training_prompts, "MT-Bench": mt_bench}.items():
        for prompt in prompts:
            for w in windows(prompt):
                seen.setdefault(w, source)
    leaked = [(kind, i, w, seen[w]) for kind, i, prompt in eval_prompts()
              for w in sorted(windows(prompt)) if w in seen]
    assert not leaked, f"evaluation prompts repeat training or MT-Bench text: {leaked[:5]}"

    owner: dict[str, tuple[str, int]] = {}
    repeated = []
    for kind, i, prompt in eval_prompts():
        for w in windows(prompt):
            if owner.setdefault(w, (kind, i))[0] != kind:
                repeated.append((owner[w], (kind, i), w))
    assert not repeated, f"two sets share a passage: {repeated[:3]}"


def test_no_training_prompt_nearly_duplicates_an_evaluation_prompt(training_prompts):
    """No training prompt (the written stocks, as tests/test_train.py checks them among
    themselves, and every built-in one) shares more than 60% of its word set (Jaccard) with an
    evaluation prompt. Prefix-filtered: two such sets share a word among the evaluation
    prompt's ``len - ceil(0.6 len) + 1`` rarest."""
    sets = [word_set(p) for prompts in training_prompts.values() for p in prompts]
    freq = Counter(w for s in sets for w in s)
    prefixes = []
    for kind, i, prompt in eval_prompts():
        s = word_set(prompt)
        keep = len(s) - math.ceil(0.6 * len(s)) + 1
        prefixes.append((kind, i, s, sorted(s, key=lambda w: (freq[w], w))[:keep]))
    wanted = {w for *_, prefix in prefixes for w in prefix}
    index: dict[str, list[int]] = {}
    for j, s in enumerate(sets):
        for w in s & wanted:
            index.setdefault(w, []).append(j)
    near = [(kind, i, round(len(s & sets[j]) / len(s | sets[j]), 2))
            for kind, i, s, prefix in prefixes
            for j in {j for w in prefix for j in index.get(w, ())}
            if len(s & sets[j]) > 0.6 * len(s | sets[j])]
    assert not near, f"training prompts nearly repeat evaluation prompts: {near[:5]}"


def test_training_code_never_reads_the_evaluation_sets():
    """Nothing under vllm_redrafter/train imports eval_sets, uses its names, or names a set's file,
    in code or data (a docstring may say that training never reads MT-Bench)."""
    names = {"eval_sets", "EVAL_SETS", "MT_BENCH", "read_questions", "first_turns", "read_eval_set"}
    files = [p.name for p, _ in EVAL_SETS.values()] + [MT_BENCH.name]

    def refers(text: str) -> bool:
        return (bool(names & set(re.split(r"\W+", text))) or "data/eval_" in text
                or any(name in text for name in files))

    sources = sorted(TRAIN_DIR.rglob("*.py"))
    assert len(sources) > 5
    for source in sources:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                           ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found = [node.module or ""] + [a.name for a in node.names]
            elif isinstance(node, ast.Name):
                found = [node.id]
            elif isinstance(node, ast.Attribute):
                found = [node.attr]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and id(node) not in docstrings):
                found = [node.value]
            else:
                continue
            bad = [text for text in found if refers(text)]
            assert not bad, f"{source.relative_to(REPO)}:{node.lineno} refers to {bad}"
    for data in sorted(TRAIN_DIR.rglob("*.jsonl")):
        text = data.read_text(encoding="utf-8")
        assert not any(name in text for name in files), f"{data.name} names an evaluation set"
