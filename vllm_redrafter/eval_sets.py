"""The evaluation sets shipped inside the package, and the one reader of their format.

A set is a jsonl file, one question per line: ``{"category": str, "turns": [str, ...]}``
(MT-Bench's format; other keys are ignored). Evaluation only: never training data, never used
to choose a setting. Attribution and licence: ``vllm_redrafter/data/README.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
MT_BENCH = DATA_DIR / "mt_bench_questions.jsonl"
MT_BENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"


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
