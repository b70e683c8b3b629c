"""vLLM with KVDConnector against vLLM alone, side by side in one run (CPU backend).

    python bench/bench_vllm.py [--prefix 16384] [--suffix 256] [--repeats 3]

A random Llama large enough that prefill dominates on this CPU is written to a temporary
directory; one kvd daemon and three vLLM processes run at once: `first` (kvd) computes a
shared prefix and saves it; `second` (kvd) and `alone` (no connector) then each answer the
same new prompts (the shared prefix + a suffix of their own, one token generated):

- time to first token of `second` against `alone`, and the FLOPs-ideal ratio (what only
  the suffix costs against the whole prompt); target: achieved ≥ 0.7 × ideal speed-up;
  beside it the same prefix served from vLLM's own prefix cache (and a suffix as long to
  compute), the floor that no external cache can beat;
- the connector's overhead when nothing hits: all-distinct prompts on `second` against
  `alone`; target ≤ 3 % slower.

Not measured here: vLLM's own host offloading (`OffloadingConnector`) against kvd within
one process. vLLM 0.32's CPU backend refuses it at start ("CPU Offloading is currently only
supported on CUDA-alike and XPU GPUs", tried 2026-11-30); the comparison is for a GPU run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from engine_client.launch import DaemonProcess  # noqa: E402


def write_model(path: str, layers: int, hidden: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=1000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(path)


@dataclass
class Timings:
    """Seconds to a first token, one entry per repeat."""

    hit: list[float] = field(default_factory=list)  # second, the prefix from kvd
    local: list[float] = field(default_factory=list)  # second, the prefix from vLLM's own cache
    alone: list[float] = field(default_factory=list)  # alone, the same prompt
    miss: list[float] = field(default_factory=list)  # second, a prompt nothing holds
    miss_alone: list[float] = field(default_factory=list)  # alone, the same prompt
    hit_tokens: int = 0  # prompt tokens second loaded from kvd


def ttft(engine, prompt_tokens: list[int], forget: bool = True) -> tuple[float, int]:
    """Seconds to one generated token, and the prompt tokens loaded from kvd; ``forget``
    empties vLLM's own prefix cache first."""
    if forget:
        engine.forget_local_cache()
    start = time.perf_counter()
    _, hits = engine.generate([{"tokens": prompt_tokens}], max_tokens=1)
    return time.perf_counter() - start, hits


def measure(second, alone, prefix: list[int], ids, args) -> Timings:
    """The engines side by side, each repeat on fresh suffixes and a fresh unshared prompt."""
    timings = Timings()
    for _ in range(args.repeats):
        p = prefix + ids(args.suffix)
        t, timings.hit_tokens = ttft(second, p)
        timings.hit.append(t)
        # The floor: the same prefix from vLLM's own cache (second just computed it), a
        # suffix of as many new tokens to compute.
        timings.local.append(ttft(second, prefix + ids(args.suffix), forget=False)[0])
        timings.alone.append(ttft(alone, p)[0])
        q = ids(args.prefix + args.suffix)
        t, miss_hits = ttft(second, q)
        assert miss_hits == 0
        timings.miss.append(t)
        timings.miss_alone.append(ttft(alone, q)[0])
    return timings


def report(args, timings: Timings) -> None:
    med = statistics.median
    total, hits = args.prefix + args.suffix, timings.hit_tokens
    computed = total - hits
    # Prefill FLOPs: ~32 h^2 a token in the linear layers (attention projections and a
    # 4h MLP), ~4 h a (query, key) pair in attention; causal: a prompt has T^2 / 2 pairs.
    pair = 4 * args.hidden / (32 * args.hidden**2)
    ideal = (total + pair * total**2 / 2) / (computed + pair * (total**2 - hits**2) / 2)
    achieved = med(timings.alone) / med(timings.hit)
    overhead = med(timings.miss) / med(timings.miss_alone) - 1
    floor = med(timings.local)
    print(
        f"prompt {total:,} tokens ({args.prefix:,} shared + {args.suffix} own), {args.layers} layers x "
        f"hidden {args.hidden}, float32, vLLM CPU backend, {args.repeats} repeats (medians)"
    )
    print(f"  second engine TTFT with kvd  {med(timings.hit) * 1000:9.1f} ms  ({hits:,} prompt tokens loaded from kvd)")
    print(
        f"  same prefix from vLLM's own cache {floor * 1000:9.1f} ms (the floor for any cache: "
        f"kvd takes {med(timings.hit) / floor:.2f}x it)"
    )
    print(f"  same prompt, vLLM alone      {med(timings.alone) * 1000:9.1f} ms")
    print(
        f"  speed-up achieved {achieved:.2f}x, FLOPs-ideal {ideal:.2f}x -> {achieved / ideal:.2f} of ideal "
        f"(target >= 0.7); vLLM's own cache reaches {med(timings.alone) / floor / ideal:.2f}"
    )
    print(
        f"  no hit: TTFT with kvd {med(timings.miss) * 1000:.1f} ms, alone "
        f"{med(timings.miss_alone) * 1000:.1f} ms -> overhead {overhead * 100:+.1f} % (target <= 3 %)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    args = parser.parse_args()

    from test_vllm_connector import Engine

    os.environ["VLLM_ENGINE_MAX_MODEL_LEN"] = str(args.prefix + args.suffix + 64)  # read by tests/vllm_engine.py

    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1, 999, n)]

    with tempfile.TemporaryDirectory() as workdir:
        model = os.path.join(workdir, "model")
        write_model(model, args.layers, args.hidden)
        socket = os.path.join(workdir, "kvd.sock")
        daemon = DaemonProcess.start(
            socket, "--enable-prefix-reuse", "--host-bytes", "4GiB", log_path=os.path.join(workdir, "kvd.log")
        )
        engines = {
            name: Engine(name, model, workdir, None if name == "alone" else socket)
            for name in ("first", "second", "alone")
        }
        try:
            for engine in engines.values():
                engine.wait_ready(timeout=600)
            first, second, alone = engines["first"], engines["second"], engines["alone"]
            prefix = ids(args.prefix)
            first.generate([{"tokens": prefix + ids(args.suffix)}], max_tokens=1)
            first.stop()  # its pages stay in kvd; an idle engine would only take CPU from the timed ones
            for engine in (second, alone):  # warm-up: first-call costs land in no timed figure
                engine.generate([{"tokens": ids(args.prefix + args.suffix)}], max_tokens=1)
            report(args, measure(second, alone, prefix, ids, args))
        finally:
            for engine in engines.values():
                engine.stop()
            daemon.stop()
            daemon.clean()


if __name__ == "__main__":
    main()
