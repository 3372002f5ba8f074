"""``python -m orchestrator.launch CONFIG``: serve a cluster config on the Ray cluster this
process belongs to, until SIGINT / SIGTERM. The entry point of

    ray job submit --working-dir . -- python -m orchestrator.launch configs/local-1p3d.yaml

Inside a Ray job ``RAY_ADDRESS`` names the cluster; elsewhere ``--ray-address`` does, and with
neither an embedded local Ray is started (as ``pdserve serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="cluster config (YAML)")
    parser.add_argument("--model", default=None, help="checkpoint directory (overrides model)")
    parser.add_argument(
        "--address", default=None, help="router HOST:PORT (overrides router.address)"
    )
    parser.add_argument(
        "--http-address",
        default=None,
        help="OpenAI-compatible HTTP HOST:PORT (overrides router.http_address)",
    )
    parser.add_argument("--ray-address", default=None, help="join this Ray cluster")
    metrics_port = os.environ.get("PDSERVE_METRICS_PORT")
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(metrics_port) if metrics_port else None,
        help="serve the router's /metrics on this port (default: $PDSERVE_METRICS_PORT; none)",
    )
    worker_port = os.environ.get("PDSERVE_WORKER_METRICS_PORT")
    parser.add_argument(
        "--worker-metrics-port",
        type=int,
        default=int(worker_port) if worker_port else 0,
        help="port of every worker's /metrics, -1 for none "
        "(default: $PDSERVE_WORKER_METRICS_PORT; 0, any free port)",
    )


def run_serve(args: argparse.Namespace) -> int:
    from orchestrator.app import AppOptions, serve
    from orchestrator.config import ClusterConfig, ConfigError
    from orchestrator.controller import ControllerOptions

    try:
        config = ClusterConfig.from_yaml(args.config).with_overrides(
            model=args.model, address=args.address, http_address=args.http_address
        )
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    options = AppOptions(ray_address=args.ray_address, metrics_port=args.metrics_port)
    worker_port = args.worker_metrics_port
    controller = ControllerOptions(worker_metrics_port=None if worker_port < 0 else worker_port)
    return asyncio.run(serve(config, options, controller))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchestrator.launch", description=__doc__)
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_serve(args)


if __name__ == "__main__":
    sys.exit(main())
