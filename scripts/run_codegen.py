"""Generates the Python wire stubs in kvd/wire/ from protos/kvd.proto.

Run after editing the proto: ``python scripts/run_codegen.py``. The generated files are
checked in; tests/test_codegen.py fails when they are stale.
"""

from __future__ import annotations

import pathlib
import re
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
OUT_DIR = ROOT / "kvd" / "wire"
GENERATED = ("kvd_pb2.py", "kvd_pb2.pyi", "kvd_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    """Writes the stubs for protos/kvd.proto into out_dir."""
    include = pathlib.Path(protoc.__file__).parent / "_proto"
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / "kvd.proto"),
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    # protoc writes an absolute "import kvd_pb2"; the stubs live in the kvd.wire package.
    grpc_file = out_dir / "kvd_pb2_grpc.py"
    text = re.sub(r"^import kvd_pb2 as", "from kvd.wire import kvd_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)


def stale_files() -> list[str]:
    """Names of checked-in stubs that differ from what the proto generates now."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(pathlib.Path(tmp))
        return [
            name
            for name in GENERATED
            if not (OUT_DIR / name).exists() or (OUT_DIR / name).read_text() != (pathlib.Path(tmp) / name).read_text()
        ]


if __name__ == "__main__":
    generate(OUT_DIR)
    sys.exit(0)
