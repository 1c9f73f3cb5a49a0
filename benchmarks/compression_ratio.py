"""Compression ratio of dynamic tree attention on real beams: W*L / packed tokens.

For MT-Bench prompts (first turn, chat template), the embedded target answers greedily; at every
position of its answer the drafter runs beam search from the target's own hidden state, and the
beams' shared prefixes are removed. Prints the mean ratio per beam width (the paper reports
30-60% fewer tokens) and writes JSON.

    python benchmarks/compression_ratio.py [--drafter DIR] [--prompts FILE] [--num-prompts 10]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from vllm_redrafter.eval_sets import MT_BENCH, first_turns  # noqa: E402
from vllm_redrafter.results import portable  # noqa: E402
from vllm_redrafter.beam_search import beam_search
from vllm_redrafter.demo import DEFAULT_DRAFTER
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter
from vllm_redrafter.reference_loop import chat_prompt_ids, greedy_generate
from vllm_redrafter.target import prepare_target
from vllm_redrafter.tree import build_tree



def load_drafter(path: Path | None, model) -> tuple[RecurrentDrafter, str]:
    embedding = model.get_input_embeddings()
    if path is not None and (path / "config.json").is_file():
        return RecurrentDrafter.from_pretrained(path, embedding).eval(), str(path)
    cfg = model.config  # no trained drafter yet: an untrained one still makes real beams
    torch.manual_seed(0)
    config = DrafterConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                           exit_dim=2 * cfg.hidden_size, num_draft_layers=2, draft_vocab_size=8192)
    return RecurrentDrafter(config, embedding).eval(), "untrained (random) drafter"


@torch.no_grad()
def hidden_states_along_answers(model, tokenizer, questions, max_new_tokens):
    """(h, g0) at every position of the target's own greedy answers: [N, H], [N]."""
    hs, g0s = [], []
    for question in questions:
        prompt = chat_prompt_ids(tokenizer, question)
        answer = greedy_generate(model, prompt, max_new_tokens, tokenizer.eos_token_id)
        ids = torch.tensor([prompt + answer])
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0]
        # h at position t (after the final norm) and the token the target produced there.
        hs.append(hidden[len(prompt) - 1: len(ids[0]) - 1])
        g0s.append(ids[0, len(prompt): len(ids[0])])
    return torch.cat(hs), torch.cat(g0s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--prompts", type=Path, default=MT_BENCH)
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--beam-length", type=int, default=5)
    parser.add_argument("--widths", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compression_ratio.json"))
    args = parser.parse_args()

    target = prepare_target()
    tokenizer = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    drafter, drafter_name = load_drafter(args.drafter, model)
    questions = first_turns(args.prompts, args.num_prompts)
    h, g0 = hidden_states_along_answers(model, tokenizer, questions, args.max_new_tokens)

    results = []
    print(f"drafter: {drafter_name}; {len(g0)} positions; L={args.beam_length}")
    print(f"{'W':>4} {'W*L':>5} {'packed':>7} {'ratio':>6} {'fewer tokens':>13}")
    for width in args.widths:
        with torch.no_grad():
            beams = beam_search(drafter, h, g0, width, args.beam_length).beams
        tree = build_tree(beams)
        packed = tree.num_packed.float().mean().item()
        ratio = tree.compression_ratio().mean().item()
        fewer = 1 - packed / (width * args.beam_length)
        print(f"{width:>4} {width * args.beam_length:>5} {packed:>7.1f} {ratio:>6.2f} {fewer:>12.0%}")
        results.append({"beam_width": width, "beam_length": args.beam_length,
                        "mean_packed": packed, "mean_compression_ratio": ratio})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(portable({"drafter": drafter_name, "positions": len(g0),
                                    "results": results}), indent=2))


if __name__ == "__main__":
    main()
