"""Generate the gRPC stubs where they are missing.

The stubs are git-ignored, so a tree shipped by ``ray job submit --working-dir .`` (which honours
.gitignore) has none; the entry point and every worker actor call `ensure_stubs()` before
importing them. Same command as ``scripts/gen_protos.sh``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos" / "pdserve" / "v1"


def missing_stubs() -> list[Path]:
    return [
        proto
        for proto in sorted(PROTO_DIR.glob("*.proto"))
        if not (PROTO_DIR / f"{proto.stem}_pb2.py").exists()
        or not (PROTO_DIR / f"{proto.stem}_pb2_grpc.py").exists()
    ]


def ensure_stubs() -> None:
    protos = missing_stubs()
    if not protos:
        return
    logger.info("generating gRPC stubs for %s", ", ".join(p.name for p in protos))
    relative = [str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto")]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpc_python_out=.",
            *relative,
        ],
        cwd=ROOT,
        check=True,
    )
