"""What a KV server costs its host, read from /proc: the CPU seconds and the host memory of
a process and its descendants (kvd's daemon is one process; LMCache's server may start
workers). bench/load_replay.py and the vLLM benchmarks measure kvd and LMCache with it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after "pid (comm)": state, ppid, pgrp, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            children.setdefault(int(_stat(int(entry))[1]), []).append(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process and its live descendants so far, with those
    of the children they waited for."""
    ticks = 0
    for p in process_tree(pid):
        try:
            fields = _stat(p)
        except (FileNotFoundError, ProcessLookupError):
            continue
        ticks += sum(int(fields[i]) for i in (11, 12, 13, 14))  # utime, stime, cutime, cstime
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class HostMemory:
    """Host memory a process tree holds."""

    shm_bytes: int  # resident pages of the /dev/shm files its processes map or hold open
    anon_bytes: int  # their private resident memory (RssAnon: heaps, Python objects, buffers)

    @property
    def total(self) -> int:
        return self.shm_bytes + self.anon_bytes


def host_memory(pid: int) -> HostMemory:
    """The process tree's host memory; a /dev/shm file counts once, by its resident pages
    (tmpfs blocks), whoever touched them, and whether or not it is unlinked already."""
    shm: dict[tuple[int, int], int] = {}
    anon = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                anon += next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
            with open(f"/proc/{p}/maps") as f:
                ranges = [line.split()[0] for line in f if " /dev/shm/" in line]
            files = [f"/proc/{p}/map_files/{r}" for r in ranges]
            files += [
                f"/proc/{p}/fd/{fd}"
                for fd in os.listdir(f"/proc/{p}/fd")
                if os.readlink(f"/proc/{p}/fd/{fd}").startswith("/dev/shm/")
            ]
            for path in files:
                st = os.stat(path)
                shm[(st.st_dev, st.st_ino)] = st.st_blocks * 512
        except (FileNotFoundError, ProcessLookupError):
            continue  # ended meanwhile
    return HostMemory(sum(shm.values()), anon)
