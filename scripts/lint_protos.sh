#!/usr/bin/env bash
# Lint the client API: `buf lint` (rules in buf.yaml) and `buf format` (no diff allowed).
# `make test` runs this. buf comes from the npm package @bufbuild/buf, installed once into
# .cache/tools (git-ignored; PDSERVE_TOOLS_DIR moves it) at the pinned version below; set
# BUF=/path/to/buf to use another binary.
set -euo pipefail
cd "$(dirname "$0")/.."

# Pinned: new buf releases may add lint rules, and `make test` must not start failing by itself.
BUF_VERSION=1.75.0
tools_dir="${PDSERVE_TOOLS_DIR:-.cache/tools}"
buf="${BUF:-$tools_dir/node_modules/.bin/buf}"

installed_version() { "$buf" --version 2>/dev/null || true; }

if [ -z "${BUF:-}" ] && [ "$(installed_version)" != "$BUF_VERSION" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    echo "error: buf $BUF_VERSION is needed to lint protos/ and comes from npm, but npm is not" \
      "installed (Debian/Ubuntu: apt-get install -y nodejs npm), or set BUF=/path/to/buf" >&2
    exit 1
  fi
  echo "[lint_protos] installing @bufbuild/buf@$BUF_VERSION into $tools_dir"
  mkdir -p "$tools_dir"
  if ! npm install --prefix "$tools_dir" --no-audit --no-fund --loglevel=error \
    "@bufbuild/buf@$BUF_VERSION" >/dev/null; then
    echo "error: npm install @bufbuild/buf@$BUF_VERSION failed (offline? registry unreachable?)" >&2
    exit 1
  fi
  [ "$(installed_version)" = "$BUF_VERSION" ] || {
    echo "error: $buf does not report version $BUF_VERSION after install" >&2
    exit 1
  }
fi

"$buf" lint
"$buf" format --diff --exit-code
echo "[lint_protos] buf lint and buf format: clean"
