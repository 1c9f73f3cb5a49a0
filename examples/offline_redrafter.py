"""Offline generation with ReDrafter in vLLM, then vLLM's own speculative-decoding metrics.

    python examples/offline_redrafter.py --drafter DRAFTER_DIR [--model TARGET] [--beam-width 4]

The target defaults to the embedded SmolLM2-135M-Instruct (prepared on first use); the drafter
defaults to the package's ``default_drafter`` when it ships one. On CPU, float32 is the fast
dtype (no native bf16 on most CPUs). A request may pick its own beam shape through
``SamplingParams.extra_args`` (``redrafter_beam_width``, ``redrafter_beam_length``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

QUESTIONS = [
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "What is the capital of Australia, and why is it not Sydney?",
]


def main() -> None:
    import vllm_redrafter

    default_drafter = Path(vllm_redrafter.__file__).parent / "default_drafter"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target model (default: the embedded SmolLM2-135M)")
    parser.add_argument("--drafter", default=str(default_drafter), help="drafter directory")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0,
                        help="KV cache size (on CPU this also sidesteps vLLM's memory check)")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    from vllm_redrafter.target import prepare_target

    model = args.model or str(prepare_target())
    llm = LLM(
        model=model,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=2048,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        disable_log_stats=False,  # vLLM's spec-decode counters are stats
        speculative_config={
            "method": "redrafter",
            "model": args.drafter,
            "beam_width": args.beam_width,
            "beam_length": args.beam_length,
        },
    )
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for question, output in zip(QUESTIONS, llm.chat(conversations, params)):
        print(f"Q: {question}\nA: {output.outputs[0].text.strip()}\n")
    print_spec_decode_metrics(llm, positions=args.beam_length - 1)


def print_spec_decode_metrics(llm, positions: int) -> None:
    """Acceptance length and per-position acceptance (first ``positions``), from vLLM's counters."""
    metrics = {m.name: m for m in llm.get_metrics()}
    drafts = metrics["vllm:spec_decode_num_drafts"].value
    draft_tokens = metrics["vllm:spec_decode_num_draft_tokens"].value
    accepted = metrics["vllm:spec_decode_num_accepted_tokens"].value
    per_position = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values[:positions]
    if not drafts:
        print("no drafts were verified")
        return
    print(f"drafts verified:          {drafts}")
    print(f"draft tokens:             {draft_tokens}")
    print(f"accepted draft tokens:    {accepted}  ({accepted / draft_tokens:.1%} of drafted)")
    print(f"mean acceptance length:   {1 + accepted / drafts:.2f} tokens per step (bonus included)")
    rates = ", ".join(f"{n / drafts:.2f}" for n in per_position)
    print(f"acceptance per position:  {rates}")


if __name__ == "__main__":  # vLLM's engine core is a spawned process: the guard is required
    main()
