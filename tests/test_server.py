"""``vllm-redrafter serve`` as a user starts it, over HTTP, under load (CPU, the embedded target).

One server start for the whole module (``server``): the tests run against it in file order and the
last one stops it under load. vLLM alone's greedy output, the reference, comes from one offline run
of ``tests/_vllm_generate.py`` in a subprocess with the plugin not loaded (``VLLM_PLUGINS=""``),
started beside the server so that the two starts overlap. Requests send token ids to
``/v1/completions`` (``return_token_ids``), so the server and the offline run see the same prompt
and the outputs compare token for token.

- greedy output, streamed and not, equals vLLM alone's, for several beam shapes; bad ``vllm_xargs``
  sent while those 32 requests are in flight get a 400 (a streamed one: the 400 error event vLLM
  sends for any validation error of a streamed request) and the 32 complete;
- 64 concurrent streams, half of them dropped by their client mid-stream: every other one
  completes (greedy ones as vLLM alone), the server keeps serving, the dropped requests stop
  generating, and the KV cache's usage returns to its idle value (``/metrics``);
- prompts within L tokens of ``max_model_len``: every request ends at ``max_model_len`` with vLLM
  alone's tokens, drafts or not;
- shutdown under load (SIGINT, ``--shutdown-timeout``: vLLM drains in-flight requests): every
  in-flight stream completes, the server exits 0, and the log holds no traceback but the ones
  the bad requests caused and vLLM's own output-handler ``EngineDeadError``, which vLLM alone logs
  under the same shutdown (``benchmarks/soak.py`` records both servers' shutdown logs).

With vLLM's default ``--shutdown-timeout 0`` vLLM kills its engine at once: in-flight streams then
end with an EngineDeadError event or get nothing more until their clients give up, a race in vLLM
seen both ways with and without ReDrafter (benchmarks/soak.py, ``--shutdown-cycles abort``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from _vllm_generate import finish_job, start_job, stop_job
from conftest import chat_prompts
from vllm_redrafter.demo import metric_totals

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 1024
SPEC = {"beam_width": 2, "beam_length": 3, "num_speculative_tokens": 8}  # + method, model
SHUTDOWN_TIMEOUT = 60  # s vLLM drains in-flight requests for at shutdown
NUM_PROMPTS, MAX_TOKENS = 16, 32  # the greedy identity checks
NEAR_LIMIT = (1, 2, 3, 4, 5, 6)  # prompts of MAX_MODEL_LEN - k tokens
SHAPES = [None, (1, 2), (1, 5), (2, 5), (4, 3), (3, 4)]  # vllm_xargs beam shapes (None: server's)
BAD_XARGS = [  # (vllm_xargs, the key the 400 names)
    ({"redrafter_beam_width": 0}, "redrafter_beam_width"),
    ({"redrafter_beam_width": "two"}, "redrafter_beam_width"),
    ({"redrafter_beam_width": 1.5}, "redrafter_beam_width"),
    ({"redrafter_beam_length": 1}, "redrafter_beam_length"),
    ({"redrafter_beam_length": 99}, "redrafter_beam_length"),  # > num_speculative_tokens + 1
    ({"redrafter_verification": "nope"}, "redrafter_verification"),
]
TIMEOUT = 120  # s, any one HTTP request


# -- the server and vLLM alone -------------------------------------------------------------------


@dataclass
class Server:
    process: subprocess.Popen
    base: str
    model: str
    log_path: Path
    stream_errors_sent: int = 0  # streamed requests that vLLM answers with a logged traceback
    idle: dict[str, float] = field(default_factory=dict)  # /metrics gauges once warmed up

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def prompts(target_dir, mt_bench_questions) -> list[list[int]]:
    """The first NUM_PROMPTS MT-Bench first turns in the target's chat template, as token ids."""
    return chat_prompts(target_dir, mt_bench_questions[:NUM_PROMPTS])


@pytest.fixture(scope="module")
def long_prompts(target_dir, mt_bench_questions) -> dict[int, list[int]]:
    """k -> a prompt of MAX_MODEL_LEN - k tokens (MT-Bench questions run together)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(target_dir)("\n\n".join(mt_bench_questions))["input_ids"]
    assert len(ids) >= MAX_MODEL_LEN
    return {k: list(ids[: MAX_MODEL_LEN - k]) for k in NEAR_LIMIT}


@pytest.fixture(scope="module")
def alone_job(target_dir, prompts, long_prompts, tmp_path_factory):
    """vLLM alone's offline run, started now (it overlaps the server's start); see ``alone``."""
    work = tmp_path_factory.mktemp("vllm_alone")
    job = {
        "engine": dict(model=str(target_dir), dtype="float32", enforce_eager=True,
                       max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=512 << 20, seed=0),
        "runs": [
            {"prompts": prompts, "params": {"temperature": 0.0, "max_tokens": MAX_TOKENS}},
            {"prompts": list(long_prompts.values()),
             "params": [{"temperature": 0.0, "max_tokens": k, "ignore_eos": True}
                        for k in long_prompts]},
        ],
    }
    run = start_job(job, work, {"VLLM_PLUGINS": ""}, new_session=True)
    yield run, work
    stop_job(run)


@pytest.fixture(scope="module")
def alone(alone_job, server) -> dict[str, list[list[int]]]:
    """vLLM alone, greedy: "prompts" (MAX_TOKENS each), "long" (k tokens for the k-th prompt)."""
    out = finish_job(*alone_job, timeout=900)
    assert out["plugin_patched"] is False  # VLLM_PLUGINS="" kept the plugin out
    return {"prompts": out["outputs"][0], "long": out["outputs"][1]}


@pytest.fixture(scope="module")
def server(target_dir, drafter_dir, alone_job, tmp_path_factory) -> Server:
    """``vllm-redrafter serve`` as a user types it; SIGINT (then SIGKILL) at the end if still up."""
    port = _free_port()
    spec = json.dumps({"method": "redrafter", "model": str(drafter_dir), **SPEC})
    command = ["vllm-redrafter", "serve", str(target_dir), "--speculative-config", spec,
               "--dtype", "float32", "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
               "--kv-cache-memory-bytes", str(1 << 30), "--shutdown-timeout",
               str(SHUTDOWN_TIMEOUT), "--port", str(port)]
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_PLUGINS")}
    with log_path.open("w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    server = Server(process, f"http://127.0.0.1:{port}", str(target_dir), log_path)
    try:
        _wait_healthy(server)
        _post(f"{server.base}/v1/completions", {"model": server.model, "prompt": [1, 2, 3],
                                                "max_tokens": 2})  # the gauges exist from here
        server.idle = _wait_idle(server)
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


# -- HTTP ----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> bytes:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as response:
        return response.read()


def _wait_healthy(server: Server, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"the server exited with {server.process.returncode}:\n"
                        f"{server.log()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{server.base}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the server did not become healthy within {timeout} s")


def _metrics(server: Server) -> dict[str, float]:
    """The /metrics samples we read, summed over labels; request_success_total per reason."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.base}/metrics", timeout=30) as response:
        text = response.read().decode()
    wanted = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
              "vllm:num_requests_waiting", "vllm:generation_tokens_total",
              "vllm:e2e_request_latency_seconds_count", "vllm:spec_decode_num_drafts_total",
              "vllm:spec_decode_num_draft_tokens_total")
    values = metric_totals(text, wanted)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:request_success_total":
                key = f"{sample.name}/{sample.labels['finished_reason']}"
                values[key] = values.get(key, 0.0) + sample.value
    return values


def _wait_idle(server: Server, timeout: float = 30) -> dict[str, float]:
    """/metrics once no request runs or waits (the gauges update at each engine step)."""
    deadline = time.monotonic() + timeout
    while True:
        values = _metrics(server)
        if values["vllm:num_requests_running"] == values["vllm:num_requests_waiting"] == 0:
            return values
        if time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def _client():
    import httpx

    return httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=256))


async def _complete(client, server: Server, body: dict, endpoint: str = "completions") -> dict:
    """A non-streamed request: status, json, the time it was answered."""
    response = await client.post(f"{server.base}/v1/{endpoint}", json=body)
    return {"status": response.status_code, "json": response.json(), "t": time.monotonic()}


async def _stream(client, server: Server, body: dict, drop_after: int | None = None,
                  endpoint: str = "completions") -> dict:
    """A streamed request; with ``drop_after`` the client closes the connection after that many
    chunks (0: as soon as the response starts). Token ids, finish reason, error events, [DONE]."""
    out = {"tokens": [], "chunks": 0, "finish": None, "errors": [], "done": False,
           "dropped": False}
    async with client.stream("POST", f"{server.base}/v1/{endpoint}",
                             json={**body, "stream": True}) as response:
        out["status"] = response.status_code
        if drop_after == 0:
            out["dropped"] = True
            return out
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            choice = event["choices"][0]
            out["tokens"] += choice.get("token_ids") or []
            out["finish"] = choice.get("finish_reason") or out["finish"]
            out["chunks"] += 1
            if drop_after is not None and out["chunks"] >= drop_after:
                out["dropped"] = True  # leaving the block closes the unread response
                break
    out["t"] = time.monotonic()
    return out


def _xargs(shape) -> dict:
    if shape is None:
        return {}
    return {"vllm_xargs": {"redrafter_beam_width": shape[0], "redrafter_beam_length": shape[1]}}


def _greedy(server: Server, prompt: list[int], max_tokens: int, shape=None, **extra) -> dict:
    return {"model": server.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **_xargs(shape), **extra}


# -- the log -------------------------------------------------------------------------------------

_TAGGED = re.compile(r"^\((\w+) pid=(\d+)\) (\w+) [\d\- :]+ \[([\w.]+:\d+)\] ?(.*)$")


def traceback_blocks(log: str) -> list[dict]:
    """Every logged traceback as {"tag", "header", "last", "line"}: vLLM logs one exception as a
    run of lines with the same process and ``[file:line]`` tag; an untagged traceback (uvicorn's)
    has tag None."""
    lines = log.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if "Traceback (most recent call last)" not in lines[i]:
            i += 1
            continue
        match = _TAGGED.match(lines[i])
        if match is None:
            blocks.append({"tag": None, "header": lines[i - 1] if i else "", "last": lines[i],
                           "line": i})
            i += 1
            continue
        key = match.group(1, 2, 4)
        start = i
        while start > 0 and (m := _TAGGED.match(lines[start - 1])) and m.group(1, 2, 4) == key:
            start -= 1
        end = i
        while end + 1 < len(lines) and (m := _TAGGED.match(lines[end + 1])) and \
                m.group(1, 2, 4) == key:
            end += 1
        blocks.append({"tag": key[2], "header": _TAGGED.match(lines[start]).group(5),
                       "last": _TAGGED.match(lines[end]).group(5), "line": start})
        i = end + 1
    return blocks


def is_bad_xargs_stream_error(block: dict) -> bool:
    """vLLM's log of a streamed request refused by validation: ours, naming the extra_args key."""
    return (block["header"].endswith("stream generator.")
            and "VLLMValidationError: extra_args['redrafter_" in block["last"])


def is_output_handler_engine_dead(block: dict) -> bool:
    """vLLM 0.32's own shutdown race: its output handler sees the engine core gone first."""
    return ((block["tag"] or "").startswith("async_llm.py:")
            and block["header"] == "AsyncLLM output_handler failed."
            and "EngineDeadError" in block["last"])


# -- the tests, in order: the last one stops the server --------------------------------------------


def test_server_answers_chat_and_streaming_and_reports_metrics(server):
    before = _metrics(server)
    chat = json.loads(_post(f"{server.base}/v1/chat/completions", {
        "model": server.model, "messages": [{"role": "user", "content": "Name three colors."}],
        "max_tokens": 16, "temperature": 0,
        "vllm_xargs": {"redrafter_beam_width": 1, "redrafter_beam_length": 3},
    }))
    assert chat["choices"][0]["message"]["content"]
    stream = _post(f"{server.base}/v1/completions", {
        "model": server.model, "prompt": "The capital of France is", "max_tokens": 16,
        "temperature": 0, "stream": True,
    }).decode()
    chunks = [line[6:] for line in stream.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]" and len(chunks) > 2
    text = "".join(json.loads(c)["choices"][0]["text"] for c in chunks[:-1])
    assert text.strip()
    after = _metrics(server)
    drafts, draft_tokens = (after[name] - before[name] for name in (
        "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total"))
    # W=2, L=3 reached the worker process: trees of at most 2 x 2 draft nodes per step
    assert 0 < drafts < draft_tokens <= 4 * drafts


def test_greedy_over_http_equals_vllm_alone_and_bad_xargs_get_400_meanwhile(server, prompts,
                                                                           alone):
    """32 greedy requests (16 prompts, streamed and not, several beam shapes) in flight; the bad
    vllm_xargs, sent meanwhile on both endpoints, each get a 400 naming their key; the 32 then
    complete with vLLM alone's tokens."""

    async def run():
        async with _client() as client:
            good = [asyncio.create_task(
                        _stream(client, server, _greedy(server, p, MAX_TOKENS, SHAPES[i % 6]))
                        if stream else
                        _complete(client, server, _greedy(server, p, MAX_TOKENS, SHAPES[i % 6])))
                    for stream in (False, True) for i, p in enumerate(prompts)]
            await _until_running(server, len(good), good)
            kinds, jobs = [], []
            for xargs, key in BAD_XARGS:  # all at once, on both endpoints, streamed and not
                body = {**_greedy(server, prompts[0], 8), "vllm_xargs": xargs}
                chat = {"model": server.model, "max_tokens": 8, "vllm_xargs": xargs,
                        "messages": [{"role": "user", "content": "Hi"}]}
                kinds += [(key, "completion"), (key, "stream"), (key, "chat"),
                          (key, "chat stream")]
                jobs += [_complete(client, server, body), _stream(client, server, body),
                         _complete(client, server, chat, endpoint="chat/completions"),
                         _stream(client, server, chat, endpoint="chat/completions")]
            results = await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)
            answered_bad = time.monotonic()
            bad = [(key, kind, result) for (key, kind), result in zip(kinds, results, strict=True)]
            return await asyncio.wait_for(asyncio.gather(*good), TIMEOUT * 2), bad, answered_bad

    good, bad, answered_bad = asyncio.run(run())
    server.stream_errors_sent += sum(kind.endswith("stream") for _, kind, _ in bad)
    for key, kind, result in bad:
        if kind.endswith("stream"):  # vLLM validates a streamed request once its response began
            assert result["status"] == 200 and result["done"], (kind, result)
            assert not result["tokens"], (kind, result)
            [error] = result["errors"]
        else:
            assert result["status"] == 400, (kind, result)
            error = result["json"]["error"]
        assert error["code"] == 400 and error["param"] == key, (kind, error)
        assert f"extra_args['{key}']" in error["message"], (kind, error)
    tokens = [r["json"]["choices"][0]["token_ids"] for r in good[:NUM_PROMPTS]]
    tokens += [r["tokens"] for r in good[NUM_PROMPTS:]]
    assert tokens[:NUM_PROMPTS] == alone["prompts"]  # not streamed
    assert tokens[NUM_PROMPTS:] == alone["prompts"]  # streamed
    assert all(r["done"] and not r["errors"] for r in good[NUM_PROMPTS:])
    # the bad requests were answered while the 32 ran (most of them, on a fast machine)
    assert sum(r["t"] > answered_bad for r in good) >= len(good) // 2


async def _until_running(server: Server, n: int, tasks, timeout: float = 60) -> None:
    """Until the server holds ``n`` requests (running or waiting) or a task ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(t.done() for t in tasks):
        values = await asyncio.to_thread(_metrics, server)
        if values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"] >= n:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"the server never held the {n} requests in flight")


def test_clients_dropping_streams_lose_nothing_else_and_free_their_kv_blocks(server, prompts,
                                                                             alone):
    """64 concurrent streams; 32 clients close theirs (as the response starts, or after 1, 2 or 4
    chunks, of up to 256 tokens); the other 32 (16 greedy, 16 sampled) complete, then a new
    request is served, the dropped requests stopped generating, and KV usage is back to idle.
    (Trees of the server's shape, or chains: 64 requests' trees make long steps on 2 cores.)"""
    idle = server.idle
    before = _metrics(server)
    shapes = [None, None, None, (1, 3)]
    kept = [_greedy(server, p, MAX_TOKENS, shapes[i % 4]) for i, p in enumerate(prompts)]
    kept += [{"model": server.model, "prompt": p, "max_tokens": 16, "temperature": 0.8,
              "top_p": 0.95, "seed": i, "return_token_ids": True, **_xargs(shapes[i % 4])}
             for i, p in enumerate(prompts)]
    dropped = [{**_greedy(server, p, 256, shapes[(i + 1) % 4], ignore_eos=True),
                "temperature": 0.0 if i % 2 else 1.0}
               for i, p in enumerate(prompts + prompts)]
    drop_after = [(0, 1, 2, 4)[i % 4] for i in range(len(dropped))]

    async def run():
        async with _client() as client:
            jobs = [_stream(client, server, body) for body in kept]
            jobs += [_stream(client, server, body, n)
                     for body, n in zip(dropped, drop_after, strict=True)]
            order = list(range(len(jobs)))
            order = order[::2] + order[1::2]  # kept and dropped interleaved on arrival
            tasks = [None] * len(jobs)
            for i in order:
                tasks[i] = asyncio.create_task(jobs[i])
            return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT * 2)

    results = asyncio.run(run())
    kept_results, dropped_results = results[: len(kept)], results[len(kept):]
    assert all(r["dropped"] for r in dropped_results), [r for r in dropped_results
                                                        if not r["dropped"]]
    assert all(r["done"] and not r["errors"] and r["finish"] in ("stop", "length")
               for r in kept_results), kept_results
    assert [r["tokens"] for r in kept_results[:NUM_PROMPTS]] == alone["prompts"]
    assert all(1 <= len(r["tokens"]) <= 16 for r in kept_results[NUM_PROMPTS:])
    # the server keeps serving (a request after the drops, as vLLM alone)
    probe = json.loads(_post(f"{server.base}/v1/completions", _greedy(server, prompts[0],
                                                                      MAX_TOKENS)))
    probe_tokens = probe["choices"][0]["token_ids"]
    assert probe_tokens == alone["prompts"][0]
    after = _wait_idle(server)
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == idle["vllm:kv_cache_usage_perc"], (idle, after)
    # the dropped requests never finished in the engine, and stopped early: they generated a
    # few tokens each (the chunks their clients read, what was in flight), not 256
    finished = (after["vllm:e2e_request_latency_seconds_count"]
                - before["vllm:e2e_request_latency_seconds_count"])
    assert finished == len(kept) + 1
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    kept_tokens = sum(len(r["tokens"]) for r in kept_results) + len(probe_tokens)
    assert generated - kept_tokens < 32 * len(dropped), (generated, kept_tokens)


def test_prompt_near_max_model_len_never_lets_the_draft_overrun_it(server, long_prompts, alone):
    """Prompts of MAX_MODEL_LEN - k tokens (k = 1..6, within L of the end for L = 3 and the
    requests' L = 5), streamed and not, max_tokens unset (the server allows k) or past the end
    (the server lowers it to k): each ends at MAX_MODEL_LEN exactly, with vLLM alone's tokens,
    and the server drafted meanwhile."""
    before = _metrics(server)

    async def run():
        async with _client() as client:
            jobs = []
            for i, prompt in enumerate(long_prompts.values()):
                for shape in (None, (2, 5)):
                    body = _greedy(server, prompt, [None, 64][i % 2], shape, ignore_eos=True)
                    jobs.append(_stream(client, server, body) if (i + (shape is None)) % 2
                                else _complete(client, server, body))
            return await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT * 2)

    results = asyncio.run(run())
    expected = [tokens for tokens in alone["long"] for _ in range(2)]
    ks = [k for k in long_prompts for _ in range(2)]
    for k_prompt, result, reference in zip(ks, results, expected, strict=True):
        if "json" in result:
            assert result["status"] == 200, result
            choice = result["json"]["choices"][0]
            tokens, finish = choice["token_ids"], choice["finish_reason"]
        else:
            assert result["done"] and not result["errors"], result
            tokens, finish = result["tokens"], result["finish"]
        assert finish == "length" and len(tokens) == k_prompt, (k_prompt, finish, len(tokens))
        assert tokens == reference, k_prompt
    after = _wait_idle(server)
    assert after["vllm:spec_decode_num_drafts_total"] > before["vllm:spec_decode_num_drafts_total"]
    assert after["vllm:kv_cache_usage_perc"] == server.idle["vllm:kv_cache_usage_perc"]


def test_shutdown_under_load_is_clean(server, prompts):
    """SIGINT to the server process alone (as ``kill -INT`` or a service manager would: a signal
    to the whole group also hits the engine core directly) while 16 streams run: vLLM drains them
    (``--shutdown-timeout``), every one completes, the server exits 0, and the log holds no
    traceback but those of the bad requests and vLLM's own shutdown race."""
    log_at_signal: list[int] = []
    # long enough that none ends before all 16 are in (32 tokens did on a fast CI machine)
    max_tokens = 4 * MAX_TOKENS

    async def run():
        async with _client() as client:
            tasks = [asyncio.create_task(_stream(client, server, {
                "model": server.model, "prompt": p, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": [0.0, 0.9][i % 2], "seed": i, "return_token_ids": True}))
                for i, p in enumerate(prompts)]
            await _until_running(server, len(tasks), tasks)
            log_at_signal.append(len(server.log().splitlines()))
            server.process.send_signal(signal.SIGINT)
            return await asyncio.wait_for(asyncio.gather(*tasks), SHUTDOWN_TIMEOUT + 30)

    results = asyncio.run(run())
    try:
        returncode = server.process.wait(timeout=SHUTDOWN_TIMEOUT + 30)
    except subprocess.TimeoutExpired:
        os.killpg(server.process.pid, signal.SIGKILL)
        raise
    log = server.log()
    assert all(r["done"] and not r["errors"] and len(r["tokens"]) == max_tokens
               for r in results), results
    assert returncode == 0, log[-4000:]
    assert "Application shutdown complete" in log, log[-4000:]
    blocks = traceback_blocks(log)
    ours = [b for b in blocks if is_bad_xargs_stream_error(b)]
    race = [b for b in blocks if is_output_handler_engine_dead(b)]
    # vLLM 0.32's shutdown may log its output handler's EngineDeadError when the engine core
    # exits first: vLLM alone logs it under the same shutdown (benchmarks/soak.py). Only after
    # the signal; no other traceback anywhere.
    assert all(b["line"] >= log_at_signal[0] for b in race), race
    assert len(ours) == server.stream_errors_sent, ours
    others = [b for b in blocks if b not in ours and b not in race]
    assert not others, (others, log[-4000:])
