"""The ``vllm-redrafter`` command: one entry point for the project's tools.

    vllm-redrafter prepare-target     dequantize the embedded SmolLM2-135M-Instruct target, once
"""

from __future__ import annotations

import argparse
import sys


def _prepare_target(args: argparse.Namespace) -> int:
    from vllm_redrafter.target import prepare_target

    print(prepare_target(force=args.force))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-redrafter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-target",
        help="dequantize the embedded SmolLM2-135M-Instruct (GGUF) into a float32 checkpoint",
    )
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_prepare_target)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
