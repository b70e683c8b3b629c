"""Demo: agents in separate engine processes share one long prompt's KV through kvd.

    python -m gpu_worker.demo [--engines 3] [--agents-per-engine 2] [--prefix-tokens 3000]
                              [--suffix-tokens 64] [--decode-tokens 8] [--family llama|gpt_oss]
                              [--device cpu|cuda] [--socket PATH]

The parent starts `kvd serve --enable-prefix-reuse` on a temporary socket (or uses the
daemon on `--socket`) and spawns the engine processes. Each builds the same tiny random
model in-process (fixed seed, no download) and an `Engine`, and holds a few agents whose
prompts are one shared prefix plus a few tokens of their own. Engine 1 prefills first and
publishes the prefix pages; the others then prefill with a prefix hit and compute only
their agents' own tokens. Every agent greedy-decodes a few tokens, and every engine checks
its agents' logits against a full recompute without any cache. The parent reads the
daemon's page counts while all agents are live, prints one table, lets the engines
complete their sequences, stops the daemon and exits 0, or 1 when a logit check failed
or the host held no page fewer than the agents address.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import queue
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from engine_client.launch import DaemonProcess
from gpu_worker.model import ModelRunner
from gpu_worker.tiny_model import LOGIT_TOLERANCE, recompute_logits, tiny_model

SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class DemoConfig:
    engines: int = 3
    agents_per_engine: int = 2
    prefix_tokens: int = 3000
    suffix_tokens: int = 64
    decode_tokens: int = 8
    family: str = "llama"
    page_size: int = 16
    device: str = "cpu"
    vocab_size: int = 512
    seed: int = 0

    @property
    def model_name(self) -> str:
        return f"kvd-demo-tiny-{self.family}"

    @property
    def revision(self) -> str:
        return f"random-seed-{self.seed}-vocab-{self.vocab_size}"


def agent_prompt(cfg: DemoConfig, agent: int) -> list[int]:
    """The shared prefix (the same for every agent) followed by the agent's own tokens."""
    shared = torch.randint(
        0, cfg.vocab_size, (cfg.prefix_tokens,), generator=torch.Generator().manual_seed(1000 + cfg.seed)
    )
    own = torch.randint(0, cfg.vocab_size, (cfg.suffix_tokens,), generator=torch.Generator().manual_seed(2000 + agent))
    return shared.tolist() + own.tolist()


# ---- one engine process -------------------------------------------------------------------


@dataclass(frozen=True)
class EngineReport:
    engine: int
    pid: int
    agents: tuple[str, ...]
    computed_tokens: int
    reused_tokens: int
    gpu_pages_loaded: int
    duplicate_loads_skipped: int
    gpu_logical_pages: int
    gpu_physical_pages: int
    max_logit_delta: float  # max |Δ| against a full recompute, over prompts and the last decode step
    generated: tuple[tuple[int, ...], ...]  # greedy tokens of each agent
    seconds: float  # from its start signal to its report: prefill, checks, decode


def run_engine(socket: str, cfg: DemoConfig, engine: int, go, finish, messages) -> None:
    """An engine process: prefill its agents (after `go`), decode, check, report, then wait
    for `finish` with its sequences live, complete them and close the session."""
    from engine_client import KVDClient
    from gpu_worker.engine import Engine

    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.engines))  # engines share the cores
        spec, weights = tiny_model(cfg.family, cfg.seed, cfg.vocab_size)
        runner = ModelRunner(spec, weights, device=cfg.device)
        first = engine * cfg.agents_per_engine
        agents = {f"agent-{a + 1}": agent_prompt(cfg, a) for a in range(first, first + cfg.agents_per_engine)}
        pages_per_agent = -(-(cfg.prefix_tokens + cfg.suffix_tokens + cfg.decode_tokens) // cfg.page_size) + 1
        with KVDClient.connect(socket, client_name=f"demo-engine-{engine + 1}") as client:
            eng = Engine(
                client,
                runner,
                spec,
                cfg.page_size,
                gpu_pages=pages_per_agent * len(agents),
                model=cfg.model_name,
                revision=cfg.revision,
            )
            go.wait()
            start = time.perf_counter()
            # The first agent's prefill publishes the shared prompt, so the engine's other agents
            # hit it: within one batch nothing is published yet and both would compute it.
            items = list(agents.items())
            results = eng.prefill(items[:1]) + (eng.prefill(items[1:]) if items[1:] else [])
            messages.put(("prefilled", engine))
            generated, delta = _decode_and_check(eng, runner, cfg, agents, results)
            stats = eng.stats()
            messages.put(
                (
                    "report",
                    EngineReport(
                        engine=engine + 1,
                        pid=os.getpid(),
                        agents=tuple(agents),
                        computed_tokens=stats.prefill_tokens_computed,
                        reused_tokens=stats.prefill_tokens_reused,
                        gpu_pages_loaded=stats.gpu.unique_host_pages_loaded,
                        duplicate_loads_skipped=stats.gpu.duplicate_loads_skipped,
                        gpu_logical_pages=stats.gpu.logical_pages,
                        gpu_physical_pages=stats.gpu.physical_pages,
                        max_logit_delta=delta,
                        generated=tuple(tuple(generated[s][: cfg.decode_tokens]) for s in agents),
                        seconds=time.perf_counter() - start,
                    ),
                )
            )
            finish.wait(timeout=300)
            eng.complete(list(agents))
    except BaseException as e:
        messages.put(("error", f"engine {engine + 1}: {type(e).__name__}: {e}"))
        raise


def _decode_and_check(eng, runner: ModelRunner, cfg: DemoConfig, agents: dict[str, list[int]], results):
    """Decodes the agents after their prefill ``results``; returns the tokens each generated
    and the largest logit difference against a recompute of the whole conversation (after
    the prefill and after the last decode step)."""
    delta = max(
        (r.logits - recompute_logits(runner, cfg.page_size, agents[r.seq_id])).abs().max().item() for r in results
    )
    generated = {r.seq_id: [r.next_token] for r in results}
    last = None
    for _ in range(cfg.decode_tokens - 1):
        last = eng.decode_step(list(agents))
        for s, t in zip(last.seq_ids, last.tokens):
            generated[s].append(t)
    if last is not None:
        for i, s in enumerate(last.seq_ids):
            ref = recompute_logits(runner, cfg.page_size, list(eng.info(s).tokens))
            delta = max(delta, (last.logits[i] - ref).abs().max().item())
    return generated, delta


# ---- the parent -----------------------------------------------------------------------------


def _next_message(messages, procs, timeout: float = 300.0):
    """The next message of any engine; raises if one died without a word or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            kind, body = messages.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"engine process {dead[0].pid} exited with {dead[0].exitcode}") from None
            continue
        if kind == "error":
            raise RuntimeError(body)
        return kind, body
    raise RuntimeError(f"no engine reported within {timeout} s")


@dataclass(frozen=True)
class DemoResult:
    reports: tuple[EngineReport, ...]
    live: dict  # the demo namespace's daemon page stats while every agent was live
    after: dict  # the same after the engines completed their sequences
    prefix_reuse: bool  # whether the daemon shares prefix pages at all
    violations: tuple[str, ...]
    seconds: float

    @property
    def max_logit_delta(self) -> float:
        return max(r.max_logit_delta for r in self.reports)

    @property
    def ok(self) -> bool:
        return (
            self.max_logit_delta <= LOGIT_TOLERANCE
            and self.live["physical_pages"] < self.live["logical_pages"]
            and not self.violations
        )


def run_demo(cfg: DemoConfig, socket: str | None = None) -> DemoResult:
    """Run the engines against the daemon on `socket`, or against one started for the run."""
    from engine_client import KVDClient
    from kvd.wire.admin import fetch_stats

    start = time.perf_counter()
    daemon = tmp = None
    if socket is None:  # a daemon of our own, in a temporary directory
        tmp = tempfile.TemporaryDirectory(prefix="kvd-demo-")
        socket = os.path.join(tmp.name, "kvd.sock")
        daemon = DaemonProcess(
            socket,
            ("--enable-prefix-reuse", "--host-bytes", "256MiB", "--extent-bytes", "8MiB", "--log-level", "WARNING"),
            log_path=os.path.join(tmp.name, "kvd.log"),
        )
    procs: list = []
    finish = SPAWN.Event()
    try:
        if daemon is not None:
            daemon.wait_ready(20.0)
        else:
            KVDClient.connect(socket, client_name="kvd-demo", timeout=5).close()  # fail early, clearly
        reports = _run_engines(cfg, socket, procs, finish)
        live = fetch_stats(socket)
        prefix_reuse = bool(live["prefix_reuse"])
        live = _ns_stats(live, cfg.model_name)
        with KVDClient.connect(socket, client_name="kvd-demo") as observer:
            violations = tuple(observer.check_invariants())
        finish.set()
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise RuntimeError(f"{p.name} exited with {p.exitcode}")
        after = _ns_stats(fetch_stats(socket), cfg.model_name)
    finally:
        finish.set()
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
        if daemon is not None:
            daemon.stop()
            daemon.clean()  # the demo's cache is not worth keeping for a warm restart
            tmp.cleanup()
    return DemoResult(
        tuple(reports[e] for e in sorted(reports)), live, after, prefix_reuse, violations, time.perf_counter() - start
    )


def _run_engines(cfg: DemoConfig, socket: str, procs: list, finish) -> dict[int, EngineReport]:
    """Starts the engine processes (into ``procs``) and returns their reports, by engine
    number, once each has decoded; they then wait for ``finish`` with their sequences live."""
    messages = SPAWN.Queue()
    go_first, go_rest = SPAWN.Event(), SPAWN.Event()
    # Every process starts now (imports overlap); engine 1 prefills first, the rest
    # after it has published.
    for engine in range(cfg.engines):
        go = go_first if engine == 0 else go_rest
        procs.append(
            SPAWN.Process(
                target=run_engine,
                args=(socket, cfg, engine, go, finish, messages),
                name=f"demo-engine-{engine + 1}",
            )
        )
    for p in procs:
        p.start()
    go_first.set()
    reports: dict[int, EngineReport] = {}
    while len(reports) < cfg.engines:
        kind, body = _next_message(messages, procs)
        if kind == "prefilled" and body == 0:
            go_rest.set()
        elif kind == "report":
            reports[body.engine] = body
    return reports


def _ns_stats(stats: dict, model: str) -> dict:
    """The demo namespace's page counts (the daemon may serve others on a shared socket)."""
    return next((n for n in stats["namespaces"] if n["model"] == model), stats)


def format_result(cfg: DemoConfig, result: DemoResult) -> str:
    live, after = result.live, result.after
    agents = cfg.engines * cfg.agents_per_engine
    reused = sum(r.reused_tokens for r in result.reports)
    computed = sum(r.computed_tokens for r in result.reports)
    loaded = sum(r.gpu_pages_loaded for r in result.reports)
    skipped = sum(r.duplicate_loads_skipped for r in result.reports)
    delta = result.max_logit_delta
    lines = [
        f"kvd demo: {cfg.engines} engine processes x {cfg.agents_per_engine} agents; one shared prompt of "
        f"{cfg.prefix_tokens:,} tokens + {cfg.suffix_tokens} own tokens per agent; "
        f"{cfg.decode_tokens} greedy tokens each",
        f"model: tiny random {cfg.family} (2 layers, hidden 64, 4/2 heads, vocab {cfg.vocab_size}, seed {cfg.seed}), "
        f"float32 on {cfg.device}, {cfg.page_size}-token pages",
        "",
        f"{'engine':>6}  {'pid':>7}  {'prefill computed':>16}  {'prefill reused':>14}  {'GPU pages loaded':>16}  "
        f"{'dup loads skipped':>17}  {'GPU logical/physical':>20}  {'max |dlogit|':>12}  {'secs':>5}  "
        "first tokens of each agent",
    ]
    for r in result.reports:
        firsts = " | ".join(" ".join(map(str, g[:4])) for g in r.generated)
        lines.append(
            f"{r.engine:>6}  {r.pid:>7}  {r.computed_tokens:>16,}  {r.reused_tokens:>14,}  {r.gpu_pages_loaded:>16,}  "
            f"{r.duplicate_loads_skipped:>17,}  {f'{r.gpu_logical_pages}/{r.gpu_physical_pages}':>20}  "
            f"{r.max_logit_delta:>12.1e}  {r.seconds:>5.1f}  {firsts}"
        )
    share = reused / (reused + computed) if reused + computed else 0.0
    lines += [
        "",
        f"host pages (kvd, {agents} agents live): logical {live['logical_pages']:,}  "
        f"physical {live['physical_pages']:,}  "
        f"saved {live['host_pages_saved']:,} pages = {live['host_bytes_saved'] / 2**20:.2f} MiB of host memory",
        f"prefill tokens: reused {reused:,}  computed {computed:,}  ({share:.0%} of prompt tokens not recomputed)",
        f"GPU pages: unique host pages loaded {loaded:,}  duplicate host->device loads skipped {skipped:,}",
        f"logits vs a full recompute without cache: largest |difference| {delta:.2e} "
        f"(limit {LOGIT_TOLERANCE:.0e}) {'OK' if delta <= LOGIT_TOLERANCE else 'FAILED'}",
        f"daemon invariants: {'clean' if not result.violations else '; '.join(result.violations)}; "
        f"after completion {after['sequences']} sequences, {after['cached_pages']:,} pages cached for reuse",
        f"result: {'OK' if result.ok else 'FAILED'} in {result.seconds:.1f} s",
    ]
    if not result.prefix_reuse:
        lines.append("note: the daemon runs without --enable-prefix-reuse, so no page is shared")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[DemoConfig, str | None]:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m gpu_worker.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=d.engines, help="engine processes (default %(default)s)")
    p.add_argument("--agents-per-engine", type=int, default=d.agents_per_engine, help="(default %(default)s)")
    p.add_argument(
        "--prefix-tokens", type=int, default=d.prefix_tokens, help="shared prompt length (default %(default)s)"
    )
    p.add_argument(
        "--suffix-tokens", type=int, default=d.suffix_tokens, help="own tokens per agent (default %(default)s)"
    )
    p.add_argument(
        "--decode-tokens", type=int, default=d.decode_tokens, help="greedy tokens per agent (default %(default)s)"
    )
    p.add_argument("--family", choices=("llama", "gpt_oss"), default=d.family, help="model style (default %(default)s)")
    p.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page (default %(default)s)")
    p.add_argument(
        "--device", default=d.device, help="where the engines run the model: cpu or cuda (default %(default)s)"
    )
    p.add_argument(
        "--socket",
        help="use the kvd daemon on this socket (started with --enable-prefix-reuse) instead of starting one",
    )
    a = p.parse_args(argv)
    if a.engines < 1 or a.agents_per_engine < 1 or a.prefix_tokens < 0 or a.suffix_tokens < 0 or a.decode_tokens < 1:
        p.error("--engines, --agents-per-engine and --decode-tokens must be ≥ 1; token counts ≥ 0")
    if a.prefix_tokens + a.suffix_tokens < 1:
        p.error("a prompt needs at least one token")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch sees no CUDA GPU here")
    cfg = DemoConfig(
        a.engines,
        a.agents_per_engine,
        a.prefix_tokens,
        a.suffix_tokens,
        a.decode_tokens,
        a.family,
        a.page_size,
        a.device,
    )
    return cfg, a.socket


def main(argv: list[str] | None = None) -> int:
    from engine_client import KVDError

    cfg, socket = parse_args(argv)
    try:
        result = run_demo(cfg, socket)
    except (RuntimeError, KVDError) as e:
        print(f"kvd demo failed: {e}", file=sys.stderr)
        return 1
    print(format_result(cfg, result), flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    # Call main through the package module, so that what the spawned engines pickle back
    # (reports) names `gpu_worker.demo`, not this `__main__` copy of the module.
    from gpu_worker.demo import main as package_main

    sys.exit(package_main())
