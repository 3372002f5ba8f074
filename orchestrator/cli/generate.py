"""``pdserve generate --address HOST:PORT PROMPT``: stream an answer to the terminal.

``--tls-ca`` / ``--tls-cert`` / ``--tls-key`` (or ``--tls``) connect over TLS / mTLS;
``--token`` (default: ``$PDSERVE_TOKEN``) is sent as ``authorization: Bearer``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import grpc

from orchestrator.api.client import channel, pb, pb_grpc
from orchestrator.api.security import TLSFileError

TOKEN_ENV = "PDSERVE_TOKEN"


def _chatml(prompt: str) -> str:
    # The router applies no template over gRPC (generation.proto's ``prompt``) and the client
    # has no checkpoint: --chat writes ChatML (SmolLM2's and Qwen's format) by hand.
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


async def generate(args: argparse.Namespace) -> int:
    prompt = _chatml(args.prompt) if args.chat else args.prompt
    request = pb.GenerateRequest(prompt=prompt)
    if args.max_tokens is not None:
        request.sampling.max_tokens = args.max_tokens
    if args.temperature is not None:
        request.sampling.temperature = args.temperature
    try:
        chan = open_channel(args)
    except TLSFileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    async with chan:
        stub = pb_grpc.GenerationStub(chan)
        finished = False
        try:
            async for response in stub.Generate(request, timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
                    finished = True
                    t = response.timings
                    print(
                        f"\n[{response.usage.prompt_tokens} prompt + "
                        f"{response.usage.completion_tokens} tokens, "
                        f"finish={response.finish_reason}, "
                        f"TTFT {t.time_to_first_token_seconds * 1000:.0f} ms, "
                        f"ITL {t.mean_inter_token_latency_seconds * 1000:.1f} ms]",
                        file=sys.stderr,
                    )
        except grpc.aio.AioRpcError as error:
            print(f"\nerror: {error.code().name}: {error.details()}", file=sys.stderr)
            if error.code() == grpc.StatusCode.UNAUTHENTICATED:
                print(
                    f"the router requires a token: pass --token or set {TOKEN_ENV}"
                    if not _token(args)
                    else "the router rejected the token given (--token / $PDSERVE_TOKEN)",
                    file=sys.stderr,
                )
            return 1
        except BrokenPipeError:
            # The reader left (`| head`): stop quietly; the stream's cancel aborts the request.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 1
    if not finished:
        print("\nerror: the stream ended without a finish reason", file=sys.stderr)
        return 1
    return 0


def _token(args: argparse.Namespace) -> str | None:
    return args.token or os.environ.get(TOKEN_ENV) or None


def open_channel(args: argparse.Namespace, address: str | None = None) -> grpc.aio.Channel:
    """The channel to ``address`` (default ``args.address``) with the connection flags (TLS
    files, token)."""

    def path(value: str | None) -> Path | None:
        return Path(value).expanduser() if value else None

    return channel(
        address or args.address,
        tls_ca=path(args.tls_ca),
        client_cert=path(args.tls_cert),
        client_key=path(args.tls_key),
        token=_token(args),
        tls=args.tls,
    )
