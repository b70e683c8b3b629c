"""The time vLLM spends in KVDConnector per engine step, scheduler half and worker half, against vLLM alone.

    python bench/bench_vllm_scheduler.py [--requests 32] [--prompt 1024] [--shared 768] [--max-tokens 256]
                                         [--configs alone kvd kvd-inline]

Each configuration runs in a process of its own, vLLM's engine core in that process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the scheduler's methods can be timed where they
run. One random Llama (bench/bench_vllm.py's), one kvd daemon; every configuration answers
the same batch: `--requests` prompts submitted at once, half sharing a `--shared`-token
prefix that another engine saved in kvd beforehand, the other half unique, each
generating `--max-tokens` tokens:

- `alone`: vLLM without a connector;
- `kvd`: KVDConnector as shipped (lookups and holds run ahead on the lookahead thread);
- `kvd-inline`: the same connector, but `get_num_new_matched_tokens` waits for the
  lookahead's answer in the scheduler loop, as a connector that looks prompts up inline
  does (what KVDConnector did before the lookahead).

The engine core steps as its busy loop does: after a step that ran no model while
requests wait, it sleeps 1 ms (`yield_when_idle`).

Per engine step it records the seconds in the scheduler-side connector methods
(`on_new_request`, `get_num_new_matched_tokens`, `update_state_after_alloc`,
`build_connector_meta`, `update_connector_output`, `request_finished`, `take_events`),
and the seconds of vLLM's `schedule()` + `update_from_output()`; and, the worker in this
process too (vLLM's in-process executor), the seconds in the worker-side connector
methods (`handle_preemptions`, `start_load_kv`, `wait_for_layer_load`, `save_kv_layer`,
`wait_for_save`, `get_transfer_results` (vLLM's `get_finished`),
`get_block_ids_with_load_errors`, `build_connector_worker_meta`), of which the load
copies (gpu_worker/vllm/worker.py's `copy_layer`: on CPU they do not overlap compute),
beside vLLM's own model step (from the end of `schedule()` to `update_from_output()`,
the worker half's methods taken out). It prints p50/p99/max over the steps that ran all
requests at once (decode at full batch) and over all steps.
Targets: scheduler half p99 ≤ 0.2 ms per step at 32 running requests (issue 25); worker
half p99 ≤ 0.2 ms, copies that overlap compute excluded (issue 31).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))

CONNECTOR_METHODS = (
    "on_new_request",
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
)
WORKER_METHODS = (
    "handle_preemptions",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "build_connector_worker_meta",
)


def prompts(args) -> tuple[list[int], list[list[int]]]:
    """The prefix saved beforehand, and the batch: half of it behind that prefix."""
    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1, 999, n)]

    shared = ids(args.shared)
    batch = [
        (shared + ids(args.prompt - args.shared)) if i % 2 == 0 else ids(args.prompt) for i in range(args.requests)
    ]
    return shared, batch


def kvd_transfer(args) -> dict:
    """vLLM's kv_transfer_config for KVDConnector on the benchmark's daemon."""
    return {
        "kv_connector": "KVDConnector",
        "kv_connector_module_path": "gpu_worker.vllm_connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"socket": args.socket},
    }


def engine(args, kv_transfer: dict | None, **kw):
    """A vLLM engine of the benchmark's model, its engine core in this process (`child`
    starts the process with VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm import LLM

    return LLM(
        model=args.model,
        max_model_len=args.prompt + args.max_tokens + 16,
        block_size=32,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        enable_prefix_caching=True,
        kv_transfer_config=kv_transfer,
        seed=0,
        **kw,
    )


def yield_when_idle(client_class) -> None:
    """vLLM's in-process client steps the engine core back to back; the engine core's own
    busy loop (a process of its own in a deployment) sleeps 1 ms after a step that ran no
    model while requests wait (for a connector, say), which lets the process's other
    threads run. The same here, so the lookahead thread meets what it meets in vLLM."""
    get_output = client_class.get_output

    def get_output_then_yield(self):
        core = self.engine_core
        step_fn = core.step_fn
        executed = [True]

        def step():
            outputs, executed[0] = step_fn()
            return outputs, executed[0]

        core.step_fn = step
        try:
            return get_output(self)
        finally:
            core.step_fn = step_fn
            if not executed[0] and core.scheduler.has_requests():
                time.sleep(0.001)

    client_class.get_output = get_output_then_yield


def run_config(args) -> dict:
    """One configuration in this process: the batch, its per-step timings."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core_client import InprocClient

    # per schedule(): seconds in vLLM's scheduler and model step, in each connector half, requests run
    steps: list[dict] = []
    spent = {"connector": 0.0, "worker": 0.0, "load_copies": 0.0}  # since the last update_from_output
    scheduled_at = [0.0]

    def timed(fn, into: str):
        def wrapper(*a, **kw):
            start = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[into] += time.perf_counter() - start

        return wrapper

    schedule, update = Scheduler.schedule, Scheduler.update_from_output

    def timed_schedule(self, *a, **kw):
        start = time.perf_counter()
        out = schedule(self, *a, **kw)
        scheduled_at[0] = time.perf_counter()
        steps.append({"scheduler": scheduled_at[0] - start, "requests": len(out.num_scheduled_tokens)})
        return out

    def timed_update(self, *a, **kw):
        start = time.perf_counter()
        out = update(self, *a, **kw)
        if steps:
            steps[-1]["scheduler"] += time.perf_counter() - start
            steps[-1]["model"] = start - scheduled_at[0] - spent["worker"]
            steps[-1].update(spent)
            spent.update(dict.fromkeys(spent, 0.0))
        return out

    Scheduler.schedule, Scheduler.update_from_output = timed_schedule, timed_update
    yield_when_idle(InprocClient)
    kv_transfer = None
    if args.config != "alone":
        from gpu_worker.vllm.connector import KVDConnector

        if args.config == "kvd-inline":
            asked = KVDConnector.get_num_new_matched_tokens

            def wait_for_answer(self, request, num_computed_tokens):
                while (answer := asked(self, request, num_computed_tokens))[0] is None:
                    time.sleep(0)
                return answer

            KVDConnector.get_num_new_matched_tokens = wait_for_answer
        from gpu_worker.vllm import worker

        for name in CONNECTOR_METHODS:
            setattr(KVDConnector, name, timed(getattr(KVDConnector, name), "connector"))
        for name in WORKER_METHODS:
            setattr(KVDConnector, name, timed(getattr(KVDConnector, name), "worker"))
        worker.copy_layer = timed(worker.copy_layer, "load_copies")  # the forward thread's copies: loads
        kv_transfer = kvd_transfer(args)
    llm = engine(args, kv_transfer, max_num_seqs=max(args.requests, 8))
    _, batch = prompts(args)
    warm = SamplingParams(max_tokens=2, temperature=0, detokenize=False)
    llm.generate([{"prompt_token_ids": [7] * args.prompt}], warm, use_tqdm=False)  # first-call costs
    steps.clear()
    llm.generate(
        [{"prompt_token_ids": p} for p in batch],
        SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True, detokenize=False),
        use_tqdm=False,
    )
    return {"steps": [s for s in steps if "connector" in s or args.config == "alone"]}


def save_shared_prefix(args) -> None:
    """Another engine computes the shared prefix and saves it in kvd."""
    from vllm import SamplingParams

    shared, _ = prompts(args)
    llm = engine(args, kvd_transfer(args))
    llm.generate([{"prompt_token_ids": shared + [5]}], SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)


def percentiles(values: list[float]) -> str:
    if not values:
        return "no steps"
    ms = np.array(values) * 1000
    return f"p50 {np.percentile(ms, 50):7.3f}  p99 {np.percentile(ms, 99):7.3f}  max {ms.max():7.3f} ms"


def child(args, config: str) -> dict:
    """Runs one configuration in a fresh process; its timings."""
    out = os.path.join(args.workdir, f"{config}.json")
    command = [sys.executable, __file__, "--child", config, "--out", out, *args.passthrough]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    subprocess.run(command, check=True, env=env)
    with open(out) as f:
        return json.load(f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--shared", type=int, default=768)
    parser.add_argument("--max-tokens", type=int, default=256)  # ~250 full-batch steps: a p99 that is not the max
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--configs", nargs="+", choices=["alone", "kvd", "kvd-inline"], default=["alone", "kvd", "kvd-inline"]
    )
    parser.add_argument("--child", choices=["alone", "kvd", "kvd-inline", "save"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 0 <= args.shared < args.prompt:
        parser.error(f"--shared must be at least 0 and below --prompt ({args.prompt}); got {args.shared}")
    if args.requests < 1 or args.max_tokens < 1:
        parser.error("--requests and --max-tokens must be at least 1")
    if args.child:
        args.config = args.child
        if args.child == "save":
            save_shared_prefix(args)
            result = {}
        else:
            result = run_config(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return

    from bench_vllm import write_model

    from engine_client.launch import DaemonProcess

    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        model = os.path.join(workdir, "model")
        write_model(model, args.layers, args.hidden)
        socket = os.path.join(workdir, "kvd.sock")
        daemon = DaemonProcess.start(
            socket, "--enable-prefix-reuse", "--host-bytes", "2GiB", log_path=os.path.join(workdir, "kvd.log")
        )
        args.passthrough = [
            *("--requests", str(args.requests), "--prompt", str(args.prompt), "--shared", str(args.shared)),
            *("--max-tokens", str(args.max_tokens), "--model", model, "--socket", socket),
        ]
        try:
            child(args, "save")
            results = {config: child(args, config) for config in args.configs}
        finally:
            daemon.stop()
            daemon.clean()
    print(
        f"{args.requests} requests at once ({args.requests // 2 + args.requests % 2} behind a {args.shared}-token "
        f"prefix in kvd), {args.prompt}-token prompts, {args.max_tokens} tokens each; "
        f"{args.layers} layers x hidden {args.hidden}, vLLM CPU backend"
    )
    for config, result in results.items():
        steps = result["steps"]
        full = [s for s in steps if s["requests"] == args.requests]
        print(f"  {config:10s} {len(steps)} steps, {len(full)} with every request running")
        print(f"    vLLM scheduler per step, full batch: {percentiles([s['scheduler'] for s in full])}")
        print(f"    vLLM model step, full batch:         {percentiles([s['model'] for s in full])}")
        if config != "alone":
            print(f"    scheduler half per step, full:       {percentiles([s['connector'] for s in full])}")
            print(f"    scheduler half per step, all:        {percentiles([s['connector'] for s in steps])}")
            print(f"    worker half per step, full:          {percentiles([s['worker'] for s in full])}")
            print(f"    worker half per step, all:           {percentiles([s['worker'] for s in steps])}")
            no_copies = [s["worker"] - s["load_copies"] for s in steps]
            print(f"    worker half less load copies, all:   {percentiles(no_copies)}")
            print(f"    load copies per step, all:           {percentiles([s['load_copies'] for s in steps])}")


if __name__ == "__main__":
    main()
