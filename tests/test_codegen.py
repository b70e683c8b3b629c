"""The checked-in wire stubs must match protos/kvd.proto."""

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_stubs_are_generated_from_the_current_proto():
    spec = importlib.util.spec_from_file_location("run_codegen", ROOT / "scripts" / "run_codegen.py")
    codegen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codegen)
    assert codegen.stale_files() == [], "run `python scripts/run_codegen.py` after editing protos/kvd.proto"


def test_client_side_imports_no_daemon_module():
    import subprocess
    import sys

    code = (
        "import sys, engine_client; "
        "bad = sorted(m for m in sys.modules if m.startswith('kvd') and not m.startswith('kvd.wire') and m != 'kvd'); "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_daemon_imports_neither_torch_nor_cupy():
    import subprocess
    import sys

    code = (
        "import sys, kvd.server.daemon, kvd.cli, kvd.server.metrics; "
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a source file imports, at top level or inside a function (read with ast);
    ``from a import b`` counts as importing ``a`` and ``a.b`` (b may be a module)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def _violations(
    package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = (), exempt: tuple[str, ...] = ()
) -> set[str]:
    """The imports in ``package``'s source files (but those ``exempt``: files or folders) of a
    module that a ``forbidden`` prefix covers more closely than any ``allowed`` one: the
    longest prefix that names a module decides."""

    def closest(name: str, prefixes: tuple[str, ...]) -> int:
        return max((len(p) for p in prefixes if name == p or name.startswith(p + ".")), default=-1)

    out = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        if any(where == e or where.startswith(e + "/") for e in exempt):
            continue
        for name in _imports(path):
            if closest(name, forbidden) > closest(name, allowed):
                out.add(f"{path.relative_to(ROOT)}: {name}")
    return out


# The transport: gRPC, protobuf and the stubs generated from protos/kvd.proto.
TRANSPORT = ("grpc", "google.protobuf", "kvd.wire.kvd_pb2", "kvd.wire.kvd_pb2_grpc")
# The client's own transport layer; every other client module sees only the client's types.
CLIENT_TRANSPORT = ("engine_client/connection.py", "engine_client/messages.py")
# The vLLM connector; the reference engine, the rest of gpu_worker/, stands without it (and without vLLM).
CONNECTOR = ("gpu_worker/vllm", "gpu_worker/vllm_connector.py")
# The remote tier and the launcher that builds it; the page core hears it only through kvd/core/tier.py.
REMOTE_TIER = (
    "kvd/remote/tier.py",
    "kvd/remote/link.py",
    "kvd/remote/format.py",
    "kvd/remote/mooncake_store.py",
    "kvd/server/daemon.py",
)


def test_import_rules_hold_in_the_source_including_imports_inside_functions():
    """DESIGN.md's "who may import whom", read from the source, not from what a run loads."""
    assert _violations("kvd", ("engine_client", "gpu_worker", "torch", "cupy")) == set()
    assert _violations("kvd/wire", ("kvd",), allowed=("kvd.wire",)) == set()
    assert _violations("engine_client", ("kvd", "gpu_worker"), allowed=("kvd.wire",)) == set()
    assert _violations("engine_client", TRANSPORT, exempt=CLIENT_TRANSPORT) == set()
    assert _violations("gpu_worker", ("kvd", *TRANSPORT), allowed=("kvd.wire",)) == set()
    assert (
        _violations("gpu_worker", ("vllm", "gpu_worker.vllm", "gpu_worker.vllm_connector"), exempt=CONNECTOR) == set()
    )
    # the remote tier hangs beside the page core (kvd/core/tier.py): only the launcher builds it
    tier = ("kvd.remote.tier", "kvd.remote.link", "kvd.remote.format", "kvd.remote.mooncake_store", "mooncake")
    assert _violations("kvd", tier, exempt=REMOTE_TIER) == set()


def test_the_import_rules_see_what_they_forbid(tmp_path, monkeypatch):
    """The rules above would notice: a stub imported by name, grpc inside a function."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from kvd.wire import kvd_pb2 as pb\nfrom kvd.wire import layout\n")
    (package / "b.py").write_text("def f():\n    import grpc\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations("pkg", ("kvd", *TRANSPORT), allowed=("kvd.wire",)) == {
        "pkg/a.py: kvd.wire.kvd_pb2",
        "pkg/b.py: grpc",
    }
    assert _violations("pkg", TRANSPORT, exempt=("pkg/a.py", "pkg/b.py")) == set()
    assert _violations("pkg", ("grpc",), exempt=("pkg",)) == set(), "a folder exempts what it holds"
