"""``python -m orchestrator.control.launch CONFIG``: serve a cluster config on the Ray cluster this
process belongs to, until SIGINT / SIGTERM. The entry point of (from the repository root, with
the head started from this checkout's venv, ``.venv/bin/ray start --head``)::

    ray job submit --working-dir configs -- "$PWD/.venv/bin/python" -m orchestrator.control.launch \\
        local-1p3d.yaml --model "$PWD/.cache/models/SmolLM2-135M-Instruct"

Ship the config alone as the working directory, never the repository: Ray leaves git-ignored
files out of the upload (the venv, the model cache, the compiled libfabric binding) and puts the
unpacked copy first on ``PYTHONPATH``, where its ``workers`` package would shadow the installed
one. Hence the absolute interpreter and ``--model`` (the config's relative ``model`` would
resolve inside the unpacked copy). The Helm chart's launcher does the same with its ConfigMap.

Inside a Ray job ``RAY_ADDRESS`` names the cluster; elsewhere ``--ray-address`` does, and with
neither an embedded local Ray is started (as ``pdserve serve``).

``ray job stop`` sends the driver SIGTERM, which drains as in ``pdserve serve``, then SIGKILL
after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s unless the head's environment sets it): give it at
least ``router.grace_seconds`` + 15, or the drain is cut short (a warning at start says so).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from workers.log import configure_logging

if TYPE_CHECKING:
    from orchestrator.config.cluster import ClusterConfig

logger = logging.getLogger(__name__)

# What the stop takes beyond the router's grace: the workers' own drain and stop, ending Ray.
STOP_MARGIN_SECONDS = 15
# Ray's job manager: the seconds between its SIGTERM and its SIGKILL (its default).
JOB_STOP_WAIT_DEFAULT_SECONDS = 3

SIGNALS_HELP = """\
SIGINT / SIGTERM (to the process, its process group or its whole cgroup) drain: health
NOT_SERVING, new requests UNAVAILABLE, running and queued ones finish within
router.grace_seconds, then the workers drain and stop and an embedded Ray ends; exit status 0
("shutdown complete" logged). A second SIGINT / SIGTERM during the drain stops at once: exit
status 130 / 143. Ctrl-C before serving began: 130. A config, file, port or placement error: 2.
"""


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="cluster config (YAML)")
    parser.add_argument("--model", default=None, help="checkpoint directory (overrides model)")
    parser.add_argument(
        "--address", default=None, help="router HOST:PORT (overrides router.address)"
    )
    parser.add_argument(
        "--http-address",
        default=None,
        help="OpenAI-compatible HTTP HOST:PORT, or none to serve no HTTP "
        "(overrides router.http_address)",
    )
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster")
    # String defaults go through ``type`` when (and only when) this command is parsed, so a bad
    # environment value is an argparse error of `serve`, never a traceback of every command.
    parser.add_argument(
        "--metrics-port",
        type=_port_type(0),
        default=os.environ.get("PDSERVE_METRICS_PORT") or None,
        help="serve the router's /metrics on this port (default: $PDSERVE_METRICS_PORT; none)",
    )
    parser.add_argument(
        "--worker-metrics-port",
        type=_port_type(-1),
        default=os.environ.get("PDSERVE_WORKER_METRICS_PORT") or "0",
        help="port of every worker's /metrics, -1 for none "
        "(default: $PDSERVE_WORKER_METRICS_PORT; 0, any free port)",
    )


def _port_type(lowest: int) -> Callable[[str], int]:
    def port(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
        if not lowest <= value <= 65535:
            raise argparse.ArgumentTypeError(f"{value} is not in [{lowest}, 65535]")
        return value

    return port


def config_from_args(args: argparse.Namespace) -> ClusterConfig:
    """The config file with the command line's overrides (raises `ConfigError`)."""
    from orchestrator.config.cluster import ClusterConfig

    return ClusterConfig.from_yaml(args.config).with_overrides(
        model=args.model, address=args.address, http_address=args.http_address
    )


def error_line(error: BaseException) -> str:
    """``error: Type: message`` on one line. A worker's failure is its cause alone: Ray's own
    text of it carries the remote traceback (and of other Ray errors, the first line says it)."""
    from ray.exceptions import RayError, RayTaskError

    while isinstance(error, RayTaskError) and isinstance(error.cause, BaseException):
        error = error.cause
    message = str(error)
    if isinstance(error, RayError):
        message = message.strip().partition("\n")[0]
    return f"error: {type(error).__name__}: {message}"


def run_reporting(main: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """``asyncio.run(main())`` with what a user can fix (config, TLS files, resources, a port
    in use, a worker that cannot start) as one line and exit 2, Ctrl-C as 130: the message,
    not a traceback. ``main`` stops what it started before any of these reach here."""
    from ray.exceptions import RayError

    from orchestrator.config.cluster import ConfigError
    from orchestrator.control.placement import PlacementError

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        # Ctrl-C before serving began (after, `serve` drains on SIGINT and returns 0).
        print("interrupted", file=sys.stderr)
        return 130
    except (ConfigError, PlacementError, OSError, TimeoutError, RayError) as error:
        print(error_line(error), file=sys.stderr)
        return 2


def run_serve(args: argparse.Namespace) -> int:
    from orchestrator.config.cluster import ConfigError
    from orchestrator.control.app import AppOptions, serve
    from orchestrator.control.cluster_secret import ClusterSecretError, cluster_secret
    from orchestrator.control.controller import ControllerOptions
    from orchestrator.control.embedded_ray import exit_abandoning_ray, ray_abandoned

    try:
        config = config_from_args(args)
        secret = cluster_secret()  # $PDSERVE_CLUSTER_SECRET (the Helm chart's), else drawn
    except (ConfigError, ClusterSecretError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    options = AppOptions(
        ray_address=args.ray_address, metrics_port=args.metrics_port, cluster_secret=secret
    )
    worker_port = args.worker_metrics_port
    controller = ControllerOptions(worker_metrics_port=None if worker_port < 0 else worker_port)
    warn_of_job_stop_wait(config.router.grace_seconds)
    code = run_reporting(lambda: serve(config, options, controller))
    if ray_abandoned():
        exit_abandoning_ray(code)  # Ray's exit hook would wait for a GCS that is gone
    return code


def warn_of_job_stop_wait(grace_seconds: float) -> None:
    """Inside a Ray job, say so when ``ray job stop`` will SIGKILL this driver before its drain
    can end. The driver's environment is a copy of the job supervisor's, which reads
    ``RAY_JOB_STOP_WAIT_TIME_S``."""
    if "RAY_JOB_CONFIG_JSON_ENV_VAR" not in os.environ:
        return
    text = os.environ.get("RAY_JOB_STOP_WAIT_TIME_S", str(JOB_STOP_WAIT_DEFAULT_SECONDS))
    try:
        wait = float(text)
    except ValueError:
        return  # Ray's own problem to report
    if wait < grace_seconds + STOP_MARGIN_SECONDS:
        logger.warning(
            "ray job stop kills this driver %g s after its SIGTERM "
            "(RAY_JOB_STOP_WAIT_TIME_S on the head), before a drain of up to %g s "
            "(router.grace_seconds) and the workers' stop can end: set it to %g or more",
            wait,
            grace_seconds,
            grace_seconds + STOP_MARGIN_SECONDS,
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator.control.launch",
        description=__doc__,
        epilog=SIGNALS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    configure_logging()
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
