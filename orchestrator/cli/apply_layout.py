"""``pdserve plan ... --apply ADDRESS``: make a serving cluster run the layout the planner picked,
by scaling its groups (``ScaleGroup``, one group at a time, as ``pdserve scale`` does).

The running groups come from ``GetClusterState`` (each group's replicas and TP size). Only
replica counts change while serving: a plan that needs another TP size, a group the cluster
does not run, or the other serving mode (mixed instead of disaggregated, or back) is refused
before anything is scaled (`LayoutMismatchError`, naming each difference); those take a
redeploy with the plan's emitted config.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from orchestrator.api.client import pb, pb_grpc
from orchestrator.api.security import TLSFileError
from orchestrator.cli.generate import open_channel
from orchestrator.cli.scale import rpc_error_line, scale_group, scaled_line
from orchestrator.sim.simulator import Layout

STATE_TIMEOUT_SECONDS = 30.0


@dataclass(frozen=True)
class GroupShape:
    """A group's replicas and the TP size of each, planned or running."""

    replicas: int
    tp: int


class LayoutMismatchError(ValueError):
    """The planned layout differs from the running cluster in more than replica counts."""

    def __init__(self, differences: list[str]) -> None:
        self.differences = tuple(differences)
        super().__init__("; ".join(self.differences))


def planned_groups(layout: Layout) -> dict[str, GroupShape]:
    """The groups of ``layout`` under their cluster-config names."""
    if layout.is_mixed:
        return {"mixed": GroupShape(layout.num_mixed, layout.tp_mixed)}
    return {
        "prefill": GroupShape(layout.num_prefill, layout.tp_prefill),
        "decode": GroupShape(layout.num_decode, layout.tp_decode),
    }


def running_groups(state: pb.GetClusterStateResponse) -> dict[str, GroupShape]:
    return {group.name: GroupShape(group.num_replicas, group.tp_size) for group in state.groups}


def _mode(groups: Mapping[str, GroupShape]) -> str:
    return "mixed" if "mixed" in groups else "disaggregated"


def layout_changes(
    planned: Mapping[str, GroupShape], running: Mapping[str, GroupShape]
) -> list[tuple[str, int]]:
    """The ``(group, replicas)`` scales that turn ``running`` into ``planned``, groups that grow
    first (so the cluster never holds less than the smaller of both layouts meanwhile); empty
    when they match. Raises `LayoutMismatchError` naming every difference that scaling cannot
    make: the serving mode, a group missing on either side, a TP size."""
    differences: list[str] = []
    if _mode(planned) != _mode(running):
        differences.append(
            f"the plan is {_mode(planned)} ({', '.join(planned)}), the cluster serves "
            f"{_mode(running)} ({', '.join(running) or 'no groups'})"
            + (" (plan with --no-mixed)" if _mode(planned) == "mixed" else "")
        )
    else:
        differences += [
            f"the cluster has no {name} group" for name in planned if name not in running
        ]
        differences += [f"the plan has no {name} group" for name in running if name not in planned]
    for name, shape in planned.items():
        now = running.get(name)
        if now is not None and now.tp != shape.tp:
            differences.append(
                f"{name}: the plan wants TP {shape.tp}, the cluster runs TP {now.tp} "
                f"(TP cannot change while serving; plan with --tp {now.tp} to keep it)"
            )
    if differences:
        raise LayoutMismatchError(differences)
    changes = [(name, shape.replicas) for name, shape in planned.items()]
    grow = [(n, r) for n, r in changes if r > running[n].replicas]
    shrink = [(n, r) for n, r in changes if r < running[n].replicas]
    return grow + shrink


async def apply_layout(layout: Layout, args: argparse.Namespace) -> int:
    """Scale the cluster at ``args.apply`` to ``layout``; 0 once it runs it, 1 when refused or
    a scale failed (the groups scaled before it stay scaled), 2 for unreadable TLS files."""
    address = args.apply
    try:
        chan = open_channel(args, address=address)
    except TLSFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    async with chan:
        stub = pb_grpc.GenerationStub(chan)
        try:
            state = await stub.GetClusterState(
                pb.GetClusterStateRequest(), timeout=STATE_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            print(rpc_error_line(error), file=sys.stderr)
            return 1
        running = running_groups(state)
        try:
            changes = layout_changes(planned_groups(layout), running)
        except LayoutMismatchError as error:
            print(
                f"error: cannot apply {layout.label} to {address} by scaling, nothing scaled: "
                f"{error}",
                file=sys.stderr,
            )
            return 1
        print(f"\n--- applying {layout.label} to {address} ---")
        if not changes:
            print(f"{address} already runs {layout.label}: nothing scaled")
            return 0
        for group, replicas in changes:
            try:
                response = await scale_group(stub, group, replicas, args.apply_timeout)
            except grpc.aio.AioRpcError as error:
                print(rpc_error_line(error), file=sys.stderr)
                print(f"{group}: not scaled to {replicas} ({error.code().name})")
                return 1
            # Each line as its group is done: a later failure leaves the earlier ones said.
            print(scaled_line(group, response, before=running[group].replicas), flush=True)
    print(f"{address} runs {layout.label}")
    return 0
