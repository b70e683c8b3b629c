"""bench/bench_vllm_load.py cannot rot: its engine-free mode, with tiny parameters, against a
real daemon (no vLLM), and its command line's refusals."""

from __future__ import annotations

import os
import sys

import pytest
from test_service import free_port

from engine_client import KVDClient

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import bench_vllm_load  # noqa: E402
from load_replay import METHODS, Level, Mix, histogram_quantile, replay, saturation  # noqa: E402


def test_replay_reports_sane_figures(daemon_factory, capsys):
    port = free_port()
    d = daemon_factory("--enable-prefix-reuse", "--host-bytes", "64MiB", "--metrics-port", str(port))
    # 40 generated tokens: each request's decode fills a block, so extend_batch runs too
    mix = Mix(prefix_tokens=96, suffix_tokens=16, shared_fraction=0.5, prefixes=2, output_tokens=40)
    levels = replay(d.socket, d.process.pid, [20.0, 40.0], 2, 1.0, mix, 0.01, metrics_port=port)
    assert [v.offered for v in levels] == [20.0, 40.0]
    for v in levels:
        assert v.requests > 0 and v.achieved > 0
        # a lookup and an allocation each, plus the step's pins, extends, publishes and releases
        assert 2 <= v.calls_per_request <= 20, v
        assert 0 < v.p50_ms <= v.p99_ms, v
        assert v.daemon_p99_ms is not None and v.daemon_p99_ms > 0, v
        assert v.daemon_cpu_ms_per_request >= 0 and 0 <= v.daemon_cpu_share <= 2.5, v
    assert levels[-1].hit_fraction > 0, "requests on a shared prefix found it published"
    with KVDClient.connect(d.socket, client_name="test") as kvd:
        assert kvd.check_invariants() == []
        assert kvd.stats()["sequences"] == 0, "every replayed sequence and pin was released"

    args = bench_vllm_load.parse_args(["--replay", "--clients", "2", "--rates", "20,40", "--seconds", "1"])
    bench_vllm_load.print_replay(args, mix, levels)
    out = capsys.readouterr().out
    assert "saturation" in out and "offered req/s" in out


def test_saturation_and_quantile():
    def level(rate: float, p99: float) -> Level:
        return Level(rate, rate, 1, 0.0, 1.0, p99 / 2, p99, None, 0.0, 0.0)

    assert saturation([level(10, 1.0), level(20, 1.5), level(40, 1.9)]) is None
    assert saturation([level(10, 1.0), level(20, 1.0), level(40, 3.0)]) == pytest.approx(20 * 2**0.5)
    # Prometheus: linear within the bucket that holds the quantile
    assert histogram_quantile({0.001: 50, 0.002: 100, float("inf"): 100}, 0.75) == pytest.approx(0.0015)
    assert histogram_quantile({0.001: 0, float("inf"): 0}, 0.99) is None
    assert set(METHODS) >= {"Lookup", "Publish"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rates", "40,20"], "rates must increase"),
        (["--rates", "20"], "at least two rates"),
        (["--rates", "20,x"], "not a number"),
        (["--engines", "0"], "must be at least 1"),
        (["--shared-fraction", "1.5"], "must lie in [0, 1]"),
        (["--hidden", "100"], "multiple of 64"),
        (["--prefix", "16"], "at least one 32-token block"),
        (["--seconds", "-1"], "positive finite number"),
    ],
)
def test_bad_command_lines_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_vllm_load.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
