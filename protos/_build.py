"""Build step: generate the Python stubs of protos/pdserve/v1/*.proto (needs grpcio-tools).

Writes <name>_pb2.py (messages), <name>_pb2.pyi (their types) and <name>_pb2_grpc.py (service
stubs) next to each .proto. setup.py runs it before collecting the modules, so that every
installed pdserve (a wheel, an editable install) has the stubs and nothing generates them where
it runs; `scripts/gen_protos.sh` runs it after a .proto changes. The stubs are git-ignored.

protoc runs from the repository root with ``-I .``, so a file's import path is
protos/pdserve/v1/<name>.proto and protoc's absolute imports come out as
``from protos.pdserve.v1 import <name>_pb2``, which resolve as they are: no rewriting.
``python -m grpc_tools.protoc`` adds its bundled google/protobuf/*.proto include path itself.

Usage: python protos/_build.py   (prints the generated modules)
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos" / "pdserve" / "v1"
STUB_PATTERNS = ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")


def generate(python: str = sys.executable) -> list[str]:
    """Regenerate every stub with ``python``'s grpc_tools; return the generated module names.

    protoc writes into a temporary directory and each stub then replaces its old copy in one
    rename: a process importing the stubs meanwhile sees the old or the new, never none."""
    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files in {PROTO_DIR}")
    relative = [str(proto.relative_to(ROOT)) for proto in protos]
    with tempfile.TemporaryDirectory(dir=PROTO_DIR, prefix=".stubs-") as tmp:
        out = f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}"
        command = [python, "-m", "grpc_tools.protoc", "-I", ".", *out, *relative]
        subprocess.run(command, cwd=ROOT, check=True)
        fresh = {path.name: path for path in (Path(tmp) / PROTO_DIR.relative_to(ROOT)).iterdir()}
        for name, path in fresh.items():
            os.replace(path, PROTO_DIR / name)
    # Stubs of .proto files deleted or renamed since the last run would linger as stale modules.
    for pattern in STUB_PATTERNS:
        for stale in PROTO_DIR.glob(pattern):
            if stale.name not in fresh:
                stale.unlink()
    package = ".".join(PROTO_DIR.relative_to(ROOT).parts)
    return [f"{package}.{p.stem}{suffix}" for p in protos for suffix in ("_pb2", "_pb2_grpc")]


if __name__ == "__main__":
    print(" ".join(generate()))
