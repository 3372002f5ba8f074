"""``pdserve scale --address HOST:PORT --group decode --replicas N``: resize a group of a
serving cluster (the router's ``ScaleGroup``); waits until the group has its new size.

Connection flags as ``pdserve generate`` (`orchestrator.cli.generate`): ``--token`` (default
``$PDSERVE_TOKEN``), ``--tls`` / ``--tls-ca`` / ``--tls-cert`` / ``--tls-key``.
"""

from __future__ import annotations

import argparse
import sys

import grpc

from orchestrator.api.client import pb, pb_grpc
from orchestrator.api.security import TLSFileError
from orchestrator.cli.generate import open_channel


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
        request = pb.ScaleGroupRequest(group=args.group, replicas=args.replicas)
        print(f"scaling {args.group} to {args.replicas} replicas ...", file=sys.stderr)
        try:
            response = await stub.ScaleGroup(request, timeout=args.timeout)
        except grpc.aio.AioRpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    added = ", ".join(response.added) or "none"
    removed = ", ".join(response.removed) or "none"
    print(f"{args.group}: {response.replicas} replicas (started: {added}; stopped: {removed})")
    return 0
