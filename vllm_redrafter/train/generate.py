"""Batched generation with vLLM alone, in a subprocess, resumable shard by shard.

The training process never imports vLLM: :func:`vllm_generate` writes the requests to a file and
runs ``python -m vllm_redrafter.train.generate JOB.json`` with ``VLLM_PLUGINS=""`` (data must come
from plain vLLM, never from this package's own plugin). The subprocess starts ONE engine, feeds
the requests in shards of ``shard_size`` (vLLM batches each shard itself) and writes every
finished shard atomically, so a killed data build resumes at the first missing shard. Its tqdm bar
is vLLM's own.

A request is ``GenRequest(prompt_token_ids, max_tokens, temperature=0.0, seed=None)``; the result,
per request in order, is the generated token ids (EOS included when generation stopped on it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class GenRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int | None = None


@dataclass(frozen=True)
class GenSettings:
    """How vLLM is started; defaults fit a CPU with a few GB free.

    See docs/costs.md, CPU: vLLM on a small machine.
    """

    # "auto": the dtype the target's config.json names (float32 for the embedded target). vLLM's
    # own "auto" would downcast a float32 checkpoint to bfloat16 on CPU, so the labels would come
    # from another model than the one the drafter serves.
    dtype: str = "auto"
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.4
    kv_cache_gib: int = 4  # CPU only: VLLM_CPU_KVCACHE_SPACE
    block_size: int | None = None  # 32 on CPU when prefix caching matters (labels=distill)
    enable_prefix_caching: bool = True
    shard_size: int = 256
    enforce_eager: bool = True
    # Before each shard, prefill (max_tokens=1) the shard's longest prompts that are not a prefix
    # of another one, so the many prefix requests of labels=distill hit the prefix cache instead
    # of recomputing their common prefixes concurrently.
    prefix_warmup: bool = False


# (requests, name of the work sub-directory) -> generated token ids per request
Generator = Callable[[Sequence[GenRequest], str], list[list[int]]]


def vllm_generate(target_dir: str | Path, requests: Sequence[GenRequest], work_dir: str | Path,
                  settings: GenSettings = GenSettings()) -> list[list[int]]:
    """Generate for all requests with vLLM in a subprocess; shards in ``work_dir`` survive a kill."""
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    requests_file = work_dir / "requests.jsonl"
    lines = "".join(json.dumps(asdict(r)) + "\n" for r in requests)
    if not requests_file.is_file() or requests_file.read_text() != lines:
        for stale in work_dir.glob("shard_*.jsonl"):  # different requests: old shards are void
            stale.unlink()
        _atomic_write(requests_file, lines)
    job = {"target": str(target_dir), "requests": str(requests_file), "out_dir": str(work_dir),
           "settings": asdict(settings)}
    job_file = work_dir / "job.json"
    job_file.write_text(json.dumps(job, indent=1))
    if not _all_shards_done(work_dir, len(requests), settings.shard_size):
        env = {**os.environ, "VLLM_PLUGINS": "", "VLLM_CPU_KVCACHE_SPACE": str(settings.kv_cache_gib)}
        if not torch.cuda.is_available():
            # On a CPU the engine runs in the subprocess itself: vLLM's engine-core process waits
            # for its worker by spinning (sched_yield), which on a 2-core CPU takes a core from
            # the model.
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        proc = subprocess.run([sys.executable, "-m", "vllm_redrafter.train.generate", str(job_file)],
                              env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM generation failed (exit code {proc.returncode}); "
                               f"see its output above. Job: {job_file}")
    return _read_shards(work_dir, len(requests), settings.shard_size)


def _num_shards(n: int, shard_size: int) -> int:
    return (n + shard_size - 1) // shard_size


def _shard_file(work_dir: Path, i: int) -> Path:
    return work_dir / f"shard_{i:05d}.jsonl"


def _all_shards_done(work_dir: Path, n: int, shard_size: int) -> bool:
    return all(_shard_file(work_dir, i).is_file() for i in range(_num_shards(n, shard_size)))


def _read_shards(work_dir: Path, n: int, shard_size: int) -> list[list[int]]:
    out: list[list[int]] = []
    for i in range(_num_shards(n, shard_size)):
        out.extend(json.loads(line) for line in _shard_file(work_dir, i).read_text().splitlines())
    if len(out) != n:
        raise RuntimeError(f"{work_dir}: {len(out)} generations for {n} requests")
    return out


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def maximal_prompts(requests: Sequence[GenRequest]) -> list[list[int]]:
    """The prompts that are not a prefix of another request's prompt (each once).

    >>> reqs = [GenRequest([1], 1), GenRequest([1, 2], 1), GenRequest([3], 1), GenRequest([1, 2], 1)]
    >>> maximal_prompts(reqs)
    [[1, 2], [3]]
    """
    kept: list[tuple[int, ...]] = []
    for ids in sorted({tuple(r.prompt_token_ids) for r in requests}, key=len, reverse=True):
        if not any(k[: len(ids)] == ids for k in kept):
            kept.append(ids)
    return sorted(list(k) for k in kept)


def _resolve_dtype(dtype: str, target_dir: Path) -> str:
    if dtype != "auto":
        return dtype
    config = json.loads((target_dir / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def _run_job(job_file: Path) -> None:
    """The subprocess: one vLLM engine, shard after shard."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job = json.loads(job_file.read_text())
    settings = GenSettings(**job["settings"])
    out_dir = Path(job["out_dir"])
    requests = [GenRequest(**json.loads(line)) for line in Path(job["requests"]).read_text().splitlines()]
    todo = [i for i in range(_num_shards(len(requests), settings.shard_size))
            if not _shard_file(out_dir, i).is_file()]
    longest = max(len(r.prompt_token_ids) + r.max_tokens for r in requests)
    kwargs = dict(model=job["target"], dtype=_resolve_dtype(settings.dtype, Path(job["target"])), enforce_eager=settings.enforce_eager,
                  max_model_len=min(settings.max_model_len, max(longest, 64)),
                  gpu_memory_utilization=settings.gpu_memory_utilization,
                  enable_prefix_caching=settings.enable_prefix_caching, seed=0)
    if settings.block_size is not None:
        kwargs["block_size"] = settings.block_size
    llm = LLM(**kwargs)
    for i in tqdm(todo, desc="generation shards", unit="shard"):
        shard = requests[i * settings.shard_size: (i + 1) * settings.shard_size]
        if settings.prefix_warmup:
            warm = [TokensPrompt(prompt_token_ids=ids) for ids in maximal_prompts(shard)]
            llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=1, detokenize=False),
                         use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in shard]
        params = [SamplingParams(temperature=r.temperature, max_tokens=r.max_tokens, seed=r.seed,
                                 detokenize=False) for r in shard]
        outputs = llm.generate(prompts, params, use_tqdm=True)
        lines = "".join(json.dumps(list(o.outputs[0].token_ids)) + "\n" for o in outputs)
        _atomic_write(_shard_file(out_dir, i), lines)


if __name__ == "__main__":
    _run_job(Path(sys.argv[1]))
