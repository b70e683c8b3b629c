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
        "import sys, kvd.server, kvd.cli, kvd.metrics; "
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
