"""Soak: ``vllm-redrafter serve`` and vLLM alone under one mixed load, then shut down under load.

A benchmark, not a test: it takes about 2 x (start + ``--minutes`` + 2 min) plus two server
starts per shutdown cycle. Local only (servers on 127.0.0.1), bounded (every request has a
timeout, every loop a count and a deadline, the whole run a deadline after which the servers are
killed), and it stops by itself.

Per server (ReDrafter, then vLLM alone, the order reversed every other ``--repeats``; vLLM alone
is the same command with the plugin not loaded, ``VLLM_PLUGINS=""``, and no speculative config):

1. start, warm up (``--warmup`` requests, not counted), wait until idle: memory (RSS of the server's
   process tree: API server, engine core, worker) and the KV cache's usage (``/metrics``) at start;
2. ``--concurrency`` closed-loop clients for ``--minutes``, each sending the next request of one
   deterministic schedule (the same for both servers): MT-Bench first turns through
   ``/v1/chat/completions``; greedy, sampled (seeded), structured (a JSON schema) and aborted
   (a stream its client closes after 0 to 8 chunks), streamed or not, some with a per-request beam
   shape (``vllm_xargs``, which vLLM alone ignores); memory sampled as it runs;
3. no new request: the in-flight ones finish, then memory and KV usage at end (idle);
4. shutdown under load: ``--shutdown-streams`` streams run, SIGINT to the server process (with
   ``--shutdown-timeout``, vLLM drains in-flight requests: the CI test's shutdown), one request
   arrives after the signal: what each client got, the exit code and time, every traceback in the
   log after the signal, classified.

Figures per server: requests sent / completed / aborted (by their client, as scheduled) / errored
(anything else: an HTTP error, an error event, a timeout, a stream without [DONE], a structured
output that is not the schema's JSON), per kind; output throughput; TTFT and TPOT (streamed,
completed requests: (latency - TTFT) / (tokens - 1), as ``vllm bench serve``) mean / p50 / p99;
memory at start, end and peak; KV usage at start and end; the server's finished-request counters.

``--shutdown-cycles drain,abort`` then starts each server again per listed mode for step 4 alone
(``abort``: vLLM's default ``--shutdown-timeout 0``). The log lines the CI test exempts (vLLM's
output handler's ``EngineDeadError``) are counted per server and mode.

    python benchmarks/soak.py [--minutes 10] [--concurrency 8] [--repeats 1]
        [--drafter DIR] [--beam-width 4 --beam-length 4] [--shutdown-cycles drain,abort]
        [--out benchmarks/results/soak_epyc.json]

The servers inherit this script's environment (``VLLM_CPU_*`` recorded in the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the CI test's log classification

from vllm_redrafter.demo import DEFAULT_DRAFTER, engine_kwargs, machine  # noqa: E402
from vllm_redrafter.eval_sets import MT_BENCH, first_turns  # noqa: E402
from vllm_redrafter.results import write_json  # noqa: E402

ARMS = ("redrafter", "alone")
KINDS = {"greedy": 0.35, "sampled": 0.30, "structured": 0.15, "aborted": 0.20}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["topic", "words"],
          "properties": {"topic": {"type": "string", "maxLength": 40},
                         "words": {"type": "integer", "minimum": 0, "maximum": 1000}}}
SHAPES = [(1, 4), (2, 3), (4, 2), (2, 5)]  # vllm_xargs beam shapes some requests carry
REQUEST_TIMEOUT = 120.0  # s, one request
SHUTDOWN_TIMEOUT = 60  # s, --shutdown-timeout in drain mode (as the CI test)
CLIENT_WAIT_AT_SHUTDOWN = 45.0  # s a client of an in-flight stream waits for more after SIGINT


# -- servers -------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LIVE: list[Server] = []  # started and not yet killed: the watchdog kills them


class Server:
    """One ``vllm-redrafter serve`` process group on 127.0.0.1, its log in ``work``."""

    def __init__(self, arm: str, target: str, spec: dict | None, work: Path, tag: str,
                 shutdown_timeout: int) -> None:
        self.arm, self.port = arm, free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.model = target
        self.log_path = work / f"{tag}.log"
        args = [sys.executable, "-m", "vllm_redrafter.cli", "serve", target,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--shutdown-timeout", str(shutdown_timeout)]
        for key, value in engine_kwargs(target).items():
            if key != "model":
                flag = "--" + key.replace("_", "-")
                args += [flag] if value is True else [flag, str(value)]
        env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
        if spec is None:
            env["VLLM_PLUGINS"] = ""  # vLLM alone: the plugin not loaded
        else:
            env.pop("VLLM_PLUGINS", None)
            args += ["--speculative-config", json.dumps(spec)]
        self.command = args
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        LIVE.append(self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout: float = 600) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.arm} exited ({self.process.returncode}):\n"
                                   f"{self.log()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{self.base}/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - start
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"{self.arm} not healthy after {timeout} s")

    def rss_mib(self) -> float:
        """Resident memory of the server's process tree (API server, engine core, workers)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return round(total / 2**20, 1)

    def metrics(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                              "vllm:num_requests_waiting", "vllm:generation_tokens_total",
                              "vllm:spec_decode_num_drafts_total",
                              "vllm:spec_decode_num_draft_tokens_total",
                              "vllm:spec_decode_num_accepted_tokens_total"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
                elif s.name == "vllm:request_success_total":
                    key = f"{s.name}/{s.labels['finished_reason']}"
                    out[key] = out.get(key, 0.0) + s.value
        return out

    def wait_idle(self, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            values = self.metrics()
            idle = values.get("vllm:num_requests_running", 0) == 0 and \
                values.get("vllm:num_requests_waiting", 0) == 0
            if idle or time.monotonic() > deadline:
                values["idle"] = float(idle)
                return values
            time.sleep(1)

    def kill(self) -> None:
        """SIGKILL to the whole group; returns when it is gone (bounded)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if self in LIVE:
            LIVE.remove(self)


# -- requests ------------------------------------------------------------------------------------


def schedule(i: int, questions: list[str], max_tokens: int, seed: int) -> dict:
    """Request ``i`` of the load, the same for every server."""
    rng = random.Random(seed * 1_000_003 + i)
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    question = questions[i % len(questions)]
    body: dict = {"messages": [{"role": "user", "content": question}],
                  "max_tokens": rng.choice([max_tokens // 2, max_tokens, 2 * max_tokens])}
    stream = kind == "aborted" or rng.random() < 0.75
    if kind == "greedy":
        body["temperature"] = 0
    elif kind == "sampled":
        body.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]), seed=i)
    elif kind == "structured":
        body["messages"] = [{"role": "user", "content": "Answer with JSON giving the topic of "
                             f"this request and a word count for the answer: {question}"}]
        body.update(temperature=0, max_tokens=2 * max_tokens, response_format={
            "type": "json_schema", "json_schema": {"name": "summary", "schema": SCHEMA}})
    else:  # aborted: a stream its client drops
        body.update(temperature=rng.choice([0, 0.8]), seed=i, max_tokens=4 * max_tokens,
                    ignore_eos=True)
    if kind != "structured" and rng.random() < 0.2:
        W, L = rng.choice(SHAPES)
        body["vllm_xargs"] = {"redrafter_beam_width": W, "redrafter_beam_length": L}
    drop_after = rng.randint(0, 8) if kind == "aborted" else None
    return {"i": i, "kind": kind, "stream": stream, "drop_after": drop_after, "body": body}


async def send(client, server: Server, request: dict) -> dict:
    """One request; its outcome: completed / aborted (dropped as scheduled) / errored."""
    body = {**request["body"], "model": server.model}
    rec = {"i": request["i"], "kind": request["kind"], "stream": request["stream"],
           "outcome": "errored", "tokens": 0}
    start = time.monotonic()
    try:
        if not request["stream"]:
            r = await client.post(f"{server.base}/v1/chat/completions", json=body)
            rec["status"] = r.status_code
            data = r.json()
            if r.status_code == 200:
                choice = data["choices"][0]
                rec["tokens"] = data["usage"]["completion_tokens"]
                rec["finish"] = choice["finish_reason"]
                rec["outcome"] = check(request, choice["message"]["content"], rec["finish"])
            else:
                rec["error"] = str(data)[:300]
            rec["latency"] = time.monotonic() - start
            return rec
        body.update(stream=True, stream_options={"include_usage": True})
        text, chunks, t_first, done = [], 0, None, False
        async with client.stream("POST", f"{server.base}/v1/chat/completions",
                                 json=body) as r:
            rec["status"] = r.status_code
            if request["drop_after"] == 0:
                rec["outcome"] = "aborted"
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    rec["error"] = str(event["error"])[:300]
                    continue
                if event.get("usage"):
                    rec["tokens"] = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        t_first = t_first or time.monotonic()
                        text.append(content)
                        chunks += 1
                    rec["finish"] = choice.get("finish_reason") or rec.get("finish")
                if request["drop_after"] is not None and chunks >= request["drop_after"]:
                    rec["outcome"], rec["chunks"] = "aborted", chunks
                    return rec
        latency = time.monotonic() - start
        rec["latency"] = latency
        if request["drop_after"] is not None:  # ended before the client could drop it
            rec["outcome"] = "errored"
            rec["error"] = "stream ended before its client dropped it"
        elif done and "error" not in rec and r.status_code == 200:
            rec["outcome"] = check(request, "".join(text), rec.get("finish"))
            if t_first is not None:
                rec["ttft"] = t_first - start
                if rec["tokens"] > 1:
                    rec["tpot"] = (latency - rec["ttft"]) / (rec["tokens"] - 1)
        elif not done:
            rec["error"] = rec.get("error", "no [DONE]")
    except Exception as err:  # a timeout, a dropped connection: errored
        rec["error"] = f"{type(err).__name__}: {err}"[:300]
        rec["latency"] = time.monotonic() - start
    return rec


def check(request: dict, text: str, finish: str | None) -> str:
    if finish not in ("stop", "length"):
        return "errored"
    if request["kind"] == "structured" and finish == "stop":
        try:
            value = json.loads(text)
            ok = (isinstance(value, dict) and set(value) == {"topic", "words"}
                  and isinstance(value["topic"], str) and isinstance(value["words"], int))
        except ValueError:
            ok = False
        return "completed" if ok else "errored"
    return "completed"


def client():
    import httpx

    return httpx.AsyncClient(timeout=REQUEST_TIMEOUT,
                             limits=httpx.Limits(max_connections=512))


async def load(server: Server, questions: list[str], args, seconds: float,
               first: int = 0) -> tuple[list[dict], list[tuple[float, float]]]:
    """``args.concurrency`` closed-loop clients for ``seconds``; every record, RSS samples."""
    records: list[dict] = []
    memory: list[tuple[float, float]] = []
    start = time.monotonic()
    next_index = [first]

    async def worker(c):
        while time.monotonic() - start < seconds and next_index[0] - first < args.max_requests:
            i = next_index[0]
            next_index[0] += 1
            request = schedule(i, questions, args.max_tokens, args.seed)
            records.append(await send(c, server, request))

    async def sample_memory():
        while time.monotonic() - start < seconds:
            memory.append((round(time.monotonic() - start, 1),
                           await asyncio.to_thread(server.rss_mib)))
            await asyncio.sleep(30)

    async with client() as c:
        sampler = asyncio.create_task(sample_memory())
        # every worker stops starting requests at `seconds`; the in-flight ones get their timeout
        await asyncio.wait_for(asyncio.gather(*[worker(c) for _ in range(args.concurrency)]),
                               seconds + REQUEST_TIMEOUT + 60)
        sampler.cancel()
    return records, memory


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summary(records: list[dict], seconds: float) -> dict:
    out = {"sent": len(records)}
    for outcome in ("completed", "aborted", "errored"):
        out[outcome] = sum(r["outcome"] == outcome for r in records)
    out["by_kind"] = {kind: {o: sum(r["outcome"] == o for r in records if r["kind"] == kind)
                             for o in ("completed", "aborted", "errored")} for kind in KINDS}
    out["errors"] = [{k: r.get(k) for k in ("i", "kind", "stream", "status", "finish", "error")}
                     for r in records if r["outcome"] == "errored"][:20]
    out["aborted_before_first_chunk"] = sum(
        r["outcome"] == "aborted" and not r.get("chunks") for r in records)
    out["structured_finished"] = {  # stop: valid JSON of the schema (checked); length: cut
        reason: sum(r["kind"] == "structured" and r["outcome"] == "completed"
                    and r.get("finish") == reason for r in records)
        for reason in ("stop", "length")}
    done = [r for r in records if r["outcome"] == "completed"]
    out["output_tokens"] = sum(r["tokens"] for r in done)
    out["output_tokens_per_s"] = round(out["output_tokens"] / seconds, 2)
    for name in ("ttft", "tpot"):
        values = [r[name] for r in done if r.get(name) is not None]
        out[name] = {"n": len(values),
                     "mean_ms": round(1000 * sum(values) / len(values), 2) if values else None,
                     **{f"p{q}_ms": (round(1000 * percentile(values, q), 2) if values else None)
                        for q in (50, 99)}}
    return out


# -- shutdown under load -------------------------------------------------------------------------


async def shutdown_under_load(server: Server, questions: list[str], streams: int,
                              max_tokens: int) -> dict:
    """``streams`` streams running, SIGINT to the server process alone, one request after it."""
    from test_server import (  # the CI test's classification of logged tracebacks
        is_output_handler_engine_dead,
        traceback_blocks,
    )

    async def stream(c, i):
        body = {"model": server.model, "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True,
                "messages": [{"role": "user", "content": questions[i % len(questions)]}]}
        out = {"tokens": 0, "done": False}
        try:
            async with c.stream("POST", f"{server.base}/v1/chat/completions", json=body) as r:
                out["status"] = r.status_code
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                        break
                    if line.startswith("data: ") and "error" in json.loads(line[6:]):
                        out["error"] = line[6:300]
                    elif line.startswith("data: "):
                        out["tokens"] += 1
        except Exception as err:
            out["exception"] = type(err).__name__
        return out

    import httpx

    lines_before = 0
    async with httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT,
                                                       read=CLIENT_WAIT_AT_SHUTDOWN),
                                 limits=httpx.Limits(max_connections=256)) as c:
        tasks = [asyncio.create_task(stream(c, i)) for i in range(streams)]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until every stream runs (or waits) in the engine
            m = await asyncio.to_thread(server.metrics)
            if m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0) \
                    >= streams:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2)  # tokens flowing
        lines_before = len(server.log().splitlines())
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGINT)
        await asyncio.sleep(1)
        late: dict = {}
        try:
            r = await c.post(f"{server.base}/v1/chat/completions", json={
                "model": server.model, "max_tokens": 4,
                "messages": [{"role": "user", "content": "late"}]}, timeout=30)
            late = {"status": r.status_code}
        except Exception as err:
            late = {"exception": type(err).__name__}
        results = await asyncio.wait_for(asyncio.gather(*tasks), CLIENT_WAIT_AT_SHUTDOWN + 60)
    try:
        returncode = await asyncio.to_thread(server.process.wait, SHUTDOWN_TIMEOUT + 60)
    except subprocess.TimeoutExpired:
        returncode = None
        server.kill()
    exit_s = round(time.monotonic() - signalled, 1)
    log_lines = server.log().splitlines()
    after = "\n".join(log_lines[lines_before:])
    blocks = traceback_blocks(after)
    return {
        "streams": streams,
        "completed": sum(r["done"] and "error" not in r for r in results),
        "error_event": sum("error" in r for r in results),
        "hung_until_client_timeout": sum(r.get("exception") == "ReadTimeout" for r in results),
        "other_exception": sum(r.get("exception") not in (None, "ReadTimeout") for r in results),
        "late_request": late,
        "returncode": returncode, "exit_s_after_sigint": exit_s,
        "application_shutdown_complete": "Application shutdown complete" in after,
        "tracebacks_after_sigint": [
            {"tag": b["tag"], "header": b["header"][:120], "last": b["last"][-160:],
             "output_handler_engine_dead": is_output_handler_engine_dead(b)} for b in blocks],
        "traceback_kinds": {kind: sum(traceback_kind(b) == kind for b in blocks) for kind in (
            "output_handler_engine_dead", "stream_engine_dead", "uvicorn_asgi", "other")},
    }


def traceback_kind(block: dict) -> str:
    """What a logged traceback after the signal is: vLLM's output handler seeing the engine gone
    (the line the CI test exempts), a stream ended by EngineDeadError, uvicorn's own (an
    'Exception in ASGI application': a request arriving during shutdown), or anything else."""
    from test_server import is_output_handler_engine_dead

    if is_output_handler_engine_dead(block):
        return "output_handler_engine_dead"
    if block["header"].endswith("stream generator.") and "EngineDeadError" in block["last"]:
        return "stream_engine_dead"
    if block["tag"] is None and "Exception in ASGI application" in block["header"]:
        return "uvicorn_asgi"
    return "other"


# -- the run -------------------------------------------------------------------------------------


def soak(arm: str, target: str, spec: dict | None, questions: list[str], args, work: Path,
         tag: str) -> dict:
    server = Server(arm, target, spec if arm == "redrafter" else None, work, tag,
                    SHUTDOWN_TIMEOUT)
    try:
        started_s = server.wait_healthy()
        warm, _ = asyncio.run(load(server, questions, argparse.Namespace(
            **{**vars(args), "max_requests": args.warmup, "concurrency": min(args.concurrency,
                                                                             args.warmup)}),
            600, first=10**6))
        start_metrics = server.wait_idle()
        start_rss = server.rss_mib()
        load_avg_start = os.getloadavg()
        t0 = time.monotonic()
        records, memory = asyncio.run(load(server, questions, args, 60 * args.minutes))
        seconds = time.monotonic() - t0
        probe, _ = asyncio.run(load(server, questions, argparse.Namespace(  # a step after the
            **{**vars(args), "max_requests": 1, "concurrency": 1}), 600, first=2 * 10**6))  # drops
        end_metrics = server.wait_idle()
        end_rss = server.rss_mib()
        result = {
            "server": arm, "command": server.command[2:], "seconds_to_healthy": round(started_s, 1),
            "warmup": {"sent": len(warm), "errored": sum(r["outcome"] == "errored" for r in warm)},
            "probe_after_load": probe[0]["outcome"],
            "seconds": round(seconds, 1), **summary(records, seconds),
            "memory_mib": {"start": start_rss, "end": end_rss,
                           "peak": max([start_rss, end_rss, *(m for _, m in memory)]),
                           "samples": memory},
            "kv_cache_usage": {"start": start_metrics.get("vllm:kv_cache_usage_perc"),
                               "end": end_metrics.get("vllm:kv_cache_usage_perc"),
                               "idle_at_end": bool(end_metrics["idle"])},
            "server_counters": {k: end_metrics.get(k, 0) - start_metrics.get(k, 0)
                                for k in end_metrics if k.startswith("vllm:") and
                                ("_total" in k)},
            "load_average": {"start": load_avg_start, "end": os.getloadavg()},
        }
        result["shutdown_under_load"] = asyncio.run(shutdown_under_load(
            server, questions, args.shutdown_streams, args.max_tokens))
        result["shutdown_under_load"]["mode"] = "drain"
        return result
    finally:
        server.kill()


def shutdown_cycle(arm: str, mode: str, target: str, spec: dict | None, questions, args,
                   work: Path, tag: str) -> dict:
    server = Server(arm, target, spec if arm == "redrafter" else None, work, tag,
                    SHUTDOWN_TIMEOUT if mode == "drain" else 0)
    try:
        server.wait_healthy()
        asyncio.run(load(server, questions, argparse.Namespace(
            **{**vars(args), "max_requests": 4, "concurrency": 2}), 300, first=10**6))
        result = asyncio.run(shutdown_under_load(server, questions, args.shutdown_streams,
                                                 args.max_tokens))
        return {"server": arm, "mode": mode, **result}
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-requests", type=int, default=20000, help="per server and soak")
    parser.add_argument("--warmup", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--drafter", type=Path, default=DEFAULT_DRAFTER)
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--beam-length", type=int, default=4)
    parser.add_argument("--shutdown-streams", type=int, default=16)
    parser.add_argument("--shutdown-cycles", default="drain,abort",
                        help="extra start + shutdown-under-load per server, per mode ('' none)")
    parser.add_argument("--work", type=Path, default=None, help="logs (default: a temp dir)")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks/results/soak_epyc.json")
    args = parser.parse_args()

    from vllm_redrafter.target import prepare_target

    target = str(prepare_target())
    questions = first_turns(MT_BENCH)
    spec = {"method": "redrafter", "model": str(args.drafter.resolve()),
            "beam_width": args.beam_width, "beam_length": args.beam_length}
    work = args.work or Path(__import__("tempfile").mkdtemp(prefix="soak_"))
    work.mkdir(parents=True, exist_ok=True)
    cycles = [m for m in args.shutdown_cycles.split(",") if m]
    budget = (2 * args.repeats * (60 * args.minutes + 900) + 2 * len(cycles) * 900)

    def watchdog(*_):
        print(f"soak: past its {budget:.0f} s budget, stopping", file=sys.stderr, flush=True)
        for server in list(LIVE):
            server.kill()
        os._exit(3)

    signal.signal(signal.SIGALRM, watchdog)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds: each server is killed
    signal.alarm(int(budget))
    print(f"soak: logs in {work}; stops by itself within {budget / 60:.0f} min", flush=True)

    runs, shutdowns = [], []
    for repeat in range(args.repeats):
        order = list(ARMS)[::-1] if repeat % 2 else list(ARMS)
        for arm in order:
            print(f"soak: repeat {repeat}, {arm}, {args.minutes} min", flush=True)
            result = soak(arm, target, spec, questions, args, work, f"soak{repeat}_{arm}")
            result["repeat"] = repeat
            runs.append(result)
            print(json.dumps({k: result[k] for k in ("server", "sent", "completed", "aborted",
                                                     "errored", "memory_mib", "tpot")}),
                  flush=True)
    for c, mode in enumerate(cycles):
        order = list(ARMS)[::-1] if c % 2 else list(ARMS)
        for arm in order:
            print(f"soak: shutdown cycle {c} ({mode}), {arm}", flush=True)
            shutdowns.append(shutdown_cycle(arm, mode, target, spec, questions, args, work,
                                            f"shutdown{c}_{mode}_{arm}"))
            print(json.dumps(shutdowns[-1])[:600], flush=True)
    signal.alarm(0)

    out = {
        "machine": machine(), "when": time.strftime("%Y-%m-%d"),
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU")},
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                     if k not in ("work", "out")},  # where this machine kept them
        "speculative_config": spec, "engine": engine_kwargs(target),
        "kinds": KINDS, "shutdown_timeout_drain_s": SHUTDOWN_TIMEOUT,
        "tpot_p99_ms": {arm: [r["tpot"]["p99_ms"] for r in runs if r["server"] == arm]
                        for arm in ARMS},  # one per repeat
        "runs": runs, "shutdown_cycles": shutdowns,
        "lost": {arm: sum(r["errored"] for r in runs if r["server"] == arm) for arm in ARMS},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out, out)
    print(f"soak: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
