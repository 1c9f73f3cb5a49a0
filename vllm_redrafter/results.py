"""Writing measured figures and run records without the machine's absolute paths.

A result file is read on other machines: a path under the checkout or the working directory is
written relative to it, one under the home directory as ``~/...``. Example, with the checkout
at ``/src/vllm-redrafter`` and home ``/users/ada``::

    portable({"drafter": "/src/vllm-redrafter/vllm_redrafter/default_drafter",
              "target": "/users/ada/.cache/vllm-redrafter/SmolLM2-135M-Instruct-fp32"})
    == {"drafter": "vllm_redrafter/default_drafter",
        "target": "~/.cache/vllm-redrafter/SmolLM2-135M-Instruct-fp32"}
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CHECKOUT = Path(__file__).resolve().parents[1]  # the clone, or site-packages for a wheel


def _prefixes() -> list[tuple[str, str]]:
    """(absolute prefix, replacement), most specific first."""
    pairs = [(f"{CHECKOUT}/", ""), (f"{Path.cwd()}/", ""), (f"{Path.home()}/", "~/")]
    return sorted((p for p in pairs if p[0] != "//"), key=lambda p: -len(p[0]))


def portable(value: Any) -> Any:
    """``value`` with every absolute path prefix in its strings and paths made relative (see
    above); a ``Path`` becomes a string."""
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        for prefix, short in _prefixes():
            value = value.replace(prefix, short)
        return value
    if isinstance(value, dict):
        return {k: portable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    return value


def write_json(path: Path | str, value: Any) -> None:
    """``value`` as indented JSON at ``path``, its paths made portable."""
    Path(path).write_text(json.dumps(portable(value), indent=1))
