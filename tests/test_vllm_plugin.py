"""ReDrafter inside vLLM 0.32.0 (CPU, the embedded SmolLM2 target): output, hidden state, metrics.

Engine starts are the cost here, so there are few, and two subprocesses run all but one of them,
each one after another (``engine_runs``): "vLLM alone" with the plugin NOT loaded (its greedy
references, then the sampling tests' samples); the engines of the tests that need one of their
own, plugin loaded (plain vLLM, preemption, chunked prefill, bf16, tensor parallel). One
redrafter engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the tests can reach its proposer's debug hooks
(``trace``, ``beam_source``, the drafter). The server is tested in test_server.py.

The drafter is ``vllm_redrafter/default_drafter`` when the package ships one, else a tiny random
drafter: a random drafter is never accepted, so acceptance is exercised with a teacher-forced
stand-in that knows the target's continuation (from the "vLLM alone" run).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from _vllm_generate import finish_job, sampling_params, start_job, stop_job
from conftest import DEFAULT_DRAFTER, chat_prompts
from vllm_redrafter.drafter import DrafterConfig, RecurrentDrafter

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
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
STOPPING_PROMPTS = 10  # the first 10 prompts: each condition falls mid-path in most of them
SEEDED = dict(temperature=0.8, seed=7, max_tokens=32, ignore_eos=True)


# -- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(target_dir, mt_bench_questions) -> list[list[int]]:
    """The first NUM_PROMPTS MT-Bench first turns in the target's chat template, as token ids."""
    return chat_prompts(target_dir, mt_bench_questions[:NUM_PROMPTS])


EVAL_PER_SET = 2  # prompts from each of the project's evaluation sets (vllm_redrafter/eval_sets.py)


@pytest.fixture(scope="module")
def eval_prompts(target_dir) -> list[list[int]]:
    """The first EVAL_PER_SET prompts of each evaluation set (translation, summarization, qa,
    math, rag, code_edit) in the target's chat template: text that copies from its context."""
    from transformers import AutoTokenizer

    from vllm_redrafter.eval_sets import EVAL_SETS, read_eval_set
    from vllm_redrafter.reference_loop import chat_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return [chat_prompt_ids(tokenizer, q.first_turn)
            for kind in EVAL_SETS for q in read_eval_set(kind, EVAL_PER_SET)]


class JobResults(dict):
    """The subprocess's jobs by name; looking up a job that failed there fails the test."""

    def __getitem__(self, name: str) -> dict:
        result = super().__getitem__(name)
        if "error" in result:
            pytest.fail(f"the subprocess's job {name!r} failed:\n{result['log'][-4000:]}")
        return result


@pytest.fixture(scope="module")
def engine_runs(target_dir, drafter_dir, prompts, eval_prompts, exact_prompt, exact_size,
                tmp_path_factory) -> JobResults:
    """Every engine of this module but its own, in two subprocesses, each running its engines
    one after another (vLLM is imported once a process, ~20 s on 2 cores). First vLLM alone,
    the plugin kept out (``VLLM_PLUGINS=""``): "alone" (its greedy outputs, where stop
    conditions fall mid-path, seeded sampling, ...: see ALONE_RUNS) and "alone_samples" (the
    sampling tests' samples: ``alone_samples``). Then the tests' own engines, plugin loaded:
    plain vLLM, preemption, chunked prefill, bf16, tensor parallel. (One process cannot do both:
    the plugin loaded after an engine ran finds vLLM's attention backend already chosen.) Runs
    before this module's engine."""
    work = tmp_path_factory.mktemp("engine_runs")
    runs = [{"prompts": prompts, "params": GREEDY}]
    runs += [{"prompts": prompts[:STOPPING_PROMPTS] * len(STOPPING),  # one batch, as ours
              "params": [p for p in STOPPING.values() for _ in range(STOPPING_PROMPTS)]}]
    runs += [{"prompts": prompts[:4], "params": SEEDED}]
    for sampled in (False, True):
        index, params = mixed_batch(sampled)
        runs += [{"prompts": [prompts[i] for i in index], "params": params}]
    runs += [{"continue": [0, LONG], "params": GREEDY}]
    runs += [{"prompts": eval_prompts, "params": GREEDY}]
    alone = {"alone": {"engine": engine_kwargs(target_dir), "runs": runs},
             "alone_samples": alone_samples_job(target_dir, exact_prompt, exact_size)}
    loaded = {"plugin_loaded": {"engine": engine_kwargs(target_dir),
                                "runs": [{"prompts": prompts[:4], "params": GREEDY}]},
              "preemption": preemption_job(target_dir, drafter_dir, prompts),
              "chunked_prefill": chunked_prefill_job(target_dir, drafter_dir, prompts,
                                                     work / "steps.jsonl"),
              "bf16": bf16_job(target_dir, drafter_dir, prompts),
              "tensor_parallel": tensor_parallel_job(target_dir, drafter_dir, prompts)}
    # the second process imports vLLM beside the first one's import, then waits for its turn:
    # the engines never share the cores (their timing would not matter, their speed would)
    go = work / "go"
    second = start_job({"jobs": loaded, "wait_for": str(go)}, work / "loaded")
    try:
        results = generate_in_subprocess({"jobs": alone}, work / "alone", {"VLLM_PLUGINS": ""},
                                         timeout=2700)
    except BaseException:  # the module's tests fail: its engines would run for nothing
        stop_job(second)
        raise
    go.touch()
    results.update(finish_job(second, work / "loaded", timeout=2700))
    results["chunked_prefill"]["steps"] = work / "steps.jsonl"
    print("\nthe subprocesses' engines:",
          {name: f"{run['seconds']:.0f} s" for name, run in results.items()})
    return JobResults(results)


# the runs of the "alone" job after GREEDY (0), STOPPING (1: every condition in one batch) and
# SEEDED (2)
ALONE_RUNS = {"mixed_greedy": 3, "mixed_sampled": 4, "long_continued": 5, "eval": 6}


def generate_in_subprocess(job: dict, work: Path, env: dict[str, str] | None = None,
                           timeout: float = 900) -> dict:
    """``_vllm_generate``'s :func:`start_job`, then :func:`finish_job`."""
    return finish_job(start_job(job, work, env), work, timeout)


@pytest.fixture(scope="module")
def alone(engine_runs) -> list[list[int]]:
    """vLLM alone, greedy, MAX_TOKENS tokens per prompt: what redrafter must reproduce."""
    return engine_runs["alone"]["outputs"][0]


@pytest.fixture(scope="module")
def alone_stopping(engine_runs) -> dict[str, list[list[int]]]:
    """vLLM alone under each STOPPING condition."""
    outputs, n = engine_runs["alone"]["outputs"][1], STOPPING_PROMPTS
    return {name: outputs[i * n: (i + 1) * n] for i, name in enumerate(STOPPING)}


@pytest.fixture(scope="module")
def alone_seeded(engine_runs) -> list[list[int]]:
    """vLLM alone, SEEDED sampling, the first 4 prompts."""
    return engine_runs["alone"]["outputs"][2]


@pytest.fixture(scope="module")
def alone_eval(engine_runs) -> list[list[int]]:
    """vLLM alone, greedy, MAX_TOKENS tokens for each of ``eval_prompts``."""
    return engine_runs["alone"]["outputs"][ALONE_RUNS["eval"]]


@pytest.fixture(scope="module")
def llm(target_dir, drafter_dir, engine_runs, every_core):
    """One redrafter engine, in this process, on every core (as vLLM alone's subprocess runs).
    Default beam W=2, L=4, no context candidates; requests override them."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when the engine starts
    from vllm import LLM

    engine = LLM(**engine_kwargs(target_dir), disable_log_stats=False, speculative_config={
        "method": "redrafter", "model": str(drafter_dir), "beam_width": 2, "beam_length": 4,
        "beam_policy": "fixed",  # the same shapes with or without a step-cost curve cached here
        "num_speculative_tokens": 64,  # room for W = 16, L = 5 trees
        "context_candidates": 0,  # the tests that want them ask per request (and test that key)
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
    proposer.candidate_source = proposer._lookup


# -- helpers -------------------------------------------------------------------------------------


def generate(llm, prompts, per_request_params: list[dict]):
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                        [sampling_params(p) for p in per_request_params], use_tqdm=False)


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


def candidate_counts(proposer) -> dict[str, int]:
    names = ("num_candidate_trees", "num_candidate_wins", "num_candidate_tokens")
    return {name: getattr(proposer, name) for name in names}


def candidates(count: int) -> dict:
    return {"redrafter_context_candidates": count}


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


def test_plugin_loaded_plain_generation_equals_vllm_alone(engine_runs):
    assert engine_runs["alone"]["plugin_patched"] is False  # VLLM_PLUGINS="" kept it out
    assert engine_runs["plugin_loaded"]["plugin_patched"] is True
    loaded = engine_runs["plugin_loaded"]["outputs"][0]
    assert loaded == engine_runs["alone"]["outputs"][0][: len(loaded)]


# -- greedy identity and the hidden state ---------------------------------------------------------


@pytest.mark.parametrize("L", [3, 5])
def test_greedy_identical_to_vllm_alone_for_every_beam_shape(llm, proposer, drafter_dir, prompts,
                                                             alone, L):
    """6 MT-Bench prompts x 64 tokens for W = 1, 4 and 16 in one mixed batch (prefix caching on).

    W = 16, L = 5 packs up to 64 draft nodes per request: the scheduler's token budget cuts some
    trees short, which the verifier must take as smaller trees. (6 of the 20 prompts: every
    width runs every prompt, and the teacher-forced test below covers all 20.)
    """
    widths, prompts, alone = (1, 4, 16), prompts[:6], alone[:6]
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


TREE_MUTATIONS = ("SKIP_KV_MOVE", "CAUSAL_TREE_MASK", "NO_POSITION_REWRITE")
MUTATION_PROMPTS = 8  # requests per mutation run (4 of them W = 4 trees)
MUTATION_TOKENS = 32  # per request: the 20 prompts' W = 4 outputs differed by token 2-20


@pytest.mark.parametrize("mutation", [None, *TREE_MUTATIONS])
def test_greedy_identical_with_teacher_forced_stand_in(llm, proposer, prompts, alone, mutation,
                                                       monkeypatch):
    """The core issue's stand-in knows vLLM alone's output: long accepted chains, same tokens.

    20 MT-Bench prompts x 64 tokens, W = 1 and W = 4 (L = 5) in one batch; the stand-in hides the
    truth cut at a depth uniform in [0, 4], so about 60% of steps can accept >= 2 draft tokens.

    Mutation runs (``vllm_plugin/mutations.py``): with the accepted nodes' KV not moved, the tree
    rows under the causal mask, or node j at position p + j instead of p + depth, the same run
    on the first MUTATION_PROMPTS prompts must differ from vLLM alone (docs/exactness.md).
    """
    from vllm_redrafter.vllm_plugin import mutations

    params = GREEDY
    if mutation is not None:  # a control needs fewer requests: a wrong KV shows within tokens
        monkeypatch.setattr(mutations, mutation, True)
        prompts, params = prompts[:MUTATION_PROMPTS], {**GREEDY, "max_tokens": MUTATION_TOKENS}
        alone = [a[:MUTATION_TOKENS] for a in alone[:MUTATION_PROMPTS]]
    proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=2)
    shapes = [beam_shape(1 if i % 2 else 4, 5) for i in range(len(prompts))]
    counts_before = verifier_counts(llm)
    before = spec_metrics(llm)
    outputs = generate(llm, prompts, [{**params, **s} for s in shapes])
    after = spec_metrics(llm)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    if mutation is not None:
        differ = [i for i, (g, a) in enumerate(zip(got, alone)) if g != a]
        first = [next((j for j, (x, y) in enumerate(zip(g, a)) if x != y), min(len(g), len(a)))
                 for g, a in zip(got, alone) if g != a]
        print(f"\n{mutation}: {len(differ)} of {len(prompts)} outputs differ from vLLM alone "
              f"(prompts {differ}, first differing token at {first})")
        assert differ, f"{mutation}: the identity test did not notice"
        assert all(i % 2 == 0 for i in differ)  # W = 4 requests only: chains need none of the three
        return
    assert got == alone
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
    prompts, n = prompts[:STOPPING_PROMPTS], STOPPING_PROMPTS
    outputs = generate(llm, prompts * len(STOPPING),  # every condition in one batch
                       [{**params, **beam_shape(4, 5)} for params in STOPPING.values()
                        for _ in prompts])
    for i, name in enumerate(STOPPING):
        got = [list(o.outputs[0].token_ids) for o in outputs[i * n: (i + 1) * n]]
        assert got == alone_stopping[name], name
        if name != "max_tokens":
            assert sum(len(g) < MAX_TOKENS for g in got) >= 5, name  # it did stop early
    assert sum(t.count(30) for t in alone[:STOPPING_PROMPTS]) >= 10  # "." occurs: exercised


PREEMPTED = 10  # prompts: with their answers they need ~1,200 tokens of KV, the cache holds ~530


def preemption_job(target_dir: Path, drafter_dir: Path, prompts) -> dict:
    engine = {**engine_kwargs(target_dir), "max_model_len": 256,
              "kv_cache_memory_bytes": 24 << 20, "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 5, "beam_policy": "fixed"}}
    return {"engine": engine, "metrics": True,
            "runs": [{"prompts": prompts[:PREEMPTED], "params": GREEDY}]}


def test_preemption_with_a_small_kv_cache(engine_runs, alone):
    """A KV cache too small for the batch: vLLM preempts and recomputes; output unchanged."""
    out = engine_runs["preemption"]
    assert out["outputs"][0] == alone[:PREEMPTED]
    print(f"\npreemptions: {out['metrics'].get('vllm:num_preemptions')}")
    assert out["metrics"].get("vllm:num_preemptions", 0) > 0


TP_PROMPTS = 4
TP_SAMPLED = {"temperature": 0.8, "seed": 7, "max_tokens": 32, "ignore_eos": True,
              "extra_args": {**beam_shape(4, 4)["extra_args"], "redrafter_context_candidates": 0}}


def tensor_parallel_job(target_dir: Path, drafter_dir: Path, prompts) -> dict:
    """TP = 3 over vLLM's multiprocessing executor: greedy with the default context candidates,
    then seeded sampling without them (as the module's engine). TP = 3: the target's 9 query / 3
    KV heads split no other way. Three workers on this 2-core machine cannot each own a core, so
    threads are not pinned (``nobind``), one per worker."""
    engine = {**engine_kwargs(target_dir), "tensor_parallel_size": 3,
              "distributed_executor_backend": "mp", "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 4, "beam_policy": "fixed"}}
    return {"engine": engine, "metrics": True,
            "env": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"},
            "runs": [{"prompts": prompts[:TP_PROMPTS], "params": GREEDY},
                     {"prompts": prompts[:TP_PROMPTS], "params": TP_SAMPLED}]}


def test_tensor_parallel_workers_match_vllm_alone(llm, drafter_dir, prompts, alone, engine_runs):
    """TP over vLLM's multiprocessing executor (:func:`tensor_parallel_job`): the drafter runs in
    each worker, on the all-reduced hidden state, and every worker verifies alike. Greedy output
    is vLLM alone's; seeded sampling gives what one worker gives (workers that drew differently
    would feed each other's all-reduce different tokens)."""
    n, out = TP_PROMPTS, engine_runs["tensor_parallel"]
    assert out["outputs"][0] == alone[:n]
    one_worker = generate(llm, prompts[:n], [TP_SAMPLED] * n)
    assert out["outputs"][1] == [list(o.outputs[0].token_ids) for o in one_worker]
    drafts = out["metrics"].get("vllm:spec_decode_num_drafts", 0)
    draft_tokens = out["metrics"].get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = out["metrics"].get("vllm:spec_decode_num_accepted_tokens", 0)
    print(f"\nTP=3: {drafts} steps with drafts, {draft_tokens / max(drafts, 1):.1f} draft nodes "
          f"per draft, {accepted} accepted draft tokens")
    assert drafts > 0
    # trees, not the chain fallback: each of the 3 workers loaded the drafter and none warned
    # that it drafts chains; the drafts scheduled hold more nodes than a chain's L - 1 = 3
    assert out["log"].count("ReDrafter: drafter ") == 3, out["log"][-4000:]
    assert "drafting chains" not in out["log"]
    assert draft_tokens > 3 * drafts
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
                        lambda requests, *args, **kwargs: [None] * len(requests))
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
                        lambda requests, *args, **kwargs: [None] * len(requests))
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


def test_failing_step_planning_costs_drafts_only(llm, proposer, prompts, alone, monkeypatch):
    """The beam policy's choice and the candidate lookup raise on alternate steps: the output
    is unchanged, those steps draft nothing, the others still draft (the engine lives on)."""
    shapes, find = proposer._shapes, proposer._find_candidates
    step = {"n": 0}

    def faulty_shapes(*args, **kwargs):
        step["n"] += 1
        if step["n"] % 2 == 0:
            raise RuntimeError("injected beam policy failure")
        return shapes(*args, **kwargs)

    def faulty_find(*args, **kwargs):
        if step["n"] % 4 == 1:
            raise RuntimeError("injected candidate lookup failure")
        return find(*args, **kwargs)

    monkeypatch.setattr(proposer, "_shapes", faulty_shapes)
    monkeypatch.setattr(proposer, "_find_candidates", faulty_find)
    failed_before, traced_before = proposer.num_failed_steps, len(proposer.trace)
    outputs = generate(llm, prompts[:4], [{**GREEDY, "max_tokens": 32}] * 4)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [a[:32] for a in alone[:4]]
    assert proposer.num_failed_steps - failed_before >= step["n"] // 2
    steps = proposer.trace[traced_before:]
    assert any(not r.drafts for r in steps) and any(r.drafts for r in steps)


def test_bad_request_override_fails_that_request_only(llm, prompts):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"extra_args\['redrafter_beam_length'\]"):
        generate(llm, prompts[:1], [{**GREEDY, **beam_shape(2, 99)}])
    with pytest.raises(VLLMValidationError, match=r"extra_args\['redrafter_beam_width'\]"):
        generate(llm, prompts[:1], [{**GREEDY, **beam_shape(0, 3)}])
    outputs = generate(llm, prompts[:1], [{**GREEDY, "max_tokens": 4}])
    assert len(outputs[0].outputs[0].token_ids) == 4


# -- requests that bypass drafting, beside tree requests --------------------------------------------

JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                                "age": {"type": "integer"}},
               "required": ["name", "age"]}
BYPASS = {  # one request of each kind that proposer.tree_eligible keeps off drafting (logit_bias
    #        and min_p: vLLM refuses them on any speculative engine, see the test below)
    "repetition_penalty": {"repetition_penalty": 1.3},
    "presence_penalty": {"presence_penalty": 1.0},
    "frequency_penalty": {"frequency_penalty": 1.0},
    "logprobs": {"logprobs": 3},
    "json_schema": {"structured_outputs": {"json": JSON_SCHEMA}},
    "min_tokens": {"min_tokens": 16},  # drafts once 16 tokens are out
    "n2": {"n": 2},  # sampled only (vLLM refuses n > 1 greedy); each completion is a request
}
MIXED_TREES, MIXED_MAX_TOKENS = 4, 32


def test_logit_bias_and_min_p_are_refused_as_on_any_speculative_engine(llm, prompts):
    """vLLM 0.32 refuses logit_bias and min_p with speculative decoding (its own check, before
    the request reaches ReDrafter): the request fails alone, the engine goes on."""
    from vllm.exceptions import VLLMValidationError

    for extra in ({"logit_bias": {"30": -100.0}}, {"temperature": 0.8, "min_p": 0.1}):
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative"):
            generate(llm, prompts[:1], [{**GREEDY, "max_tokens": 4, **extra}])
    assert len(generate(llm, prompts[:1], [{**GREEDY, "max_tokens": 4}])[0].outputs[0].token_ids) == 4


def mixed_batch(sampled: bool) -> tuple[list[int], list[dict]]:
    """(prompt indices, params): MIXED_TREES tree requests (W = 4, L = 5) on prompts 0-3, then one
    request of each BYPASS kind on prompts 4, 5, ...; seeded T = 0.8 if ``sampled``, else greedy."""
    kinds = [k for k in BYPASS if sampled or k != "n2"]
    params = []
    for i in range(MIXED_TREES + len(kinds)):
        p = {"max_tokens": MIXED_MAX_TOKENS, "temperature": 0.8 if sampled else 0.0}
        if sampled:
            p["seed"] = 100 + i
        p.update(beam_shape(4, 5) if i < MIXED_TREES else BYPASS[kinds[i - MIXED_TREES]])
        params.append(p)
    return list(range(len(params))), params


def mixed_kinds(sampled: bool) -> list[str]:
    return ["tree"] * MIXED_TREES + [k for k in BYPASS if sampled or k != "n2"]


def logprob_lists(completion) -> list | None:
    """A completion's logprobs as tests/_vllm_generate.py writes them: [token, logprob, rank]."""
    if completion.logprobs is None:
        return None
    return [sorted([t, lp.logprob, lp.rank] for t, lp in step.items())
            for step in completion.logprobs]


def assert_same_logprobs(ours, alone, tolerance: float = 1e-4) -> float:
    """Same tokens and ranks at every position, logprobs within ``tolerance``; the largest gap."""
    assert len(ours) == len(alone)
    gap = 0.0
    for mine, theirs in zip(ours, alone):
        assert [(t, r) for t, _, r in mine] == [(t, r) for t, _, r in theirs]
        gap = max([gap, *(abs(a[1] - b[1]) for a, b in zip(mine, theirs))])
    assert gap <= tolerance, gap
    return gap


def drafted_kinds(trace, outputs, kinds: list[str]) -> dict[str, list[int]]:
    """kind -> tokens emitted before each step at which a request of that kind got drafts
    (n > 1 completions run as child requests "INDEX_PARENT")."""
    import re

    kind_of = {o.request_id: k for o, k in zip(outputs, kinds)}
    result: dict[str, list[int]] = {}
    for r in trace:
        if not r.drafts:
            continue
        child = re.match(r"\d+_(.+)$", r.req_id)
        parent = _external_id(child.group(1) if child else r.req_id, kind_of)
        result.setdefault(kind_of[parent], []).append(r.num_output_tokens)
    return result


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_mixed_batch_of_trees_and_bypassing_requests(llm, proposer, prompts, alone,
                                                     engine_runs, sampled, monkeypatch):
    """Tree requests (W = 4, L = 5; teacher-forced when greedy) beside one request of each kind
    that bypasses drafting: penalties, logprobs, a JSON schema, min_tokens (until 16 tokens are
    out), n = 2 (sampled only; vLLM refuses n > 1 greedy). Greedy, every output is vLLM alone's; seeded, every
    bypassing request's output is (min_tokens: its first 16 tokens; n = 2 drafts, so its
    completions are only distributed as vLLM alone's). Logprobs come from the tree verifier's
    logprobs path on the steps that verify trees, and equal vLLM alone's."""
    from vllm_redrafter.patches.runner_tree import tree_verifier

    kinds = mixed_kinds(sampled)
    index, params = mixed_batch(sampled)
    if not sampled:
        proposer.beam_source = TeacherForcedBeams(dict(zip(map(tuple, prompts), alone)), seed=5)
    verifier = tree_verifier(model_runner(llm))
    calls = []
    method = verifier._logprobs
    monkeypatch.setattr(verifier, "_logprobs", lambda *a, **k: calls.append(1) or method(*a, **k))
    before = verifier_counts(llm)
    outputs = generate(llm, [prompts[i] for i in index], params)
    counts = {k: v - before[k] for k, v in verifier_counts(llm).items()}
    run = ALONE_RUNS["mixed_sampled" if sampled else "mixed_greedy"]
    expected = engine_runs["alone"]["completions"][run]
    got = [[list(c.token_ids) for c in o.outputs] for o in outputs]
    drafted = drafted_kinds(proposer.trace, outputs, kinds)
    print(f"\n{'seeded' if sampled else 'greedy'}: steps with drafts per kind "
          f"{ {k: len(v) for k, v in drafted.items()} }; {counts}; verifier logprobs calls "
          f"{len(calls)}")
    for kind, mine, theirs in zip(kinds, got, expected):
        if kind == "min_tokens" and sampled:
            assert mine[0][:16] == theirs[0][:16], kind
        elif kind == "n2":
            assert len(mine) == 2 and all(len(c) == MIXED_MAX_TOKENS for c in mine)
        elif kind != "tree" or not sampled:
            assert mine == theirs, kind
    # the bypassing requests never drafted (min_tokens: only once 16 tokens were out) ...
    assert set(drafted) <= {"tree", "min_tokens", "n2"}, drafted
    assert min(drafted.get("min_tokens", [16])) >= 16
    if sampled:
        assert "n2" in drafted  # n > 1 completions are requests of their own: they draft
    # ... beside trees that branched and left beam 0, in steps whose logprobs the verifier made
    assert counts["num_branching_verifications"] > 0 and counts["num_kv_moves"] > 0
    assert calls
    k = kinds.index("logprobs")
    gap = assert_same_logprobs(logprob_lists(outputs[k].outputs[0]),
                               engine_runs["alone"]["logprobs"][run][k][0])
    print(f"logprobs: {len(got[k][0])} positions, largest gap to vLLM alone {gap:.1e}")


# -- chunked prefill and the prefix cache beside tree steps ----------------------------------------

LONG = [1, 2, 3, 8]  # prompts of 68-126 tokens: over CHUNK, within one 128-block
CHUNK = 64


def chunked_prefill_job(target_dir: Path, drafter_dir: Path, prompts, steps: Path) -> dict:
    engine = {**engine_kwargs(target_dir), "max_num_batched_tokens": CHUNK, "max_num_seqs": 8,
              "enable_prefix_caching": True, "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 4, "beam_policy": "fixed"}}
    return {"engine": engine, "metrics": True, "env": {"VLLM_REDRAFTER_STEP_LOG": str(steps)},
            "runs": [{"prompts": [prompts[i] for i in LONG], "params": GREEDY},
                     {"continue": [0, list(range(len(LONG)))], "params": GREEDY}]}


def test_chunked_prefill_and_prefix_cache_on_generated_text(prompts, alone, engine_runs):
    """An engine whose step budget is 64 tokens: the long prompts are prefilled in chunks, beside
    other requests' tree steps. Then each prompt + its answer is sent again: the prefix cache
    serves the first block, which holds generated text the tree steps wrote (the accepted nodes'
    KV moved in place). Both rounds give vLLM alone's output."""
    assert all(CHUNK < len(prompts[i]) < 128 for i in LONG)
    out = engine_runs["chunked_prefill"]
    steps = out["steps"]
    assert out["outputs"][0] == [alone[i] for i in LONG]
    assert out["outputs"][1] == engine_runs["alone"]["outputs"][ALONE_RUNS["long_continued"]]
    # every second-round request hit the cache past its original prompt: on generated text
    cached = out["num_cached_tokens"][1]
    assert all(c > len(prompts[i]) for c, i in zip(cached, LONG)), cached
    first, second = out["metrics_per_run"]
    hits = second["vllm:prefix_cache_hits"] - first["vllm:prefix_cache_hits"]
    assert hits == sum(cached)
    # chunks beside tree steps: a step that prefilled part of a prompt (nothing emitted) and
    # verified another request's drafts (more than one token emitted)
    lines = [json.loads(line) for line in steps.read_text().splitlines()]
    beside = [line for line in lines if min(line["emitted"]) == 0 and max(line["emitted"]) > 1]
    drafts, draft_tokens, accepted = (second[f"vllm:spec_decode_num_{name}"] for name in (
        "drafts", "draft_tokens", "accepted_tokens"))
    print(f"\nprefix cache hits on round 2: {cached} tokens per request; {len(beside)} of "
          f"{len(lines)} steps prefilled a chunk beside verified drafts; {draft_tokens / drafts:.1f}"
          f" draft nodes per draft, {accepted} accepted")
    assert beside
    assert draft_tokens > 3 * drafts and accepted > 0  # trees (a chain holds L - 1 = 3 nodes)


# -- bf16 --------------------------------------------------------------------------------------------


def bf16_job(target_dir: Path, drafter_dir: Path, prompts) -> dict:
    engine = {**engine_kwargs(target_dir), "dtype": "bfloat16", "disable_log_stats": False,
              "speculative_config": {"method": "redrafter", "model": str(drafter_dir),
                                     "beam_width": 4, "beam_length": 3, "beam_policy": "fixed"}}
    greedy = {**GREEDY, "max_tokens": 16}
    return {"engine": engine, "metrics": True, "runs": [
        {"prompts": prompts[:2], "params": greedy},
        {"prompts": prompts[:2], "params": {**greedy, "logprobs": 0}}]}


def test_bf16_engine_drafts_trees_where_the_cache_layout_is_known(engine_runs):
    """In bf16 vLLM's CPU attention packs the cache for AMX where the CPU has AMX tiles (its
    "amx" layout, not known to the tree kernel): there the engine drafts chains and warns
    (docs/design.md, What is not supported); elsewhere ("vec" layout) it drafts trees. Tiny run:
    2 prompts x 16 tokens, then the same requests with logprobs (no drafts: vLLM's own path)."""
    from vllm_redrafter.cpu_features import cpu_isa

    amx = torch.cpu._is_amx_tile_supported()  # what vLLM's _get_attn_isa asks
    out = engine_runs["bf16"]
    metrics = out["metrics_per_run"][0]
    drafts, draft_tokens = (metrics[f"vllm:spec_decode_num_{name}"] for name in (
        "drafts", "draft_tokens"))
    warned = "drafting chains (beam_width 1)" in out["log"]
    same = out["outputs"][0] == out["outputs"][1]
    print(f"\nbf16 on {cpu_isa()} (AMX tiles: {amx}): {draft_tokens} draft nodes in {drafts} "
          f"drafts, chain-fallback warning: {warned}; greedy output equal to the no-draft run: "
          f"{same}")
    assert drafts > 0
    if amx:
        assert warned and draft_tokens <= 2 * drafts  # chains of L - 1 = 2
    else:
        assert not warned and draft_tokens > 2 * drafts  # trees


# -- context candidates ------------------------------------------------------------------------------


def test_context_candidates_keep_greedy_output_and_are_accepted(llm, proposer, prompts, alone,
                                                               eval_prompts, alone_eval):
    """Up to 2 context candidates per step join the trees of the drafter's W = 1 and W = 4
    beams (L = 4): 20 MT-Bench prompts and 2 of each evaluation set, greedy, output identical
    to vLLM alone; candidates entered trees, and some steps accepted deeper than the drafter's
    beams reached (the proposer's counters, checked against the trace)."""
    batch = prompts + eval_prompts
    expected = alone + alone_eval
    for W in (1, 4):
        proposer.trace = []
        before = candidate_counts(proposer)
        params = {**GREEDY, "extra_args": {**beam_shape(W, 4)["extra_args"], **candidates(2)}}
        outputs = generate(llm, batch, [params] * len(batch))
        got = [list(o.outputs[0].token_ids) for o in outputs]
        assert got == expected, f"W={W}: {sum(g != e for g, e in zip(got, expected))} differ"
        counts = {k: v - before[k] for k, v in candidate_counts(proposer).items()}
        with_candidates = sum(r.candidate_nodes > 0 for r in proposer.trace)
        print(f"\nW={W}: {with_candidates} of {len(proposer.trace)} steps' trees held candidate "
              f"nodes; {counts}")
        assert counts["num_candidate_trees"] > 0 and with_candidates > 0
        assert counts["num_candidate_wins"] >= 10, counts
        assert counts["num_candidate_tokens"] >= counts["num_candidate_wins"]
        assert_drafter_got_the_right_hidden_state(proposer.trace)


def test_candidates_one_token_off_are_not_accepted(llm, proposer, eval_prompts, alone_eval):
    """Negative control: the lookup's continuation taken one token too late (the token after
    the right one first) is almost never accepted; the output is still vLLM alone's."""
    from vllm_redrafter.context_candidates import find_candidates

    def shifted(request, count, length):
        context = [*request.prompt_token_ids, *request.output_token_ids]
        return [c[1:] for c in find_candidates(context, count, length + 1) if len(c) > 1]

    wins = {}
    for name, source in (("right", proposer._lookup), ("shifted", shifted)):
        proposer.candidate_source = source
        before = candidate_counts(proposer)
        params = {**GREEDY, "extra_args": {**beam_shape(1, 4)["extra_args"], **candidates(2)}}
        outputs = generate(llm, eval_prompts, [params] * len(eval_prompts))
        assert [list(o.outputs[0].token_ids) for o in outputs] == alone_eval, name
        wins[name] = proposer.num_candidate_wins - before["num_candidate_wins"]
    print(f"\nsteps a candidate won: {wins}")
    assert wins["right"] >= 10 and wins["shifted"] <= wins["right"] // 4, wins


def test_candidates_alone_without_drafter_beams(llm, proposer, eval_prompts, alone_eval):
    """A policy that drafts no beams (width 0) while the requests keep their candidates: steps
    draft the candidates alone; output identical, candidates accepted."""
    from vllm_redrafter.beam_policy import Choice

    class NoBeams:
        max_length = 4

        def step(self, observation):
            return Choice(0, 0, 0.0, 0.0, "test: no drafter beams")

        def describe(self, n):
            return {}

    proposer.policy = NoBeams()
    before = candidate_counts(proposer)
    params = {**GREEDY, "extra_args": candidates(1)}  # its own count: the policy leaves it
    outputs = generate(llm, eval_prompts, [params] * len(eval_prompts))
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone_eval
    counts = {k: v - before[k] for k, v in candidate_counts(proposer).items()}
    drafted = [r for r in proposer.trace if r.drafts]
    assert drafted and all(r.candidate_nodes == len(r.drafts) for r in drafted)
    assert counts["num_candidate_wins"] >= 5, counts


def test_beam_policy_chooses_context_candidates_per_request(llm, proposer, eval_prompts,
                                                            alone_eval, monkeypatch):
    """The beam policy in the engine with the engine's candidates (2, none of the requests'
    own): it scores them in the shadow and takes them in some steps; output identical."""
    import dataclasses

    from vllm_redrafter.beam_policy import BeamPolicy, PolicyConfig

    monkeypatch.setattr(proposer, "settings",
                        dataclasses.replace(proposer.settings, context_candidates=2))
    proposer.policy = BeamPolicy(2, 4, PolicyConfig(min_gain=1.0))
    taken = []
    step = proposer.policy.step

    def recording(observation):
        choice = step(observation)
        taken.extend(choice.candidates)
        return choice

    proposer.policy.step = recording
    before = candidate_counts(proposer)
    outputs = generate(llm, eval_prompts, [GREEDY] * len(eval_prompts))
    assert [list(o.outputs[0].token_ids) for o in outputs] == alone_eval
    counts = {k: v - before[k] for k, v in candidate_counts(proposer).items()}
    print(f"\npolicy: candidates taken in {sum(map(bool, taken))} of {len(taken)} request-steps; "
          f"{counts}")
    assert sum(map(bool, taken)) > 0 and counts["num_candidate_trees"] > 0, counts


def test_bad_context_candidates_override_fails_that_request_only(llm, prompts):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=r"extra_args\['redrafter_context_candidates'\]"):
        generate(llm, prompts[:1], [{**GREEDY, "extra_args": candidates(-1)}])
    with pytest.raises(VLLMValidationError, match=r"must be 0 with 'rejection' verification"):
        generate(llm, prompts[:1], [{**GREEDY, "extra_args": {
            **candidates(1), "redrafter_verification": "rejection"}}])
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
#
# docs/exactness.md. The prompt makes the target likely to continue " H , I , " (tokens 1-4) and
# unsure of token 5 (" J" about 44% at T = 1). A stand-in beam source drafts, at the first decode
# step of a request whose token 1 is " H", a W = 4, L = 4 tree whose beam 0 is junk the target
# never samples and whose beams 1-2 carry " , I ,". Where tokens 1-4 came out " H , I ," (about
# 2 requests in 3 at T = 1), the walk accepted all three drafts off beam 0 (packed nodes 4, 5, 7),
# their KV was moved, token 5 (the bonus) was drawn at node 7 under the tree mask, and token 6 by
# the next step, which reads the moved KV. On those requests, tokens 5 and 6 are compared with
# vLLM alone's given the same 4 tokens (vLLM alone prompted with them) by a two-sample chi-square
# test whose power against a total-variation bias (ExactSize.tv) is computed and asserted.

# 130 tokens: the first 128 (one KV block) are served by the prefix cache after the first request,
# so a request computes 2 prompt tokens (not 1: vLLM pads a new request with 1 token to compute to
# 1 + num_speculative_tokens with placeholder drafts, which would cost 64 rows here)
EXACT_PROMPT = ", ".join(str(i) for i in range(1, 32)) + ".\n\nA, B, C, D, E, F, G,"
# Tokens 6 and 7 come from the two steps after the tree step, both reading the moved KV; the
# first tree step is a full L = 4 (max_tokens caps beams at the tokens left: 6 after token 1).
# benchmarks/exactness.py runs the full-size version (max_tokens 16, more bins and samples).
EXACT_MAX_TOKENS = 7
COMPARED = slice(4, 6)  # tokens 5 and 6: right after the forced tree step
JUNK = tuple(range(40000, 40008))  # tokens the target does not sample after this prompt
NUM_CONTROL = 100  # requests per negative control (caught with fewer, caught with more)
NUM_BINS = 2  # the most frequent (token 5, token 6) pair of the pooled samples, and the rest
ALPHA, MIN_POWER = 0.01, 0.9
SEED_OFFSET = 1_000_000  # our seeds never equal vLLM alone's (independent samples)
PREFIX = 4  # the compared tokens follow tokens 1-4 = vLLM alone's greedy " H , I ,"
ALONE_ARMS = {"t1": {"temperature": 1.0},  # arm: sampling params
              "t07_p09_k5": {"temperature": 0.7, "top_p": 0.9, "top_k": 5}}
EXACT_ARMS = {"t1": ("t1", (4, 4)), "t07_p09_k5": ("t07_p09_k5", (4, 4)),  # arm: (vLLM alone
              "chain_t1": ("t1", (1, 4)),                                   # arm, (W, L))
              "candidate_t1": ("t1", (1, 4))}  # a junk chain; the path on a context candidate


@dataclass(frozen=True)
class ExactSize:
    """Requests per arm, ours and vLLM alone's, for power >= MIN_POWER against a total-variation
    bias of ``tv`` at the least cost: a request of ours costs several of vLLM alone's (which
    samples 2 tokens given the prefix; ours samples all 7 and only those that came out on the
    prefix count), so vLLM alone draws more (1/n_ours + 1/n_alone fixes the power)."""

    tv: float
    alone: dict[str, int]
    ours: dict[str, int]


# CI's size; ``pytest --exactness-full`` (benchmarks/exactness.py) runs the full one
EXACT_SIZES = {
    "ci": ExactSize(0.1, {"t1": 2400, "t07_p09_k5": 1500},
                    {"t1": 900, "t07_p09_k5": 600, "chain_t1": 900, "candidate_t1": 900}),
    "full": ExactSize(0.05, {"t1": 9000, "t07_p09_k5": 6000},
                      {"t1": 3200, "t07_p09_k5": 2400, "chain_t1": 3200,
                       "candidate_t1": 3200}),
}
SAMPLING_MUTATIONS = ("SKIP_KV_MOVE", "BONUS_AT_DEPTH_ROW", "CAUSAL_TREE_MASK")
SAMPLING_CONTROLS = [("t1", m) for m in SAMPLING_MUTATIONS] + [("candidate_t1", "SKIP_KV_MOVE")]


@pytest.fixture(scope="module")
def exact_size(pytestconfig) -> ExactSize:
    return EXACT_SIZES["full" if pytestconfig.getoption("exactness_full") else "ci"]


@pytest.fixture(scope="module")
def exact_prompt(target_dir) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_dir)(EXACT_PROMPT)["input_ids"]


def alone_samples_job(target_dir: Path, exact_prompt: list[int], exact_size: ExactSize) -> dict:
    """vLLM alone's greedy continuation of the prompt, then per ALONE_ARMS arm seeded samples
    of 2 tokens after the prompt + its first PREFIX tokens."""
    runs = [{"prompts": [exact_prompt],
             "params": {"temperature": 0.0, "max_tokens": EXACT_MAX_TOKENS}}]
    runs += [{"continue": [0, [0] * n, PREFIX],
              "params": [{**p, "seed": i, "max_tokens": COMPARED.stop - PREFIX} for i in range(n)]}
             for p, n in ((ALONE_ARMS[arm], exact_size.alone[arm]) for arm in ALONE_ARMS)]
    engine = {**engine_kwargs(target_dir), "kv_cache_memory_bytes": 2 << 30}  # 256 at a time
    return {"engine": engine, "runs": runs}


@pytest.fixture(scope="module")
def alone_samples(engine_runs) -> dict[str, list[list[int]]]:
    """vLLM alone (plugin not loaded): its greedy continuation ("path") and, per ALONE_ARMS arm,
    seeded samples of tokens 5 and 6 given tokens 1-4 = path[:4] (the prompt + path[:4] sampled
    for 2 tokens), returned as 6-token outputs path[:4] + the 2."""
    out = engine_runs["alone_samples"]
    path = out["outputs"][0][0]
    return {"path": path, **{arm: [path[:PREFIX] + o for o in outputs]
                             for arm, outputs in zip(ALONE_ARMS, out["outputs"][1:])}}


class ForcedPathBeams:
    """The stand-in beam source of this section: a fixed tree around the target's likely path.

    ``path`` is vLLM alone's greedy continuation p1, p2, ... of the prompt. The proposer calls it
    only at a request's first decode step after token 1 = p1 (:func:`draft_first_step_only`),
    with g0 = p1. W = 4: beam 0 = junk, beam 1 = p2 p3 junk, beam 2 = p2 p3 p4, beam 3 = beam 0's
    first two junk nodes then another: 9 packed nodes, the target's path at packed 4, 5, 7 (not
    beam 0's 1, 2, 3). W = 1: the chain p2 p3 p4, or with ``junk_chain`` three junk tokens (the
    path then comes from a context candidate: :func:`forced_candidate`). With ``q`` set, the
    beams also carry a draft distribution putting 1/2 on each drafted token: what the p/q
    rejection mode reads.
    """

    def __init__(self, path: list[int], q: bool = False, junk_chain: bool = False):
        self.path, self.q, self.junk_chain = path, q, junk_chain

    def __call__(self, h, g0, beam_width, beam_length, requests):
        from vllm_redrafter.beam_search import BeamSearchOutput

        W = int(beam_width.max()) if torch.is_tensor(beam_width) else int(beam_width)
        L = int(beam_length.max()) if torch.is_tensor(beam_length) else int(beam_length)
        p, j = self.path, JUNK
        rows = ([[p[0], j[0], j[1], j[2]] if self.junk_chain else [p[0], p[1], p[2], p[3]]]
                if W == 1 else
                [[p[0], j[0], j[1], j[2]], [p[0], p[1], p[2], j[3]], [p[0], p[1], p[2], p[3]],
                 [p[0], j[0], j[1], j[4]]])
        assert bool((g0 == p[0]).all()) and W == len(rows) and L <= 4, (g0, W, L)
        beams = torch.tensor(rows)[None, :, :L].expand(len(requests), W, L).contiguous()
        log_probs = None
        if self.q:
            log_probs = torch.full((len(requests), W, L - 1, VOCAB), math.log(0.5 / (VOCAB - 1)))
            log_probs.scatter_(-1, beams[:, :, 1:, None], math.log(0.5))
        return BeamSearchOutput(beams=beams.to(g0.device), scores=torch.zeros(len(requests), W),
                                log_probs=log_probs)


def draft_first_step_only(proposer, path: list[int], monkeypatch, q: bool = False,
                          junk_chain: bool = False) -> None:
    """Drafts only at a request's first decode step, and only after token 1 = path[0]."""
    shapes = proposer._shapes

    def first_step(requests, *args, **kwargs):
        chosen = shapes(requests, *args, **kwargs)
        return [s if list(r.output_token_ids) == path[:1] else None
                for s, r in zip(chosen, requests)]

    monkeypatch.setattr(proposer, "_shapes", first_step)
    proposer.beam_source = ForcedPathBeams(path, q, junk_chain)


def forced_candidate(proposer, path: list[int]) -> None:
    """The context candidate source finds p2 p3 p4 after token 1 = path[0], nothing else: beside
    the junk chain its nodes are packed 4, 5, 6, so taking the path moves their KV."""

    def source(request, count: int, length: int) -> list[tuple[int, ...]]:
        found = list(request.output_token_ids) == path[:1] and count > 0
        return [tuple(path[1:1 + min(3, length)])] if found else []

    proposer.candidate_source = source


def forced_tree_samples(llm, proposer, prompt, path, arm, n, monkeypatch, verification="exact"):
    """Our n seeded samples of ``arm`` and the verifier's counters over them."""
    alone_arm, (W, L) = EXACT_ARMS[arm]
    with_candidate = arm.startswith("candidate")
    draft_first_step_only(proposer, path, monkeypatch, q=verification == "rejection",
                          junk_chain=with_candidate)
    if with_candidate:
        forced_candidate(proposer, path)
    proposer.trace = None  # (its LM head per request and step would cost more than the test)
    shape = {"extra_args": {**beam_shape(W, L)["extra_args"], **candidates(int(with_candidate)),
                            "redrafter_verification": verification}}
    params = [{**ALONE_ARMS[alone_arm], "seed": SEED_OFFSET + i, "max_tokens": EXACT_MAX_TOKENS,
               **shape} for i in range(n)]
    before = {**verifier_counts(llm), **candidate_counts(proposer)}
    start = time.monotonic()
    outputs = generate(llm, [prompt] * n, params)
    seconds = time.monotonic() - start
    after = {**verifier_counts(llm), **candidate_counts(proposer)}
    counts = {k: v - before[k] for k, v in after.items()}
    return [list(o.outputs[0].token_ids) for o in outputs], counts, seconds


def on_prefix(outputs, path):
    """The outputs whose tokens 1-4 are path[:4]: after a full, off-beam-0 forced tree step."""
    return [o for o in outputs if o[:PREFIX] == path[:PREFIX]]


def compared_counts(ours, alone, bins=None):
    """(bins, counts ours [K], counts alone [K]) of the compared tokens, binned: the NUM_BINS - 1
    pairs most frequent in both samples together, then the rest."""
    import numpy as np

    a = Counter(tuple(o[COMPARED]) for o in ours)  # (shorter where EOS came first)
    b = Counter(tuple(o[COMPARED]) for o in alone)
    if bins is None:
        bins = [key for key, _ in (a + b).most_common(NUM_BINS - 1)]

    def binned(c):
        counts = [c[key] for key in bins]
        return np.array([*counts, sum(c.values()) - sum(counts)])

    return bins, binned(a), binned(b)


def chi_square_p(a, b):
    """p-values of the two-sample chi-square test (homogeneity, no continuity correction) for
    count rows a, b [..., K] (batched: the power simulation runs it on thousands of tables)."""
    import numpy as np
    from scipy.stats import chi2

    a, b = np.atleast_2d(a).astype(float), np.atleast_2d(b).astype(float)
    n_a, n_b = a.sum(-1, keepdims=True), b.sum(-1, keepdims=True)
    total = a + b
    used = total > 0  # an empty bin adds nothing and no degree of freedom
    e_a, e_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
    with np.errstate(invalid="ignore", divide="ignore"):
        stat = np.where(used, (a - e_a) ** 2 / e_a + (b - e_b) ** 2 / e_b, 0.0).sum(-1)
    return chi2.sf(stat, used.sum(-1) - 1)


def least_favourable(p, tv: float):
    """The distribution q at total-variation distance ``tv`` from p [K] that the chi-square test
    finds hardest to tell apart: q - p = +tv p / m on a set of bins of mass m, -tv p / (1 - m) on
    the rest, m as close to 1/2 as the bins allow. Any d = q - p with sum |d| / 2 = tv has
    sum d^2 / p >= tv^2 (1/m + 1/(1 - m)) (Cauchy-Schwarz on each side), which this q attains,
    and the test's power grows with sum d^2 / p (its noncentrality)."""
    import numpy as np

    p = np.asarray(p, dtype=float)
    best = None
    for mask in range(1, 2 ** len(p) - 1):
        up = np.array([(mask >> i) & 1 for i in range(len(p))], dtype=bool)
        m = p[up].sum()
        if tv < m < 1 - tv:
            distance = tv ** 2 * (1 / m + 1 / (1 - m))
            if best is None or distance < best[0]:
                best = (distance, np.where(up, p * (1 + tv / m), p * (1 - tv / (1 - m))))
    assert best is not None, p
    return best[1]


def sampling_power(p, n_ours: int, n_alone: int, tv: float, alpha: float = ALPHA,
                   simulations: int = 4000) -> tuple[float, float]:
    """Power of :func:`chi_square_p` at level alpha against the least favourable bias of total
    variation ``tv`` from p (vLLM alone's binned distribution): (simulated, from the noncentral
    chi-square approximation)."""
    import numpy as np
    from scipy.stats import chi2, ncx2

    p = np.asarray(p, dtype=float) / np.sum(p)
    q = least_favourable(p, tv)
    rng = np.random.default_rng(0)
    simulated = float((chi_square_p(rng.multinomial(n_ours, q, simulations),
                                    rng.multinomial(n_alone, p, simulations)) < alpha).mean())
    pooled = (n_ours * q + n_alone * p) / (n_ours + n_alone)
    noncentrality = n_ours * n_alone / (n_ours + n_alone) * ((q - p) ** 2 / pooled).sum()
    df = len(p) - 1
    return simulated, float(ncx2.sf(chi2.isf(alpha, df), df, noncentrality))


def test_sampling_power_computation():
    """The power computation on known cases: no bias is rejected at the level alpha; the
    least favourable bias is at distance tv; the two estimates agree."""
    import numpy as np

    p = np.array([0.4, 0.3, 0.2, 0.1])
    q = least_favourable(p, 0.05)
    assert abs(np.abs(q - p).sum() / 2 - 0.05) < 1e-12 and abs(q.sum() - 1) < 1e-12
    simulated, approximated = sampling_power(p, 2000, 6000, 0.05)
    assert abs(simulated - approximated) < 0.03, (simulated, approximated)
    rng = np.random.default_rng(1)
    size = chi_square_p(rng.multinomial(2000, p, 4000), rng.multinomial(6000, p, 4000))
    assert abs((size < ALPHA).mean() - ALPHA) < 0.006


def test_prompt_leaves_room_for_bias(alone_samples):
    """Token 5 is uncertain after " H , I ," (a bias has room)."""
    samples = alone_samples["t1"]
    fifth = Counter(tuple(o[4:5]) for o in samples)
    assert max(fifth.values()) / len(samples) <= 0.6, fifth.most_common(3)


@pytest.mark.parametrize("arm", list(EXACT_ARMS))
def test_tree_sampling_matches_vllm_alone(llm, proposer, exact_prompt, alone_samples, arm,
                                          exact_size, monkeypatch):
    """Tokens 5 and 6 after a tree step that left beam 0 (W = 4; the chain arm: a W = 1 chain;
    the candidate arm: a junk W = 1 chain beside a context candidate carrying the path)
    distributed as vLLM alone samples them; the test has power >= MIN_POWER against any bias of
    total variation exact_size.tv of the binned pair."""
    (alone_arm, (W, _)), n = EXACT_ARMS[arm], exact_size.ours[arm]
    path, alone = alone_samples["path"], alone_samples[alone_arm]
    outputs, counts, seconds = forced_tree_samples(llm, proposer, exact_prompt, path, arm, n,
                                                   monkeypatch)
    ours = on_prefix(outputs, path)
    bins, a, b = compared_counts(ours, alone)
    p_value = float(chi_square_p(a, b)[0])
    power, approximated = sampling_power(b, len(ours), len(alone), exact_size.tv)
    print(f"\n{arm}: p = {p_value:.3f}, power {power:.3f} (noncentral chi-square {approximated:.3f})"
          f" against TV {exact_size.tv}; {len(ours)} of {n} requests on the prefix, "
          f"{counts['num_tree_verifications']} tree steps, {counts['num_kv_moves']} left beam 0; "
          f"ours {a.tolist()} alone {b.tolist()} over bins {bins} + rest; {seconds:.0f} s")
    assert len(ours) >= n // 2 and counts["num_tree_verifications"] >= len(ours)
    if W > 1:  # every compared pair came after a tree step that left beam 0
        assert counts["num_branching_verifications"] == counts["num_tree_verifications"]
        assert counts["num_kv_moves"] >= len(ours)
    if arm.startswith("candidate"):  # every compared pair came off the candidate's nodes
        assert counts["num_candidate_trees"] >= counts["num_tree_verifications"]
        assert counts["num_candidate_wins"] >= len(ours) and counts["num_kv_moves"] >= len(ours)
    assert power >= MIN_POWER
    assert p_value > ALPHA


@pytest.mark.parametrize("arm, mutation", SAMPLING_CONTROLS)
def test_sampling_test_catches_each_mutation(llm, proposer, exact_prompt, alone_samples, arm,
                                             mutation, monkeypatch):
    """Negative controls: the same test, on NUM_CONTROL requests of the T = 1 arm, rejects the
    tree step with its KV move skipped, its bonus drawn at the wrong node, or a causal mask;
    on the candidate arm, the candidate's accepted nodes with their KV not moved."""
    from vllm_redrafter.vllm_plugin import mutations

    monkeypatch.setattr(mutations, mutation, True)
    outputs, counts, seconds = forced_tree_samples(llm, proposer, exact_prompt,
                                                   alone_samples["path"], arm, NUM_CONTROL,
                                                   monkeypatch)
    p_value = report_against_vllm_alone(f"{arm} {mutation}", outputs, counts, alone_samples,
                                        seconds)
    assert counts["num_kv_moves"] >= NUM_CONTROL // 2
    assert p_value < ALPHA


def test_pq_rejection_mode_runs_in_the_engine(llm, proposer, exact_prompt, alone_samples,
                                              monkeypatch):
    """Apple's p/q rejection (opt-in, inexact) on the same trees: requests complete, the walks
    leave beam 0. Its bias on the compared pair is small here (about 0.04 in the pair's
    frequency, docs/exactness.md): printed, not asserted at this size."""
    outputs, counts, seconds = forced_tree_samples(llm, proposer, exact_prompt,
                                                   alone_samples["path"], "t1", NUM_CONTROL,
                                                   monkeypatch, verification="rejection")
    report_against_vllm_alone("p/q rejection", outputs, counts, alone_samples, seconds)
    assert len(outputs) == NUM_CONTROL and all(outputs)
    assert counts["num_kv_moves"] >= NUM_CONTROL // 2


def report_against_vllm_alone(name, outputs, counts, alone_samples, seconds) -> float:
    ours = on_prefix(outputs, alone_samples["path"])
    bins, a, b = compared_counts(ours, alone_samples["t1"])
    p_value = float(chi_square_p(a, b)[0])
    print(f"\n{name}: p = {p_value:.2e}; {len(ours)} of {len(outputs)} requests on the prefix; "
          f"ours {a.tolist()} alone {b.tolist()} over bins {bins} + rest; walk left beam 0 in "
          f"{counts['num_kv_moves']} requests; {seconds:.0f} s")
    return p_value


# -- last: it empties vLLM's metric registry, as a second engine in this process would --------------


def test_spec_counters_read_this_engine_after_another_engine_started(llm, prompts):
    """demo.spec_counters reads the engine's own counters: a later engine's stat logger empties
    the process's registry of this one's collectors (simulated with vLLM's own call), and the
    counts still grow as this engine drafts, as the proposer counts its trees."""
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from vllm_redrafter.demo import counter_diff, spec_counters

    unregister_vllm_metrics()
    assert not [m for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode")]
    before = spec_counters(llm)
    generate(llm, prompts[:2], [{**GREEDY, "max_tokens": 16}] * 2)
    grown = counter_diff(spec_counters(llm), before)
    assert grown["vllm:spec_decode_num_drafts"] > 0
    assert 0 < grown["vllm:spec_decode_num_accepted_tokens"] <= 2 * 16
    assert sum(grown["vllm:spec_decode_num_accepted_tokens_per_pos"]) == \
        grown["vllm:spec_decode_num_accepted_tokens"]
