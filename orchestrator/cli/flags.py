"""Flags shared by the commands that call a running router (``generate``, ``scale``, ``plan
--apply``); argparse only, so that building the parser stays fast. `orchestrator.cli.generate`'s
``open_channel`` reads them."""

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
