"""ReDrafter inside vLLM 0.32.0 (CPU, the embedded SmolLM2 target): output, hidden state, metrics.

Engine starts are the cost here, so there are few: "vLLM alone" (plugin NOT loaded) and plain
vLLM with the plugin loaded each run once in a subprocess; one redrafter engine
runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can reach its proposer's
debug hooks (``trace``, ``beam_source``, the drafter). The server is tested in test_server.py.

The drafter is ``vllm_redrafter/default_drafter`` when the package ships one, else a tiny random
drafter: a random drafter is never accepted, so acceptance is exercised with a teacher-forced
stand-in that knows the target's continuation (from the "vLLM alone" run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import save_random_drafter
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = REPO / "vllm_redrafter" / "default_drafter"
NUM_PROMPTS, MAX_TOKENS = 20, 64
VOCAB = 49152


def engine_kwargs(target_dir: Path) -> dict:
    """The same engine for every run: float32 (fast on CPUs without bf16), eager, small KV."""
    return dict(model=str(target_dir), dtype="float32", enforce_eager=True, max_model_len=1024,
                kv_cache_memory_bytes=512 << 20, seed=0)


GREEDY = dict(temperature=0.0, max_tokens=MAX_TOKENS)
STOPPING = {  # greedy runs that end early: a stop token (as EOS would), a stop string, max_tokens
    "stop_token": dict(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[30]),  # "."
    "stop_string": dict(temperature=0.0, max_tokens=MAX_TOKENS, stop=[" and"]),
    "max_tokens": dict(temperature=0.0, max_tokens=37),
}
SEEDED = dict(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    if (DEFAULT_DRAFTER / "config.json").is_file():
        return DEFAULT_DRAFTER
    return save_random_drafter(tmp_path_factory.mktemp("drafter"))


@pytest.fixture(scope="module")
def prompts(target_dir, mt_bench_questions) -> list[list[int]]:
    """The first NUM_PROMPTS MT-Bench first turns in the target's chat template, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=True)["input_ids"])
        for q in mt_bench_questions[:NUM_PROMPTS]
    ]


@pytest.fixture(scope="module")
def subprocess_runs(target_dir, prompts, tmp_path_factory) -> dict[str, dict]:
    """Greedy outputs of vLLM alone (plugin not loaded) and of plain vLLM with the plugin loaded."""
    work = tmp_path_factory.mktemp("vllm_runs")
    results = {}
    # One after the other (side by side, their threads would fight for the cores).
    # (name, VLLM_PLUGINS, prompts): the plugin-loaded plain run needs only a few prompts.
    for name, plugins, subset in (("alone", "", prompts), ("plugin_loaded", None, prompts[:4])):
        runs = [{"prompts": subset, "params": GREEDY}]
        if name == "alone":  # where stop conditions fall mid-path; seeded sampling
            runs += [{"prompts": prompts, "params": p} for p in STOPPING.values()]
            runs += [{"prompts": prompts[:4], "params": SEEDED}]
        env = {} if plugins is None else {"VLLM_PLUGINS": plugins}
        results[name] = generate_in_subprocess({"engine": engine_kwargs(target_dir), "runs": runs},
                                               work / name, env)
    return results


def generate_in_subprocess(job: dict, work: Path, env: dict[str, str] | None = None) -> dict:
    """``tests/_vllm_generate.py`` on ``job`` in a fresh process (plugin allowed unless ``env``
    sets VLLM_PLUGINS); its output json."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "job.json").write_text(json.dumps(job))
    full_env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    full_env.pop("VLLM_PLUGINS", None)
    run = subprocess.run([sys.executable, str(REPO / "tests" / "_vllm_generate.py"),
                          str(work / "job.json"), str(work / "out.json")],
                         env={**full_env, **(env or {})}, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, f"{work.name} run failed:\n{(run.stdout + run.stderr)[-4000:]}"
    return json.loads((work / "out.json").read_text())


@pytest.fixture(scope="module")
def alone(subprocess_runs) -> list[list[int]]:
    """vLLM alone, greedy, MAX_TOKENS tokens per prompt: what redrafter must reproduce."""
    return subprocess_runs["alone"]["outputs"][0]


@pytest.fixture(scope="module")
def alone_stopping(subprocess_runs) -> dict[str, list[list[int]]]:
    """vLLM alone under each STOPPING condition."""
    return dict(zip(STOPPING, subprocess_runs["alone"]["outputs"][1: 1 + len(STOPPING)]))


@pytest.fixture(scope="module")
def alone_seeded(subprocess_runs) -> list[list[int]]:
    """vLLM alone, SEEDED sampling, the first 4 prompts."""
    return subprocess_runs["alone"]["outputs"][1 + len(STOPPING)]


@pytest.fixture(scope="module")
def llm(target_dir, drafter_dir, subprocess_runs):
    """One redrafter engine, in this process. Default beam W=2, L=4; requests override it."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine starts
    from vllm import LLM

    engine = LLM(**engine_kwargs(target_dir), disable_log_stats=False, speculative_config={
        "method": "redrafter", "model": str(drafter_dir), "beam_width": 2, "beam_length": 4,
        "beam_policy": "fixed",  # the same shapes with or without a step-cost curve cached here
        "num_speculative_tokens": 64,  # room for W = 16, L = 5 trees
    })
    yield engine
    del engine


@pytest.fixture
def proposer(llm):
    """The engine's ReDrafterProposer; its debug hooks are reset after each test."""
    proposer = model_runner(llm).drafter
    source, policy = proposer.beam_source, proposer.policy
    proposer.trace = []
    yield proposer
    proposer.trace, proposer.beam_source, proposer.policy = None, source, policy
    proposer.timings = None


# -- helpers -------------------------------------------------------------------------------------


def generate(llm, prompts, per_request_params: list[dict]):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                        [SamplingParams(**p) for p in per_request_params], use_tqdm=False)


def beam_shape(W: int, L: int) -> dict:
    return {"extra_args": {"redrafter_beam_width": W, "redrafter_beam_length": L}}


def spec_metrics(llm) -> dict[str, object]:
    return {m.name: getattr(m, "values", getattr(m, "value", None))
            for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")}


def accepted_depth(drafts, parents, continuation) -> int:
    """Draft tokens greedy verification accepts: the deepest tree path the target emitted next.

    ``drafts`` are the packed nodes after the root, ``parents`` the packed parents root first.
    """
    tokens = [None, *drafts]
    node, depth = 0, 0
    for token in continuation:
        child = next((j for j in range(1, len(tokens))
                      if parents[j] == node and tokens[j] == token), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def model_runner(llm):
    """The engine's model runner (the engine runs in this process)."""
    core = llm.llm_engine.engine_core
    assert hasattr(core, "engine_core"), "the engine must run in-process for these tests"
    return core.engine_core.model_executor.driver_worker.worker.model_runner


def verifier_counts(llm) -> dict[str, int]:
    """The tree verifier's counters (zeros before its first step: it is installed lazily)."""
    verifier = model_runner(llm).rejection_sampler
    names = ("num_tree_verifications", "num_branching_verifications", "num_kv_moves")
    return {name: getattr(verifier, name, 0) for name in names}


class TeacherForcedBeams:
    """The core issue's teacher-forced stand-in as a beam source (``proposer.beam_source``).

    It knows each prompt's continuation (vLLM alone's greedy output) and, per request, proposes
    :func:`~vllm_redrafter.reference_loop.teacher_forced_beams`: the truth on a random beam cut at
    a random depth, noise sharing random prefixes of it on the others. The true beam scores 0,
    the others -1 (padding beams of a narrower request -inf), so the proposer's best beam is the
    true one, which is often not beam 0.
    """

    def __init__(self, references: dict[tuple[int, ...], list[int]], seed: int = 0):
        self.references = references
        self.rng = torch.Generator().manual_seed(seed)

    def __call__(self, h, g0, beam_width, beam_length, requests):
        from vllm_redrafter.beam_search import BeamSearchOutput
        from vllm_redrafter.reference_loop import teacher_forced_beams

        B = len(requests)
        widths, lengths = (x.tolist() if torch.is_tensor(x) else [x] * B
                           for x in (beam_width, beam_length))
        roots = g0.tolist()
        beams = torch.tensor(roots)[:, None, None].repeat(1, max(widths), max(lengths))
        scores = torch.full((B, max(widths)), float("-inf"))  # [B, Wmax]; -inf: padding beams
        for b, request in enumerate(requests):
            W, L = widths[b], lengths[b]
            reference = self.references[tuple(request.prompt_token_ids)]
            k = len(request.output_token_ids)  # tokens emitted so far, g0 the last
            own, winner = teacher_forced_beams(reference, k, roots[b], W, L, VOCAB, self.rng)
            beams[b, :, :L] = own[0]  # padding beams w >= W_b: copies of beam 0
            beams[b, :W, :L] = own  # [W_b, L_b]
            scores[b, :W] = -1.0
            scores[b, winner] = 0.0
        return BeamSearchOutput(beams=beams.to(h.device), scores=scores.to(h.device),
                                log_probs=None)


# -- vLLM with the plugin loaded but redrafter not asked for -------------------------------------


def test_plugin_loaded_plain_generation_equals_vllm_alone(subprocess_runs):
    assert subprocess_runs["alone"]["plugin_patched"] is False  # VLLM_PLUGINS="" kept it out
    assert subprocess_runs["plugin_loaded"]["plugin_patched"] is True
    loaded = subprocess_runs["plugin_loaded"]["outputs"][0]
    assert loaded == subprocess_runs["alone"]["outputs"][0][: len(loaded)]


# -- greedy identity and the hidden state ---------------------------------------------------------


@pytest.mark.parametrize("L", [3, 5])
def test_greedy_identical_to_vllm_alone_for_every_beam_shape(llm, proposer, drafter_dir, prompts,
                                                             alone, L):
    """10 MT-Bench prompts x 64 tokens for W = 1, 4 and 16 in one mixed batch (prefix caching on).

    W = 16, L = 5 packs up to 64 draft nodes per request: the scheduler's token budget cuts some
    trees short, which the verifier must take as smaller trees. (10 of the 20 prompts: every
    width runs every prompt, and the teacher-forced test below covers all 20.)
    """
    widths, prompts, alone = (1, 4, 16), prompts[:10], alone[:10]
    shapes = [beam_shape(W, L) for W in widths for _ in prompts]
    before = spec_metrics(llm)
    outputs = generate(llm, prompts * len(widths), [{**GREEDY, **s} for s in shapes])
    after = spec_metrics(llm)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    for i, W in enumerate(widths):
        assert tokens[i * len(prompts): (i + 1) * len(prompts)] == alone, f"W={W}, L={L}"
    lengths = Counter(len(r.drafts) for r in proposer.trace)
    assert lengths[L - 1] > 0, lengths  # chains (W = 1)
    assert max(lengths) > L - 1 and max(lengths) <= 16 * (L - 1), lengths  # trees
    assert_drafter_got_the_right_hidden_state(proposer.trace)
    drafts, accepted = (after[name] - before[name] for name in (
        "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens"))
    groups = [W for W in widths for _ in prompts]
    per_width = tokens_per_step(proposer.trace, outputs, groups)
    width_of = {o.request_id: W for o, W in zip(outputs, groups)}
    packed = {W: [len(r.drafts) + 1 for r in proposer.trace if r.drafts
                  and width_of[_external_id(r.req_id, width_of)] == W] for W in widths}
    ratio = {W: round(W * L * len(n) / sum(n), 2) for W, n in packed.items() if n}
    print(f"\n{drafter_dir.name}: {accepted / drafts:.2f} accepted draft tokens per step, L={L}; "
          f"tokens/step per beam width {per_width}; compression W*L / packed {ratio}")
    if drafter_dir == DEFAULT_DRAFTER:  # a trained drafter must earn its keep, more with trees
        assert accepted / drafts > 0.5
        assert per_width[16] > per_width[4] > per_width[1] > 1.3, per_width


def tokens_per_step(trace, outputs, groups: list) -> dict:
    """Mean tokens per engine step per group (outputs[i] is in groups[i]), from the trace.

    A request is traced once per step in which it emitted tokens, so its steps are its records.
    """
    emitted = {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
    steps = Counter(_external_id(r.req_id, emitted) for r in trace)
    tokens, count = Counter(), Counter()
    for o, group in zip(outputs, groups):
        tokens[group] += emitted[o.request_id]
        count[group] += steps[o.request_id]
    return {group: round(tokens[group] / count[group], 3) for group in tokens}


def assert_drafter_got_the_right_hidden_state(records) -> None:
    """The target's own LM head on the handed h gives back g0, at every step of every request."""
    assert records
    mismatches = [r for r in records if r.target_argmax != r.g0]
    assert not mismatches, mismatches[:3]


def test_greedy_identical_with_teacher_forced_stand_in(llm, proposer, prompts, alone):
    """The core issue's stand-in knows vLLM alone's output: long accepted chains, same tokens.

    20 MT-Bench prompts x 64 tokens, W = 1 and W = 4 (L = 5) in one batch; the stand-in hides the
    truth cut at a depth uniform in [0, 4], so about 60% of steps can accept >= 2 draft tokens.
    """
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=2)
    shapes = [beam_shape(1 if i % 2 else 4, 5) for i in range(len(prompts))]
    counts_before = verifier_counts(llm)
    before = spec_metrics(llm)
    outputs = generate(llm, prompts, [{**GREEDY, **s} for s in shapes])
    after = spec_metrics(llm)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone
    assert_drafter_got_the_right_hidden_state(proposer.trace)
    # vLLM's own counts: position j is accepted in a step iff the step accepted > j drafts
    drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    per_position = [a - b for a, b in zip(after[name], before[name])]
    accepted = (after["vllm:spec_decode_num_accepted_tokens"]
                - before["vllm:spec_decode_num_accepted_tokens"])
    assert drafts > 0 and sum(per_position) == accepted
    at_least_2 = per_position[1] / drafts
    print(f"\nteacher-forced: accepted >= 2 in {at_least_2:.0%} of {drafts} steps, "
          f"{accepted / drafts:.2f} accepted draft tokens per step, per position {per_position}")
    assert at_least_2 >= 0.3, f"only {at_least_2:.0%} of steps accepted >= 2 draft tokens"
    # the winning path left beam 0 (so its KV moved) in >= 30% of the tree (W = 4) steps
    counts = {k: v - counts_before[k] for k, v in verifier_counts(llm).items()}
    off_beam_0 = counts["num_kv_moves"] / counts["num_branching_verifications"]
    print(f"accepted path off beam 0 (KV moved) in {off_beam_0:.0%} of branching-tree steps")
    assert off_beam_0 >= 0.3


def test_beam_policy_drafts_only_where_it_pays(llm, proposer, prompts, alone, tmp_path):
    """The beam policy in the engine, with no step-cost curve, for requests without their own
    beam shape: one that asks drafting to pay 10x drafts only its few exploring steps; one that
    asks little (and explores every other step) drafts most steps, in shapes up to the engine's
    W = 2, L = 4 that it measured on this machine. Output identical to vLLM alone both ways.
    The second run also writes the debug step log, which benchmarks/step_log.py reads."""
    from vllm_redrafter.beam_policy import BeamPolicy, PolicyConfig
    from vllm_redrafter.vllm_plugin.timing import StepTimings

    n = 8
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=4)
    drafted = {}
    for name, config in (("demanding", PolicyConfig(min_gain=10.0)),
                         ("eager", PolicyConfig(min_gain=0.5, explore_floor=0.0, explore_every=2))):
        proposer.policy = BeamPolicy(2, 4, config)
        proposer.trace = []
        outputs = generate(llm, prompts[:n], [GREEDY] * n)
        assert [list(o.outputs[0].token_ids) for o in outputs] == alone[:n], name
        drafted[name] = sum(bool(r.drafts) for r in proposer.trace) / len(proposer.trace)
        if name == "demanding":
            proposer.timings = StepTimings()  # the benchmark hook, on for the eager run
            proposer.step_log = str(tmp_path / "steps.jsonl")  # and the debug step log
    proposer.step_log = None
    print(f"\nsteps with drafts: {drafted}")
    assert drafted["demanding"] < 0.1 and drafted["eager"] > 0.5
    calls = proposer.timings.calls  # every phase of every step with drafts was timed (batched)
    assert calls["draft"] == calls["pack"] > 0 and 0 < calls["verify"] == calls["accept"]
    assert min(proposer.timings.seconds.values()) > 0
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "step_log.py"
    spec = importlib.util.spec_from_file_location("step_log", path)
    step_log = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(step_log)
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    emitted = sum(sum(line["emitted"]) for line in lines)  # the eager run's tokens, as logged
    assert emitted >= sum(len(o.outputs[0].token_ids) for o in outputs) - n
    summary = step_log.summary(step_log.steps(lines))
    assert {"explore", "best"} <= set(summary["reasons"]), summary["reasons"]
    assert any(line["policy"]["timed"] for line in lines), "the policy timed no engine step"
    drafted_cells = [c for c in summary["cells"] if c["shape"][0]]
    assert drafted_cells, "the log shows no drafted decode steps"
    # it measured more than one shape (which wins depends on this machine's costs)
    assert len({tuple(c["shape"]) for c in drafted_cells}) >= 2, drafted_cells
    # tokens per drafted step: one per request, and more where drafts were accepted
    assert max(c["tokens_per_step"] / c["batch"] for c in drafted_cells) > 1.2


def test_stop_conditions_mid_path_stop_where_vllm_alone_stops(llm, proposer, prompts, alone,
                                                              alone_stopping):
    """Teacher-forced trees (long accepted paths, W = 4, L = 5): a stop token, a stop string or
    max_tokens falling inside an accepted path ends the output exactly where vLLM alone ends it."""
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=3)
    for name, params in STOPPING.items():
        outputs = generate(llm, prompts, [{**params, **beam_shape(4, 5)}] * len(prompts))
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == alone_stopping[name], name
        if name != "max_tokens":
            assert sum(len(g) < MAX_TOKENS for g in got) >= 5, name  # it did stop early
    assert sum(t.count(30) for t in alone) >= 20  # "." occurs: the stop token is exercised


def test_preemption_with_a_small_kv_cache(target_dir, drafter_dir, prompts, alone, tmp_path):
    """A KV cache too small for the batch: vLLM preempts and recomputes; output unchanged."""
    engine = {**engine_kwargs(target_dir), "max_model_len": 256,
              "kv_cache_memory_bytes": 24 << 20, "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 5, "beam_policy": "fixed"}}
    out = generate_in_subprocess({"engine": engine, "runs": [{"prompts": prompts, "params": GREEDY}],
                                  "metrics": True}, tmp_path)
    assert out["outputs"][0] == alone
    print(f"\npreemptions: {out['metrics'].get('vllm:num_preemptions')}")
    assert out["metrics"].get("vllm:num_preemptions", 0) > 0


def test_tensor_parallel_workers_match_vllm_alone(llm, target_dir, drafter_dir, prompts, alone,
                                                  tmp_path):
    """TP over vLLM's multiprocessing executor: the drafter runs in each worker, on the
    all-reduced hidden state, and every worker verifies alike. Greedy output is vLLM alone's;
    seeded sampling gives what one worker gives (workers that drew differently would feed each
    other's all-reduce different tokens).

    TP = 3: the target's 9 query / 3 KV heads split no other way. Three workers on this 2-core
    machine cannot each own a core, so threads are not pinned (``nobind``), one per worker.
    """
    n = 6
    engine = {**engine_kwargs(target_dir), "tensor_parallel_size": 3,
              "distributed_executor_backend": "mp", "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 4, "beam_policy": "fixed"}}
    sampled = {"temperature": 0.8, "seed": 7, "max_tokens": 32, "ignore_eos": True,
               **beam_shape(4, 4)}
    job = {"engine": engine, "metrics": True, "runs": [
        {"prompts": prompts[:n], "params": GREEDY}, {"prompts": prompts[:n], "params": sampled}]}
    out = generate_in_subprocess(job, tmp_path, {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                 "OMP_NUM_THREADS": "1"})
    assert out["outputs"][0] == alone[:n]
    one_worker = generate(llm, prompts[:n], [sampled] * n)
    assert out["outputs"][1] == [list(o.outputs[0].token_ids) for o in one_worker]
    drafts = out["metrics"].get("vllm:spec_decode_num_drafts", 0)
    accepted = out["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0)
    print(f"\nTP=3: {drafts} steps with drafts, {accepted} accepted draft tokens")
    assert drafts > 0
    if drafter_dir == DEFAULT_DRAFTER:
        assert accepted > drafts / 2


# -- metrics ---------------------------------------------------------------------------------------


def test_acceptance_metrics_match_drafts_and_emitted_tokens(llm, proposer, prompts, alone):
    n = 10
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=1)
    before = spec_metrics(llm)
    outputs = generate(llm, prompts[:n], [{**GREEDY, **beam_shape(3, 5)}] * n)
    after = spec_metrics(llm)
    emitted = {o.request_id: list(o.outputs[0].token_ids) for o in outputs}
    assert list(emitted.values()) == alone[:n]
    assert_drafter_got_the_right_hidden_state(proposer.trace)
    # ... also right after accepted drafts, where h is no longer at the chain's start
    last_count: dict[str, int] = {}
    after_acceptance = 0
    for r in proposer.trace:
        after_acceptance += r.num_output_tokens - last_count.get(r.req_id, 0) > 1
        last_count[r.req_id] = r.num_output_tokens
    assert after_acceptance >= n, after_acceptance

    # Count from the proposer's own drafts: a draft made after k emitted tokens is verified iff
    # the request went on; greedy accepts the longest prefix that the target emitted next.
    num_drafts = num_draft_tokens = num_accepted = 0
    per_position = [0] * 4  # depth 1..4 (L = 5)
    for record in proposer.trace:
        tokens = emitted[_external_id(record.req_id, emitted)]
        if not record.drafts or record.num_output_tokens >= len(tokens):
            continue
        accepted = accepted_depth(record.drafts, record.parents, tokens[record.num_output_tokens:])
        num_drafts += 1
        num_draft_tokens += len(record.drafts)
        num_accepted += accepted
        for j in range(accepted):
            per_position[j] += 1

    def delta(name):
        return after[name] - before[name]

    assert num_accepted > num_drafts // 4  # the stand-in is accepted often enough to matter
    assert delta("vllm:spec_decode_num_drafts") == num_drafts
    assert delta("vllm:spec_decode_num_draft_tokens") == num_draft_tokens
    assert delta("vllm:spec_decode_num_accepted_tokens") == num_accepted
    name = "vllm:spec_decode_num_accepted_tokens_per_pos"
    reported = [a - b for a, b in zip(after[name], before[name])]
    assert reported[:4] == per_position and not any(reported[4:])
    print(f"\nmean acceptance length {1 + num_accepted / num_drafts:.2f} over {num_drafts} drafts,"
          f" per position {per_position}")


def test_drafts_reach_the_scheduler_inside_the_step_output(llm, proposer, prompts, alone,
                                                           monkeypatch):
    """patches/draft_handoff.py: no ``take_draft_token_ids`` round trip after a step."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    round_trips = []
    take = executor.take_draft_token_ids
    monkeypatch.setattr(executor, "take_draft_token_ids",
                        lambda: round_trips.append(1) or take())
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=2)
    before = spec_metrics(llm)
    outputs = generate(llm, prompts[:4], [GREEDY] * 4)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone[:4]
    drafts = spec_metrics(llm)["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
    assert drafts > 0 and round_trips == []


def _external_id(internal: str, emitted: dict) -> str:
    """The runner's request id carries a suffix ("0-ab12cd34"); LLM's outputs may not."""
    if internal in emitted:
        return internal
    return next(k for k in emitted if internal.startswith(f"{k}-"))


# -- sampling and robustness -----------------------------------------------------------------------


def test_temperature_with_seed_completes_every_request(llm, proposer, prompts):
    params = [{"temperature": 0.8, "seed": i, "max_tokens": 24, **beam_shape(1 + i % 3, 4)}
              for i in range(6)]
    outputs = generate(llm, prompts[:6], params)
    assert len(outputs) == 6
    for o in outputs:
        assert o.finished and o.outputs[0].finish_reason in ("length", "stop")
        assert 1 <= len(o.outputs[0].token_ids) <= 24
    assert any(r.drafts for r in proposer.trace)


def test_steps_without_drafts_sample_as_vllm_alone(llm, proposer, prompts, alone_seeded,
                                                  monkeypatch):
    """A batch without drafts makes vLLM alone's sampler call: neither the tree walk nor vLLM's
    rejection sampler (which copies the logits and draws noise over the vocabulary for nothing),
    so seeded sampling gives vLLM alone's tokens."""
    from vllm_redrafter.patches.runner_tree import tree_verifier

    verifier = tree_verifier(model_runner(llm))
    calls = []
    for owner, name in ((verifier, "_verify"), (verifier.rejection_sampler, "forward")):
        method = getattr(owner, name)
        monkeypatch.setattr(owner, name,
                            lambda *a, _m=method, _n=name, **k: calls.append(_n) or _m(*a, **k))
    monkeypatch.setattr(proposer, "_shapes",
                        lambda requests, cap, **kwargs: [None] * len(requests))
    outputs = generate(llm, prompts[:4], [SEEDED] * 4)
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone_seeded
    assert calls == [] and not any(r.drafts for r in proposer.trace)


def test_seeded_prompts_prefilled_in_chunks_sample_as_vllm_alone(llm, proposer, prompts,
                                                                alone_seeded, target_dir,
                                                                mt_bench_questions, monkeypatch):
    """patches/seeded_chunks_cpu.py: long greedy prompts fill the step's token budget, so the
    seeded prompts behind them are prefilled in chunks (vLLM alone on CPU dies there: "CPU
    Generator does not use offset"); the engine lives and, the chunks' discarded samples undone,
    the seeded requests give the tokens vLLM alone gives them unchunked."""
    from transformers import AutoTokenizer

    runner = model_runner(llm)
    budget = runner.scheduler_config.max_num_batched_tokens
    text = AutoTokenizer.from_pretrained(target_dir)("\n\n".join(mt_bench_questions))["input_ids"]
    # fillers of budget - 1 tokens in all: the first step prefills them and 1 token of the first
    # seeded prompt (its uncached part, at least 1 token, is longer unless prefix-cached but 1)
    count = -(-(budget - 1) // 1000)
    lengths = [(budget - 1) // count + (i < (budget - 1) % count) for i in range(count)]
    fillers = [list(text[i * 97: i * 97 + n]) for i, n in enumerate(lengths)]
    assert sum(map(len, fillers)) == budget - 1 and max(lengths) < 1024
    discarded = []
    bookkeeping = runner._bookkeeping_sync

    def recording(*args, **kwargs):  # the seeded requests whose sample a step discarded
        mask = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
        discarded.extend(i for i, d in enumerate(mask) if d and i in runner.input_batch.generators)
        return bookkeeping(*args, **kwargs)

    monkeypatch.setattr(runner, "_bookkeeping_sync", recording)
    monkeypatch.setattr(proposer, "_shapes",
                        lambda requests, cap, **kwargs: [None] * len(requests))
    outputs = generate(llm, fillers + prompts[:4],
                       [dict(temperature=0.0, max_tokens=1)] * len(fillers) + [SEEDED] * 4)
    assert discarded, "no seeded prompt was prefilled in chunks"
    assert [list(o.outputs[0].token_ids) for o in outputs[len(fillers):]] == alone_seeded


def test_failing_drafter_falls_back_to_no_drafts(llm, proposer, prompts, alone):
    """Every third step the drafter raises, every third it returns NaN: output unchanged."""
    drafter, source = proposer.drafter, proposer.beam_source
    step = {"n": 0}

    def counting_source(*args):
        step["n"] += 1
        return source(*args)

    def faulty_logits(h, state):
        if step["n"] % 3 == 0:
            raise RuntimeError("injected drafter failure")
        logits = type(drafter).draft_logits(drafter, h, state)
        return torch.full_like(logits, float("nan")) if step["n"] % 3 == 1 else logits

    proposer.beam_source = counting_source
    drafter.draft_logits = faulty_logits
    failed_before = proposer.num_failed_steps
    try:
        outputs = generate(llm, prompts[:4], [{**GREEDY, "max_tokens": 32}] * 4)
    finally:
        del drafter.draft_logits
    assert [list(o.outputs[0].token_ids) for o in outputs] == [a[:32] for a in alone[:4]]
    assert proposer.num_failed_steps - failed_before >= 2 * step["n"] // 3 - 1
    assert any(not r.drafts for r in proposer.trace)
    assert any(r.drafts for r in proposer.trace)  # the good steps still drafted


def test_bad_request_override_fails_that_request_only(llm, prompts):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"extra_args\['redrafter_beam_length'\]"):
        generate(llm, prompts[:1], [{**GREEDY, **beam_shape(2, 99)}])
    with pytest.raises(VLLMValidationError, match=r"extra_args\['redrafter_beam_width'\]"):
        generate(llm, prompts[:1], [{**GREEDY, **beam_shape(0, 3)}])
    outputs = generate(llm, prompts[:1], [{**GREEDY, "max_tokens": 4}])
    assert len(outputs[0].outputs[0].token_ids) == 4


# -- configuration errors before any model loads ---------------------------------------------------


@pytest.mark.parametrize(
    "overrides, error",
    [
        ({"beam_width": 0}, r"speculative_config\['beam_width'\] must be an integer >= 1, got 0"),
        ({"beam_length": 1}, r"speculative_config\['beam_length'\] must be an integer >= 2"),
        ({"beam_length": 5, "num_speculative_tokens": 3},
         r"\['beam_length'\] must be in \[2, num_speculative_tokens \+ 1 = 4\], got 5"),
        ({"verification": "fast"}, r"\['verification'\] must be one of 'exact', 'rejection'"),
        ({"model": "/nonexistent/drafter"}, r"drafter directory /nonexistent/drafter does not"),
    ],
)
def test_bad_config_is_refused_before_the_model_loads(target_dir, drafter_dir, overrides, error,
                                                       monkeypatch):
    from vllm import LLM
    from vllm.model_executor.model_loader import default_loader

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the config error")

    monkeypatch.setattr(default_loader.DefaultModelLoader, "load_weights", no_load)
    spec = {"method": "redrafter", "model": str(drafter_dir), **overrides}
    with pytest.raises(ValueError, match=error):
        LLM(**engine_kwargs(target_dir), speculative_config=spec)


def test_drafter_for_another_target_is_refused_with_both_shapes(target_dir, tmp_path):
    from vllm import LLM

    RecurrentDrafter(DrafterConfig(vocab_size=32000, hidden_size=64, exit_dim=128,
                                   num_draft_layers=1)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"hidden_size=64 / vocab_size=32000 does not match "
                                         r"the target's hidden_size=576 / vocab_size=49152"):
        LLM(**engine_kwargs(target_dir),
            speculative_config={"method": "redrafter", "model": str(tmp_path)})


def test_patches_are_pinned_to_this_vllm():
    import vllm

    from vllm_redrafter.patches import PINNED_VLLM_VERSION, check_vllm_version

    assert vllm.__version__ == PINNED_VLLM_VERSION, (
        f"the patches in patches/ were written against vLLM {PINNED_VLLM_VERSION}, this is "
        f"{vllm.__version__}: re-read each patched function before changing the pin"
    )
    check_vllm_version()


# -- exact sampling over the tree ----------------------------------------------------------------

SAMPLING_PROMPT = "My favourite animal is the"
NUM_SAMPLES = 2000
SAMPLING_ARMS = {"t1": {"temperature": 1.0}, "t07_p09": {"temperature": 0.7, "top_p": 0.9}}


def sampling_params(arm: str) -> list[dict]:
    return [{**SAMPLING_ARMS[arm], "seed": i, "max_tokens": 3} for i in range(NUM_SAMPLES)]


@pytest.fixture(scope="module")
def sampling_prompt(target_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)(SAMPLING_PROMPT)["input_ids"]


@pytest.fixture(scope="module")
def alone_samples(target_dir, sampling_prompt, tmp_path_factory) -> dict[str, list[list[int]]]:
    """vLLM alone (plugin not loaded), NUM_SAMPLES seeded requests per arm."""
    work = tmp_path_factory.mktemp("alone_samples")
    runs = [{"prompts": [sampling_prompt] * NUM_SAMPLES, "params": sampling_params(arm)}
            for arm in SAMPLING_ARMS]
    (work / "job.json").write_text(json.dumps({"engine": engine_kwargs(target_dir), "runs": runs}))
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_PLUGINS": ""}
    run = subprocess.run([sys.executable, str(REPO / "tests" / "_vllm_generate.py"),
                          str(work / "job.json"), str(work / "out.json")],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    outputs = json.loads((work / "out.json").read_text())["outputs"]
    return dict(zip(SAMPLING_ARMS, outputs))


class TopTokenBeams:
    """Beams whose first draft tokens are the target's own W most likely tokens after g0.

    ``next_top`` maps g0 (the sampled first token) to the target's top next tokens given the
    sampling prompt and g0, computed by vLLM beforehand (``h`` predicts g0 itself, not the token
    after it). Depth 1 is then accepted often, so the 2nd and 3rd emitted tokens come from walks
    that leave beam 0 (KV moved, tree-masked logits). Deeper tokens repeat the top one; a g0 not
    in the table drafts its own top tokens again (rarely right). With ``q`` set, beams also carry
    a draft distribution putting 1/2 on each drafted token: what the p/q rejection mode reads
    (and is biased by).
    """

    def __init__(self, next_top: dict[int, list[int]], q: bool = False):
        self.next_top, self.q = next_top, q

    def __call__(self, h, g0, beam_width, beam_length, requests):
        from vllm_redrafter.beam_search import BeamSearchOutput

        B = h.shape[0]
        W = int(beam_width) if not torch.is_tensor(beam_width) else int(beam_width.max())
        L = int(beam_length) if not torch.is_tensor(beam_length) else int(beam_length.max())
        fallback = [[int(g)] * W for g in g0.tolist()]
        top = torch.tensor([self.next_top.get(int(g), fallback[b])[:W]
                            for b, g in enumerate(g0.tolist())])  # [B, W]
        beams = torch.cat([g0[:, None, None].expand(B, W, 1).cpu(), top[:, :, None],
                           top[:, :1, None].expand(B, W, L - 2)], dim=2).to(g0.device)
        scores = -torch.arange(W, dtype=torch.float32).expand(B, W)
        log_probs = None
        if self.q:
            log_probs = torch.full((B, W, L - 1, VOCAB), math.log(0.5 / (VOCAB - 1)))
            log_probs.scatter_(-1, beams[:, :, 1:, None].cpu(), math.log(0.5))
        return BeamSearchOutput(beams=beams, scores=scores, log_probs=log_probs)


@pytest.fixture(scope="module")
def next_top(llm, sampling_prompt, alone_samples) -> dict[int, list[int]]:
    """The target's 4 most likely tokens after (prompt, g0), for every first token g0 that vLLM
    alone sampled (requests with logprobs get no drafts: vLLM's own sampler answers them)."""
    firsts = sorted({o[0] for outputs in alone_samples.values() for o in outputs})
    outputs = generate(llm, [sampling_prompt + [g] for g in firsts],
                       [{"max_tokens": 1, "temperature": 0.0, "logprobs": 4}] * len(firsts))
    table = {}
    for g, output in zip(firsts, outputs):
        ranked = sorted(output.outputs[0].logprobs[0].items(), key=lambda kv: kv[1].rank)
        table[g] = [token for token, _ in ranked][:4]
    return table


def joint_counts(outputs: list[list[int]]) -> Counter:
    return Counter((o[1], o[2]) for o in outputs if len(o) >= 3)


def two_sample_chi_square(a: Counter, b: Counter) -> float:
    """p-value of "same distribution" for two count tables; bins expected < 5 pooled."""
    from scipy.stats import chi2

    n_a, n_b = sum(a.values()), sum(b.values())
    bins, pooled = [], [0, 0]
    for key in set(a) | set(b):
        total = a[key] + b[key]
        if min(total * n_a, total * n_b) / (n_a + n_b) >= 5:
            bins.append((a[key], b[key]))
        else:
            pooled[0] += a[key]
            pooled[1] += b[key]
    if sum(pooled):
        bins.append(tuple(pooled))
    stat = 0.0
    for x, y in bins:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    return float(chi2.sf(stat, len(bins) - 1))


def test_prompt_leaves_room_for_bias(alone_samples):
    second = Counter(o[1] for o in alone_samples["t1"])
    assert max(second.values()) / sum(second.values()) <= 0.5


@pytest.mark.parametrize("arm", list(SAMPLING_ARMS))
def test_tree_sampling_matches_vllm_alone(llm, proposer, sampling_prompt, alone_samples, next_top,
                                          arm):
    """Tokens 2 and 3 distributed as vLLM alone samples them (W=4; with max_tokens=3 the proposer
    caps the beams at depth 1, so token 2 is a tree node or the root's sample, and token 3 the
    sample at the accepted node: one tree-verify step, or the next step after a rejection)."""
    proposer.beam_source = TopTokenBeams(next_top)
    moved = verifier_counts(llm)["num_kv_moves"]
    outputs = generate(llm, [sampling_prompt] * NUM_SAMPLES,
                       [{**p, **beam_shape(4, 3)} for p in sampling_params(arm)])
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    p_value = two_sample_chi_square(joint_counts(ours), joint_counts(alone_samples[arm]))
    moved = verifier_counts(llm)["num_kv_moves"] - moved
    print(f"\n{arm}: p = {p_value:.3f}, accepted paths off beam 0: {moved}")
    assert moved > NUM_SAMPLES // 10  # the walks did leave beam 0
    assert p_value > 0.01


def test_pq_rejection_mode_is_detectably_biased(llm, proposer, sampling_prompt, alone_samples,
                                                next_top):
    """Apple's p/q rejection (opt-in) on the same setup: the test above has the power to see it."""
    proposer.beam_source = TopTokenBeams(next_top, q=True)
    params = [{**p, "extra_args": {"redrafter_beam_width": 4, "redrafter_beam_length": 3,
                                   "redrafter_verification": "rejection"}}
              for p in sampling_params("t1")]
    outputs = generate(llm, [sampling_prompt] * NUM_SAMPLES, params)
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    p_value = two_sample_chi_square(joint_counts(ours), joint_counts(alone_samples["t1"]))
    print(f"\np/q rejection: p = {p_value:.2e}")
    assert p_value < 0.01
