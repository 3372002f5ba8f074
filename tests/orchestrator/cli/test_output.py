"""What the long commands write for a person and for a program: one log format with its level
from ``-v`` / ``$PDSERVE_LOG_LEVEL`` (`workers.log.configure_logging`), progress bars on stderr
only on a terminal and never with ``--quiet``, and stdout left to the results."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.cli.main import main
from tests.sim.test_cli import PLAN, SIMULATE
from workers import log

REPO = Path(__file__).resolve().parents[3]


class _Terminal(io.StringIO):
    """A fake terminal: a text stream that says it is a TTY, so that bars are drawn into it."""

    def isatty(self) -> bool:
        return True


def _log_lines(code: str, **env: str) -> list[str]:
    """Lines a fresh process logs on stderr (a fresh root logger: pytest's is configured)."""
    script = "import logging\nfrom workers.log import configure_logging\n" + code
    environ = {k: v for k, v in os.environ.items() if k != log.LEVEL_ENV} | env
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout == ""
    return done.stderr.splitlines()


EMIT = "\nfor level in ('debug', 'info', 'warning'):\n    getattr(logging.getLogger('pdserve.t'), level)(level)\n"


def test_one_format_and_the_level_from_the_argument_else_the_environment() -> None:
    lines = _log_lines("configure_logging()" + EMIT)
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["info", "warning"]  # the default
    # asctime, level, the process (its pid), the logger, the message.
    assert re.fullmatch(r"\d{4}-\d\d-\d\d [\d:,]+ INFO \d+ pdserve\.t: info", lines[0])
    lines = _log_lines("configure_logging()" + EMIT, PDSERVE_LOG_LEVEL="debug")
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["debug", "info", "warning"]
    lines = _log_lines("configure_logging(logging.WARNING)" + EMIT, PDSERVE_LOG_LEVEL="debug")
    assert [line.rsplit(" ", 1)[-1] for line in lines] == ["warning"]  # the argument wins
    # A worker's own default (the prefill process: warnings) and its name instead of a pid.
    code = "configure_logging(default=logging.WARNING, origin='prefill')" + EMIT
    lines = _log_lines(code, PDSERVE_LOG_LEVEL="nonsense")  # unusable: the default
    assert len(lines) == 1 and " WARNING prefill pdserve.t: warning" in lines[0]


def test_an_unknown_level_given_explicitly_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        log.resolve_level("loud")
    assert log.resolve_level("10") == log.resolve_level("DEBUG") == 10


def test_a_bar_is_drawn_only_on_a_terminal_and_not_when_quiet() -> None:
    terminal, log_file = _Terminal(), io.StringIO()
    for _ in log.progress(range(3), desc="counting", stream=terminal):
        pass
    assert "counting:   0%" in terminal.getvalue()  # then cleared: leave=False
    for _ in log.progress(range(3), desc="counting", stream=log_file):
        pass
    assert log_file.getvalue() == ""
    log.set_progress(False)
    try:
        quiet = _Terminal()
        for _ in log.progress(range(3), desc="counting", stream=quiet):
            pass
        assert quiet.getvalue() == "" and not log.progress_shown(quiet)
    finally:
        log.set_progress(True)


@pytest.mark.parametrize("argv", [SIMULATE, [*PLAN, "--top", "2"]])
def test_simulate_and_plan_draw_on_stderr_and_leave_stdout_to_the_results(
    argv: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    bar = "simulating" if argv[0] == "simulate" else "planning"
    assert bar in terminal.getvalue()
    out = capsys.readouterr().out
    assert bar not in out and "\r" not in out and "cost model: " in out
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main(["--quiet", *argv]) == 0
    assert bar not in quiet.getvalue()
    assert capsys.readouterr().out == out  # the same results, bar or not
