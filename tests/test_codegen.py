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
# The remote tier and the launcher that builds it; the cache hears it only through kvd/tiers/tier.py.
REMOTE_TIER = ("kvd/remote", "kvd/server/daemon.py")
# The tiers below the cache and their storage: the cache and the floor under it name none of them.
TIERS = ("kvd.disk", "kvd.diskstore", "kvd.remote", "mooncake")
# What the disk's storage engine may use of kvd: itself, the page records' checksum and the core's types.
DISK_STORE_USES = ("kvd.diskstore", "kvd.core.records", "kvd.core.types")
# What the connector may use of gpu_worker/ beside itself: the modules the reference engine
# and the connector share, which bring neither the reference engine's GPU pool nor its model.
SHARED_WITH_CONNECTOR = ("gpu_worker.host_registration",)


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
    # the remote tier hangs below the cache (kvd/tiers/tier.py): only the launcher builds it
    assert _violations("kvd", ("kvd.remote", "mooncake"), exempt=REMOTE_TIER) == set()
    # the cache, and the floor it meets its tiers on, name no tier
    assert _violations("kvd/cache", TIERS) == set()
    assert _violations("kvd/tiers", TIERS) == set()
    # a tier uses of the cache what its ports lend it (and the event log's names), never the manager
    for tier in ("kvd/disk", "kvd/remote"):
        assert _violations(tier, ("kvd.cache",), allowed=("kvd.cache.ports", "kvd.cache.events")) == set()
    # the disk's storage engine stands alone: of kvd, only the page records' checksum and types
    assert _violations("kvd/diskstore", ("kvd",), allowed=DISK_STORE_USES) == set()
    # the connector stands on vLLM and engine_client, never on the reference engine
    assert _violations("gpu_worker/vllm", ("gpu_worker",), allowed=("gpu_worker.vllm", *SHARED_WITH_CONNECTOR)) == set()


# kvd/ from the bottom up: a module imports from its own layer and the layers below it only.
KVD_LAYERS = (
    ("kvd", "kvd.wire"),  # the package itself (its version) and what daemon and clients share
    ("kvd.crashpoints", "kvd.collector"),  # the daemon's cross-cutting hooks: test crash points, GC policy
    ("kvd.core",),  # the page core: pages, refcounts, the index, extents and their records
    ("kvd.durability",),  # what survives a crash: seals, warm restart
    ("kvd.diskstore",),  # the disk's storage engine: pages in one file, no policy, no daemon
    ("kvd.tiers",),  # the floor the cache and its tiers meet on: the Tier interface, fetches, holds
    ("kvd.config",),  # settings: the layers below get values, never the settings
    ("kvd.cache",),  # what client calls do on top of the core
    ("kvd.remote", "kvd.disk"),  # the tiers below the cache (it calls them through kvd/tiers/tier.py)
    ("kvd.server",),  # the daemon's edge
    ("kvd.cli",),
)


def _module_of(path: pathlib.Path) -> str:
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return module.removesuffix(".__init__")


def _layer_violations(package: str, layers: tuple[tuple[str, ...], ...]) -> set[str]:
    """The imports in ``package``'s source files of a module in a layer above the importer's
    (the longest prefix that names a module decides its layer), and the files that no layer
    but the package's own root names."""

    def layer(name: str) -> tuple[int, str] | None:
        found = [(len(p), n, p) for n, prefixes in enumerate(layers) for p in prefixes]
        found = [f for f in found if name == f[2] or name.startswith(f[2] + ".")]
        return max(found)[1:] if found else None

    out = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        module = _module_of(path)
        own, prefix = layer(module)
        if prefix == package and module != package:
            out.add(f"{path.relative_to(ROOT)}: in no layer")
        for name in _imports(path):
            there = layer(name)
            if there is not None and there[0] > own:
                out.add(f"{path.relative_to(ROOT)}: {name}")
    return out


def _circles(package: str) -> set[tuple[str, ...]]:
    """The import circles between ``package``'s modules (each one's modules sorted),
    imports inside functions and under TYPE_CHECKING included."""
    modules = {_module_of(path): path for path in (ROOT / package).rglob("*.py")}

    def module_named(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {module_named(n) for n in _imports(path)} - {None, m} for m, path in modules.items()}
    reach = {}
    for start in graph:  # the modules each one reaches (a few dozen modules: a walk from each is cheap)
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()]:
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    return {
        tuple(sorted(m for m in graph if m == start or (m in reach[start] and start in reach[m])))
        for start in graph
        if start in reach[start]
    }


def test_kvd_packages_import_only_downwards_and_in_no_circle():
    """DESIGN.md: wire → core → durability → (the tiers' floor) → cache → tiers → server, nothing imports a package
    above it (imports inside functions and under TYPE_CHECKING count)."""
    assert _layer_violations("kvd", KVD_LAYERS) == set()
    assert _circles("kvd") == set()


def test_the_kvd_layers_see_what_they_forbid(tmp_path, monkeypatch):
    """A core module importing the cache inside a function, a module in no layer, and a circle
    are all seen."""
    for folder in ("kvd", "kvd/core", "kvd/cache"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "kvd/core/pool.py").write_text(
        "from kvd import crashpoints\ndef f():\n    from kvd.cache import room\n"
    )
    (tmp_path / "kvd/core/index.py").write_text("from kvd.core.pool import PagePool\n")
    (tmp_path / "kvd/cache/room.py").write_text("from kvd.core.index import PrefixIndex\nimport kvd.wire.codec\n")
    (tmp_path / "kvd/cache/events.py").write_text("from kvd.cache import room\n")
    (tmp_path / "kvd/stray.py").write_text("")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _layer_violations("kvd", KVD_LAYERS) == {
        "kvd/core/pool.py: kvd.cache",
        "kvd/core/pool.py: kvd.cache.room",
        "kvd/stray.py: in no layer",
    }
    assert _circles("kvd") == {("kvd.cache.room", "kvd.core.index", "kvd.core.pool")}


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
