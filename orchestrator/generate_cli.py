"""``pdserve generate --address HOST:PORT PROMPT``: stream an answer to the terminal."""

from __future__ import annotations

import argparse
import sys

import grpc

from orchestrator.client import channel, pb, pb_grpc


def _apply_chat_template(prompt: str, model_dir: str | None) -> str:
    # The router applies no template (client API); --chat renders SmolLM2's ChatML by hand so
    # that the client needs no checkpoint.
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


async def generate(args: argparse.Namespace) -> int:
    prompt = _apply_chat_template(args.prompt, None) if args.chat else args.prompt
    request = pb.GenerateRequest(prompt=prompt)
    if args.max_tokens is not None:
        request.sampling.max_tokens = args.max_tokens
    if args.temperature is not None:
        request.sampling.temperature = args.temperature
    async with channel(args.address) as chan:
        stub = pb_grpc.GenerationStub(chan)
        try:
            async for response in stub.Generate(request, timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.finish_reason:
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
            return 1
    return 0
