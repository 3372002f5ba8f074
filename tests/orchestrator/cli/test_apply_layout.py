"""``pdserve plan --apply``'s layout diff: a planned layout against the groups a cluster runs
gives the scales to make (growing groups first), or a refusal naming every difference that
scaling cannot make. The command against a running cluster is in tests/system/test_scaling.py."""

from __future__ import annotations

import pytest

from orchestrator.api.client import pb
from orchestrator.cli.apply_layout import (
    GroupShape,
    LayoutMismatchError,
    layout_changes,
    planned_groups,
    running_groups,
)
from orchestrator.sim.simulator import Layout

ONE_ONE = {"prefill": GroupShape(1, 1), "decode": GroupShape(1, 1)}


def plan(num_prefill: int, num_decode: int, tp: int = 1) -> dict[str, GroupShape]:
    return planned_groups(
        Layout(num_prefill=num_prefill, num_decode=num_decode, tp_prefill=tp, tp_decode=tp)
    )


def test_the_groups_that_differ_in_replicas_are_scaled() -> None:
    assert layout_changes(plan(1, 3), ONE_ONE) == [("decode", 3)]
    assert layout_changes(plan(1, 1), ONE_ONE) == []


def test_growing_groups_are_scaled_before_shrinking_ones() -> None:
    running = {"prefill": GroupShape(1, 1), "decode": GroupShape(4, 1)}
    assert layout_changes(plan(2, 2), running) == [("prefill", 2), ("decode", 2)]
    running = {"prefill": GroupShape(3, 1), "decode": GroupShape(1, 1)}
    assert layout_changes(plan(1, 2), running) == [("decode", 2), ("prefill", 1)]


def test_a_mixed_layout_scales_the_mixed_group() -> None:
    planned = planned_groups(Layout(num_mixed=3, tp_mixed=2))
    assert layout_changes(planned, {"mixed": GroupShape(2, 2)}) == [("mixed", 3)]


def test_another_tp_size_is_refused_naming_each_group() -> None:
    with pytest.raises(LayoutMismatchError) as raised:
        layout_changes(plan(1, 2, tp=2), ONE_ONE)
    assert raised.value.differences == (
        "prefill: the plan wants TP 2, the cluster runs TP 1 (TP cannot change while serving; "
        "plan with --tp 1 to keep it)",
        "decode: the plan wants TP 2, the cluster runs TP 1 (TP cannot change while serving; "
        "plan with --tp 1 to keep it)",
    )


@pytest.mark.parametrize(
    ("planned", "running", "difference"),
    [
        (
            planned_groups(Layout(num_mixed=2)),
            ONE_ONE,
            "the plan is mixed (mixed), the cluster serves disaggregated (prefill, decode) "
            "(plan with --no-mixed)",
        ),
        (
            plan(1, 2),
            {"mixed": GroupShape(2, 1)},
            "the plan is disaggregated (prefill, decode), the cluster serves mixed (mixed)",
        ),
        (plan(1, 2), {"decode": GroupShape(1, 1)}, "the cluster has no prefill group"),
    ],
)
def test_another_serving_mode_or_a_missing_group_is_refused(
    planned: dict[str, GroupShape], running: dict[str, GroupShape], difference: str
) -> None:
    with pytest.raises(LayoutMismatchError) as raised:
        layout_changes(planned, running)
    assert raised.value.differences == (difference,)


def test_running_groups_are_read_from_the_cluster_state() -> None:
    state = pb.GetClusterStateResponse(
        serving_mode=pb.SERVING_MODE_DISAGGREGATED,
        groups=[
            pb.GroupState(name="prefill", role=pb.WORKER_ROLE_PREFILL, num_replicas=1, tp_size=2),
            pb.GroupState(name="decode", role=pb.WORKER_ROLE_DECODE, num_replicas=3, tp_size=1),
        ],
    )
    assert running_groups(state) == {"prefill": GroupShape(1, 2), "decode": GroupShape(3, 1)}
