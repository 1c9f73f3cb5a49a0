"""Training datasets: read a local file into examples, and render examples into token ids.

Accepted files (one format per line/object; formats may be mixed in one file):

- ``.jsonl`` (one JSON object a line) or ``.json`` (a list of objects), each object one of
    ``{"messages": [{"role": "user", "content": "..."}, ...]}``      chat (OpenAI style)
    ``{"conversations": [{"from": "human", "value": "..."}, ...]}``  ShareGPT
    ``{"prompt": "..."}``                                             one user turn
    ``{"text": "..."}``                                               plain text
    ``{"input_ids": [1, 2, ...]}``                                    pre-tokenized (target ids)
- anything else (``.txt``, ``.md``, ...): plain UTF-8 text, split at blank lines into paragraphs
  that are packed into documents of about ``TEXT_DOC_CHARS`` characters.

Training positions (where a drafter is trained to draft): for chat data the positions whose next
token belongs to an assistant turn (that is where the drafter runs at inference); for text and
token data every position. A position t means: the target has read tokens 0..t, h_t is its hidden
state there, and the drafter predicts what follows.

Every bad input raises ``DatasetError`` (a ValueError) naming the file and line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TEXT_DOC_CHARS = 2000
SHAREGPT_ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
CHAT_ROLES = {"system", "user", "assistant"}
JSON_KEYS = ("messages", "conversations", "prompt", "text", "input_ids")


class DatasetError(ValueError):
    """A dataset file or one of its examples cannot be used; the message names file and line."""


@dataclass(frozen=True)
class Example:
    """One training example; exactly one of messages / text / input_ids is set."""

    source: str  # "file:line", for error messages
    messages: tuple[dict[str, str], ...] | None = None
    text: str | None = None
    input_ids: tuple[int, ...] | None = None

    @property
    def kind(self) -> str:
        if self.messages is not None:
            return "chat"
        return "text" if self.text is not None else "tokens"


@dataclass(frozen=True)
class TokenizedExample:
    input_ids: list[int]  # [n]
    train_mask: list[bool]  # [n]: position t is a training position (see module docstring)
    source: str


# -- reading ---------------------------------------------------------------------------------------


def read_dataset(path: str | Path) -> list[Example]:
    """All examples of a dataset file; raises DatasetError on an empty or malformed file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DatasetError(f"{path} is not UTF-8 text: {err}") from err
    if path.suffix == ".jsonl":
        examples = _read_jsonl(raw, path)
    elif path.suffix == ".json":
        examples = _read_json(raw, path)
    else:
        examples = _read_text(raw, path)
    if not examples:
        raise DatasetError(f"{path} holds no examples (empty file)")
    return examples


def _read_jsonl(raw: str, path: Path) -> list[Example]:
    examples = []
    for lineno, line in enumerate(raw.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
        examples.append(parse_object(obj, f"{path}:{lineno}"))
    return examples


def _read_json(raw: str, path: Path) -> list[Example]:
    if not raw.strip():
        return []
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as err:
        raise DatasetError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from err
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a .json dataset must be a list of objects, got "
                           f"{type(data).__name__}")
    return [parse_object(obj, f"{path}[{i}]") for i, obj in enumerate(data)]


def _read_text(raw: str, path: Path) -> list[Example]:
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", raw) if p.strip()]
    docs: list[str] = []
    for paragraph in paragraphs:
        if docs and len(docs[-1]) + len(paragraph) < TEXT_DOC_CHARS:
            docs[-1] += "\n\n" + paragraph
        else:
            docs.append(paragraph)
    return [Example(source=f"{path}#doc{i}", text=doc) for i, doc in enumerate(docs)]


def parse_object(obj: Any, source: str) -> Example:
    """One JSON object of a dataset -> Example (see the module docstring for the formats)."""
    if not isinstance(obj, dict):
        raise DatasetError(f"{source}: expected a JSON object, got {type(obj).__name__}")
    present = [key for key in JSON_KEYS if key in obj]
    if len(present) != 1:
        raise DatasetError(f"{source}: an example needs exactly one of the keys {list(JSON_KEYS)}, "
                           f"found {present or sorted(obj)}")
    key = present[0]
    value = obj[key]
    if key == "messages":
        return Example(source, messages=_chat_messages(value, source))
    if key == "conversations":
        return Example(source, messages=_sharegpt_messages(value, source))
    if key == "prompt":
        _check_string(value, f"{source}: 'prompt'")
        return Example(source, messages=({"role": "user", "content": value},))
    if key == "text":
        _check_string(value, f"{source}: 'text'")
        return Example(source, text=value)
    if not isinstance(value, list) or not value or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise DatasetError(f"{source}: 'input_ids' must be a non-empty list of integers")
    return Example(source, input_ids=tuple(value))


def _check_string(value: Any, what: str) -> None:
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{what} must be a non-empty string, got {value!r:.80}")


def _chat_messages(turns: Any, source: str) -> tuple[dict[str, str], ...]:
    if not isinstance(turns, list) or not turns:
        raise DatasetError(f"{source}: 'messages' must be a non-empty list of turns")
    out = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "role" not in turn or "content" not in turn:
            raise DatasetError(f"{source}: turn {i} must be an object with 'role' and 'content', "
                               f"got {turn!r:.80}")
        if turn["role"] not in CHAT_ROLES:
            raise DatasetError(f"{source}: turn {i} has role {turn['role']!r}; the chat template "
                               f"renders only {sorted(CHAT_ROLES)}")
        if not isinstance(turn["content"], str):
            raise DatasetError(f"{source}: turn {i} content must be a string, got "
                               f"{type(turn['content']).__name__} (the chat template cannot "
                               "render it)")
        out.append({"role": turn["role"], "content": turn["content"]})
    return tuple(out)


def _sharegpt_messages(turns: Any, source: str) -> tuple[dict[str, str], ...]:
    if not isinstance(turns, list) or not turns:
        raise DatasetError(f"{source}: 'conversations' must be a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or "from" not in turn or "value" not in turn:
            raise DatasetError(f"{source}: ShareGPT turn {i} must be an object with 'from' and "
                               f"'value', got {turn!r:.80}")
        role = SHAREGPT_ROLES.get(str(turn["from"]).lower())
        if role is None:
            raise DatasetError(f"{source}: ShareGPT turn {i} is from {turn['from']!r}; known "
                               f"speakers: {sorted(SHAREGPT_ROLES)}")
        messages.append({"role": role, "content": turn["value"]})
    return _chat_messages(messages, source)


# -- rendering into token ids ----------------------------------------------------------------------


def render_chat(tokenizer, messages, source: str, add_generation_prompt: bool) -> list[int]:
    """Token ids of messages under the target's chat template; DatasetError if it cannot render."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise DatasetError(f"{source}: the target's tokenizer has no chat template; use plain "
                           "text or input_ids data")
    try:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                            tokenize=True, return_dict=True)
    except Exception as err:  # jinja2 errors (TemplateError, UndefinedError), TypeError, ...
        raise DatasetError(f"{source}: the target's chat template cannot render these turns: "
                           f"{type(err).__name__}: {err}") from err
    return list(out["input_ids"])


def prompt_ids(example: Example, tokenizer) -> list[int]:
    """The prompt a target answers (``labels=self``): the chat up to its first assistant turn,
    with the generation prompt appended."""
    if example.messages is None:
        raise DatasetError(f"{example.source}: labels 'self' need prompts (chat, ShareGPT or "
                           f"'prompt' examples), got a {example.kind} example; use labels "
                           "'distill' or 'ground-truth' for text")
    turns = list(example.messages)
    first_answer = next((i for i, m in enumerate(turns) if m["role"] == "assistant"), len(turns))
    if not any(m["role"] == "user" for m in turns[:first_answer]):
        raise DatasetError(f"{example.source}: no user turn before the first assistant turn")
    return render_chat(tokenizer, turns[:first_answer], example.source, add_generation_prompt=True)


def tokenize_example(example: Example, tokenizer, vocab_size: int,
                     max_len: int) -> TokenizedExample:
    """Token ids and training positions of an example (``labels=distill`` / ``ground-truth``)."""
    if example.messages is not None:
        ids, mask = _chat_ids_and_mask(example, tokenizer)
    elif example.text is not None:
        ids = list(tokenizer(example.text, add_special_tokens=False)["input_ids"])
        mask = [True] * len(ids)
    else:
        ids = list(example.input_ids)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise DatasetError(f"{example.source}: input_ids hold {len(bad)} token id(s) outside "
                               f"the target's vocabulary [0, {vocab_size}), e.g. {bad[:5]}")
        mask = [True] * len(ids)
    ids, mask = ids[:max_len], mask[:max_len]
    mask[-1:] = [False] * len(mask[-1:])  # the last position has no next token in the text
    return TokenizedExample(ids, mask, example.source)


def _chat_ids_and_mask(example: Example, tokenizer) -> tuple[list[int], list[bool]]:
    """Positions t whose next token t+1 lies inside an assistant turn's rendering."""
    turns = list(example.messages)
    ids = render_chat(tokenizer, turns, example.source, add_generation_prompt=False)
    mask = [False] * len(ids)
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        start = len(render_chat(tokenizer, turns[:i], example.source, True)) if i else 0
        end = len(render_chat(tokenizer, turns[: i + 1], example.source, False))
        for t in range(max(start - 1, 0), min(end, len(ids)) - 1):
            mask[t] = True
    if not any(mask):  # no assistant turn: the whole conversation is text to learn from
        mask = [True] * len(ids)
    return ids, mask
