"""One kvd daemon for a busy host (issue 25d): vLLM engines under a stream of requests, and
the daemon's saturation point without engines.

    python bench/bench_vllm_load.py [--engines 2] [--requests 16] [--concurrency 4] [--rounds 2] [--leads] [--in-turns]
    python bench/bench_vllm_load.py --replay [--clients 8] [--rates 10,20,40,...,1280] [--seconds 3]

**Engine mode** (the default). A random Llama (bench/bench_vllm.py's `write_model`) is
written to a temporary directory and one kvd daemon started. Three configurations of
`--engines` real vLLM processes each (CPU backend, bench/load_engine.py) start at once:

- `alone`: vLLM without a connector, its own prefix cache off;
- `own cache`: vLLM with its own prefix cache, no connector;
- `kvd`: vLLM with KVDConnector on the daemon (and its own prefix cache on, as deployed).

Two workloads, each a stream of `--requests` prompts routed round-robin to a
configuration's engines, `--concurrency` in flight per engine (a request is added when
one finishes): "no hits" (every prompt unique) and "shared prefixes" (`--shared-fraction`
of the prompts start with one of `--prefixes` long prefixes, a "system prompt", the rest
are unique and as long). Every configuration answers the same stream; a new stream (new
prefixes too) is drawn for each round, so no configuration finds the last round's pages.

Side by side in one run, **all configurations at the same time**: all engines stay up and
each round runs the stream on the `alone`, `own cache` and `kvd` engines at once. They
split the box's cores, the one that needs less compute finishes first, and the box's noise
(other jobs on a shared machine) falls on all alike: with no hits `alone` and `own cache`,
which do the same work, come out within ~1 % (bench/RESULTS.md). `--in-turns` runs them one
after another instead (the order rotating between rounds): each gets the whole box, but
the noise differs from turn to turn (±10–25 % measured on a shared 2-core box).
`--leads` puts each shared prefix's first request first in the stream (a system prompt
computed once, agents branching off it later), the pattern where engines that share no
cache compute the prefix again. Throughput is output tokens over the slowest engine's time
from its first request to its last finished. For `kvd` the daemon's Prometheus metrics
give the calls per method (its latency histogram's counts) and its p99 call latency
(`kvd_request_seconds`, interpolated inside the histogram's bucket as Prometheus does),
and /proc/<pid>/stat its CPU seconds, each as a difference over that configuration's turn.

Targets (issue 25): no hits, `kvd` ≥ 0.97× `alone`; shared prefixes, `kvd` above `own cache`.

**Engine-free mode** (`--replay`): bench/load_replay.py replays the connector's calls per
engine step from `--clients` processes against a real daemon, at each offered request rate
of `--rates` (the same mix), and finds the daemon's saturation point: the rate at which
the p99 call latency the clients see reaches twice its value at the lowest rate.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from unittest import mock

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from load_replay import BLOCK, DaemonCounters, Mix, cpu_seconds, ids, replay, saturation  # noqa: E402

from engine_client.launch import DaemonProcess  # noqa: E402

LOAD_ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load_engine.py")
CONFIGS = ("alone", "own cache", "kvd")
WORKLOADS = {"no hits": 0.0, "shared prefixes": None}  # None: --shared-fraction


def _number(convert, kind: str, valid, requirement: str):
    """An argparse type: `convert`ed text that passes `valid`, else an error naming what was wrong."""

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        if not valid(value):
            raise argparse.ArgumentTypeError(f"{requirement}: {value}")
        return value

    return parse


positive_int = _number(int, "an integer", lambda v: v >= 1, "must be at least 1")
positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "must be a positive finite number")
fraction = _number(float, "a number", lambda v: 0.0 <= v <= 1.0, "must lie in [0, 1]")


def rates(text: str) -> list[float]:
    values = [positive_float(part) for part in text.split(",")]
    if any(b <= a for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"rates must increase: {text!r}")
    if len(values) < 2:
        raise argparse.ArgumentTypeError(f"give at least two rates (the first is the low-load reference): {text!r}")
    return values


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", action="store_true", help="the engine-free mode")
    mix = parser.add_argument_group("the request mix (both modes)")
    mix.add_argument("--prefix", type=positive_int, default=2048, help="tokens of a shared prefix")
    mix.add_argument("--suffix", type=positive_int, default=128, help="tokens after it (unique prompts: both)")
    mix.add_argument("--prefixes", type=positive_int, default=4, help="distinct shared prefixes")
    mix.add_argument("--shared-fraction", type=fraction, default=0.75, help="of the prompts, in the shared workload")
    mix.add_argument("--output", type=positive_int, default=32, help="tokens generated per request")
    eng = parser.add_argument_group("engine mode")
    eng.add_argument("--engines", type=positive_int, default=2, help="vLLM processes per configuration")
    eng.add_argument("--requests", type=positive_int, default=16, help="requests per workload and round")
    eng.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight per engine")
    eng.add_argument("--rounds", type=positive_int, default=2, help="turns of every configuration")
    eng.add_argument(
        "--in-turns",
        action="store_true",
        help="run the configurations one after another (each gets the whole box) rather than at the same time",
    )
    eng.add_argument(
        "--leads",
        action="store_true",
        help="each shared prefix's first request comes first in the stream (a system prompt computed once, "
        "then agents branching off it)",
    )
    eng.add_argument("--layers", type=positive_int, default=4)
    eng.add_argument("--hidden", type=positive_int, default=256, help="a multiple of 64")
    rep = parser.add_argument_group("engine-free mode (--replay)")
    rep.add_argument("--clients", type=positive_int, default=8, help="client processes, one engine each")
    rep.add_argument(
        "--rates", type=rates, default=rates("10,20,40,80,160,320,640,1280"), help="offered requests/s, rising"
    )
    rep.add_argument("--seconds", type=positive_float, default=3.0, help="of arrivals per rate")
    rep.add_argument("--step-ms", type=positive_float, default=25.0, help="an engine step")
    args = parser.parse_args(argv)
    if args.hidden % 64:
        parser.error(f"--hidden must be a multiple of 64 (heads of 64): {args.hidden}")
    if args.prefix < BLOCK:
        parser.error(f"--prefix must hold at least one {BLOCK}-token block: {args.prefix}")
    return args


def mix_of(args, shared_fraction: float) -> Mix:
    return Mix(args.prefix, args.suffix, shared_fraction, args.prefixes, args.output)


# ---- engine mode -------------------------------------------------------------------------


def load_engine_class():
    """tests/test_vllm_connector.py's `Engine` driver, starting bench/load_engine.py."""
    import test_vllm_connector

    class LoadEngine(test_vllm_connector.Engine):
        def __init__(self, name, model, workdir, kvd_socket, prefix_caching: bool) -> None:
            env = {"KVD_LOAD_PREFIX_CACHING": "1" if prefix_caching else "0"}
            with mock.patch.object(test_vllm_connector, "ENGINE", LOAD_ENGINE):
                super().__init__(name, model, workdir, kvd_socket, env=env)

        def run(self, prompts, max_tokens, concurrency) -> None:
            self.send("run", prompts, max_tokens, concurrency)

    return LoadEngine


def run_config(engines, stream: list[list[int]], args) -> dict:
    """The stream on one configuration's engines at once, round-robin; their totals."""
    for i, engine in enumerate(engines):
        engine.run(stream[i :: len(engines)], args.output, args.concurrency)
    answers = [engine.receive(timeout=900) for engine in engines]
    total = {k: sum(a[k] for a in answers) for k in ("output_tokens", "prompt_tokens", "cached_tokens")}
    total["external_tokens"] = sum(a["external_tokens"] for a in answers)
    total["seconds"] = max(a["seconds"] for a in answers)
    total["steps"] = sum(a["steps"] for a in answers)
    return total


def run_configs(engines: dict[str, list], stream: list[list[int]], args) -> dict[str, dict]:
    """The stream on each configuration's engines, all configurations at the same time."""
    totals: dict[str, dict] = {}
    threads = [
        threading.Thread(target=lambda c=config, g=group: totals.__setitem__(c, run_config(g, stream, args)))
        for config, group in engines.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return totals


ENGINE_BYTES = 2.1 * 2**30  # one engine's processes, resident (measured: caller 0.6 GiB, engine core 0.6, worker 0.9)


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def engine_mode(args) -> None:
    from bench_vllm import write_model
    from test_service import free_port
    from test_vllm_connector import unlink_vllm_shared_memory

    needed = len(CONFIGS) * args.engines * ENGINE_BYTES
    if available_bytes() < needed:  # an engine the kernel kills mid-run would only leave a traceback
        sys.exit(
            f"{len(CONFIGS) * args.engines} vLLM engines need ~{needed / 2**30:.1f} GiB of memory; "
            f"{available_bytes() / 2**30:.1f} GiB is available now: lower --engines or wait for other jobs"
        )
    os.environ["VLLM_ENGINE_MAX_MODEL_LEN"] = str(args.prefix + args.suffix + args.output + 64)
    LoadEngine = load_engine_class()
    with tempfile.TemporaryDirectory() as workdir:
        model = os.path.join(workdir, "model")
        write_model(model, args.layers, args.hidden)
        socket, port = os.path.join(workdir, "kvd.sock"), free_port()
        daemon = DaemonProcess.start(
            socket,
            "--enable-prefix-reuse",
            "--metrics-port",
            str(port),
            "--host-bytes",
            "3GiB",
            log_path=os.path.join(workdir, "kvd.log"),
        )
        engines = {
            config: [
                LoadEngine(
                    f"{config.replace(' ', '_')}{i}",
                    model,
                    workdir,
                    socket if config == "kvd" else None,
                    config != "alone",
                )
                for i in range(args.engines)
            ]
            for config in CONFIGS
        }
        every = [e for group in engines.values() for e in group]
        try:
            started = time.monotonic()
            for engine in every:
                engine.wait_ready(timeout=900)
            print(f"{len(every)} vLLM engines up in {time.monotonic() - started:.0f} s", flush=True)
            rng = np.random.default_rng(0)
            warm = [mix_of(args, 0.0).prompt(rng, []) for _ in range(2 * args.engines)]
            run_configs(engines, warm, args)  # warm-up: first-call costs land in no timed figure
            results, load = {}, [os.getloadavg()[0]]
            for workload, shared in WORKLOADS.items():
                mix = mix_of(args, args.shared_fraction if shared is None else shared)
                for r in range(args.rounds):
                    prefixes = mix.shared_prefixes(rng)
                    stream = [mix.prompt(rng, prefixes) for _ in range(args.requests)]
                    if args.leads and mix.shared_fraction:
                        stream = [p + ids(rng, mix.suffix_tokens) for p in prefixes] + stream[len(prefixes) :]
                    order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
                    turns = [[config] for config in order] if args.in_turns else [order]
                    for turn in turns:
                        before, cpu = DaemonCounters.scrape(port), cpu_seconds(daemon.process.pid)
                        totals = run_configs({config: engines[config] for config in turn}, stream, args)
                        for config, total in totals.items():
                            if config == "kvd":
                                total["daemon_cpu"] = cpu_seconds(daemon.process.pid) - cpu
                                total["calls"], total["p99"] = DaemonCounters.scrape(port).since(before)
                            results.setdefault((workload, config), []).append(total)
                            print(f"  {workload}, round {r + 1}, {config}: {total}", flush=True)
                        load.append(os.getloadavg()[0])
            report(args, results, load)
        finally:
            for engine in every:
                engine.stop()
            daemon.stop()
            daemon.clean()
            unlink_vllm_shared_memory(set().union(*(e.shared_memory for e in every)))


def report(args, results: dict, load: list[float]) -> None:
    print(
        f"\n{args.engines} vLLM engines per configuration (CPU backend), random Llama {args.layers} layers x hidden "
        f"{args.hidden}, float32; {args.requests} requests a round x {args.rounds} round(s), {args.concurrency} in "
        f"flight per engine, prompts {args.prefix + args.suffix} tokens, {args.output} generated; shared workload: "
        f"{args.shared_fraction:.0%} of prompts on one of {args.prefixes} prefixes of {args.prefix} tokens "
        f"(new ones each round); load average {min(load):.1f}-{max(load):.1f} during the turns"
    )
    for workload in WORKLOADS:
        print(f"\n{workload}:")
        print("  configuration | output tok/s | prompt tokens cached (vLLM's count) | of them from kvd | seconds")
        rate = {}
        for config in CONFIGS:
            runs = results[(workload, config)]
            out, secs = sum(r["output_tokens"] for r in runs), sum(r["seconds"] for r in runs)
            rate[config] = out / secs
            prompt, cached = sum(r["prompt_tokens"] for r in runs), sum(r["cached_tokens"] for r in runs)
            external = sum(r["external_tokens"] for r in runs)
            print(
                f"  {config:13} | {rate[config]:12.1f} | {cached:>9,} of {prompt:,} ({cached / prompt:5.1%}) "
                f"| {external:>9,} | {secs:7.2f}"
            )
        per_round = [
            {c: results[(workload, c)][r]["output_tokens"] / results[(workload, c)][r]["seconds"] for c in CONFIGS}
            for r in range(args.rounds)
        ]
        spread = "; ".join(f"{t['kvd'] / t['alone']:.2f} / {t['kvd'] / t['own cache']:.2f}" for t in per_round)
        print(
            f"  kvd / alone {rate['kvd'] / rate['alone']:.3f}x, kvd / own cache {rate['kvd'] / rate['own cache']:.3f}x "
            f"(all rounds' tokens over their seconds; round by round: {spread})"
        )
        runs = results[(workload, "kvd")]
        requests = args.requests * len(runs)
        calls = {m: sum(r["calls"][m] for r in runs) for m in runs[0]["calls"]}
        per_request = ", ".join(f"{m} {n / requests:.2f}" for m, n in calls.items())
        p99 = max((r["p99"] for r in runs if r["p99"] is not None), default=None)
        print(
            f"  kvd calls per request {sum(calls.values()) / requests:.2f} ({per_request}); "
            f"daemon CPU {sum(r['daemon_cpu'] for r in runs) * 1000 / requests:.2f} ms per request; "
            f"p99 call latency in the daemon {p99 * 1000 if p99 is not None else float('nan'):.2f} ms "
            "(kvd_request_seconds histogram)"
        )


# ---- engine-free mode --------------------------------------------------------------------


def replay_mode(args) -> None:
    from test_service import free_port

    mix = mix_of(args, args.shared_fraction)
    with tempfile.TemporaryDirectory() as workdir:
        socket, port = os.path.join(workdir, "kvd.sock"), free_port()
        daemon = DaemonProcess.start(
            socket,
            "--enable-prefix-reuse",
            "--metrics-port",
            str(port),
            "--host-bytes",
            "1GiB",
            log_path=os.path.join(workdir, "kvd.log"),
        )
        try:
            levels = replay(
                socket, daemon.process.pid, args.rates, args.clients, args.seconds, mix, args.step_ms / 1000, port
            )
        finally:
            daemon.stop()
            daemon.clean()
    print_replay(args, mix, levels)


def print_replay(args, mix: Mix, levels) -> None:
    print(
        f"engine-free replay: {args.clients} client processes (one engine each: a scheduler and a worker session), "
        f"a step every {args.step_ms:g} ms, {args.seconds:g} s of Poisson arrivals per rate; prompts "
        f"{mix.prefix_tokens + mix.suffix_tokens} tokens ({mix.shared_fraction:.0%} on one of {mix.prefixes} "
        f"shared prefixes), {mix.output_tokens} generated"
    )
    print(
        "  offered req/s | achieved | hit | calls/req | call p50 ms | call p99 ms | daemon p99 ms | "
        "daemon CPU ms/req | daemon CPU"
    )
    for v in levels:
        daemon_p99 = f"{v.daemon_p99_ms:13.2f}" if v.daemon_p99_ms is not None else f"{'-':>13}"
        print(
            f"  {v.offered:13g} | {v.achieved:8.1f} | {v.hit_fraction:3.0%} | {v.calls_per_request:9.2f} | "
            f"{v.p50_ms:11.2f} | {v.p99_ms:11.2f} | {daemon_p99} | {v.daemon_cpu_ms_per_request:17.3f} | "
            f"{v.daemon_cpu_share:10.0%}"
        )
    # The clients' p99 only: the daemon's histogram has buckets 0.5, 1, 2.5 ms wide around a low-load p99
    for key, seen in (("p99_ms", "seen by the clients"),):
        point, base = saturation(levels, key), getattr(levels[0], key)
        if base is None:
            continue
        if point is None:
            print(
                f"  saturation ({seen}): p99 stayed under 2x {base:.2f} ms (its value at {levels[0].offered:g} "
                f"req/s) up to {levels[-1].offered:g} req/s"
            )
        else:
            print(f"  saturation ({seen}): p99 call latency reaches 2x {base:.2f} ms at ~{point:.0f} requests/s")


def main(argv=None) -> None:
    args = parse_args(argv)
    # SIGTERM (a timeout, a CI cancel) ends the run through the cleanups below: engines, daemon, /dev/shm
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by SIGTERM"))
    if args.replay:
        replay_mode(args)
    else:
        engine_mode(args)


if __name__ == "__main__":
    main()
