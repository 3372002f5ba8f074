"""Flags shared by several commands: those that call a running router (``generate``,
``scale``, ``plan --apply``; `orchestrator.cli.generate`'s ``open_channel`` reads them), and a
multi-turn workload's (``simulate``, ``plan``, ``bench``); argparse only, so that building the
parser stays fast."""

from __future__ import annotations

import argparse


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", help="TLS, trusting the system's root CAs")
    p.add_argument("--tls-ca", metavar="PEM", help="TLS, trusting this CA (router.tls.cert's)")
    p.add_argument("--tls-cert", metavar="PEM", help="client certificate (mTLS; with --tls-key)")
    p.add_argument("--tls-key", metavar="PEM", help="client certificate's private key")
    p.add_argument(
        "--token", default=None, help="bearer token (router.auth.token); default $PDSERVE_TOKEN"
    )


def add_multiturn_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of a ``--prompt multiturn:C:T`` workload (None when not given)."""
    parser.add_argument(
        "--system-tokens", type=int, default=None, help="multiturn: shared system prompt (256)"
    )
    parser.add_argument(
        "--question-tokens", default=None, help="multiturn: question lengths, N or A-B (32-64)"
    )
    parser.add_argument(
        "--think-time", type=float, default=None, help="multiturn: seconds between turns (0)"
    )
