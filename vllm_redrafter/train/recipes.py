"""Named training recipes: every setting of a run, so one command reproduces a drafter.

``default``: the drafter shipped with the package for the embedded SmolLM2-135M-Instruct target,
    trained on the built-in local dataset (prompts.py; no network, never the MT-Bench questions):
    templated requests, requests over local text, over small documents (extraction, tables, JSON)
    and with several constraints, and questions the target writes itself per task kind. Measured
    on a 2-core Xeon with AMX: 7 min of self-instruct and 43 min of answers by vLLM (6,827
    prompts, resumable shards), 24 min of target hidden states, 15 min of training (2 epochs,
    2,192 steps over 1.12M positions, bf16 autocast); minutes on a GPU. Held-out top-1 per draft
    position: 0.59 / 0.54 / 0.53 / 0.51 / 0.50; MT-Bench (reference loop, 80 questions) W=4 L=4
    1.83 tokens per step. The drafter before it (4,178 prompts of templated, text and
    self-instruct kinds, 384-token answers, 796k positions, 1 epoch) reached 1.66, and 1.76 with a
    second epoch; the rest came with the more numerous and more varied prompts (not measured
    apart).
``medium``: about 360 built-in prompts and 300 steps, roughly 20 minutes on a 2-core CPU: a
    drafter that accepts something, for trying the vLLM integration before the default is built.
``quick``: the same pipeline on a tiny dataset, a few minutes on a CPU: what the tests run.

Choices of the default and why:
- labels ``self``: the target answers its prompts greedily, so every response position carries
  the target's own continuation (distillation) for one generation per prompt.
- K = 6144 draft tokens, one ResBlock, exit_dim = 2H (no input_proj): the drafter's head is its
  cost; K x 2H = 6144 x 1152 plus a 2H x 2H ResBlock and the RNN is 9.1M parameters, 18 MB in
  float16, under the package's 20 MB budget. (K = 8192 with two ResBlocks would be 25 MB.) K is
  measured by benchmarks/draft_vocab.py (medium data, same 300 steps each, W=4 L=4 on MT-Bench):
  tokens/step 1.465 / 1.476 / 1.481 / 1.471 for K = 4096 / 8192 / 16384 / full, drafting 12.6 /
  22.1 / 41.2 / 111 ms per step: acceptance is flat, cost grows with K, so K is small.
- head init: random (nn.Linear's default), the ResBlocks zero (identity, Apple's init). The
  option ``head_init="target"`` starts the head's h-half from the target's (tied) LM head rows of
  the K draft tokens; measured on 21.5k self-distilled positions (100 steps of 256, K=4096), it
  starts from a higher loss (the target's head scores the token at t+1, the drafter must score
  t+2..) and stays behind: held-out loss 17.69 vs 16.84, top-1 per position
  0.374/0.343/0.341/0.321/0.291 vs 0.381/0.368/0.359/0.347/0.344 for the random init.
- bf16 autocast on a GPU and on CPUs with AMX (3x faster there), float32 on other CPUs (bf16
  matmuls can be 30x slower on AVX2 CPUs); the shipped checkpoint is saved in float16.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vllm_redrafter.train.distill import BuiltinSpec, DataSpec
from vllm_redrafter.train.trainer import TrainConfig


@dataclass(frozen=True)
class DrafterSpec:
    num_draft_layers: int = 1
    exit_dim: int | None = None  # None: 2H (Apple's layout without input_proj)
    rnn: bool = True
    draft_vocab_size: int | None = 6144  # K; None = the full vocabulary
    head_init: str = "random"  # "random" | "target" (h-half from the target's LM head rows)
    vocab_text_weight: float = 0.1  # K counts: labels + weight * tokens of the training text

    def __post_init__(self) -> None:
        if self.head_init not in ("target", "random"):
            raise ValueError(f"head_init must be 'target' or 'random', got {self.head_init!r}")


@dataclass(frozen=True)
class Recipe:
    name: str
    data: DataSpec
    drafter: DrafterSpec = field(default_factory=DrafterSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    save_dtype: str = "float32"  # dtype of the saved drafter (float32 | float16 | bfloat16)


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        name="default",
        data=DataSpec(dataset="builtin", labels="self", num_draft_tokens=5, response_tokens=256,
                      max_len=1024, heldout_fraction=0.03,
                      builtin=BuiltinSpec(templated=1600, text=500, self_instruct=3000, seed=0,
                                          documents=900, constrained=900)),
        drafter=DrafterSpec(num_draft_layers=1, draft_vocab_size=6144, head_init="random"),
        train=TrainConfig(epochs=2.0, batch_size=1024, lr=2e-3, warmup_steps=50, save_every=100),
        save_dtype="float16",
    ),
    "medium": Recipe(
        name="medium",
        data=DataSpec(dataset="builtin", labels="self", num_draft_tokens=5, response_tokens=192,
                      max_len=768, heldout_fraction=0.05,
                      builtin=BuiltinSpec(templated=300, text=60, self_instruct=0, seed=0)),
        drafter=DrafterSpec(num_draft_layers=1, draft_vocab_size=4096, head_init="random"),
        train=TrainConfig(max_steps=300, batch_size=256, lr=2e-3, warmup_steps=30, save_every=50),
        save_dtype="float16",
    ),
    "quick": Recipe(
        name="quick",
        data=DataSpec(dataset="builtin", labels="self", num_draft_tokens=5, response_tokens=64,
                      max_len=512, heldout_fraction=0.2,
                      builtin=BuiltinSpec(templated=12, text=3, self_instruct=0, seed=0)),
        drafter=DrafterSpec(num_draft_layers=1, draft_vocab_size=2048, head_init="random"),
        train=TrainConfig(max_steps=40, batch_size=64, lr=3e-3, warmup_steps=5, save_every=10,
                          eval_max_positions=2000),
        save_dtype="float32",
    ),
}


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {sorted(RECIPES)}")
    return RECIPES[name]


def with_overrides(recipe: Recipe, *, data: dict | None = None, drafter: dict | None = None,
                   train: dict | None = None, save_dtype: str | None = None) -> Recipe:
    """A copy of the recipe with some fields replaced (None values are ignored)."""
    def clean(d: dict | None) -> dict:
        return {k: v for k, v in (d or {}).items() if v is not None}
    return replace(recipe, data=replace(recipe.data, **clean(data)),
                   drafter=replace(recipe.drafter, **clean(drafter)),
                   train=replace(recipe.train, **clean(train)),
                   save_dtype=save_dtype or recipe.save_dtype)
