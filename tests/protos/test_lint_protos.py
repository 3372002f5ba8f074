"""scripts/lint_protos.sh: buf lint + buf format are clean, and a missing npm fails clearly."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "lint_protos.sh"


def test_protos_lint_clean() -> None:
    if shutil.which("npm") is None and not (REPO / ".cache/tools/node_modules/.bin/buf").exists():
        pytest.skip("npm is not installed, so buf (npm @bufbuild/buf) cannot be installed")
    done = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "clean" in done.stdout


def test_missing_npm_fails_with_a_clear_message(tmp_path: Path) -> None:
    # A PATH holding only what the script needs before it looks for npm.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    env = {**os.environ, "PATH": str(bin_dir), "PDSERVE_TOOLS_DIR": str(tmp_path / "tools")}
    env.pop("BUF", None)
    done = subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    assert "npm is not installed" in done.stderr
