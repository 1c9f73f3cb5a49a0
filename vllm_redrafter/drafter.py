"""The recurrent drafter (ReDrafter, arXiv 2403.09919): a one-layer RNN over the target's embedding.

Per step the target gives h, its last-layer hidden state (after the final norm) at the last
accepted position, and g0, the token it produced there. The drafter then predicts the next tokens
one at a time, carrying a recurrent state s:

    s_0 = 0
    s_t = SiLU(W e(x_t) + U s_{t-1} + b)       x_1 = g0, x_t = drafted token t-1   (rnn=True)
    s_t = e(x_t) + s_{t-1}                                                          (rnn=False)
    z_t = [h, s_t]                              concatenation, h first: [2H]
    logits_t = Linear_no_bias(ResBlock^N(input_proj?(z_t)))    ResBlock(x) = x + SiLU(Linear(x))

e is the target's own input embedding, shared (never copied). Everything else is the drafter's.

Checkpoint layout
-----------------
The parameter names ARE Apple's ml-recurrent-drafter checkpoint layout, so loading is
``load_state_dict`` and checkpoints move between Apple's code, TensorRT-LLM and this package:

- ``config.json``: ``model_type = "recurrent_drafting_drafter"``, ``vocab_size`` (the target's),
  ``hidden_size`` (H, the target's), ``exit_dim`` (ResBlock width, 2H unless ``input_proj``),
  ``num_draft_layers`` (N), ``rnn``. Unknown keys (Apple's ``emb_norm``, ``architectures``,
  ``torch_dtype``, ...) are accepted and ignored.
- ``model.safetensors`` (E = exit_dim, K = draft vocabulary, V when full)::

      rnn_w.weight                  [H, H]     W, no bias            (only when rnn=True)
      rnn_u.weight, rnn_u.bias      [H, H] [H] U and b               (only when rnn=True)
      input_proj.weight, .bias      [E, 2H] [E]                      (only when E != 2H)
      lm_head.{i}.linear.weight     [E, E]     ResBlock i < N, and .bias [E]
      lm_head.{N}.weight            [K, E]     the output Linear, no bias
      draft_vocab_ids               [K] int64  (only with a reduced draft vocabulary)

  TensorRT-LLM converter spellings are accepted on load: ``lm_heads.*`` for ``lm_head.*``,
  ``input_projs.*`` for ``input_proj.*``, and a leading ``drafter.``. A checkpoint without
  ``model.safetensors`` may ship ``pytorch_model.bin`` / ``model.pt``: those are read with
  ``torch.load(weights_only=True)`` (plain tensors only, never arbitrary pickled objects).
  ``save_pretrained`` always writes the canonical names to ``model.safetensors``.

Reduced draft vocabulary (this project's extension, off by default)
------------------------------------------------------------------
A full-vocabulary head costs V x E per draft step (49152 x 1152 for SmolLM2), most of it for
tokens a drafter never proposes. With ``draft_vocab_size: K`` in ``config.json`` the last Linear is
[K, E] and the checkpoint carries ``draft_vocab_ids``: the K target ids (distinct, each < V) that
the drafter's K outputs stand for. ``draft_logits`` then returns [..., K] and ``to_target_ids``
maps draft ids back to target ids. The recurrent state still reads TARGET ids through the
target's embedding. A config without ``draft_vocab_size`` (every Apple checkpoint) is the full
vocabulary, K = V, and ``to_target_ids`` is the identity.

>>> ids = torch.tensor([7, 3, 42])          # draft vocab: K = 3 target ids
>>> ids[torch.tensor([[2, 0], [1, 1]])]     # what to_target_ids does with draft ids [2, 2]
tensor([[42,  7],
        [ 3,  3]])
"""

from __future__ import annotations

import dataclasses
import json
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
# Fallback weight files, read only with torch.load(weights_only=True), in this order.
TORCH_FILES = ("pytorch_model.bin", "model.pt")
DRAFT_VOCAB_IDS = "draft_vocab_ids"

# TensorRT-LLM converter spellings -> the canonical (Apple) names; applied to key prefixes.
_KEY_PREFIX_ALIASES = {"lm_heads.": "lm_head.", "input_projs.": "input_proj."}
_STRIPPED_KEY_PREFIX = "drafter."


class DrafterCheckpointError(ValueError):
    """A drafter checkpoint is missing, unreadable or malformed; the message names the file/keys."""


class DrafterMismatchError(ValueError):
    """The drafter's hidden size or vocabulary is not the target's; the message names both."""


@dataclass
class DrafterConfig:
    """The ``config.json`` of Apple's ml-recurrent-drafter layout (+ our ``draft_vocab_size``)."""

    vocab_size: int  # the TARGET's vocabulary size V
    hidden_size: int  # H, the target's hidden size
    exit_dim: int  # E, width of the ResBlocks; 2*H unless input_proj is used
    num_draft_layers: int  # N ResBlocks
    rnn: bool = True
    draft_vocab_size: int | None = None  # reduced draft vocabulary K (None = full vocab)
    model_type: ClassVar[str] = "recurrent_drafting_drafter"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers"):
            _check_positive_int(name, getattr(self, name))
        if not isinstance(self.rnn, bool):
            raise ValueError(f"rnn must be true or false, got {self.rnn!r}")
        if self.draft_vocab_size is not None:
            _check_positive_int("draft_vocab_size", self.draft_vocab_size)
            if self.draft_vocab_size > self.vocab_size:
                raise ValueError(
                    f"draft_vocab_size={self.draft_vocab_size} exceeds vocab_size={self.vocab_size}"
                )

    @property
    def uses_input_proj(self) -> bool:
        """Apple projects [h, s] (2H wide) to exit_dim only when the two differ."""
        return self.exit_dim != 2 * self.hidden_size

    @classmethod
    def required_keys(cls) -> list[str]:
        """Keys a config.json must carry. ``rnn`` too: its default differs between codebases."""
        fields = dataclasses.fields(cls)
        return [f.name for f in fields if f.default is dataclasses.MISSING] + ["rnn"]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DrafterConfig:
        """Build from a config.json dict: unknown keys are ignored, missing required ones raise."""
        model_type = data.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(
                f"model_type is {model_type!r}, expected {cls.model_type!r} (is this the target's "
                "directory rather than the drafter's?)"
            )
        missing = [key for key in cls.required_keys() if key not in data]
        if missing:
            raise ValueError(f"missing required key(s) {missing}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{key: value for key, value in data.items() if key in names})

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"model_type": self.model_type, **dataclasses.asdict(self)}
        if self.draft_vocab_size is None:
            del data["draft_vocab_size"]  # an Apple-identical config.json for a full-vocab drafter
        return data


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


class ResBlock(nn.Module):
    """x + SiLU(Linear(x)), as in Apple's drafter (and Medusa's heads)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        # Apple zero-initialises the block so an untrained drafter starts as the identity map.
        nn.init.zeros_(self.linear.weight)
        self.act = nn.SiLU()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.act(self.linear(x))


class RecurrentDrafter(nn.Module):
    """The ReDrafter draft model; parameter names are the checkpoint's keys (module docstring)."""

    def __init__(self, config: DrafterConfig, embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        self.config = config
        hidden, exit_dim = config.hidden_size, config.exit_dim
        if config.rnn:
            self.rnn_w = nn.Linear(hidden, hidden, bias=False)  # W
            self.rnn_u = nn.Linear(hidden, hidden, bias=True)  # U, with the bias b
        if config.uses_input_proj:
            self.input_proj = nn.Linear(2 * hidden, exit_dim, bias=True)
        self.lm_head = nn.Sequential(
            *(ResBlock(exit_dim) for _ in range(config.num_draft_layers)),
            nn.Linear(exit_dim, self.draft_vocab_size, bias=False),
        )
        if config.draft_vocab_size is not None:
            # Placeholder (the first K target ids); from_pretrained / training overwrite it.
            self.register_buffer(DRAFT_VOCAB_IDS, torch.arange(config.draft_vocab_size))
        self._set_embedding(None)
        if embedding is not None:
            self.attach_embedding(embedding)

    # -- the target's embedding (shared, not owned) --------------------------------------------

    def _set_embedding(self, embedding: nn.Module | None) -> None:
        # The target owns its input embedding. Stored with object.__setattr__ it stays out of
        # nn.Module's registries, so state_dict()/save_pretrained never write it (the drafter's
        # keys are exactly the checkpoint's), .to()/.half() never copy or cast the target's
        # tensor, and parameters() (what a trainer optimises) never includes it.
        object.__setattr__(self, "_target_embedding", embedding)

    @property
    def embedding(self) -> nn.Module | None:
        """The attached target input embedding, or None."""
        return self._target_embedding

    def attach_embedding(self, embedding: nn.Embedding) -> None:
        """Share (not copy) the target's input embedding; its shape must be [V, H] of the config."""
        vocab, hidden = _embedding_shape(embedding)
        _check_target_dims(self.config, hidden, vocab)
        self._set_embedding(embedding)

    # -- the equations ---------------------------------------------------------------------------

    @property
    def draft_vocab_size(self) -> int:
        """K, the number of draft logits (V when the draft vocabulary is the full one)."""
        return self.config.draft_vocab_size or self.config.vocab_size

    @property
    def _dtype(self) -> torch.dtype:
        return self.lm_head[-1].weight.dtype

    def init_state(self, batch_shape: tuple[int, ...]) -> Tensor:
        """s_0 = 0: zeros [*batch_shape, H] in the drafter's dtype and device."""
        weight = self.lm_head[-1].weight
        return weight.new_zeros((*batch_shape, self.config.hidden_size))

    def update_state(self, state: Tensor, token_ids: Tensor) -> Tensor:
        """s_t from s_{t-1} [..., H] and x_t, TARGET token ids [...]: returns [..., H]."""
        embedding = self._target_embedding
        if embedding is None:
            raise RuntimeError(
                "the drafter has no target embedding: pass embedding= to from_pretrained / the "
                "constructor, or call attach_embedding(target.get_input_embeddings())"
            )
        e = embedding(token_ids).to(self._dtype)  # [..., H]
        if self.config.rnn:
            return F.silu(self.rnn_w(e) + self.rnn_u(state))
        return e + state

    def draft_logits(self, h: Tensor, state: Tensor) -> Tensor:
        """logits_t = lm_head(input_proj?([h, s_t])): h [..., H], state [..., H] -> [..., K].

        Leading dims broadcast (torch rules), e.g. h [B, 1, H] with state [B, W, H].
        """
        hidden = self.config.hidden_size
        if h.shape[-1] != hidden or state.shape[-1] != hidden:
            raise ValueError(
                f"h {tuple(h.shape)} and state {tuple(state.shape)} must both end in "
                f"hidden_size={hidden}"
            )
        lead = torch.broadcast_shapes(h.shape[:-1], state.shape[:-1])
        h = h.to(self._dtype).expand(*lead, hidden)
        state = state.expand(*lead, hidden)
        z = torch.cat([h, state], dim=-1)  # [..., 2H], h first
        if self.config.uses_input_proj:
            z = self.input_proj(z)  # [..., E]
        return self.lm_head(z)  # [..., K]

    def to_target_ids(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocabulary ids [...] -> target ids [...] (the identity for a full vocabulary)."""
        if self.config.draft_vocab_size is None:
            return draft_ids
        return self.draft_vocab_ids[draft_ids]

    # -- checkpoints -----------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        embedding: nn.Embedding | None = None,
        *,
        target_hidden_size: int | None = None,
        target_vocab_size: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> RecurrentDrafter:
        """Load a drafter directory (Apple layout); refuse one that does not fit the target.

        The target's dims come from ``target_hidden_size`` / ``target_vocab_size``, else from
        ``embedding``'s shape. ``device`` / ``dtype`` cast the drafter (never the embedding).
        """
        directory = Path(path)
        if not directory.is_dir():
            problem = "is not a directory" if directory.exists() else "does not exist"
            raise DrafterCheckpointError(f"drafter directory {directory} {problem}")
        config = _read_config(directory / CONFIG_FILE)
        if embedding is not None:
            emb_vocab, emb_hidden = _embedding_shape(embedding)
            target_vocab_size = target_vocab_size or emb_vocab
            target_hidden_size = target_hidden_size or emb_hidden
        _check_target_dims(config, target_hidden_size, target_vocab_size, directory)

        weights_file, state = _read_weights(directory)
        with torch.device("meta"):  # no throw-away random init of a V x E head
            drafter = cls(config)
        _check_state(drafter, state, weights_file)
        if config.draft_vocab_size is not None:
            ids = state[DRAFT_VOCAB_IDS]
            state[DRAFT_VOCAB_IDS] = _checked_draft_vocab_ids(ids, config.vocab_size, weights_file)
        drafter.load_state_dict(state, strict=True, assign=True)
        drafter.to(device=device, dtype=dtype)
        if embedding is not None:
            drafter.attach_embedding(embedding)
        return drafter

    def save_pretrained(self, path: str | Path) -> None:
        """Write config.json + model.safetensors (canonical Apple names; no embedding)."""
        from safetensors.torch import save_file

        directory = Path(path)
        directory.mkdir(parents=True, exist_ok=True)
        config_text = json.dumps(self.config.to_dict(), indent=2) + "\n"
        (directory / CONFIG_FILE).write_text(config_text)
        tensors = {key: t.detach().cpu().contiguous() for key, t in self.state_dict().items()}
        save_file(tensors, str(directory / SAFETENSORS_FILE), metadata={"format": "pt"})


# -- helpers: target dims ------------------------------------------------------------------------


def held_out_chain_acceptance(directory: str | Path) -> list[float] | None:
    """The drafter's own held-out P(a greedy chain accepts >= d drafts), d = 1, 2, ...: its
    ``eval.json``'s ``chain_top1`` as training wrote it; None where the file or the figure is
    missing or malformed (an Apple checkpoint has none)."""
    try:
        chain = json.loads((Path(directory) / "eval.json").read_text())["chain_top1"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (not isinstance(chain, list) or not chain
            or not all(isinstance(p, (int, float)) and 0.0 <= p <= 1.0 for p in chain)):
        return None
    return [float(p) for p in chain]


def _embedding_shape(embedding: nn.Module) -> tuple[int, int]:
    """(vocab, hidden) of an embedding module.

    Prefers ``num_embeddings`` / ``embedding_dim`` over the weight's shape: vLLM's
    VocabParallelEmbedding pads (and shards) its weight rows beyond the real vocabulary.
    """
    weight = getattr(embedding, "weight", None)
    vocab = getattr(embedding, "num_embeddings", None)
    hidden = getattr(embedding, "embedding_dim", None)
    if weight is not None:
        vocab = vocab if vocab is not None else weight.shape[0]
        hidden = hidden if hidden is not None else weight.shape[-1]
    if vocab is None or hidden is None:
        raise TypeError(f"{type(embedding).__name__} is not an embedding (no weight [V, H])")
    return int(vocab), int(hidden)


def _check_target_dims(
    config: DrafterConfig,
    target_hidden: int | None,
    target_vocab: int | None,
    where: Path | None = None,
) -> None:
    hidden_ok = target_hidden is None or target_hidden == config.hidden_size
    vocab_ok = target_vocab is None or target_vocab == config.vocab_size
    if hidden_ok and vocab_ok:
        return
    location = f" ({where})" if where is not None else ""
    unknown = "?"
    raise DrafterMismatchError(
        f"drafter{location} hidden_size={config.hidden_size} / vocab_size={config.vocab_size} "
        f"does not match the target's hidden_size={target_hidden or unknown} / "
        f"vocab_size={target_vocab or unknown}"
    )


# -- helpers: reading a checkpoint ---------------------------------------------------------------


def _read_config(file: Path) -> DrafterConfig:
    if not file.is_file():
        raise DrafterCheckpointError(f"{file} is missing: a drafter directory needs a config.json")
    try:
        data = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DrafterCheckpointError(f"{file} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise DrafterCheckpointError(f"{file} must hold a JSON object, got {type(data).__name__}")
    try:
        return DrafterConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise DrafterCheckpointError(f"{file}: {err}") from err


def _read_weights(directory: Path) -> tuple[Path, dict[str, Tensor]]:
    """The checkpoint's tensors under canonical names, and the file they came from."""
    file = directory / SAFETENSORS_FILE
    if file.is_file():
        return file, _canonical_keys(_load_safetensors(file), file)
    for name in TORCH_FILES:
        file = directory / name
        if file.is_file():
            return file, _canonical_keys(_load_torch(file), file)
    looked_for = ", ".join((SAFETENSORS_FILE, *TORCH_FILES))
    raise DrafterCheckpointError(f"no drafter weights in {directory}: looked for {looked_for}")


def _load_safetensors(file: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as err:  # the Rust SafetensorError, OSError, ... : all mean "bad file"
        raise DrafterCheckpointError(f"{file} is not a readable safetensors file: {err}") from err


def _load_torch(file: Path) -> dict[str, Tensor]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise DrafterCheckpointError(
            f"{file} cannot be read with torch.load(weights_only=True): it is corrupt or holds "
            f"pickled Python objects beyond plain tensors, and arbitrary objects are never "
            f"unpickled ({_unpickler_reason(err)}). Save a plain state_dict of tensors, or "
            f"convert it to {SAFETENSORS_FILE}"
        ) from err
    except Exception as err:
        raise DrafterCheckpointError(f"{file} is not a readable torch checkpoint: {err}") from err
    if not isinstance(state, dict):
        raise DrafterCheckpointError(
            f"{file} must hold a dict of tensors (a state_dict), got {type(state).__name__}"
        )
    not_tensors = sorted(str(k) for k, v in state.items() if not isinstance(v, Tensor))
    if not_tensors:
        raise DrafterCheckpointError(f"{file}: entries that are not tensors: {not_tensors}")
    return state


def _unpickler_reason(err: Exception) -> str:
    """The informative line of torch's long weights_only error, e.g. 'Unsupported global: ...'."""
    text = str(err)
    marker = "WeightsUnpickler error:"
    if marker in text:
        text = text.split(marker, 1)[1]
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[0].split(" Please use")[0] if lines else type(err).__name__


def _canonical_key(key: str) -> str:
    """TensorRT-LLM spellings -> Apple's: 'drafter.lm_heads.0.linear.weight' -> 'lm_head.0...'."""
    key = key.removeprefix(_STRIPPED_KEY_PREFIX)
    for alias, canonical in _KEY_PREFIX_ALIASES.items():
        if key.startswith(alias):
            return canonical + key[len(alias):]
    return key


def _canonical_keys(state: dict[str, Tensor], file: Path) -> dict[str, Tensor]:
    canonical: dict[str, Tensor] = {}
    sources: dict[str, str] = {}
    for key, tensor in state.items():
        name = _canonical_key(key)
        if name in canonical:
            raise DrafterCheckpointError(
                f"{file}: keys {sources[name]!r} and {key!r} both name {name!r}"
            )
        canonical[name], sources[name] = tensor, key
    return canonical


def _check_state(drafter: RecurrentDrafter, state: dict[str, Tensor], file: Path) -> None:
    """The checkpoint's keys and shapes must be exactly the drafter's."""
    expected = {key: tuple(t.shape) for key, t in drafter.state_dict().items()}
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise DrafterCheckpointError(
            f"{file} does not fit config {drafter.config}: missing keys {missing}, "
            f"unexpected keys {unexpected}"
        )
    wrong = [
        f"{key}: expected {expected[key]}, got {tuple(state[key].shape)}"
        for key in sorted(expected)
        if tuple(state[key].shape) != expected[key]
    ]
    if wrong:
        raise DrafterCheckpointError(f"{file}: tensors of the wrong shape: {'; '.join(wrong)}")


def _checked_draft_vocab_ids(ids: Tensor, vocab_size: int, file: Path) -> Tensor:
    """draft_vocab_ids as int64, after checking they are distinct target ids in [0, vocab_size)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise DrafterCheckpointError(f"{file}: {DRAFT_VOCAB_IDS} must be integers, got {ids.dtype}")
    ids = ids.to(torch.int64)
    out_of_range = ids[(ids < 0) | (ids >= vocab_size)]
    if out_of_range.numel():
        raise DrafterCheckpointError(
            f"{file}: {DRAFT_VOCAB_IDS} holds ids outside [0, vocab_size={vocab_size}): "
            f"{out_of_range[:10].tolist()}"
        )
    values, counts = torch.unique(ids, return_counts=True)
    duplicates = values[counts > 1]
    if duplicates.numel():
        raise DrafterCheckpointError(
            f"{file}: {DRAFT_VOCAB_IDS} repeats target ids {duplicates[:10].tolist()}"
        )
    return ids
