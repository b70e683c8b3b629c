"""The LMCache configuration of the vLLM benchmarks without LMCache's venv (it is not in CI:
`make setup-lmcache` builds it), and bench/footprint.py, which measures kvd's daemon and
LMCache's server alike, on real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from multiprocessing import shared_memory

import pytest

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
sys.path.insert(0, BENCH)

import bench_vllm_load  # noqa: E402
import lmcache_mp  # noqa: E402
from footprint import cpu_seconds, host_memory, process_tree  # noqa: E402


def test_the_load_benchmark_says_how_to_build_the_missing_venv(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(lmcache_mp, "VENV", str(tmp_path / "absent-venv"))
    with pytest.raises(SystemExit) as exit_info:
        bench_vllm_load.parse_args(["--engines", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "absent-venv" in err and "make setup-lmcache" in err and "--no-lmcache" in err
    assert bench_vllm_load.parse_args(["--no-lmcache"]).configs == ("alone", "own cache", "kvd")
    assert bench_vllm_load.parse_args(["--configs", "kvd,alone"]).configs == ("alone", "kvd")
    assert bench_vllm_load.parse_args(["--replay"]).replay, "the engine-free mode needs no LMCache"


def test_the_ttft_benchmark_says_how_to_build_the_missing_venv(tmp_path):
    env = {**os.environ, "KVD_BENCH_LMCACHE_VENV": str(tmp_path / "absent-venv")}
    done = subprocess.run(
        [sys.executable, os.path.join(BENCH, "bench_vllm.py"), "--repeats", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done
    assert "absent-venv" in done.stderr and "make setup-lmcache" in done.stderr, done.stderr


HOLDER = textwrap.dedent(
    """
    import os, sys, time
    from multiprocessing import shared_memory
    # a child that spins (CPU seconds of a descendant), then the parent holds a segment
    child = os.fork()
    if child == 0:
        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass
        time.sleep(60)
        os._exit(0)
    segment = shared_memory.SharedMemory(sys.argv[1], create=False)
    segment.buf[: 4 << 20] = b"x" * (4 << 20)  # 4 MiB of 16 touched
    print("ready", child, flush=True)
    time.sleep(60)
    """
)


def test_footprint_counts_a_process_trees_cpu_and_resident_shared_memory():
    segment = shared_memory.SharedMemory(create=True, size=16 << 20)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, segment.name], stdout=subprocess.PIPE, text=True)
    try:
        _, child = holder.stdout.readline().split()
        assert int(child) in process_tree(holder.pid)
        deadline = time.monotonic() + 30
        while cpu_seconds(holder.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cpu_seconds(holder.pid) >= 0.5, "the spinning child's CPU counts"
        segment.unlink()  # still mapped: still counted
        memory = host_memory(holder.pid)
        assert 4 << 20 <= memory.shm_bytes < 8 << 20, memory  # the touched pages, not the segment's size
        assert memory.anon_bytes > 0 and memory.total == memory.shm_bytes + memory.anon_bytes
    finally:
        for pid in process_tree(holder.pid):
            os.kill(pid, 9)
        holder.wait()
        segment.close()
