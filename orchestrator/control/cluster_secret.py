"""The cluster's secret: the MAC key of its workers' KV control messages (`workers.kv.protocol`)
and the token of their gRPC service, which only the router presents (`workers.token_auth`).

``$PDSERVE_CLUSTER_SECRET``, when set, gives it (the Helm chart sets it on the head pod, where
the driver runs, from a Secret kept across upgrades); unset or empty, each cluster draws its
own. The controller hands the key to its workers through Ray with their spec.

Any text of at least `MIN_CHARS` characters will do: the key is its SHA-256, so a Secret made
by hand (``openssl rand -base64 48``, a password manager's) needs no particular spelling.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Mapping

CLUSTER_SECRET_ENV = "PDSERVE_CLUSTER_SECRET"
# 32 characters of even a hex alphabet carry 128 bits.
MIN_CHARS = 32


class ClusterSecretError(ValueError):
    """``$PDSERVE_CLUSTER_SECRET`` is set but too short to be a key."""


def cluster_secret(environ: Mapping[str, str] | None = None) -> str:
    """The cluster's key as hex: derived from ``$PDSERVE_CLUSTER_SECRET`` (surrounding
    whitespace, a trailing newline say, is not part of it), or drawn when it is unset or
    empty. Raises `ClusterSecretError` for a value shorter than `MIN_CHARS`; never says the
    value."""
    text = (os.environ if environ is None else environ).get(CLUSTER_SECRET_ENV, "").strip()
    if not text:
        return secrets.token_hex(32)
    if len(text) < MIN_CHARS:
        raise ClusterSecretError(
            f"${CLUSTER_SECRET_ENV} holds {len(text)} characters; give at least {MIN_CHARS} "
            "(e.g. openssl rand -hex 32), or unset it to draw one per cluster"
        )
    return hashlib.sha256(text.encode()).hexdigest()
