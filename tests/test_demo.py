"""`python -m gpu_worker.demo` on a small size: it starts its own daemon, runs three engine
processes, prints one table and exits 0 when pages were shared and the logits match."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from gpu_worker.demo import main
from gpu_worker.tiny_model import LOGIT_TOLERANCE

SMALL = ["--prefix-tokens", "400", "--suffix-tokens", "12", "--decode-tokens", "4"]


def table_numbers(out: str) -> tuple[int, int, float]:
    """(logical host pages, physical host pages, largest logit difference) from the table."""
    pages = re.search(r"host pages .*: logical ([\d,]+)\s+physical ([\d,]+)", out)
    delta = re.search(r"largest \|difference\| (\S+)", out)
    assert pages and delta, out
    return int(pages[1].replace(",", "")), int(pages[2].replace(",", "")), float(delta[1])


def test_demo_module_runs_end_to_end(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpu_worker.demo", "--engines", "3", "--agents-per-engine", "2", *SMALL],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logical, physical, delta = table_numbers(proc.stdout)
    assert physical < logical
    assert delta <= LOGIT_TOLERANCE
    # 400 tokens = 25 shared pages; each of 6 agents adds one page of its own (12 + 4 tokens).
    assert (logical, physical) == (6 * 26, 25 + 6)
    assert "result: OK" in proc.stdout and "invariants: clean" in proc.stdout


def test_demo_uses_a_running_daemon(daemon, capsys) -> None:
    assert (
        main(["--socket", daemon.socket, "--engines", "2", "--agents-per-engine", "1", "--family", "gpt_oss", *SMALL])
        == 0
    )
    out = capsys.readouterr().out
    logical, physical, delta = table_numbers(out)
    assert physical < logical and delta <= LOGIT_TOLERANCE
    assert daemon.process.poll() is None  # a daemon the demo did not start keeps running


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_demo_on_cuda_without_a_gpu_says_so(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda", *SMALL])
    assert e.value.code == 2 and "torch sees no CUDA GPU here" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_runs_its_engines_on_cuda(daemon, capsys) -> None:
    """The engines' CUDA path end to end: model, GPU page pool, host→device loads of
    registered shared memory, side-stream offload, all checked against a recompute."""
    assert main(["--socket", daemon.socket, "--device", "cuda", *SMALL]) == 0
    out = capsys.readouterr().out
    logical, physical, delta = table_numbers(out)
    assert physical < logical and delta <= LOGIT_TOLERANCE and "float32 on cuda" in out
