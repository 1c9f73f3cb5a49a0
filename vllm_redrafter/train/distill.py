"""The distillation dataset: for training positions t, (h_t, g0_t, labels_t[1..T]).

At position t the target has read tokens 0..t of a sequence; h_t is its last hidden state there
(after the final norm), g0_t the token it produces there (the root of the draft, given to the
drafter), and labels_t the T tokens after g0 that the drafter learns to draft. Label modes
(``labels``):

``self`` (the default for prompt data)
    The target answers each prompt greedily with vLLM; the training positions are the response's
    positions. Greedy decoding is deterministic, so the response's next T+1 tokens after t ARE the
    target's own greedy continuation from that prefix: distillation labels (the paper's Eq. 2) at
    the price of one generation per prompt.
``distill``
    Positions of a given text (assistant turns of chat data, all of plain text / token data, every
    ``position_stride``-th). For each, vLLM generates the target's greedy continuation of T+1
    tokens from the ground-truth prefix, all positions in one batched call (prefix caching shares
    the common prefixes). g0 = its first token, labels = the next T.
``ground-truth``
    The same positions; g0 and labels are the text's own next tokens (the paper's ablation).

A label is -1 where the text or the generation has ended (the loss ignores it).

h_t is computed with transformers, in batches of whole sequences, and stored as float16 in a
flat file (``h.f16``, [N, H]); the build is resumable batch by batch. A data build is keyed by a
fingerprint of everything it depends on; a data dir with another fingerprint is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from vllm_redrafter.train import prompts as builtin_prompts
from vllm_redrafter.train.data import DatasetError, Example, prompt_ids, read_dataset, tokenize_example
from vllm_redrafter.train.detailed_prompts import detailed_prompts
from vllm_redrafter.train.generate import GenRequest, GenSettings, Generator, vllm_generate
from vllm_redrafter.train.specific_prompts import specific_prompts
from vllm_redrafter.train.written_prompts import STOCK_FILES, source_name, written_prompts

LABEL_MODES = ("self", "distill", "ground-truth")
BUILTIN = "builtin"
H_FILE, META_FILE, ARRAYS_FILE, PROGRESS_FILE = "h.f16", "meta.json", "arrays.pt", "h.progress"


@dataclass(frozen=True)
class BuiltinSpec:
    """The built-in local dataset (see prompts.py): how many prompts of each source."""

    templated: int = 64
    text: int = 16
    self_instruct: int = 0
    seed: int = 0
    documents: int = 0  # extraction / table / JSON requests over small documents
    constrained: int = 0  # several instructions at once, multi-part questions
    detailed: int = 0  # long, specific requests in eight kinds of task (detailed_prompts.py)
    specific: int = 0  # the same kinds from another stock of templates (specific_prompts.py)
    written: int = 0  # requests written one by one, not from templates (written_prompts.py)
    written_2: int = 0  # a second stock of them (written_prompts_2.jsonl)
    written_3: int = 0  # a third (written_prompts_3.jsonl)
    written_4: int = 0  # a fourth (written_prompts_4.jsonl)
    written_5: int = 0  # a fifth (written_prompts_5.jsonl)
    written_6: int = 0  # a sixth (written_prompts_6.jsonl)
    written_7: int = 0  # a seventh: other kinds of work than MT-Bench's (written_prompts_7.jsonl)
    written_8: int = 0  # an eighth: six of stock 7's kinds again (written_prompts_8.jsonl)
    written_9: int = 0  # a ninth: translation, summarization, qa, rag (written_prompts_9.jsonl)


@dataclass(frozen=True)
class DataSpec:
    dataset: str  # a dataset file, or "builtin"
    labels: str = "self"
    num_draft_tokens: int = 5  # T
    response_tokens: int = 256  # labels=self: most tokens per response
    max_len: int = 1024  # longest sequence (tokens) fed to the target
    position_stride: int = 1  # labels=distill / ground-truth: every n-th training position
    heldout_fraction: float = 0.05
    split_seed: int = 0
    builtin: BuiltinSpec = field(default_factory=BuiltinSpec)
    gen: GenSettings = field(default_factory=GenSettings)

    def __post_init__(self) -> None:
        if self.labels not in LABEL_MODES:
            raise ValueError(f"labels must be one of {LABEL_MODES}, got {self.labels!r}")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens (T) must be >= 1, got {self.num_draft_tokens}")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")


@dataclass
class DistillData:
    """The built dataset, N positions; ``h`` is a read-only float16 memory map (in memory when
    several datasets are joined, :func:`concat_data`)."""

    h: np.ndarray  # [N, H] float16
    g0: torch.Tensor  # [N] long: the root token at t
    labels: torch.Tensor  # [N, T] long: target ids of the T tokens after g0; -1 = none
    sequence: torch.Tensor  # [N] long: which sequence the position belongs to
    heldout: torch.Tensor  # [N] bool: position belongs to the held-out split
    token_counts: torch.Tensor  # [V] long: every token of the training sequences (for vocab.py)
    meta: dict
    t: torch.Tensor | None = None  # [N] long: the position's index in its sequence

    @property
    def num_positions(self) -> int:
        return int(self.g0.numel())

    def hidden(self, idx: torch.Tensor) -> torch.Tensor:
        """h of the positions ``idx`` (any shape) as float32 [*idx.shape, H], from the map."""
        rows = np.ascontiguousarray(self.h[idx.reshape(-1).numpy()])
        return torch.from_numpy(rows).float().view(*idx.shape, rows.shape[-1])


@dataclass
class _Positions:
    sequences: list[list[int]]  # token ids fed to the target for h
    seq: list[int] = field(default_factory=list)  # per position
    t: list[int] = field(default_factory=list)
    g0: list[int] = field(default_factory=list)
    labels: list[list[int]] = field(default_factory=list)


# -- entry point -----------------------------------------------------------------------------------


def build_data(spec: DataSpec, target_dir: str | Path, data_dir: str | Path, *,
               generator: Generator | None = None, device: str = "cpu",
               batch_tokens: int = 8192, rebuild_stale: bool = False) -> DistillData:
    """Build (or reuse) the distillation dataset of ``spec`` in ``data_dir``.

    A ``data_dir`` built for other settings is cleared only with ``rebuild_stale``, else refused.

    ``generator`` replaces vLLM (tests); by default :func:`vllm_generate` runs in a subprocess.
    Bad input (dataset, chat turns, token ids) raises DatasetError BEFORE any generation starts.
    """
    from transformers import AutoConfig, AutoTokenizer

    data_dir = Path(data_dir)
    target_dir = Path(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target_config = AutoConfig.from_pretrained(target_dir)
    vocab_size = target_config.vocab_size
    examples = None if spec.dataset == BUILTIN else read_dataset(spec.dataset)
    fingerprint = data_fingerprint(spec, target_dir)
    if _is_complete(data_dir, fingerprint):
        return load_data(data_dir)
    _reset_if_stale(data_dir, fingerprint, rebuild_stale)
    data_dir.mkdir(parents=True, exist_ok=True)
    settings = spec.gen
    if spec.labels == "distill":  # many prompts share prefixes: cache them at a fine grain
        settings = replace(settings, prefix_warmup=True, block_size=settings.block_size or 32)
    gen = generator or (lambda reqs, name: vllm_generate(target_dir, reqs, data_dir / name, settings))

    if spec.labels == "self":
        prompts = (_builtin_prompt_ids(spec, tokenizer, gen) if examples is None
                   else [prompt_ids(ex, tokenizer) for ex in examples])
        positions = _self_positions(prompts, spec, gen, tokenizer.eos_token_id)
    else:
        if examples is None:
            examples = _builtin_text_examples(spec)
        tokenized = [tokenize_example(ex, tokenizer, vocab_size, spec.max_len) for ex in examples]
        positions = (_distill_positions(tokenized, spec, gen) if spec.labels == "distill"
                     else _ground_truth_positions(tokenized, spec))
    if not positions.g0:
        raise DatasetError(f"{spec.dataset}: no training positions (all examples too short?)")
    _check_vocab(positions, vocab_size)
    _write_arrays(positions, spec, data_dir, vocab_size)
    meta = {"fingerprint": fingerprint, "spec": _jsonable(asdict(spec)), "target": str(target_dir),
            "num_positions": len(positions.g0), "num_sequences": len(positions.sequences),
            "num_tokens": sum(len(s) for s in positions.sequences),
            "hidden_size": target_config.hidden_size, "vocab_size": vocab_size}
    _compute_hidden_states(positions, target_dir, data_dir, meta, device, batch_tokens)
    (data_dir / META_FILE).write_text(json.dumps(meta, indent=1))
    return load_data(data_dir)


def data_fingerprint(spec: DataSpec, target_dir: Path) -> str:
    """Hash of the spec (minus generation engine knobs), the dataset file and the target."""
    digest = hashlib.sha256()
    spec_dict = asdict(spec)
    gen = spec_dict.pop("gen")
    spec_dict["gen_dtype"] = gen["dtype"]
    # a source at 0 is left out: builds from before the source keep their fingerprints
    for source in ("detailed", "specific", *map(source_name, STOCK_FILES)):
        if spec_dict["builtin"][source] == 0:
            spec_dict["builtin"].pop(source)
    digest.update(json.dumps(spec_dict, sort_keys=True).encode())
    if spec.dataset != BUILTIN:
        digest.update(Path(spec.dataset).read_bytes())
    digest.update(json.dumps(target_signature(target_dir), sort_keys=True).encode())
    return digest.hexdigest()[:16]


# The target's architecture, as every transformers version names it (v5 renamed torch_dtype to
# dtype and moved rope_theta into rope_parameters): what the target is, not how it was saved.
_SIGNATURE_KEYS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "vocab_size",
                   "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")


def target_signature(target_dir: Path) -> dict:
    """The target's identity, independent of the transformers version that saved it: its
    architecture from ``config.json`` and the names, shapes and dtypes of its weight tensors."""
    config = json.loads((target_dir / "config.json").read_text())
    signature = {key: config.get(key) for key in _SIGNATURE_KEYS}
    signature["dtype"] = config.get("dtype") or config.get("torch_dtype")
    signature["rope_theta"] = (config.get("rope_parameters") or {}).get("rope_theta",
                                                                         config.get("rope_theta"))
    signature["tensors"] = hashlib.sha256(json.dumps(_tensor_headers(target_dir),
                                                     sort_keys=True).encode()).hexdigest()[:16]
    return signature


def _tensor_headers(target_dir: Path) -> dict[str, list]:
    """name -> [dtype, shape] of every tensor in the target's safetensors files (headers only)."""
    headers = {}
    for file in sorted(target_dir.glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        headers.update({name: [t["dtype"], t["shape"]] for name, t in header.items()
                        if name != "__metadata__"})
    return headers


# -- positions per label mode ----------------------------------------------------------------------


def _builtin_prompt_ids(spec: DataSpec, tokenizer, gen) -> list[list[int]]:
    b = spec.builtin
    questions = builtin_prompts.templated_prompts(b.templated, b.seed)
    questions += builtin_prompts.text_prompts(b.text, b.seed)
    questions += builtin_prompts.document_prompts(b.documents, b.seed)
    questions += builtin_prompts.constrained_prompts(b.constrained, b.seed)
    questions += detailed_prompts(b.detailed, b.seed)
    questions += specific_prompts(b.specific, b.seed)
    for stock in STOCK_FILES:  # a field of BuiltinSpec per stock, in the stocks' order
        questions += written_prompts(getattr(b, source_name(stock)), b.seed, stock=stock)
    if b.self_instruct:
        # No per-request seeds: vLLM 0.32 on CPU crashes when a seeded request's prefill is chunked
        # (Generator.get_offset is CUDA-only); the engine's fixed seed makes the run reproducible.
        requests = [GenRequest(_chat(tokenizer, q), max_tokens=64, temperature=0.9)
                    for q in builtin_prompts.self_instruct_requests(b.self_instruct, b.seed)]
        for out in gen(requests, "gen_self_instruct"):
            question = builtin_prompts.clean_self_instruct(tokenizer.decode(out, skip_special_tokens=True))
            if question is not None:
                questions.append(question)
    return [_chat(tokenizer, q) for q in questions]


def _builtin_text_examples(spec: DataSpec) -> list[Example]:
    b = spec.builtin
    paragraphs = builtin_prompts.local_paragraphs(b.text, b.seed)
    return [Example(source=f"builtin#paragraph{i}", text=p) for i, p in enumerate(paragraphs)]


def _chat(tokenizer, question: str) -> list[int]:
    out = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def _self_positions(prompts: list[list[int]], spec: DataSpec, gen, eos: int | None) -> _Positions:
    """labels=self: the target answers; every response position is a training position."""
    T = spec.num_draft_tokens
    budget = spec.max_len - spec.response_tokens
    kept = [p for p in prompts if len(p) <= budget]
    if not kept:
        raise DatasetError(f"{spec.dataset}: every prompt is longer than max_len - response_tokens "
                           f"= {budget} tokens")
    responses = gen([GenRequest(p, spec.response_tokens) for p in kept], "gen")
    pos = _Positions(sequences=[])
    for prompt, response in zip(kept, responses):
        if not response:
            continue
        seq = prompt + response
        s = len(pos.sequences)
        pos.sequences.append(seq)
        for t in range(len(prompt) - 1, len(seq) - 1):  # seq[t + 1] is a response token
            pos.seq.append(s)
            pos.t.append(t)
            pos.g0.append(seq[t + 1])
            pos.labels.append(_pad(seq[t + 2: t + 2 + T], T))
    return pos


def _training_ts(mask: list[bool], stride: int) -> list[int]:
    return [t for t in (i for i, m in enumerate(mask) if m)][::stride]


def _distill_positions(tokenized, spec: DataSpec, gen) -> _Positions:
    """labels=distill: the target's greedy continuation of T+1 tokens from each text prefix."""
    T = spec.num_draft_tokens
    pos = _Positions(sequences=[ex.input_ids for ex in tokenized])
    requests: list[GenRequest] = []
    for s, ex in enumerate(tokenized):
        for t in _training_ts(ex.train_mask, spec.position_stride):
            pos.seq.append(s)
            pos.t.append(t)
            requests.append(GenRequest(ex.input_ids[: t + 1], T + 1))
    for out in gen(requests, "gen"):
        out = _pad(list(out), T + 1)
        pos.g0.append(out[0])
        pos.labels.append(out[1:])
    keep = [i for i, g in enumerate(pos.g0) if g >= 0]  # nothing generated: no root, no position
    return _select(pos, keep)


def _ground_truth_positions(tokenized, spec: DataSpec) -> _Positions:
    """labels=ground-truth: the text's own next tokens."""
    T = spec.num_draft_tokens
    pos = _Positions(sequences=[ex.input_ids for ex in tokenized])
    for s, ex in enumerate(tokenized):
        for t in _training_ts(ex.train_mask, spec.position_stride):
            pos.seq.append(s)
            pos.t.append(t)
            pos.g0.append(ex.input_ids[t + 1])
            pos.labels.append(_pad(ex.input_ids[t + 2: t + 2 + T], T))
    return pos


def _pad(tokens: Sequence[int], n: int) -> list[int]:
    return list(tokens[:n]) + [-1] * (n - len(tokens[:n]))


def _select(pos: _Positions, keep: list[int]) -> _Positions:
    return _Positions(pos.sequences, [pos.seq[i] for i in keep], [pos.t[i] for i in keep],
                      [pos.g0[i] for i in keep], [pos.labels[i] for i in keep])


def _check_vocab(pos: _Positions, vocab_size: int) -> None:
    labels = torch.tensor(pos.labels)
    g0 = torch.tensor(pos.g0)
    if int(g0.max()) >= vocab_size or int(labels.max()) >= vocab_size:
        raise ValueError(f"generated token ids reach {max(int(g0.max()), int(labels.max()))}, "
                         f"beyond the target's vocab_size {vocab_size}")


# -- arrays, split and hidden states ---------------------------------------------------------------


def _write_arrays(pos: _Positions, spec: DataSpec, data_dir: Path, vocab_size: int) -> None:
    num_seq = len(pos.sequences)
    gen = torch.Generator().manual_seed(spec.split_seed)
    n_heldout = 0 if num_seq < 2 else max(1, round(spec.heldout_fraction * num_seq))
    heldout_seqs = torch.randperm(num_seq, generator=gen)[:n_heldout]
    is_heldout_seq = torch.zeros(num_seq, dtype=torch.bool)
    is_heldout_seq[heldout_seqs] = True
    sequence = torch.tensor(pos.seq, dtype=torch.long)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s, ids in enumerate(pos.sequences):
        if not is_heldout_seq[s]:
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    arrays = {"g0": torch.tensor(pos.g0, dtype=torch.long),
              "labels": torch.tensor(pos.labels, dtype=torch.long).view(-1, spec.num_draft_tokens),
              "sequence": sequence, "t": torch.tensor(pos.t, dtype=torch.long),
              "heldout": is_heldout_seq[sequence], "token_counts": counts}
    torch.save(arrays, data_dir / ARRAYS_FILE)
    with open(data_dir / "sequences.jsonl", "w") as f:
        for ids in pos.sequences:
            f.write(json.dumps(ids) + "\n")


def _batch_plan(pos: _Positions, batch_tokens: int) -> list[list[int]]:
    """Sequences grouped into batches of about ``batch_tokens`` padded tokens, by length."""
    used = sorted(set(pos.seq), key=lambda s: len(pos.sequences[s]))
    plan: list[list[int]] = []
    for s in used:
        longest = len(pos.sequences[s])
        if plan and longest * (len(plan[-1]) + 1) <= batch_tokens:
            plan[-1].append(s)
        else:
            plan.append([s])
    return plan


@torch.inference_mode()
def _compute_hidden_states(pos: _Positions, target_dir: Path, data_dir: Path, meta: dict,
                           device: str, batch_tokens: int) -> None:
    """h_t for every position with the frozen target (transformers), resumable batch by batch."""
    from transformers import AutoModelForCausalLM

    hidden = meta["hidden_size"]
    n = len(pos.g0)
    h_file = data_dir / H_FILE
    mode = "r+" if h_file.is_file() and h_file.stat().st_size == n * hidden * 2 else "w+"
    h_out = np.memmap(h_file, dtype=np.float16, mode=mode, shape=(n, hidden))
    progress_file = data_dir / PROGRESS_FILE
    done = int(progress_file.read_text()) if mode == "r+" and progress_file.is_file() else 0
    rows_of: dict[int, list[int]] = {}
    for i, s in enumerate(pos.seq):
        rows_of.setdefault(s, []).append(i)
    plan = _batch_plan(pos, batch_tokens)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).to(device).eval()
    agree = total = 0
    for b, batch in enumerate(tqdm(plan[done:], desc="target hidden states", unit="batch",
                                   initial=done, total=len(plan)), start=done):
        last = [max(pos.t[i] for i in rows_of[s]) + 1 for s in batch]  # tokens needed per sequence
        width = max(last)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attn = torch.zeros(len(batch), width, dtype=torch.long)
        for r, (s, k) in enumerate(zip(batch, last)):
            ids[r, :k] = torch.tensor(pos.sequences[s][:k])
            attn[r, :k] = 1
        states = model.model(input_ids=ids.to(device), attention_mask=attn.to(device)).last_hidden_state
        for r, s in enumerate(batch):
            rows = rows_of[s]
            h = states[r, [pos.t[i] for i in rows]]  # [n_s, H], after the final norm
            h_out[rows[0]: rows[-1] + 1] = h.float().cpu().numpy().astype(np.float16)
            if b < 4:  # sanity: the target's own argmax at t is g0 (self / distill labels)
                pred = model.lm_head(h).argmax(-1).cpu()
                agree += int((pred == torch.tensor([pos.g0[i] for i in rows])).sum())
                total += len(rows)
        h_out.flush()
        progress_file.write_text(str(b + 1))
    meta["g0_agreement_first_batches"] = agree / total if total else None  # None: resumed past them


def _is_complete(data_dir: Path, fingerprint: str) -> bool:
    meta_file = data_dir / META_FILE
    if not meta_file.is_file():
        return False
    return json.loads(meta_file.read_text()).get("fingerprint") == fingerprint


def _reset_if_stale(data_dir: Path, fingerprint: str, rebuild_stale: bool) -> None:
    """Prepare ``data_dir`` for a build of ``fingerprint``.

    Same fingerprint: keep everything (a resumed build reuses the generation shards and the
    hidden states done so far). Another fingerprint: the dir is a cache of another build; it is
    cleared only when ``rebuild_stale`` (the run's own OUTPUT/work/data), else refused: a shared
    ``--data-dir`` is never wiped behind the user's back. A non-empty dir without our stamp is
    never touched.
    """
    stamp = data_dir / "fingerprint"
    if data_dir.is_dir() and any(data_dir.iterdir()):
        if not stamp.is_file():
            raise ValueError(f"data dir {data_dir} is not empty and was not made by vllm-redrafter; "
                             "choose an empty or new directory")
        if stamp.read_text() != fingerprint:
            if not rebuild_stale:
                raise ValueError(f"data dir {data_dir} holds data built with other settings "
                                 f"(fingerprint {stamp.read_text()} != {fingerprint}); choose "
                                 "another data dir or delete it")
            shutil.rmtree(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    stamp.write_text(fingerprint)


def load_data(data_dir: str | Path) -> DistillData:
    data_dir = Path(data_dir)
    meta = json.loads((data_dir / META_FILE).read_text())
    arrays = torch.load(data_dir / ARRAYS_FILE, weights_only=True)
    h = np.memmap(data_dir / H_FILE, dtype=np.float16, mode="r",
                  shape=(meta["num_positions"], meta["hidden_size"]))
    return DistillData(h=h, g0=arrays["g0"], labels=arrays["labels"], sequence=arrays["sequence"],
                       heldout=arrays["heldout"], token_counts=arrays["token_counts"], meta=meta,
                       t=arrays.get("t"))


def concat_data(parts: Sequence[DistillData]) -> DistillData:
    """Several built datasets as one, positions in order (each part keeps its held-out split).

    The hidden states are copied into memory (``h`` of all parts together, float16).
    """
    if len(parts) == 1:
        return parts[0]
    T = {p.labels.shape[1] for p in parts}
    H = {p.h.shape[1] for p in parts}
    V = {p.meta["vocab_size"] for p in parts}
    if len(T) > 1 or len(H) > 1 or len(V) > 1:
        raise ValueError(f"datasets to train on together differ in T (draft tokens {sorted(T)}), "
                         f"hidden size {sorted(H)} or vocab size {sorted(V)}")
    offsets = np.cumsum([0] + [p.meta["num_sequences"] for p in parts[:-1]]).tolist()
    meta = {key: sum(p.meta[key] for p in parts)
            for key in ("num_positions", "num_sequences", "num_tokens")}
    meta.update(hidden_size=H.pop(), vocab_size=V.pop(), parts=[p.meta for p in parts])
    has_t = all(p.t is not None for p in parts)
    return DistillData(
        h=np.concatenate([p.h for p in parts]),
        g0=torch.cat([p.g0 for p in parts]), labels=torch.cat([p.labels for p in parts]),
        sequence=torch.cat([p.sequence + o for p, o in zip(parts, offsets)]),
        heldout=torch.cat([p.heldout for p in parts]),
        token_counts=torch.stack([p.token_counts for p in parts]).sum(0), meta=meta,
        t=torch.cat([p.t for p in parts]) if has_t else None)


def _jsonable(obj):
    return json.loads(json.dumps(obj, default=str))
