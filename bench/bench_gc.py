"""Garbage-collection pauses on a daemon heap of ~512K pages, with and without freezing.

A full collection walks every object the collector tracks; a daemon holding 1 GiB of 2 KiB
pages tracks well over a million, and the collection runs on the event loop, inside
whichever call allocated when it came due. kvd freezes its long-lived objects at start-up
and after each extent is adopted (kvd/collector.py). This bench builds the same heap twice,
each in a fresh process, side by side in one run: with the freezes (the daemon's code) and
with them turned into no-ops (before). Each fills a 1 GiB budget of 64 MiB extents by
publishing fresh 50K-token prompts (3,125 pages of 16 tokens each), then churns: publishes
more in steps, as the servicer runs them, with the collector on. Printed, ms of thread CPU
time (on a shared box, wall time also counts other processes' turns):

- one full collection (``gc.collect()``) of the heap;
- the longest automatic collection during the churn (what a call stalls on), and how many
  of the oldest generation ran;
- the longest loop step of a churn publish (collections that landed in it included);
- after the churn: a full collection again, the tracked objects frozen and outside the
  permanent generation, and the garbage cycles the freezes kept from the collector (found by
  unfreezing and collecting at the end): what freezing could leak.

    python bench/bench_gc.py [--churn 40]
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import resource
import time

import numpy as np

TOKENS = 50_000
SPAWN = multiprocessing.get_context("spawn")


def heap(freeze: bool, churn: int, out) -> None:
    from kvd import collector
    from kvd.cache.manager import KVCacheManager
    from kvd.cache.manager import SequenceRequest as CoreRequest
    from kvd.core.arena import Arena
    from kvd.core.namespaces import NamespaceIdentity, make_layout

    policy = collector.Collector().install() if freeze else None  # as kvd/server/daemon.py does
    m = KVCacheManager(Arena(1 << 30, 64 << 20, f"/kvdbench-gc-{os.getpid()}", lock_memory=False), prefix_reuse=True)
    try:
        session = m.open_session("bench", os.getpid()).id
        ns = m.catalog.register_namespace(NamespaceIdentity("bench", make_layout(2, 2, 8, 16, "float16")))
        prompt = 0

        def allocate() -> None:
            nonlocal prompt
            tokens = (np.arange(TOKENS, dtype="<i4") + prompt * TOKENS).tobytes()
            prompt += 1
            m.allocate(session, ns.id, [CoreRequest("s", tokens)])

        pages = 0
        while pages < (1 << 30) // 2048:  # fill: every page published (then cached)
            allocate()
            m.publish(session, ns.id, [("s", 0)])
            m.integrity.apply(wait=True)
            m.release(session, ns.id, ["s"])
            pages += TOKENS // 16
        t = time.thread_time()
        gc.collect()
        full = time.thread_time() - t
        gc.collect()  # the next full collection comes as after the daemon's own ones (kvd/collector.py)

        pauses, steps = _churn(m, session, ns.id, allocate, churn)
        unfrozen = len(gc.get_objects())
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        longest = max((p for gen in pauses.values() for p in gen), default=0.0)
        frozen = gc.get_freeze_count()
        t = time.thread_time()
        gc.collect()
        end = time.thread_time() - t
        if policy is not None:
            policy.uninstall()  # unfreezes: the collection below finds the cycles freezing kept
        trapped = gc.collect()
        out.send((full, longest, len(pauses[2]), max(steps), end, frozen, unfrozen, trapped, rss))
    finally:
        m.close()


def _churn(m, session: str, ns: int, allocate, churn: int) -> tuple[dict[int, list[float]], list[float]]:
    """``churn`` prompts allocated (each evicting cached pages) and published in steps (each
    making new ones); returns the collector's pauses by generation and every publish step's
    time, in thread CPU seconds."""
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses[info["generation"]].append(time.thread_time() - started[0])

    gc.callbacks.append(timed)
    steps = []
    for _ in range(churn):
        allocate()
        job = m.publish_job(session, ns, [("s", 0)])
        done = False
        while not done:
            t = time.thread_time()
            done = job.step()
            steps.append(time.thread_time() - t)
        m.integrity.apply(wait=True)
        m.release(session, ns, ["s"])
    gc.callbacks.remove(timed)
    return pauses, steps


def run(freeze: bool, churn: int) -> tuple:
    receive, send = SPAWN.Pipe(duplex=False)
    p = SPAWN.Process(target=heap, args=(freeze, churn, send))
    p.start()
    result = receive.recv()
    p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--churn", type=int, default=40, help="publishes of fresh prompts once the budget is full")
    args = ap.parse_args()
    print(f"heap: 1 GiB of 2 KiB pages (512K pages, all published), then {args.churn} more 50K-token publishes")
    for label, freeze in (("no freeze (before)", False), ("frozen (kvd/collector.py)", True)):
        full, longest, full_runs, step, end, frozen, unfrozen, trapped, rss = run(freeze, args.churn)
        print(
            f"  {label:<26} full collection {full * 1e3:6.1f} ms filled, {end * 1e3:6.1f} ms after the churn; "
            f"during churn: longest collection {longest * 1e3:6.1f} ms ({full_runs} full), longest loop step "
            f"{step * 1e3:6.2f} ms; objects frozen {frozen:,}, tracked outside {unfrozen:,}; "
            f"garbage cycles the freezes kept {trapped:,}; max RSS {rss:,.0f} MiB"
        )


if __name__ == "__main__":
    main()
