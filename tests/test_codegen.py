"""The checked-in wire stubs must match protos/kvd.proto."""

import importlib.util
import pathlib

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
        "import sys, kvd.server, kvd.cli, kvd.metrics; assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _imports(path: pathlib.Path) -> set[str]:
    """Every module a source file imports, at top level or inside a function (read with ast)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def _violations(package: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> set[str]:
    def hit(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    out = set()
    for path in sorted((ROOT / package).rglob("*.py")):
        for name in _imports(path):
            if any(hit(name, f) for f in forbidden) and not any(hit(name, a) for a in allowed):
                out.add(f"{path.relative_to(ROOT)}: {name}")
    return out


def test_import_rules_hold_in_the_source_including_imports_inside_functions():
    """DESIGN.md's "who may import whom", read from the source, not from what a run loads."""
    assert _violations("kvd", ("engine_client", "gpu_worker", "torch", "cupy")) == set()
    assert _violations("kvd/wire", ("kvd",), allowed=("kvd.wire",)) == set()
    assert _violations("engine_client", ("kvd", "gpu_worker"), allowed=("kvd.wire",)) == set()
    assert _violations("gpu_worker", ("kvd",), allowed=("kvd.wire",)) == set()
    # the remote tier hangs beside the page core (kvd/tier.py): only the launcher builds it
    tier = ("kvd.remote", "kvd.remote_link", "kvd.remote_format", "kvd.mooncake_store", "mooncake")
    beside = ("remote.py", "remote_link.py", "remote_format.py", "mooncake_store.py", "server.py")
    assert {v for v in _violations("kvd", tier) if v.split(":")[0].rsplit("/", 1)[-1] not in beside} == set()
