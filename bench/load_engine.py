"""A real vLLM engine process (CPU backend) that bench/bench_vllm_load.py drives: a stream of
requests with a fixed number in flight.

    python bench/load_engine.py MODEL_DIR CONTROL_SOCKET [KVD_SOCKET]

With a kvd socket the engine uses KVDConnector, or the connector `KVD_TEST_CONNECTOR`
names, as tests/vllm_engine.py's engines do (vLLM's own prefix cache stays on, as it would
in a deployment); without, `KVD_LOAD_PREFIX_CACHING=0` turns vLLM's own prefix cache
off ("vLLM alone"). Like tests/vllm_engine.py (whose driver, the `Engine` class of
tests/test_vllm_connector.py, starts this script too), commands travel over a
`multiprocessing.connection` socket, because vLLM logs to stdout:

- ("run", prompts, max_tokens, concurrency): adds the prompts (lists of token ids) in
  order, keeping `concurrency` requests in flight (a request is added as soon as one
  finishes), steps the engine until all finished, and answers a dict: `seconds` from the
  first request added to the last finished, `output_tokens`, `prompt_tokens`,
  `cached_tokens` (local and external prefix hits, as vLLM counts them),
  `external_tokens` (those from the connector), `steps` (engine steps run) and `ttfts`
  (each request's seconds from being added to its first token);
- ("stop",) ends the process.
"""

from __future__ import annotations

import os
import sys
import time
from multiprocessing.connection import Client

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from vllm_engine import kv_transfer_config  # noqa: E402

# After that import, which sets it: vLLM's legacy setting (whole GiB) would override the size below
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

BLOCK_SIZE = 32
KV_CACHE_BYTES = 256 << 20  # per engine: ~30 prompts of the bench's model; 6 engines must fit beside other jobs


def external_hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"))


def run(llm, prompts: list[list[int]], max_tokens: int, concurrency: int, tag: str) -> dict:
    """Runs the stream with `concurrency` requests in flight; see the module docstring."""
    from vllm import SamplingParams, TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    before = external_hits(llm)
    queue = list(reversed(prompts))
    in_flight, steps = 0, 0
    totals = {"output_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0}
    added: dict[str, float] = {}  # request id -> when it was added, until its first token
    ttfts = []
    start = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            request_id = f"{tag}-{len(queue)}"
            added[request_id] = time.perf_counter()
            engine.add_request(request_id, TokensPrompt(prompt_token_ids=queue.pop()), params)
            in_flight += 1
        steps += 1
        for out in engine.step():
            if out.request_id in added and out.outputs[0].token_ids:
                ttfts.append(time.perf_counter() - added.pop(out.request_id))
            if out.finished:
                in_flight -= 1
                totals["output_tokens"] += len(out.outputs[0].token_ids)
                totals["prompt_tokens"] += len(out.prompt_token_ids)
                totals["cached_tokens"] += out.num_cached_tokens or 0
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "steps": steps,
        "external_tokens": external_hits(llm) - before,
        "ttfts": ttfts,
        **totals,
    }


def main(model: str, control: str, kvd_socket: str | None) -> None:
    from vllm import LLM

    kw = {}
    if kvd_socket:
        kw["kv_transfer_config"] = kv_transfer_config(kvd_socket)
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=int(os.environ.get("VLLM_ENGINE_MAX_MODEL_LEN", "4096")),
        block_size=BLOCK_SIZE,
        dtype="float32",
        disable_log_stats=False,
        seed=0,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        enable_prefix_caching=os.environ.get("KVD_LOAD_PREFIX_CACHING", "1") == "1",
        **kw,
    )
    channel = Client(control, authkey=b"kvd-test")
    channel.send(("ready", os.getpid()))
    runs = 0
    while True:
        command, *args = channel.recv()
        if command == "run":
            runs += 1
            channel.send(run(llm, *args, tag=f"r{runs}"))
        elif command == "stop":
            channel.send("stopping")
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
