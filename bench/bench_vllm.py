"""vLLM with KVDConnector against vLLM alone, side by side in one run (CPU backend).

    python bench/bench_vllm.py [--prefix 16384] [--suffix 256] [--repeats 3] [--no-lmcache]

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

**LMCache** (issue 32): with LMCache's venv built (`make setup-lmcache`), LMCache's
multi-process server (bench/lmcache_mp.py) and two vLLM engines on it run beside them, at
the same settings (model, block size, prompts; a host budget of `--host-gib` each):
`lmcache-first` computes the same shared prefix; `lmcache-second` answers the same prompts
as `second`, repeat by repeat, the two taking turns to go first. Reported: each hit's TTFT
and their ratio (target: kvd ≤ 0.8× LMCache), each against its own engine's local-cache
floor, the no-hit overhead of each, and the host memory each server holds for the prefix
(its resident /dev/shm pages and private memory, bench/footprint.py). Without the venv the
benchmark says how to build it and stops; `--no-lmcache` leaves LMCache out.

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

import lmcache_mp  # noqa: E402
from footprint import HostMemory, host_memory  # noqa: E402

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
    lmcache: list[float] = field(default_factory=list)  # lmcache-second, the prefix from LMCache's server
    lmcache_local: list[float] = field(default_factory=list)  # lmcache-second, from vLLM's own cache
    lmcache_miss: list[float] = field(default_factory=list)  # lmcache-second, a prompt nothing holds
    lmcache_tokens: int = 0  # prompt tokens lmcache-second loaded from LMCache


def ttft(engine, prompt_tokens: list[int], forget: bool = True) -> tuple[float, int]:
    """Seconds to one generated token, and the prompt tokens loaded from kvd; ``forget``
    empties vLLM's own prefix cache first."""
    if forget:
        engine.forget_local_cache()
    start = time.perf_counter()
    _, hits = engine.generate([{"tokens": prompt_tokens}], max_tokens=1, until_saved=False)
    return time.perf_counter() - start, hits


def measure(second, alone, lmcache, prefix: list[int], ids, args) -> Timings:
    """The engines side by side, each repeat on fresh suffixes and a fresh unshared prompt;
    ``lmcache`` (lmcache-second, or None) answers the same prompts as ``second``, the two
    taking turns to go first."""
    timings = Timings()
    for r in range(args.repeats):
        p, local, q = prefix + ids(args.suffix), prefix + ids(args.suffix), ids(args.prefix + args.suffix)
        caches = [(second, timings.hit, timings.local, timings.miss)]
        if lmcache is not None:
            caches.append((lmcache, timings.lmcache, timings.lmcache_local, timings.lmcache_miss))
        for engine, hit, floor, miss in caches[:: 1 if r % 2 == 0 else -1]:
            t, hits = ttft(engine, p)
            hit.append(t)
            if engine is second:
                timings.hit_tokens = hits
            else:
                timings.lmcache_tokens = hits
            # The floor: the same prefix from vLLM's own cache (the engine just computed it),
            # a suffix of as many new tokens to compute.
            floor.append(ttft(engine, local, forget=False)[0])
            t, miss_hits = ttft(engine, q)
            assert miss_hits == 0, f"{engine.name} loaded {miss_hits} tokens of a prompt nothing holds"
            miss.append(t)
        timings.alone.append(ttft(alone, p)[0])
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


def report_lmcache(timings: Timings, memory: dict[str, tuple[HostMemory, HostMemory]]) -> None:
    """kvd against LMCache's server: the hits, the floors, the no-hit cost, the host memory
    (``memory``: each server's before and after the first engine stored the prefix)."""
    med = statistics.median
    kvd, lmcache = med(timings.hit), med(timings.lmcache)
    print(
        f"  LMCache MP server: lmcache-second TTFT {lmcache * 1000:.1f} ms ({timings.lmcache_tokens:,} prompt "
        f"tokens loaded from LMCache), its own-cache floor {med(timings.lmcache_local) * 1000:.1f} ms (LMCache "
        f"takes {lmcache / med(timings.lmcache_local):.2f}x it)"
    )
    pairs = [a / b for a, b in zip(timings.hit, timings.lmcache)]  # each repeat's two hits ran back to back
    print(
        f"  kvd hit / LMCache hit {kvd / lmcache:.2f}x (target <= 0.8; medians' ratio; the repeats' ratios "
        f"{'; '.join(f'{r:.2f}' for r in pairs)}, median {med(pairs):.2f})"
    )
    print(
        f"  no hit: TTFT with LMCache {med(timings.lmcache_miss) * 1000:.1f} ms -> overhead "
        f"{(med(timings.lmcache_miss) / med(timings.miss_alone) - 1) * 100:+.1f} % (kvd's above)"
    )
    for name, (before, after) in memory.items():
        print(
            f"  {name} host memory: {after.total / 2**20:.1f} MiB after the prefix was stored "
            f"({(after.total - before.total) / 2**20:+.1f} MiB for it; /dev/shm {after.shm_bytes / 2**20:.1f} MiB "
            f"resident, private {after.anon_bytes / 2**20:.1f} MiB)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", type=int, default=16384)
    parser.add_argument("--suffix", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--host-gib", type=int, default=4, help="host memory for KV: kvd's budget, LMCache's L1")
    parser.add_argument("--no-lmcache", action="store_true", help="leave LMCache's configuration out")
    args = parser.parse_args()
    if not args.no_lmcache and (why := lmcache_mp.missing()):
        sys.exit(why)

    from test_vllm_connector import Engine, unlink_vllm_shared_memory

    os.environ["VLLM_ENGINE_MAX_MODEL_LEN"] = str(args.prefix + args.suffix + 64)  # read by tests/vllm_engine.py

    rng = np.random.default_rng(0)

    def ids(n: int) -> list[int]:
        return [int(t) for t in rng.integers(1, 999, n)]

    with tempfile.TemporaryDirectory() as workdir:
        model = os.path.join(workdir, "model")
        write_model(model, args.layers, args.hidden)
        socket = os.path.join(workdir, "kvd.sock")
        daemon = DaemonProcess.start(
            socket,
            "--enable-prefix-reuse",
            "--host-bytes",
            f"{args.host_gib}GiB",
            log_path=os.path.join(workdir, "kvd.log"),
        )
        engines = {
            name: Engine(name, model, workdir, None if name == "alone" else socket)
            for name in ("first", "second", "alone")
        }
        servers = {"kvd": daemon.process.pid}
        server = None
        try:
            if not args.no_lmcache:
                server = lmcache_mp.LMCacheServer.start(workdir, args.host_gib)
                servers["LMCache"] = server.process.pid
                for name in ("lmcache-first", "lmcache-second"):
                    engines[name] = Engine(
                        name, model, workdir, server.address, env=server.engine_env(), python=lmcache_mp.python()
                    )
            for engine in engines.values():
                engine.wait_ready(timeout=600)
            second, alone, lmcache = engines["second"], engines["alone"], engines.get("lmcache-second")
            prefix, own = ids(args.prefix), ids(args.suffix)
            memory = {}
            for name, pid in servers.items():
                before = host_memory(pid)
                writer = engines["first" if name == "kvd" else "lmcache-first"]
                writer.generate([{"tokens": prefix + own}], max_tokens=1)
                writer.stop()  # its pages stay in the server; an idle engine would only take CPU from the timed ones
                memory[name] = (before, host_memory(pid))
            for engine in (second, alone, lmcache):  # warm-up: first-call costs land in no timed figure
                if engine is not None:
                    engine.generate([{"tokens": ids(args.prefix + args.suffix)}], max_tokens=1)
            timings = measure(second, alone, lmcache, prefix, ids, args)
            report(args, timings)
            if lmcache is not None:
                report_lmcache(timings, memory)
        finally:
            for engine in engines.values():
                engine.stop()
            if server is not None:
                server.stop()
            daemon.stop()
            daemon.clean()
            unlink_vllm_shared_memory(set().union(*(e.shared_memory for e in engines.values())))


if __name__ == "__main__":
    main()
