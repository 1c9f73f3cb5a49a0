"""Named training recipes: every setting of a run, so one command reproduces a drafter.

``RECIPES`` maps a name to a :class:`Recipe` (datasets, drafter shape, training settings, saved
dtype); ``get_recipe`` looks one up and ``with_overrides`` replaces single fields (the CLI flags).

``shipped``: the drafter shipped with the package for the embedded SmolLM2-135M-Instruct target:
    ``default``'s drafter (trained first, in OUTPUT/work/base; ``init_from="recipe:default"``),
    fine-tuned for one epoch at lr 2e-4 on seven more built-in datasets with 128-token answers:
    specific requests, a second draw of ``default``'s first dataset's kinds (so the base does not
    forget them), and the five written stocks ``written`` .. ``written_5``.
``broad``: ``shipped``'s drafter (found finished in OUTPUT/work/base, or trained there first)
    fine-tuned for one epoch at lr 5e-4 on other kinds of work than MT-Bench's (written stocks 7,
    8 and 9: translation, summarization, extraction, QA over a passage, math, code, answers over
    retrieved documents) and half of written stock 6 (MT-Bench's kinds, so the drafter keeps
    them), 1,024 of its K draft tokens swapped for those the data counts most; a study toward a
    drafter for all kinds of work, not shipped.
``default``: the from-scratch recipe (what ``train`` runs without ``--recipe``) and the base of
    ``shipped``: three built-in local datasets (prompts.py, detailed_prompts.py; no network, never
    the MT-Bench questions), each built and cached on its own. Two ResBlocks, K = 5,632 (19.7 MB
    in float16, under the package's 20 MB budget), ``labels="self"``, soft labels at weight 0.5.
``medium``: about 360 built-in prompts and 300 steps, roughly 20 minutes on a 2-core CPU: a
    drafter that accepts something, for trying the vLLM integration before the default is built.
``quick``: the same pipeline on a tiny dataset, a few minutes on a CPU: what the tests run.

Measurements and history (the choices of K, ResBlocks, soft labels, head init, and the steps to
the shipped drafter): docs/training.md.
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
    # with init_from: swap this many of its K tokens, the least counted in this recipe's training
    # data, for the most counted ones outside it (train.vocab.swap_draft_vocab); 0 keeps its K
    draft_vocab_swap: int = 0

    def __post_init__(self) -> None:
        if self.head_init not in ("target", "random"):
            raise ValueError(f"head_init must be 'target' or 'random', got {self.head_init!r}")
        if self.draft_vocab_swap < 0 or (self.draft_vocab_swap and self.init_from is None):
            raise ValueError("draft_vocab_swap must be >= 0, and > 0 only with init_from "
                             f"(a trained head to swap tokens of), got {self.draft_vocab_swap}")


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


def _fine_tune(name: str, init_from: str, data: DataSpec, extra_data: tuple[DataSpec, ...],
               save_every: int, draft_vocab_swap: int = 0, lr: float = 2e-4) -> Recipe:
    """A stage on a trained drafter (its shape kept): one epoch at ``lr``, soft labels at 0.5."""
    return Recipe(
        name=name, data=data, save_dtype="float16", extra_data=extra_data,
        drafter=DrafterSpec(num_draft_layers=2, draft_vocab_size=5632, head_init="random",
                            init_from=init_from, draft_vocab_swap=draft_vocab_swap),
        train=TrainConfig(epochs=1.0, batch_size=1024, lr=lr, warmup_steps=20,
                          save_every=save_every, soft_label_weight=0.5))


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
    "shipped": _fine_tune(
        "shipped", "recipe:default", _answers_128(seed=0, specific=4000),
        (_answers_128(seed=1, templated=200, self_instruct=1000, documents=300, constrained=300),
         _answers_128(seed=0, written=1358), _answers_128(seed=0, written_2=680),
         _answers_128(seed=0, written_3=2397), _answers_128(seed=0, written_4=2396),
         _answers_128(seed=0, written_5=2557)),
        save_every=100),
    # 1,024 of K swapped: the smallest swap within 0.005 of the best mean held-out coverage over
    # the stocks' kinds (benchmarks/results/draft_vocab_by_kind.json; translation 0.69 -> 0.89);
    # lr 5e-4: higher than 2e-4 on stocks 7 and 8's held-out splits, stock 6's kept within 0.03
    # (benchmarks/results/heldout_beams_broad_lr5.json); stock 9: stocks 7-9's held-out mean
    # 1.944 -> 1.973, stock 6's 2.284 -> 2.290 (heldout_beams_broad9.json)
    "broad": _fine_tune("broad", "recipe:shipped", _answers_128(seed=0, written_6=1280),
                        (_answers_128(seed=0, written_7=1554), _answers_128(seed=0, written_8=1681),
                         _answers_128(seed=0, written_9=1208)),
                        save_every=50, draft_vocab_swap=1024, lr=5e-4),
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
