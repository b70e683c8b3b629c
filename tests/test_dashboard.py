"""deploy/grafana/ and deploy/prometheus/ against a daemon's real metrics.

Two daemons serve traffic (one plain with a disk tier, one with tenants, whose series carry
a ``tenant`` label), and every PromQL expression of the dashboard and of the alert rules must name
metrics one of them exports, with labels it exports or Prometheus attaches when it scrapes
(``job``, ``instance`` and the target labels of deploy/prometheus/scrape.yml). The
expressions are read by tests/promql.py, whose own tests come first.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import textwrap
import urllib.request

import numpy as np
import pytest
import yaml
from conftest import remove_shared_memory, start_daemon, stop_cleanly
from prometheus_client.parser import text_string_to_metric_families
from promql import Reads, Selector, reads
from test_service import free_port

from engine_client import KVDClient, PageLayout, SequenceRequest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "kvd-dashboard.json"
RULES = ROOT / "deploy" / "prometheus" / "kvd-alerts.yml"
SCRAPE = ROOT / "deploy" / "prometheus" / "scrape.yml"
PROMETHEUS_SERIES = {"up"}  # series Prometheus itself writes for every target it scrapes
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype="float16")


# ---- the expression reader ------------------------------------------------------------


@pytest.mark.parametrize(
    "expr, selectors, grouping",
    [
        ("up == 0", [("up", ())], ()),
        (
            'sum by (method) (rate(kvd_request_seconds_count{instance=~"$instance"}[5m]))',
            [("kvd_request_seconds_count", ("instance",))],
            ("method",),
        ),
        (
            "histogram_quantile(0.99, sum by (le, method) (rate(x_bucket[$__rate_interval])))",
            [("x_bucket", ())],
            ("le", "method"),
        ),
        ("a / on(instance) group_left b offset 1h > bool 1e3", [("a", ()), ("b", ())], ("instance",)),
        ("a * on (pod) group_left(node) b", [("a", ()), ("b", ())], ("pod", "node")),
        ('x{l="a{b}(c)", m!~"sum(y)"} and z', [("x", ("l", "m")), ("z", ())], ()),
        ("sum without (tenant) (y) - .5", [("y", ())], ("tenant",)),
        ("time() - process_start_time_seconds < 3600", [("process_start_time_seconds", ())], ()),
        (r'x{a="\"}"} or y', [("x", ("a",)), ("y", ())], ()),
    ],
)
def test_the_reader_finds_metrics_matchers_and_grouping_labels(expr, selectors, grouping):
    expected = Reads(tuple(Selector(m, frozenset(ls)) for m, ls in selectors), frozenset(grouping))
    assert reads(expr) == expected


@pytest.mark.parametrize("expr", ['{__name__="x"}', "rate(x[5m)", 'x{l="a"', "x{l=y}", "sum by (a b) (x)"])
def test_the_reader_refuses_what_it_cannot_read(expr):
    with pytest.raises(ValueError):
        reads(expr)


# ---- the daemons' metrics -------------------------------------------------------------


def traffic(socket: str) -> None:
    """A shared prefix, its hit and a release: every call the engines make most."""
    with KVDClient.connect(socket) as client:
        ns = client.register_namespace("tiny", LAYOUT)
        client.allocate_with_prefix(ns, [SequenceRequest("a", np.arange(64))])
        client.publish(ns, ["a"])
        client.allocate_with_prefix(ns, [SequenceRequest("b", np.arange(70))])
        client.lookup(ns, [SequenceRequest("c", np.arange(64))])
        client.release(ns, ["a", "b"])


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, set[str]]:
    """Every sample name the two daemons' metrics endpoints serve after traffic, with the
    label names it carries on either."""
    work = tmp_path_factory.mktemp("metrics")
    (work / "tenants.toml").write_text(
        textwrap.dedent(
            f"""
            host_bytes = "64MiB"
            [tenants.mine]
            uids = [{os.getuid()}]
            host_bytes = "32MiB"
            """
        )
    )
    found: dict[str, set[str]] = {}
    (work / "disk").mkdir()
    disk = ("--disk-path", str(work / "disk"), "--disk-bytes", "8MiB", "--disk-chunk-bytes", "1MiB")
    for name, env in (("plain", None), ("tenants", {"KVD_CONFIG": str(work / "tenants.toml")})):
        port = free_port()
        daemon = start_daemon(
            work,
            *(disk if env is None else ()),  # the plain daemon's disk tier is on, the other's off
            "--enable-prefix-reuse",
            "--host-bytes",
            "64MiB",
            "--extent-bytes",
            "1MiB",
            "--metrics-port",
            str(port),
            env=None if env is None else {**os.environ, **env},
            name=name,
        )
        try:
            traffic(daemon.socket)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
                for family in text_string_to_metric_families(reply.read().decode()):
                    for sample in family.samples:
                        found.setdefault(sample.name, set()).update(sample.labels)
        finally:
            stop_cleanly(daemon)
            remove_shared_memory(daemon.socket)
    return found


def target_labels() -> set[str]:
    """What Prometheus attaches to every series of a target: job, instance and the labels
    the scrape job's relabelling sets."""
    [job] = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    return {"job", "instance"} | {r["target_label"] for r in job["relabel_configs"] if "target_label" in r}


def problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What ``expr`` reads that the daemon does not export (empty: all of it is there)."""
    found = reads(expr)
    attached = target_labels()
    out = [] if found.selectors else [f"{expr!r} reads no metric"]
    labels_read: set[str] = set()
    for s in found.selectors:
        if s.metric not in exported and s.metric not in PROMETHEUS_SERIES:
            out.append(f"{s.metric} is not exported")
            continue
        labels = exported.get(s.metric, set()) | attached
        labels_read |= labels
        out += [f"{s.metric} has no label {label!r}" for label in sorted(s.labels - labels)]
    out += [f"no metric of {expr!r} has label {label!r}" for label in sorted(found.grouping - labels_read)]
    return out


def dashboard_expressions() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            metric, label = re.fullmatch(r"label_values\((\w+), (\w+)\)", variable["definition"]).groups()
            exprs.append(f'{metric}{{{label}=""}}')  # the series whose label values it lists
    return exprs


def alert_rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def test_every_dashboard_expression_reads_what_the_daemon_exports(exported):
    exprs = dashboard_expressions()
    assert len(exprs) > 20
    assert {e: problems(e, exported) for e in exprs if problems(e, exported)} == {}


def test_every_alert_rule_reads_what_the_daemon_exports(exported):
    rules = alert_rules()
    assert {r["alert"] for r in rules} == {
        "KvdDown",
        "KvdDevShmRefusals",
        "KvdCorruptedPages",
        "KvdRemoteStoreDown",
        "KvdHitRatioCollapse",
        "KvdDiskErrors",
        "KvdDiskFull",
    }
    assert {r["alert"]: problems(r["expr"], exported) for r in rules if problems(r["expr"], exported)} == {}


def test_the_dashboard_and_the_rules_are_well_formed():
    board = json.loads(DASHBOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    [job] = yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"], rule
    down = next(r for r in alert_rules() if r["alert"] == "KvdDown")
    assert f'job="{job["job_name"]}"' in down["expr"], "KvdDown names the scrape job of scrape.yml"
