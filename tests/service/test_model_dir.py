"""The worker's own check of the model directory on its node (`workers.service.model_dir`): a
path that does not open there is a `ModelNotOnNodeError` naming the worker, the node, the path
and the fix, which survives the pickling Ray carries it back to the driver with."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from workers.service.model_dir import ModelNotOnNodeError, check_model_dir


def test_a_checkpoint_directory_passes(tiny_model_dir: Path) -> None:
    check_model_dir("decode-0", "10.0.0.2", str(tiny_model_dir))


def _path(root: Path, kind: str) -> Path:
    if kind == "file":
        (root / "file").write_text("not a checkpoint")
        return root / "file"
    return root / "absent" if kind == "absent" else root  # else: an empty directory


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("absent", "no such directory"),
        ("empty", "the directory has no config.json"),
        ("file", "not a directory on this node"),
    ],
)
def test_a_path_that_does_not_open_names_node_path_and_fix(
    tmp_path: Path, kind: str, reason: str
) -> None:
    path = str(_path(tmp_path, kind))
    with pytest.raises(ModelNotOnNodeError) as raised:
        check_model_dir("decode-1", "10.0.0.2", path)
    message = str(raised.value)
    assert message.startswith(f"decode-1 on node 10.0.0.2: no checkpoint at {path} ({reason});")
    assert "storage that every node mounts there" in message
    assert isinstance(raised.value, FileNotFoundError)


def test_the_error_survives_pickling() -> None:
    error = ModelNotOnNodeError("prefill-0", "10.0.0.3", "/models/m", "no such directory")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ModelNotOnNodeError
    assert (copy.worker_id, copy.node, copy.path, copy.reason) == (
        "prefill-0",
        "10.0.0.3",
        "/models/m",
        "no such directory",
    )
    assert str(copy) == str(error)
