"""`kvd doctor --disk` against real directories: ext4 (direct I/O, a timed read), tmpfs (a
WARN: memory, no direct I/O), a read-only mount, a missing directory, a budget larger
than the free space, the space kvd's own file holds already, and no [disk] at all. Each
check's status and reason come from the file system, never from a fake."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
from conftest import clean_env
from test_disk_faults import needs_root

from kvd.disk.doctor import MEMORY_FILE_SYSTEMS, file_system
from kvd.diskstore.layout import FILE_NAME

CHECKS = ["disk path", "disk space", "direct I/O", "read bandwidth"]
PROBE = ("--probe-bytes", "8MiB")


def doctor(tmp_path, *args: str, prefix: tuple[str, ...] = ()) -> tuple[int, dict[str, dict]]:
    """`kvd doctor --disk --json` (behind ``prefix``, a command that runs it): its exit
    status and its checks by name, in the order printed."""
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "kvd.cli", "doctor", "--disk", "--json", *PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(tmp_path),
    )
    assert done.stdout, done.stderr
    report = json.loads(done.stdout)
    assert report["ok"] == (done.returncode == 0)
    return done.returncode, {c["name"]: c for c in report["checks"]}


def in_private_mount(mount: str) -> tuple[str, ...]:
    """A prefix that runs a command in a private mount namespace after ``mount``."""
    return ("unshare", "-m", "--propagation", "private", "sh", "-c", mount + ' && exec "$@"', "sh")


def test_an_ext4_directory_passes_with_direct_io_and_a_timed_read(tmp_path):
    if file_system(str(tmp_path)) not in ("ext4", "xfs"):
        pytest.skip(f"{tmp_path} is on {file_system(str(tmp_path))}, not ext4 or xfs")
    disk = tmp_path / "disk"
    disk.mkdir()
    rc, checks = doctor(tmp_path, "--disk-path", str(disk), "--disk-bytes", "1GiB")
    assert rc == 0 and list(checks) == CHECKS and {c["status"] for c in checks.values()} == {"ok"}, checks
    assert f"can write in {disk} (ext4)" in checks["disk path"]["detail"] or "(xfs)" in checks["disk path"]["detail"]
    assert "reserves 960.0 MiB (its file)" in checks["disk space"]["detail"]
    assert "direct I/O at" in checks["direct I/O"]["detail"]
    assert "read 8.0 MiB in 2 MiB direct reads at" in checks["read bandwidth"]["detail"]
    assert os.listdir(disk) == [], "every probe file removed"
    text = subprocess.run(
        [sys.executable, "-m", "kvd.cli", "doctor", "--disk", *PROBE, "--disk-path", str(disk), "--disk-bytes", "1GiB"],
        capture_output=True,
        text=True,
        env=clean_env(tmp_path),
    )
    assert text.returncode == 0 and text.stdout.splitlines()[-1] == "the disk tier here would work with kvd"


def test_tmpfs_is_a_warning_memory_without_direct_io(tmp_path):
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="kvd-doctor-") as disk:
        assert file_system(disk) in MEMORY_FILE_SYSTEMS
        rc, checks = doctor(tmp_path, "--disk-path", disk, "--disk-bytes", "16MiB", "--disk-chunk-bytes", "1MiB")
        assert rc == 0 and [c["status"] for c in checks.values()] == ["ok", "ok", "WARN", "ok"], checks
        assert "is on tmpfs, which is memory" in checks["direct I/O"]["detail"]
        assert "local SSD" in checks["direct I/O"]["fix"]
        assert "buffered reads" in checks["read bandwidth"]["detail"]
        assert os.listdir(disk) == []


@needs_root
def test_a_read_only_mount_fails_the_path_and_skips_the_rest(tmp_path):
    """Root writes through any mode bits: only a read-only mount stops it, as it stops the daemon."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount --bind {disk} {disk} && mount -o remount,bind,ro {disk}"
    rc, checks = doctor(tmp_path, "--disk-path", str(disk), "--disk-bytes", "1GiB", prefix=in_private_mount(mount))
    assert rc == 1 and [c["status"] for c in checks.values()] == ["FAIL", "skip", "skip", "skip"], checks
    assert "its file system is mounted read-only" in checks["disk path"]["detail"]
    assert checks["disk space"]["detail"] == "not checked: needs disk path"


def test_a_missing_directory_fails(tmp_path):
    rc, checks = doctor(tmp_path, "--disk-path", str(tmp_path / "nowhere"), "--disk-bytes", "1GiB")
    assert rc == 1 and checks["disk path"]["status"] == "FAIL"
    assert checks["disk path"]["detail"].endswith("nowhere does not exist") and "mkdir" in checks["disk path"]["fix"]


def test_a_budget_larger_than_the_free_space_fails_and_says_what_fits(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    rc, checks = doctor(tmp_path, "--disk-path", str(tmp_path), "--disk-bytes", str(free + (64 << 30)))
    assert rc == 1 and [c["status"] for c in checks.values()] == ["ok", "FAIL", "ok", "ok"], checks
    assert "the daemon's start would be refused (no space)" in checks["disk space"]["detail"]
    assert checks["disk space"]["fix"].startswith("lower disk.bytes to at most ")


@needs_root
def test_what_kvds_file_holds_already_counts_as_room(tmp_path):
    """On a 64 MiB file system whose kvd file holds 40 MiB, a 48 MiB budget fits (the file
    is kept at the next start); a 96 MiB one does not."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = f"mount -t tmpfs -o size=64m kvdtest {disk} && fallocate -l 40MiB {disk / FILE_NAME}"
    small = ("--disk-path", str(disk), "--disk-chunk-bytes", "1MiB")
    for budget, status in (("48MiB", "ok"), ("96MiB", "FAIL")):
        _, checks = doctor(tmp_path, *small, "--disk-bytes", budget, prefix=in_private_mount(mount))
        assert checks["disk space"]["status"] == status, checks
        assert "kvd's files hold 40.0 MiB already" in checks["disk space"]["detail"]


def test_without_a_disk_table_there_is_nothing_to_check(tmp_path):
    rc, checks = doctor(tmp_path)
    assert rc == 1 and list(checks) == ["disk tier"] and checks["disk tier"]["detail"].startswith("not configured")
