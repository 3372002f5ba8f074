"""The pdserve chart, loaded once per module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import helm_python as helm
import pytest

from tests.ops.helm_chart import CHART


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded
