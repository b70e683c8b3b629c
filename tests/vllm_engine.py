"""A real vLLM engine process (CPU backend) that tests drive over their own channel.

    python tests/vllm_engine.py MODEL_DIR CONTROL_SOCKET [KVD_SOCKET]

With a kvd socket the engine uses KVDConnector (or the class `KVD_TEST_CONNECTOR` names as
`module:Class`, with `KVD_TEST_CONNECTOR_EXTRA` as JSON added to its extra config); without,
it is the baseline. `KVD_TEST_KV_EVENTS` (a ZMQ endpoint) turns vLLM's KV events on, published there;
`KVD_TEST_LORA=1` enables LoRA adapters (rank ≤ 8, one at a time); `KVD_TEST_TP` sets
`tensor_parallel_size` (default 1); `KVD_TEST_MLA=1` runs an MLA model (DeepSeek-V2/V3) on
vLLM's reference CPU MLA backend, the one that takes float32 (its block size is 16);
`KVD_TEST_NUM_BLOCKS` gives vLLM that many KV blocks (so that it preempts requests) in 64 MiB
of KV cache memory (not `VLLM_CPU_KVCACHE_SPACE`). vLLM logs to
stdout, so commands travel over a `multiprocessing.connection` unix socket the test
listens on: ("generate", [prompt, ...], max_tokens, until_saved) answers the greedy token
ids of each prompt (a prompt is a dict with `tokens`, optionally `cache_salt`, `lora`,
the path of a LoRA adapter, named after its directory, and `kv_transfer_params`, the
request's, as the OpenAI server passes them on) and how many prompt tokens came
from the connector, with `until_saved` once every save of the engine's connector is done
(vLLM answers before its connector's saves end); ("reset_prefix_cache",) empties vLLM's own prefix
cache, so the next request can only hit kvd; ("steps",) answers how many engine steps
ran so far (vLLM's `iteration_tokens` histogram); ("stop",) ends the process.

Requests can also be driven one by one, through vLLM's `LLMEngine` (the engine core runs
them in a process of its own meanwhile): ("add", {id: prompt}, max_tokens) adds them and
answers at once; ("advance", id, n) reads vLLM's outputs until request `id` has n tokens
(or finished) and answers its tokens; ("abort", [id, ...]) aborts them
(`LLMEngine.abort_request`) and answers their tokens so far; ("finish",) reads outputs
until no added request runs and answers every added request's tokens.
"""

from __future__ import annotations

import json
import os
import sys
import time
from multiprocessing.connection import Client

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # `wait_for_saves` sends a function to the workers

BLOCK_SIZE = 32
MAX_MODEL_LEN = int(os.environ.get("VLLM_ENGINE_MAX_MODEL_LEN", "4096"))


def external_hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits"))


def lora_request(path: str | None):
    """vLLM's request for the adapter at ``path`` (None: the base model)."""
    from vllm.lora.request import LoRARequest

    return None if path is None else LoRARequest(os.path.basename(path), 1, path)


def kv_transfer_config(kvd_socket: str):
    """vLLM's connector settings: KVDConnector on the daemon at ``kvd_socket``, or the
    connector `KVD_TEST_CONNECTOR` names (bench/load_engine.py's engines use this too)."""
    from vllm.config import KVTransferConfig

    module, name = os.environ.get("KVD_TEST_CONNECTOR", "gpu_worker.vllm_connector:KVDConnector").split(":")
    extra = json.loads(os.environ.get("KVD_TEST_CONNECTOR_EXTRA", "{}"))
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"socket": kvd_socket, **extra},
    )


def saves_done(worker) -> bool:
    """On a vLLM worker: whether its connector has no save left to do (True without one)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return not has_kv_transfer_group() or getattr(get_kv_transfer_group(), "saves_done", lambda: True)()


def wait_for_saves(llm, timeout: float = 60.0) -> None:
    """Until every worker's connector published (or dropped) what it was handed to save."""
    deadline = time.monotonic() + timeout
    while not all(llm.collective_rpc(saves_done)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the connector's saves were not done within {timeout} s")
        time.sleep(0.01)


class Driven:
    """Requests added one by one to `llm`'s engine, and the tokens vLLM gave each so far."""

    def __init__(self, llm) -> None:
        self.engine = llm.llm_engine
        self.tokens: dict[str, list[int]] = {}
        self.done: set[str] = set()

    def add(self, prompts: dict, max_tokens: int) -> None:
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
        for req_id, p in prompts.items():
            self.engine.add_request(req_id, TokensPrompt(prompt_token_ids=p["tokens"]), params)
            self.tokens[req_id] = []

    def step(self) -> None:
        for output in self.engine.step():
            self.tokens[output.request_id] = list(output.outputs[0].token_ids)
            if output.finished:
                self.done.add(output.request_id)

    def advance(self, req_id: str, n: int) -> list[int]:
        while len(self.tokens[req_id]) < n and req_id not in self.done:
            self.step()
        return self.tokens[req_id]

    def abort(self, req_ids: list[str]) -> dict[str, list[int]]:
        self.engine.abort_request(req_ids)
        self.done.update(req_ids)
        return {r: self.tokens[r] for r in req_ids}

    def finish(self) -> dict[str, list[int]]:
        while self.engine.has_unfinished_requests():
            self.step()
        tokens, self.tokens, self.done = self.tokens, {}, set()
        return tokens


def main(model: str, control: str, kvd_socket: str | None) -> None:
    from vllm import LLM, SamplingParams, TokensPrompt

    kw = {}
    if kvd_socket:
        kw["kv_transfer_config"] = kv_transfer_config(kvd_socket)
    if os.environ.get("KVD_TEST_KV_EVENTS"):
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=os.environ["KVD_TEST_KV_EVENTS"]
        )
    if os.environ.get("KVD_TEST_HYBRID_MANAGER_OFF"):
        kw["disable_hybrid_kv_cache_manager"] = True
    if os.environ.get("KVD_TEST_NUM_BLOCKS"):  # and memory for little more (the variable would override it)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE")
        kw.update(num_gpu_blocks_override=int(os.environ["KVD_TEST_NUM_BLOCKS"]), kv_cache_memory_bytes=64 << 20)
    if os.environ.get("KVD_TEST_LORA"):
        kw.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    block_size = BLOCK_SIZE
    if os.environ.get("KVD_TEST_MLA"):
        kw["attention_backend"] = "CPU_MLA"
        block_size = 16
    llm = LLM(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=block_size,
        dtype="float32",
        disable_log_stats=False,
        seed=0,
        tensor_parallel_size=int(os.environ.get("KVD_TEST_TP", "1")),
        **kw,
    )
    channel = Client(control, authkey=b"kvd-test")
    channel.send(("ready", os.getpid()))
    driven = Driven(llm)
    while True:
        command, *args = channel.recv()
        if command == "generate":
            prompts, max_tokens, until_saved = args
            before = external_hits(llm)
            params = [
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.0,
                    detokenize=False,
                    ignore_eos=True,
                    extra_args={"kv_transfer_params": p["kv_transfer_params"]} if "kv_transfer_params" in p else None,
                )
                for p in prompts
            ]
            outputs = llm.generate(
                [
                    TokensPrompt(
                        prompt_token_ids=p["tokens"], **({"cache_salt": p["cache_salt"]} if "cache_salt" in p else {})
                    )
                    for p in prompts
                ],
                params,
                use_tqdm=False,
                lora_request=[lora_request(p.get("lora")) for p in prompts],
            )
            if until_saved:
                wait_for_saves(llm)
            channel.send(([list(o.outputs[0].token_ids) for o in outputs], external_hits(llm) - before))
        elif command == "reset_prefix_cache":
            channel.send(llm.reset_prefix_cache())
        elif command == "counter":
            [name] = args
            channel.send(sum(m.value for m in llm.get_metrics() if m.name == name))
        elif command == "steps":
            channel.send(sum(m.count for m in llm.get_metrics() if m.name == "vllm:iteration_tokens_total"))
        elif command == "add":
            channel.send(driven.add(*args))
        elif command == "advance":
            channel.send(driven.advance(*args))
        elif command == "abort":
            channel.send(driven.abort(*args))
        elif command == "finish":
            channel.send(driven.finish())
        elif command == "stop":
            channel.send("stopping")
            return


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
