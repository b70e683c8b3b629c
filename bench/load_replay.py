"""The request mix of bench/bench_vllm_load.py, and its engine-free mode: KVDConnector's kvd
calls replayed from many client processes against a real daemon.

Each client process plays one vLLM engine with its connector: a scheduler session and a
worker session, stepping every `step_s` seconds (an engine step), requests arriving as a
Poisson stream. Per step it makes the calls gpu_worker/vllm/lookahead.py and worker.py make:

- the scheduler half's lookahead (a thread of its own in vLLM; here in the step): one
  `lookup` of every request that arrived since its last turn (the prompt's full blocks
  short of the last token), one `release` of the holds let go, one `allocate_with_prefix`
  holding the new hits;
- worker: one `release` of the finished requests' sequences, one `allocate_with_prefix`
  of the new requests' prompts, one `extend_batch` for the requests whose generated tokens
  filled a block, one `publish` of every sequence with new full blocks (the worker's
  saver thread, gpu_worker/vllm/saver.py, makes them once per turn, for every step handed
  since its last; here once per step: a turn per step is the most it makes). Page
  bytes are not written: the daemon does not read them on these paths (it checksums
  them after a publish, whatever they hold).

A request is prefilled in its first step and generates one token a step.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np
from footprint import cpu_seconds

from engine_client import ExtendItem, KVDClient, PageLayout, SequenceRequest

BLOCK = 32  # vLLM's block size on the CPU backend, kvd's page size here
# Small pages: the replay loads the control plane; real page bytes are the engine mode's.
LAYOUT = PageLayout(num_layers=2, num_kv_heads=1, head_dim=16, page_size=BLOCK, dtype="float16")
METHODS = ("Lookup", "AllocateWithPrefix", "Extend", "Publish", "Release")


@dataclass(frozen=True)
class Mix:
    """A stream's requests: a fraction start with one of a few long shared prefixes (a
    system prompt) and add a suffix of their own; the others are unique prompts as long."""

    prefix_tokens: int = 2048
    suffix_tokens: int = 128
    shared_fraction: float = 0.5  # 0: every prompt unique ("no hits")
    prefixes: int = 4
    output_tokens: int = 32

    def check(self) -> None:
        if self.prefix_tokens < BLOCK or self.suffix_tokens < 1 or self.output_tokens < 1 or self.prefixes < 1:
            raise ValueError(
                f"the mix needs a prefix of at least {BLOCK} tokens, a suffix and an output of at least "
                f"1 token and at least 1 prefix: {self}"
            )
        if not 0.0 <= self.shared_fraction <= 1.0:
            raise ValueError(f"the shared fraction must lie in [0, 1]: {self.shared_fraction}")

    def shared_prefixes(self, rng: np.random.Generator) -> list[list[int]]:
        return [ids(rng, self.prefix_tokens) for _ in range(self.prefixes)]

    def prompt(self, rng: np.random.Generator, prefixes: list[list[int]]) -> list[int]:
        if rng.random() < self.shared_fraction:
            return prefixes[int(rng.integers(len(prefixes)))] + ids(rng, self.suffix_tokens)
        return ids(rng, self.prefix_tokens + self.suffix_tokens)


def ids(rng: np.random.Generator, n: int) -> list[int]:
    """Random token ids of the bench models' vocabulary (1,000; 0 left out)."""
    return [int(t) for t in rng.integers(1, 999, n)]


# ---- one simulated engine ------------------------------------------------------------


@dataclass
class _Request:
    seq_id: str
    tokens: list[int]  # the prompt's full blocks, then each generated block once full
    generated: int = 0
    pinned: bool = False


@dataclass
class LevelResult:
    """One client's figures for one offered rate."""

    requests: int = 0
    hits: int = 0  # requests whose lookup found a hit
    latencies: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


class _Engine:
    """One engine's connector calls (both halves), step by step."""

    def __init__(self, socket: str, name: str, mix: Mix, step_s: float, seed: int) -> None:
        self.sched = KVDClient.connect(socket, client_name=f"{name}-scheduler")
        self.worker = KVDClient.connect(socket, client_name=f"{name}-worker")
        self.ns = self.sched.register_namespace("bench-load-replay", LAYOUT)
        assert self.worker.register_namespace("bench-load-replay", LAYOUT) == self.ns
        self.name, self.mix, self.step_s = name, mix, step_s
        self.rng = np.random.default_rng(seed)
        self.prefixes = mix.shared_prefixes(np.random.default_rng(0))  # the same in every client: hits across them
        self.running: list[_Request] = []
        self.finished: list[str] = []  # worker sequences to release with the next step
        self.unpinned: list[str] = []  # scheduler pins to release with the next step
        self.count = 0

    def _call(self, result: LevelResult, method: str, action):
        start = time.perf_counter()
        out = action()
        result.latencies[method].append(time.perf_counter() - start)
        return out

    def run_level(self, rate: float, seconds: float) -> LevelResult:
        """Poisson arrivals at `rate` requests/s for `seconds`, then steps until every request
        finished and was released."""
        result = LevelResult()
        start = time.perf_counter()
        arrival = start + self.rng.exponential(1 / rate)
        while True:
            step_start = time.perf_counter()
            new = []
            while arrival <= step_start and arrival < start + seconds:
                self.count += 1
                full = self.mix.prompt(self.rng, self.prefixes)
                new.append(_Request(f"{self.name}-{self.count}", full[: (len(full) - 1) // BLOCK * BLOCK]))
                arrival += self.rng.exponential(1 / rate)
            if not new and not self.running and not self.finished and not self.unpinned:
                if step_start >= start + seconds:
                    return result
            self._step(result, new)
            time.sleep(max(0.0, step_start + self.step_s - time.perf_counter()))

    def _step(self, result: LevelResult, new: list[_Request]) -> None:
        result.requests += len(new)
        ns, call = self.ns, self._call
        hits = self._schedule(result, new)
        # the scheduler half's lookahead: release the holds let go, hold the new hits
        if self.unpinned:
            call(result, "Release", lambda: self.sched.release(ns, self.unpinned))
            self.unpinned = []
        if hits:
            call(result, "AllocateWithPrefix", lambda: self.sched.allocate_with_prefix(ns, hits))
        # the worker: release the finished, allocate the new, extend and publish what filled a block
        if self.finished:
            call(result, "Release", lambda: self.worker.release(ns, self.finished))
            self.finished = []
        if new:
            requests = [SequenceRequest(r.seq_id, r.tokens) for r in new]
            call(result, "AllocateWithPrefix", lambda: self.worker.allocate_with_prefix(ns, requests))
        self.running += new
        grown = []
        for r in self.running:
            r.generated += 1
            if r.generated % BLOCK == 0 and r.generated < self.mix.output_tokens:  # the last token has no KV yet
                grown.append(r)
        if grown:
            items = [ExtendItem(r.seq_id, BLOCK, token_ids=ids(self.rng, BLOCK)) for r in grown]
            call(result, "Extend", lambda: self.worker.extend_batch(ns, items))
            for r, item in zip(grown, items):
                r.tokens += item.token_ids
        publish = {r.seq_id: len(r.tokens) for r in new + grown if r.tokens}
        if publish:
            call(result, "Publish", lambda: self.worker.publish(ns, list(publish), publish))
        done = [r for r in self.running if r.generated >= self.mix.output_tokens]
        self.running = [r for r in self.running if r.generated < self.mix.output_tokens]
        self.finished = [r.seq_id for r in done]
        self.unpinned = ["pin-" + r.seq_id for r in done if r.pinned]

    def _schedule(self, result: LevelResult, new: list[_Request]) -> list[SequenceRequest]:
        """The lookahead's turn (gpu_worker/vllm/lookahead.py): one lookup of every request
        that arrived since the last one; the holds of those that hit (their tokens up to the hit)."""
        if not new:
            return []
        wanted = [SequenceRequest(r.seq_id, r.tokens) for r in new]
        found = self._call(result, "Lookup", lambda: self.sched.lookup(self.ns, wanted))
        holds = []
        for r, hit in zip(new, found):
            if hit.hit_tokens:
                result.hits += 1
                r.pinned = True
                holds.append(SequenceRequest("pin-" + r.seq_id, r.tokens[: hit.hit_tokens]))
        return holds

    def close(self) -> None:
        self.sched.close()
        self.worker.close()


def _client_main(socket: str, index: int, mix: Mix, step_s: float, channel) -> None:
    """A client process: runs each level its channel names, answers its figures."""
    engine = _Engine(socket, f"engine{index}", mix, step_s, seed=1000 + index)
    channel.send("ready")
    try:
        while (command := channel.recv()) is not None:
            rate, seconds = command
            result = engine.run_level(rate, seconds)
            channel.send((result.requests, result.hits, {m: np.array(v) for m, v in result.latencies.items()}))
    finally:
        engine.close()


class ReplayClients:
    """`count` client processes (spawned: no gRPC state crosses a fork), one engine each."""

    def __init__(self, socket: str, count: int, mix: Mix, step_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.channels, self.processes = [], []
        for index in range(count):
            mine, theirs = context.Pipe()
            process = context.Process(target=_client_main, args=(socket, index, mix, step_s, theirs), daemon=True)
            process.start()
            self.channels.append(mine)
            self.processes.append(process)
        for channel, process in zip(self.channels, self.processes):
            if not channel.poll(60) or channel.recv() != "ready":
                self.close()
                raise RuntimeError(f"replay client {process.pid} did not start")

    def level(self, rate: float, seconds: float) -> tuple[int, int, dict[str, np.ndarray]]:
        """Every client at `rate` / count requests/s at once: (requests, hits, latencies by method)."""
        for channel in self.channels:
            channel.send((rate / len(self.channels), seconds))
        requests, hits, latencies = 0, 0, defaultdict(list)
        for channel in self.channels:
            if not channel.poll(seconds + 120):
                raise RuntimeError("a replay client did not finish its level")
            n, h, lat = channel.recv()
            requests, hits = requests + n, hits + h
            for method, values in lat.items():
                latencies[method].append(values)
        return requests, hits, {m: np.concatenate(v) for m, v in latencies.items()}

    def close(self) -> None:
        for channel, process in zip(self.channels, self.processes):
            try:
                channel.send(None)
            except (BrokenPipeError, OSError):
                pass
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


# ---- the daemon's side ---------------------------------------------------------------


@dataclass(frozen=True)
class DaemonCounters:
    """A scrape of the daemon's metrics: calls answered and the latency histogram's
    cumulative bucket counts (upper bound in seconds -> calls), per method."""

    calls: dict[str, float]
    buckets: dict[str, dict[float, float]]

    @classmethod
    def scrape(cls, metrics_port: int) -> DaemonCounters:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        calls, buckets = {}, defaultdict(dict)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvd_request_seconds_count":
                    calls[s.labels["method"]] = s.value
                elif s.name == "kvd_request_seconds_bucket":
                    buckets[s.labels["method"]][float(s.labels["le"])] = s.value
        return cls(calls, dict(buckets))

    def since(self, before: DaemonCounters, methods=METHODS) -> tuple[dict[str, int], float | None]:
        """Calls per method since `before`, and the p99 of their latency inside the daemon
        (linear within the histogram's bucket; None without calls)."""
        calls = {m: int(self.calls.get(m, 0) - before.calls.get(m, 0)) for m in methods}
        merged: dict[float, float] = defaultdict(float)
        for m in methods:
            for le, n in self.buckets.get(m, {}).items():
                merged[le] += n - before.buckets.get(m, {}).get(le, 0)
        return calls, histogram_quantile(dict(merged), 0.99)


def histogram_quantile(cumulative: dict[float, float], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket that holds the quantile."""
    bounds = sorted(cumulative)
    if not bounds or cumulative[bounds[-1]] == 0:
        return None
    rank = q * cumulative[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        if cumulative[le] >= rank:
            if le == float("inf"):
                return lower  # beyond the last finite bound: its lower edge, as Prometheus does
            return lower + (le - lower) * (rank - below) / max(cumulative[le] - below, 1e-12)
        lower, below = le, cumulative[le]
    return lower


# ---- the engine-free mode --------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """The daemon under one offered request rate, all clients together."""

    offered: float  # requests/s
    achieved: float  # requests admitted / seconds of arrivals
    requests: int
    hit_fraction: float  # requests whose lookup hit
    calls_per_request: float
    p50_ms: float  # call latency seen by the clients (every method)
    p99_ms: float
    daemon_p99_ms: float | None  # inside the daemon (its histogram), None without metrics
    daemon_cpu_ms_per_request: float
    daemon_cpu_share: float  # of one core, over the level's wall time


def replay(
    socket: str,
    daemon_pid: int,
    rates: list[float],
    clients: int,
    seconds: float,
    mix: Mix,
    step_s: float,
    metrics_port: int | None = None,
) -> list[Level]:
    """The connector's call pattern at each offered rate in turn (see the module docstring),
    after a warm-up at the first."""
    runner = ReplayClients(socket, clients, mix, step_s)
    levels = []
    try:
        runner.level(rates[0], seconds)  # warm-up, not reported: first calls open token buffers, extents
        for rate in rates:
            before = DaemonCounters.scrape(metrics_port) if metrics_port else None
            cpu, wall = cpu_seconds(daemon_pid), time.perf_counter()
            requests, hits, latencies = runner.level(rate, seconds)
            cpu, wall = cpu_seconds(daemon_pid) - cpu, time.perf_counter() - wall
            every = np.concatenate(list(latencies.values())) if latencies else np.zeros(1)
            daemon_p99 = DaemonCounters.scrape(metrics_port).since(before)[1] if before else None
            levels.append(
                Level(
                    offered=rate,
                    achieved=requests / seconds,
                    requests=requests,
                    hit_fraction=hits / max(requests, 1),
                    calls_per_request=len(every) / max(requests, 1),
                    p50_ms=float(np.percentile(every, 50)) * 1000,
                    p99_ms=float(np.percentile(every, 99)) * 1000,
                    daemon_p99_ms=None if daemon_p99 is None else daemon_p99 * 1000,
                    daemon_cpu_ms_per_request=cpu * 1000 / max(requests, 1),
                    daemon_cpu_share=cpu / wall,
                )
            )
    finally:
        runner.close()
    return levels


def saturation(levels: list[Level], key: str = "p99_ms") -> float | None:
    """The offered rate at which a p99 (`key`: as the clients see it, or `daemon_p99_ms`)
    reaches twice its value at the lowest rate (geometric interpolation between the two
    levels around it); None when it never does or the daemon's histogram is missing."""
    values = [getattr(v, key) for v in levels]
    if any(x is None for x in values):
        return None
    base = values[0]
    for (low, a), (high, b) in zip(zip(levels, values), zip(levels[1:], values[1:])):
        if b >= 2 * base:
            t = min(max((2 * base - a) / (b - a), 0.0), 1.0) if b > a else 1.0
            return low.offered * (high.offered / low.offered) ** t
    return None
