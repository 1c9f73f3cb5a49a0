"""The evaluation sets shipped inside the package, and the one reader of their format.

A set is a jsonl file, one question per line: ``{"category": str, "turns": [str, ...]}``
(MT-Bench's format; other keys are ignored). Evaluation only: never training data, never used
to choose a setting. Attribution and licence: ``vllm_redrafter/data/README.md``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
MT_BENCH = DATA_DIR / "mt_bench_questions.jsonl"
MT_BENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"

# The project's own sets, one per kind of task (issue 38): {kind: (file, sha256)}, 24 single-turn
# questions each, written for this project (Apache-2.0). Recorded before anything was measured on
# them and fixed since: a set that must change is a new file under a new name, never an edit.
# tests/test_eval_sets.py checks the fingerprints and that no training prompt overlaps them.
EVAL_SETS: dict[str, tuple[Path, str]] = {
    "translation": (DATA_DIR / "eval_translation.jsonl",
                    "3534ed197dd651b8452e62d25692c343b0070f859f48bb2960a92adf35cf81c4"),
    "summarization": (DATA_DIR / "eval_summarization.jsonl",
                      "3a52d9b65c0e8e64eca1619d810bd36eb2f8606971ec5808637598ae3c868a78"),
    "qa": (DATA_DIR / "eval_qa.jsonl",
           "66c1e9c2c13002d5a107ef5e8d63975e3c796595a5108e0f142d0e119f28f662"),
    "math": (DATA_DIR / "eval_math.jsonl",
             "fe91ca404102d04209ec47e71f28f889e5c614b75dc41f211a9b3b4a6af032e8"),
    "rag": (DATA_DIR / "eval_rag.jsonl",
            "bbf1982a5b6eafc9e2a2d002c6954520dbc21e3929176c403365d2bec6a18884"),
    "code_edit": (DATA_DIR / "eval_code_edit.jsonl",
                  "c44269b990007fe5af05b07f46b621b51b3f12cecf5ace47f5d7a32402d5e16e"),
}


@dataclass(frozen=True)
class Question:
    category: str
    turns: tuple[str, ...]

    @property
    def first_turn(self) -> str:
        return self.turns[0]


def read_questions(path: Path | str = MT_BENCH, limit: int | None = None) -> list[Question]:
    """The first ``limit`` questions of a set, in file order; a malformed line names itself."""
    path = Path(path)
    questions = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            turns = tuple(row["turns"])
            if not turns or not all(isinstance(t, str) and t for t in turns):
                raise ValueError("'turns' must be a non-empty list of non-empty strings")
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{n}: not a question ({err!r}); each line must be a JSON "
                             "object with a non-empty 'turns' list") from err
        questions.append(Question(str(row.get("category", "")), turns))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions[:limit]


def first_turns(path: Path | str = MT_BENCH, limit: int | None = None) -> list[str]:
    """The first turn of each of the first ``limit`` questions."""
    return [q.first_turn for q in read_questions(path, limit)]


def read_eval_set(kind: str, limit: int | None = None) -> list[Question]:
    """The first ``limit`` questions of one of the project's own sets (``EVAL_SETS``), after
    checking that the file is the one recorded: a changed set would make measurements on it
    incomparable with earlier ones."""
    if kind not in EVAL_SETS:
        raise ValueError(f"no evaluation set {kind!r}; sets: {sorted(EVAL_SETS)}")
    path, sha256 = EVAL_SETS[kind]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != sha256:
        raise ValueError(f"{path} is not the recorded {kind!r} set (sha256 {digest}, recorded "
                         f"{sha256}); sets are never edited: add a new file instead")
    return read_questions(path, limit)
