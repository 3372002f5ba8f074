"""``pdserve scale --address HOST:PORT --group decode --replicas N``: resize a group of a
serving cluster (the router's ``ScaleGroup``); waits until the group has its new size.

Connection flags as ``pdserve generate`` (`orchestrator.cli.generate`): ``--token`` (default
``$PDSERVE_TOKEN``), ``--tls`` / ``--tls-ca`` / ``--tls-cert`` / ``--tls-key``. ``pdserve plan
--apply`` scales through `scale_group` too (`orchestrator.cli.apply_layout`).
"""

from __future__ import annotations

import argparse
import sys

import grpc

from orchestrator.api.client import pb, pb_grpc
from orchestrator.api.security import TLSFileError
from orchestrator.cli.generate import open_channel


async def scale_group(
    stub: pb_grpc.GenerationStub, group: str, replicas: int, timeout: float
) -> pb.ScaleGroupResponse:
    """One ``ScaleGroup`` call, announced on stderr; raises ``grpc.aio.AioRpcError``."""
    print(f"scaling {group} to {replicas} replicas ...", file=sys.stderr)
    request = pb.ScaleGroupRequest(group=group, replicas=replicas)
    response: pb.ScaleGroupResponse = await stub.ScaleGroup(request, timeout=timeout)
    return response


def scaled_line(group: str, response: pb.ScaleGroupResponse, before: int | None = None) -> str:
    """``decode: [1 -> ]2 replicas (started: decode-1; stopped: none)``."""
    added = ", ".join(response.added) or "none"
    removed = ", ".join(response.removed) or "none"
    was = "" if before is None else f"{before} -> "
    return f"{group}: {was}{response.replicas} replicas (started: {added}; stopped: {removed})"


def rpc_error_line(error: grpc.aio.AioRpcError) -> str:
    return f"error: {error.code().name}: {error.details()}"


async def scale(args: argparse.Namespace) -> int:
    if args.replicas < 1:
        print(f"error: --replicas must be at least 1, got {args.replicas}", file=sys.stderr)
        return 2
    try:
        chan = open_channel(args)
    except TLSFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    async with chan:
        stub = pb_grpc.GenerationStub(chan)
        try:
            response = await scale_group(stub, args.group, args.replicas, args.timeout)
        except grpc.aio.AioRpcError as error:
            print(rpc_error_line(error), file=sys.stderr)
            return 1
    print(scaled_line(args.group, response))
    return 0
