#!/usr/bin/env bash
# One-time (idempotent) setup used by `make install`, `make test` and `make demo`:
# system packages (libfabric, iperf3), the .venv, and the project with its dev extras, at the
# versions constraints.txt pins; the package build generates the gRPC stubs.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[install]\033[0m %s\n' "$*"; }

# --- Python --------------------------------------------------------------------------------------
python=""
for candidate in python3.11 python3.12 python3.13 python3; do
  if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    python="$candidate"; break
  fi
done
[ -n "$python" ] || { echo "error: Python >= 3.11 is required" >&2; exit 1; }

# --- system packages -------------------------------------------------------------------------
apt_packages=()
[ -f /usr/include/rdma/fabric.h ] || apt_packages+=(libfabric-dev libfabric1)
command -v fi_info >/dev/null 2>&1 || apt_packages+=(libfabric-bin)
command -v iperf3 >/dev/null 2>&1 || apt_packages+=(iperf3)
# promtool (Debian package prometheus) checks the /metrics exposition in the tests.
command -v promtool >/dev/null 2>&1 || apt_packages+=(prometheus)
# The libfabric binding is a cffi extension compiled here; buf (protos lint) comes from npm.
command -v cc >/dev/null 2>&1 || apt_packages+=(gcc libc6-dev)
# The CPU decode-attention kernel is C++ compiled against torch (workers/engine/attention).
command -v c++ >/dev/null 2>&1 || apt_packages+=(g++)
"$python" -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
  || apt_packages+=("${python##*/}-dev")
"$python" -c 'import ensurepip' 2>/dev/null || apt_packages+=("${python##*/}-venv")
command -v npm >/dev/null 2>&1 || apt_packages+=(nodejs npm)
if [ ${#apt_packages[@]} -gt 0 ]; then
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "error: missing ${apt_packages[*]} and no apt-get; install them (libfabric >= 1.17, with headers) by hand" >&2
    exit 1
  fi
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || {
      echo "error: missing ${apt_packages[*]}; run as root or install sudo (or the packages) first" >&2
      exit 1
    }
    sudo="sudo"
  fi
  log "apt-get install ${apt_packages[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi
# The binding asks libfabric for API 1.17 (workers/fabric/_build.py); an older one (Ubuntu
# 22.04 ships 1.11) installs, then refuses every provider at run time.
fabric_version=$(fi_info --version 2>/dev/null | sed -n 's/^libfabric: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
if [ -n "$fabric_version" ] && ! printf '%s\n' "1.17" "$fabric_version" | sort -C -V; then
  echo "error: libfabric $fabric_version is installed; pdserve needs >= 1.17 (Debian 12, Ubuntu 24.04)" >&2
  exit 1
fi

# --- virtual environment -----------------------------------------------------------------------
# A venv whose creation failed half-way (no ensurepip) has a python but no pip: make it again.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
  log "removing the incomplete .venv"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $python"
  "$python" -m venv .venv
fi
log "installing pdserve and its dev extras into .venv (versions pinned by constraints.txt)"
# The machine's pip config adds local wheel indexes that may be absent; hide only that noise
# (pipefail keeps pip's own exit status). constraints.txt pins what pyproject.toml leaves a
# range (torch: the CPU build, not the multi-GB CUDA one a newer release would bring).
pip_install() { .venv/bin/pip install -q --disable-pip-version-check -c constraints.txt "$@" 2>&1 | { grep -v "is ignored" || true; }; }
# The build requirements of pyproject.toml: cffi compiles the fabric binding, grpcio-tools
# generates the gRPC stubs (setup.py).
pip_install --upgrade pip setuptools wheel cffi 'grpcio-tools>=1.85.1,<2'
# --no-build-isolation: the build's requirements are those, already in the venv; this keeps
# the native fabric extension built against the same cffi that imports it.
# A copy built earlier (e.g. a `.cpython-311` one by the fallback below) would shadow the fresh
# `.abi3` build of a changed _build.py: the interpreter prefers it. Start from none.
rm -f workers/fabric/_fabric_cffi*.so
pip_install --no-build-isolation -e '.[dev]'
# The editable install builds the cffi extension in place with current setuptools; if another
# setuptools left it elsewhere, compile it next to the sources (fails with one clear message).
.venv/bin/python -c 'import workers.fabric._fabric_cffi' 2>/dev/null || .venv/bin/python workers/fabric/_build.py
# The engine's CPU kernels (attention, fused element-wise steps), compiled against the torch just
# installed (about a minute, announced on stderr; skipped when neither their sources nor torch
# changed).
.venv/bin/python workers/engine/attention/_build_cpu.py >/dev/null
# The build generated the gRPC stubs (setup.py runs protos/_build.py): check they import.
.venv/bin/python -c 'import workers, orchestrator, workers.fabric._fabric_cffi, protos.pdserve.v1.generation_pb2_grpc, protos.pdserve.v1.worker_pb2_grpc' || { echo "error: install failed" >&2; exit 1; }
log "done"
