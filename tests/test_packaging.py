"""The distribution's identity: its name on PyPI, its licence and one version everywhere."""

from __future__ import annotations

import email.parser
import pathlib
import subprocess
import sys

import kvd

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_metadata_names_kvd_cache_apache_2_and_the_packages_version(tmp_path):
    build = (
        "from setuptools import build_meta; import sys; print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    dist_info = tmp_path / run.stdout.strip().splitlines()[-1]
    meta = email.parser.Parser().parsestr((dist_info / "METADATA").read_text())
    assert meta["Name"] == "kvd-cache"  # "kvd" on PyPI is an unrelated project
    assert meta["Version"] == kvd.__version__
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert "kvd = kvd.cli:main" in (dist_info / "entry_points.txt").read_text()
    assert "Apache License" in (ROOT / "LICENSE").read_text()
