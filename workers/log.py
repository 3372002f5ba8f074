"""What a person reads on stderr: one logging setup for every pdserve process, and progress bars.

`configure_logging` is called once at each entry point (the CLI, ``launch``, a worker actor,
the prefill process, a TP follower, the bench scripts), with one format everywhere, so that the
lines of processes interleaved in one terminal or one Ray log read alike; a process with a
name of its own (a worker id) gives it as ``origin``, the others show their pid. The level is
the caller's explicit one (``pdserve -v``), else ``$PDSERVE_LOG_LEVEL``, else the caller's
default.

`progress` is a tqdm bar on stderr for what runs longer than a few seconds. It is drawn only
on a terminal (a log file would fill with redrawn lines) and never after
``set_progress(False)`` (``pdserve --quiet``); stdout, where commands print their results, is
never written by a bar. A log record emitted while a bar is drawn goes through `tqdm.write`,
which clears the bar and redraws it below the line; `echo` does the same for a command's own
result lines on stdout (on a terminal, both streams share one screen).

Imports nothing of pdserve's: any layer may use it.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from tqdm import tqdm

LEVEL_ENV = "PDSERVE_LOG_LEVEL"
FORMAT = "%(asctime)s %(levelname)s %(origin)s %(name)s: %(message)s"

_progress_enabled = True


class _StderrHandler(logging.Handler):
    """Writes to the ``sys.stderr`` of the moment (pytest and tools swap it), around any bar."""

    def __init__(self, origin: str | None) -> None:
        super().__init__()
        self._origin = origin

    def emit(self, record: logging.LogRecord) -> None:
        try:
            record.origin = self._origin or str(record.process)
            line = self.format(record)
            _write(line, sys.stderr)
        except Exception:
            self.handleError(record)


def _write(line: str, stream: TextIO) -> None:
    if getattr(tqdm, "_instances", None):  # a bar is drawn: clear it, write, redraw it below
        tqdm.write(line, file=stream)
    else:
        stream.write(line + "\n")
    stream.flush()


def echo(line: str = "") -> None:
    """Print ``line`` to stdout (a command's result) without breaking a bar drawn on stderr."""
    _write(line, sys.stdout)


def warn(line: str) -> None:
    """Print ``line`` to stderr (a caveat on a command's result) without breaking a bar."""
    _write(line, sys.stderr)


def resolve_level(level: int | str | None, default: int | str = logging.INFO) -> int:
    """``level``, else ``$PDSERVE_LOG_LEVEL``, else ``default``; a name (``debug``) or a number.
    An unknown name in the environment falls back to ``default`` rather than failing a worker."""
    for candidate in (level, os.environ.get(LEVEL_ENV) or None, default):
        if candidate is None:
            continue
        if isinstance(candidate, int):
            return candidate
        if candidate.strip().isdigit():
            return int(candidate)
        named = logging.getLevelName(candidate.strip().upper())
        if isinstance(named, int):
            return named
        if candidate is level:
            raise ValueError(f"unknown log level {level!r}")
    return logging.INFO


def configure_logging(
    level: int | str | None = None,
    *,
    default: int | str = logging.INFO,
    origin: str | None = None,
) -> None:
    """Log to stderr in `FORMAT` at `resolve_level`. As `logging.basicConfig`, it does nothing
    when the root logger already has handlers (a host process's, pytest's, a second call)."""
    handler = _StderrHandler(origin)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.basicConfig(level=resolve_level(level, default), handlers=[handler])


def set_progress(enabled: bool) -> None:
    """Turn every later progress bar on (the default: on a terminal) or off."""
    global _progress_enabled
    _progress_enabled = enabled


def progress_enabled() -> bool:
    """False after ``set_progress(False)``: no bar, nor any other progress report."""
    return _progress_enabled


def progress_shown(stream: TextIO | None = None) -> bool:
    """Whether a bar on ``stream`` (default: stderr) would be drawn: a terminal, not quieted."""
    stream = sys.stderr if stream is None else stream
    return _progress_enabled and stream.isatty()


def progress(
    iterable: Iterable[Any] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    leave: bool = False,
    stream: TextIO | None = None,
) -> Any:
    """A tqdm bar on ``stream`` (default: stderr), disabled off a terminal or when quieted.
    Use it as tqdm: iterate it, or ``update`` it and ``close`` it (a ``with`` block)."""
    stream = sys.stderr if stream is None else stream
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        leave=leave,
        file=stream,
        dynamic_ncols=True,
        disable=not progress_shown(stream),
    )
