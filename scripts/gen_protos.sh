#!/usr/bin/env bash
# Generate the Python stubs of the client API from protos/pdserve/v1/*.proto:
# <name>_pb2.py (messages), <name>_pb2.pyi (their types) and <name>_pb2_grpc.py (service stubs),
# written next to each .proto. The generated files are git-ignored; `make install` runs this.
#
# protoc runs from the repository root with `-I .`, so a file's import path is
# protos/pdserve/v1/<name>.proto and protoc's absolute imports come out as
# `from protos.pdserve.v1 import <name>_pb2`, which resolve as they are: no rewriting.
# grpc_tools adds its bundled google/protobuf/*.proto include path by itself.
#
# Usage: scripts/gen_protos.sh [PYTHON]   (default: .venv/bin/python, which needs grpcio-tools)
set -euo pipefail
cd "$(dirname "$0")/.."

python="${1:-.venv/bin/python}"
proto_dir=protos/pdserve/v1

if ! "$python" -c 'import grpc_tools.protoc' 2>/dev/null; then
  echo "error: $python cannot import grpc_tools; install grpcio-tools (pip install -e '.[dev]')" >&2
  exit 1
fi

shopt -s nullglob
protos=("$proto_dir"/*.proto)
[ ${#protos[@]} -gt 0 ] || { echo "error: no .proto files in $proto_dir" >&2; exit 1; }

# Remove stubs of .proto files that were deleted or renamed, so that no stale module lingers.
rm -f "$proto_dir"/*_pb2.py "$proto_dir"/*_pb2.pyi "$proto_dir"/*_pb2_grpc.py

"$python" -m grpc_tools.protoc -I . \
  --python_out=. --pyi_out=. --grpc_python_out=. \
  "${protos[@]}"

# Import every generated module: proves the imports resolve and the descriptors load.
modules=()
for proto in "${protos[@]}"; do
  name="${proto%.proto}"
  modules+=("${name//\//.}_pb2" "${name//\//.}_pb2_grpc")
done
"$python" -c 'import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)' "${modules[@]}"
echo "generated ${modules[*]}"
