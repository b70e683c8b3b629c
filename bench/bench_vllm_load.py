"""One kvd daemon for a busy host (issue 25d): vLLM engines under a stream of requests, and
the daemon's saturation point without engines.

    python bench/bench_vllm_load.py [--engines 2] [--requests 16] [--concurrency 4] [--rounds 2] [--leads] [--in-turns]
                                    [--configs alone,own cache,kvd,LMCache] [--no-lmcache] [--host-gib 3]
    python bench/bench_vllm_load.py --replay [--clients 8] [--rates 10,20,40,...,1280] [--seconds 3]

**Engine mode** (the default). A random Llama (bench/bench_vllm.py's `write_model`) is
written to a temporary directory and one kvd daemon started. Configurations of
`--engines` real vLLM processes each (CPU backend, bench/load_engine.py) start at once:

- `alone`: vLLM without a connector, its own prefix cache off;
- `own cache`: vLLM with its own prefix cache, no connector;
- `kvd`: vLLM with KVDConnector on the daemon (and its own prefix cache on, as deployed);
- `LMCache` (issue 32): vLLM with LMCacheMPConnector on one LMCache multi-process server
  (bench/lmcache_mp.py; its own prefix cache on), run from LMCache's venv: without it
  (`make setup-lmcache` builds it) the benchmark says so and stops; `--no-lmcache` leaves
  it out. `--configs` picks configurations (all four by default) where memory is short.

Two workloads, each a stream of `--requests` prompts routed round-robin to a
configuration's engines, `--concurrency` in flight per engine (a request is added when
one finishes): "no hits" (every prompt unique) and "shared prefixes" (`--shared-fraction`
of the prompts start with one of `--prefixes` long prefixes, a "system prompt", the rest
are unique and as long). Every configuration answers the same stream; a new stream (new
prefixes too) is drawn for each round, so no configuration finds the last round's pages.

Side by side in one run, **all configurations at the same time**: all engines stay up and
each round runs the stream on every configuration's engines at once. They
split the box's cores, the one that needs less compute finishes first, and the box's noise
(other jobs on a shared machine) falls on all alike: with no hits `alone` and `own cache`,
which do the same work, come out within ~1 % (bench/RESULTS.md). `--in-turns` runs them one
after another instead (the order rotating between rounds): each gets the whole box, but
the noise differs from turn to turn (±10–25 % measured on a shared 2-core box).
`--leads` puts each shared prefix's first request first in the stream (a system prompt
computed once, agents branching off it later), the pattern where engines that share no
cache compute the prefix again. Throughput is output tokens over the slowest engine's time
from its first request to its last finished. For `kvd` the daemon's Prometheus metrics
give the calls per method, every method the engines called (its latency histogram's counts), and its p99 call latency
(`kvd_request_seconds`, interpolated inside the histogram's bucket as Prometheus does),
each as a difference over that configuration's turn. Every configuration reports TTFT p50
and p99 (each request's time from being added to its first token); `kvd` and `LMCache`
their server's CPU seconds per request (its process tree, /proc) and its host memory
after each round (resident /dev/shm pages and private memory, bench/footprint.py).

Targets (issue 25): no hits, `kvd` ≥ 0.97× `alone`; shared prefixes, `kvd` above `own cache`.
Targets (issue 32), against `LMCache`: shared prefixes, ≥ 1.1× its throughput; no hits, at
least its throughput; no more host memory and no more server CPU per request.

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

import lmcache_mp  # noqa: E402
from footprint import cpu_seconds, host_memory  # noqa: E402
from load_replay import BLOCK, DaemonCounters, Mix, ids, replay, saturation  # noqa: E402

from engine_client.launch import DaemonProcess  # noqa: E402

LOAD_ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "load_engine.py")
CONFIGS = ("alone", "own cache", "kvd", "LMCache")
SERVED = ("kvd", "LMCache")  # the configurations with a server: its CPU and host memory are measured
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


def configs(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(","))
    if unknown := [c for c in chosen if c not in CONFIGS]:
        raise argparse.ArgumentTypeError(f"unknown configuration(s) {unknown}: choose among {', '.join(CONFIGS)}")
    return tuple(c for c in CONFIGS if c in chosen)


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
    eng.add_argument(
        "--configs",
        type=configs,
        default=CONFIGS,
        help=f"the configurations to run, comma-separated (default: {','.join(CONFIGS)})",
    )
    eng.add_argument("--no-lmcache", action="store_true", help="leave LMCache's configuration out")
    eng.add_argument(
        "--host-gib",
        type=positive_float,
        default=3,
        help="host memory for KV: kvd's budget, LMCache's L1 (one the first round fills shows the steady state)",
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
    if args.no_lmcache:
        args.configs = tuple(c for c in args.configs if c != "LMCache")
    if not args.replay and "LMCache" in args.configs and (why := lmcache_mp.missing()):
        parser.exit(2, why + "\n")
    return args


def mix_of(args, shared_fraction: float) -> Mix:
    return Mix(args.prefix, args.suffix, shared_fraction, args.prefixes, args.output)


# ---- engine mode -------------------------------------------------------------------------


def load_engine_class():
    """tests/test_vllm_connector.py's `Engine` driver, starting bench/load_engine.py."""
    import test_vllm_connector

    class LoadEngine(test_vllm_connector.Engine):
        def __init__(self, name, model, workdir, kvd_socket, prefix_caching: bool, server=None) -> None:
            """``server``: an LMCacheServer, whose venv's python runs the engine on it."""
            env = {"KVD_LOAD_PREFIX_CACHING": "1" if prefix_caching else "0"}
            python = sys.executable
            if server is not None:
                env, python, kvd_socket = {**env, **server.engine_env()}, lmcache_mp.python(), server.address
            with mock.patch.object(test_vllm_connector, "ENGINE", LOAD_ENGINE):
                super().__init__(name, model, workdir, kvd_socket, env=env, python=python)

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
    total["ttfts"] = [t for a in answers for t in a["ttfts"]]
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

    needed = len(args.configs) * args.engines * ENGINE_BYTES
    if available_bytes() < needed:  # an engine the kernel kills mid-run would only leave a traceback
        sys.exit(
            f"{len(args.configs) * args.engines} vLLM engines need ~{needed / 2**30:.1f} GiB of memory; "
            f"{available_bytes() / 2**30:.1f} GiB is available now: lower --engines, choose fewer --configs "
            "or wait for other jobs"
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
            f"{args.host_gib}GiB",
            log_path=os.path.join(workdir, "kvd.log"),
        )
        server = lmcache_mp.LMCacheServer.start(workdir, args.host_gib) if "LMCache" in args.configs else None
        pids = {"kvd": daemon.process.pid, "LMCache": server.process.pid if server else None}
        engines = {
            config: [
                LoadEngine(
                    f"{config.replace(' ', '_')}{i}",
                    model,
                    workdir,
                    socket if config == "kvd" else None,
                    config != "alone",
                    server if config == "LMCache" else None,
                )
                for i in range(args.engines)
            ]
            for config in args.configs
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
                    shift = r % len(args.configs)
                    order = args.configs[shift:] + args.configs[:shift]
                    turns = [[config] for config in order] if args.in_turns else [order]
                    for turn in turns:
                        before = DaemonCounters.scrape(port)
                        cpu = {c: cpu_seconds(pids[c]) for c in SERVED if c in turn}
                        memory = {c: host_memory(pids[c]).total for c in SERVED if c in turn}
                        totals = run_configs({config: engines[config] for config in turn}, stream, args)
                        for config, total in totals.items():
                            if config in SERVED:
                                total["server_cpu"] = cpu_seconds(pids[config]) - cpu[config]
                                total["memory_growth"] = host_memory(pids[config]).total - memory[config]
                                total["memory"] = host_memory(pids[config]).total
                            if config == "kvd":
                                after = DaemonCounters.scrape(port)  # every method: the workers' too
                                total["calls"], total["p99"] = after.since(before, tuple(after.calls))
                            results.setdefault((workload, config), []).append(total)
                            shown = {k: v for k, v in total.items() if k != "ttfts"}
                            print(f"  {workload}, round {r + 1}, {config}: {shown}", flush=True)
                        load.append(os.getloadavg()[0])
            report(args, results, load)
        finally:
            for engine in every:
                engine.stop()
            if server is not None:
                server.stop()
            daemon.stop()
            daemon.clean()
            unlink_vllm_shared_memory(set().union(*(e.shared_memory for e in every)))


def report(args, results: dict, load: list[float]) -> None:
    print(
        f"\n{args.engines} vLLM engines per configuration (CPU backend), random Llama {args.layers} layers x hidden "
        f"{args.hidden}, float32; {args.requests} requests a round x {args.rounds} round(s), {args.concurrency} in "
        f"flight per engine, prompts {args.prefix + args.suffix} tokens, {args.output} generated; shared workload: "
        f"{args.shared_fraction:.0%} of prompts on one of {args.prefixes} prefixes of {args.prefix} tokens "
        f"(new ones each round); host memory for KV {args.host_gib} GiB per server; load average "
        f"{min(load):.1f}-{max(load):.1f} during the turns"
    )
    for workload in WORKLOADS:
        print(f"\n{workload}:")
        print(
            "  configuration | output tok/s | TTFT p50 ms | TTFT p99 ms | prompt tokens cached (vLLM's count) "
            "| of them from the connector | seconds"
        )
        rate = {}
        for config in args.configs:
            runs = results[(workload, config)]
            out, secs = sum(r["output_tokens"] for r in runs), sum(r["seconds"] for r in runs)
            rate[config] = out / secs
            prompt, cached = sum(r["prompt_tokens"] for r in runs), sum(r["cached_tokens"] for r in runs)
            external = sum(r["external_tokens"] for r in runs)
            p50, p99 = np.percentile([t for r in runs for t in r["ttfts"]], [50, 99]) * 1000
            print(
                f"  {config:13} | {rate[config]:12.1f} | {p50:11.1f} | {p99:11.1f} | {cached:>9,} of {prompt:,} "
                f"({cached / prompt:5.1%}) | {external:>9,} | {secs:7.2f}"
            )
        if "kvd" in args.configs:
            report_ratios(args, results, workload, rate)
        for config in SERVED:
            if config in args.configs:
                report_server(args, results[(workload, config)], config)


def report_ratios(args, results: dict, workload: str, rate: dict[str, float]) -> None:
    """kvd's throughput over each other configuration's, overall and round by round."""
    others = [c for c in args.configs if c != "kvd"]
    if not others:
        return
    per_round = [
        {c: results[(workload, c)][r]["output_tokens"] / results[(workload, c)][r]["seconds"] for c in args.configs}
        for r in range(args.rounds)
    ]
    overall = ", ".join(f"kvd / {c} {rate['kvd'] / rate[c]:.3f}x" for c in others)
    spread = "; ".join(" / ".join(f"{t['kvd'] / t[c]:.2f}" for c in others) for t in per_round)
    print(f"  {overall} (all rounds' tokens over their seconds; round by round: {spread})")


def report_server(args, runs: list[dict], config: str) -> None:
    """A server's CPU per request and host memory over the workload's rounds; kvd's calls."""
    requests = args.requests * len(runs)
    line = (
        f"  {config} server: CPU {sum(r['server_cpu'] for r in runs) * 1000 / requests:.2f} ms per request ("
        + ", ".join(f"{r['server_cpu'] * 1000 / args.requests:.2f}" for r in runs)
        + " round by round); host "
        f"memory {runs[-1]['memory'] / 2**20:.0f} MiB after the workload ("
        + ", ".join(f"{r['memory_growth'] / 2**20:+.0f}" for r in runs)
        + " MiB round by round)"
    )
    if config == "kvd":
        methods = sorted(set().union(*(r["calls"] for r in runs)))
        calls = {m: n for m in methods if (n := sum(r["calls"].get(m, 0) for r in runs))}
        per_request = ", ".join(f"{m} {n / requests:.2f}" for m, n in calls.items())
        p99 = max((r["p99"] for r in runs if r["p99"] is not None), default=None)
        line += (
            f"; calls per request {sum(calls.values()) / requests:.2f} ({per_request}); p99 call latency in the "
            f"daemon {p99 * 1000 if p99 is not None else float('nan'):.2f} ms (kvd_request_seconds histogram)"
        )
    print(line)


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
