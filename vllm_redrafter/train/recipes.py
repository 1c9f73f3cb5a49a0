"""Named training recipes: every setting of a run, so one command reproduces a drafter.

``shipped``: the drafter shipped with the package for the embedded SmolLM2-135M-Instruct target:
    ``default``'s drafter (trained first, in OUTPUT/work/base), fine-tuned for one epoch at a low
    learning rate, soft labels at 0.5, on seven more built-in datasets, all with 128-token answers:
    (4) 4,000 requests in MT-Bench's eight kinds from a second stock of templates
    (specific_prompts.py, seed 0; 461,515 positions, 41 min of data on a 2-core AVX-512 EPYC), (5)
    1,776 prompts of dataset (1)'s kinds drawn again (seed 1; 175,108 positions, 21 min of data),
    and five stocks of requests written one by one (written_prompts.py): (7) 1,358 (162,228
    positions, 18 min), (8) 680 (83,988, 10 min), (9) 2,397 (289,438, 30 min), (10) 2,396
    (285,796, 30 min) and (11) 2,557 (301,841, 39 min) (HISTORY.md's dataset 6 was a second draw
    of (5)'s kinds, not taken). A fine-tuning stage adds data without building the base's again;
    (5) keeps the base's kinds in the stage: on (4) alone the base forgot some of them (held-out
    top-1 on (5) 0.64 -> 0.61) and MT-Bench W=4 L=4 rose to 1.932 only; with (5), 1.949; with (7)
    too, 1.970; with (7)-(10), 1.998; with (7)-(11), 2.012 (the base 1.921): prompts that are not
    from templates carry further to new prompts. 70 min of training (1,668 steps over 1.76M
    positions, 2.52 s each in float32 on the EPYC). Held-out top-1 over the seven datasets 0.54 /
    0.51 / 0.49 / 0.49 / 0.47 (the written requests are harder to predict than the templates:
    0.62 / ... over (4), (5), (7) before).
``default``: the from-scratch recipe (what ``train`` runs without ``--recipe``) and the base of
    ``shipped`` (the drafter shipped before the last four), trained on three built-in local
    datasets (prompts.py, detailed_prompts.py; no network, never the MT-Bench questions), each
    built and cached on its own: (1) templated requests, requests
    over local text, over small documents (extraction, tables, JSON) and with several
    constraints, and questions the target writes itself per task kind, answered in up to 256
    tokens (6,827 prompts, 1.16M positions); (2) 3,200 long, specific requests in MT-Bench's
    eight kinds of task, answered in up to 128 tokens (385k positions); (3) 4,000 more of them
    (seed 1; 2,896 not among (2)'s), 128-token answers (483k positions). Two ResBlocks, K =
    5,632, soft labels at weight 0.5. Measured on a 2-core Xeon with AMX: 74 min of data for
    (1) (self-instruct, answers by vLLM, hidden states), about 25 min for (2), 32 min for (3),
    56 min of training (2 epochs, 3,838 steps over 1.96M training positions, bf16 autocast; 28
    min with hard labels); minutes on a GPU. Held-out top-1 per draft position: 0.66 / 0.62 /
    0.60 / 0.59 / 0.59; MT-Bench (reference loop, 80 questions) W=4 L=4 1.92 tokens per step.
    Steps to it: 1.66 (4,178 prompts of three kinds, 384-token answers, one epoch), 1.76 (a
    second epoch), 1.83 (dataset 1 alone, one ResBlock, K = 6,144), 1.84 (fewer of dataset 1's
    kinds plus the detailed requests, one ResBlock), 1.87 (the same data, two ResBlocks), 1.88
    (datasets 1-2), 1.90 (datasets 1-3, hard labels), 1.92 (this recipe). Not taken: a fourth
    dataset of 4,000 requests from specific_prompts.py (hard labels, 1.91).
``medium``: about 360 built-in prompts and 300 steps, roughly 20 minutes on a 2-core CPU: a
    drafter that accepts something, for trying the vLLM integration before the default is built.
``quick``: the same pipeline on a tiny dataset, a few minutes on a CPU: what the tests run.

Choices of the default and why:
- labels ``self``: the target answers its prompts greedily, so every response position carries
  the target's own continuation (distillation) for one generation per prompt.
- K = 5632 draft tokens, two ResBlocks, exit_dim = 2H (no input_proj): the drafter's head is its
  cost; K x 2H = 5632 x 1152 plus two 2H x 2H ResBlocks and the RNN is 9.8M parameters, 19.7 MB
  in float16, under the package's 20 MB budget (K = 6144 with two ResBlocks would be 20.8 MB).
  K is measured by benchmarks/draft_vocab.py (medium data, same 300 steps each, W=4 L=4 on
  MT-Bench): tokens/step 1.465 / 1.476 / 1.481 / 1.471 for K = 4096 / 8192 / 16384 / full,
  drafting 12.6 / 22.1 / 41.2 / 111 ms per step: acceptance is flat, cost grows with K, so K is
  small, and the budget is better spent on a second ResBlock: on the same data it raised
  MT-Bench W=4 L=4 from 1.84 to 1.87 (held-out top-1 by under 1%) for ~15% more drafting time
  (11.2 vs 9.7 ms per reference-loop step); the demo's batch-1 speedup stayed at 1.30x (tokens
  per step 1.59 vs 1.56 at W=1 L=3).
- soft labels, w = 0.5 (train/soft_labels.py): on datasets 1-3, 1.92 tokens per step against
  1.90 with hard labels alone (held-out top-1 0.66 vs 0.65 at position 1), for twice the
  training time (the KL over the K draft tokens at every label).
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
    # start from a trained drafter instead of a fresh one (fine-tuning): a directory, "default"
    # (the package's), or "recipe:NAME" (that recipe's drafter, trained first in the same run);
    # its shape and draft vocabulary replace the fields above
    init_from: str | None = None

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
    # more datasets, each built (and cached) on its own, trained on together with ``data``
    extra_data: tuple[DataSpec, ...] = ()

    @property
    def datasets(self) -> tuple[DataSpec, ...]:
        return (self.data, *self.extra_data)


def _answers_128(seed: int, **counts: int) -> DataSpec:
    """A built-in dataset of the given prompt counts, answered in up to 128 tokens."""
    builtin = BuiltinSpec(**{"templated": 0, "text": 0, "self_instruct": 0, "documents": 0,
                             "constrained": 0, **counts, "seed": seed})
    return DataSpec(dataset="builtin", labels="self", num_draft_tokens=5, response_tokens=128,
                    max_len=1024, heldout_fraction=0.03, builtin=builtin)


RECIPES: dict[str, Recipe] = {
    "default": Recipe(
        name="default",
        data=DataSpec(dataset="builtin", labels="self", num_draft_tokens=5, response_tokens=256,
                      max_len=1024, heldout_fraction=0.03,
                      builtin=BuiltinSpec(templated=1600, text=500, self_instruct=3000, seed=0,
                                          documents=900, constrained=900)),
        drafter=DrafterSpec(num_draft_layers=2, draft_vocab_size=5632, head_init="random"),
        train=TrainConfig(epochs=2.0, batch_size=1024, lr=2e-3, warmup_steps=50, save_every=100,
                          soft_label_weight=0.5),
        save_dtype="float16",
        extra_data=(_answers_128(seed=0, detailed=3200), _answers_128(seed=1, detailed=4000)),
    ),
    "shipped": Recipe(
        name="shipped",
        data=_answers_128(seed=0, specific=4000),
        drafter=DrafterSpec(num_draft_layers=2, draft_vocab_size=5632, head_init="random",
                            init_from="recipe:default"),
        train=TrainConfig(epochs=1.0, batch_size=1024, lr=2e-4, warmup_steps=20, save_every=100,
                          soft_label_weight=0.5),
        save_dtype="float16",
        extra_data=(_answers_128(seed=1, templated=200, self_instruct=1000, documents=300,
                                 constrained=300),
                    _answers_128(seed=0, written=1358), _answers_128(seed=0, written_2=680),
                    _answers_128(seed=0, written_3=2397), _answers_128(seed=0, written_4=2396),
                    _answers_128(seed=0, written_5=2557)),
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
    """A copy of the recipe with some fields replaced (None values are ignored).

    ``data`` settings apply to every dataset of the recipe, except ``dataset``: a dataset given
    replaces the recipe's datasets.
    """
    def clean(d: dict | None) -> dict:
        return {k: v for k, v in (d or {}).items() if v is not None}
    data = clean(data)
    extra = () if "dataset" in data else tuple(replace(d, **data) for d in recipe.extra_data)
    return replace(recipe, data=replace(recipe.data, **data), extra_data=extra,
                   drafter=replace(recipe.drafter, **clean(drafter)),
                   train=replace(recipe.train, **clean(train)),
                   save_dtype=save_dtype or recipe.save_dtype)
