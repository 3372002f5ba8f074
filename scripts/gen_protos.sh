#!/usr/bin/env bash
# Regenerate the Python stubs of protos/pdserve/v1/*.proto (protos/_build.py, the step the
# package build runs too) and import each one: proves the imports resolve and the descriptors
# load. `make install` runs it when a .proto changed since the install.
#
# Usage: scripts/gen_protos.sh [PYTHON]   (default: .venv/bin/python, which needs grpcio-tools)
set -euo pipefail
cd "$(dirname "$0")/.."

python="${1:-.venv/bin/python}"

if ! "$python" -c 'import grpc_tools.protoc' 2>/dev/null; then
  echo "error: $python cannot import grpc_tools; install grpcio-tools (pip install -e '.[dev]')" >&2
  exit 1
fi

read -r -a modules < <("$python" protos/_build.py)
"$python" -c 'import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)' "${modules[@]}"
echo "generated ${modules[*]}"
