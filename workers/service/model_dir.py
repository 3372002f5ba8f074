"""The model directory as the node a worker landed on sees it.

Every worker opens the model at the cluster config's one path, on whichever node Ray placed it:
on a cluster of several nodes that path must open on each (shared storage mounted at the same
place everywhere, or the same directory filled on every host). The driver can only check its
own node, so a worker checks its node before it loads anything: `check_model_dir` raises
`ModelNotOnNodeError` naming the worker, the node, the path and the fix, instead of a loader's
traceback from deep inside the checkpoint code.
"""

from __future__ import annotations

import os
from typing import Any

FIX = (
    "every worker opens the model at this same path on its own node: put it on storage that "
    "every node mounts there, or fill the same directory on each host"
)


class ModelNotOnNodeError(FileNotFoundError):
    """A worker's node cannot open the model directory. Not a passing failure: another start on
    the same node fails the same way, so the control plane does not retry it."""

    def __init__(self, worker_id: str, node: str, path: str, reason: str) -> None:
        self.worker_id = worker_id
        self.node = node
        self.path = path
        self.reason = reason
        super().__init__(f"{worker_id} on node {node}: no checkpoint at {path} ({reason}); {FIX}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles a worker's exception to the driver: rebuilt from the fields, not from
        # OSError's args.
        return (type(self), (self.worker_id, self.node, self.path, self.reason))


def check_model_dir(worker_id: str, node: str, path: str) -> None:
    """Raise `ModelNotOnNodeError` unless ``path`` is a directory with a readable
    ``config.json`` on this node."""
    config = os.path.join(path, "config.json")
    if not os.path.isdir(path):
        reason = "not a directory on this node" if os.path.exists(path) else "no such directory"
    elif not os.path.isfile(config):
        reason = "the directory has no config.json"
    elif not os.access(config, os.R_OK):
        reason = "config.json is not readable"
    else:
        return
    raise ModelNotOnNodeError(worker_id, node, path, reason)
