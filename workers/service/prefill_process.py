"""A prefill worker in its own process.

Two ways in:

- ``multiprocessing`` (spawn) target `prefill_process_main(conn, options_json)`: builds a
  `PrefillWorker`, sends its `PrefillEndpoint` bytes, then answers JSON commands
  (``{"op": "state"}``, ``{"op": "stats", "request_id": ...}``, ``{"op": "pids"}`` (TP
  followers), ``{"op": "close"}``) on the pipe.
  The pipe carries bytes only (JSON / msgpack), never pickled objects of ours.
- ``python -m workers.service.prefill_process --model DIR [--provider P] [--endpoint-file F]``: prints
  (or writes) the endpoint as hex and serves until SIGINT / SIGTERM.

Options (JSON object): ``model_dir``, ``provider``, ``node``, ``nics`` (a list: one transfer
engine per NIC instead of one on ``node``, `workers.service.kv_worker.open_fabric`), ``engine``
(EngineConfig fields, e.g. ``tensor_parallel_size``: the worker is then its group's leader and
spawns the other ranks, so the process must not be daemonic), ``messenger``
(PrefillMessengerConfig fields),
``num_threads`` (``torch.set_num_threads`` before the engine starts; TP followers never use more
than the leader).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from workers.engine.compute_thread import build_on_passing_thread
from workers.engine.config import EngineConfig
from workers.kv.prefill_messenger import PrefillMessengerConfig
from workers.log import configure_logging
from workers.service.kv_worker import PrefillWorker

log = logging.getLogger(__name__)


def build_prefill_worker(options: dict[str, Any]) -> PrefillWorker:
    num_threads = options.get("num_threads")
    if num_threads is not None:
        torch.set_num_threads(int(num_threads))
    # Loaded on a thread that ends: the step loop's OpenMP team is then the process's only one
    # (see `workers.engine.compute_thread`).
    return build_on_passing_thread(
        lambda: PrefillWorker(
            options["model_dir"],
            EngineConfig(**options.get("engine", {})),
            provider=options.get("provider", "tcp;ofi_rxm"),
            node=options.get("node", "127.0.0.1"),
            nics=tuple(options.get("nics", ())),
            messenger_config=PrefillMessengerConfig(**options.get("messenger", {})),
        )
    )


def prefill_process_main(conn: Connection, options_json: bytes) -> None:
    configure_logging(default=logging.WARNING, origin="prefill")
    worker = build_prefill_worker(json.loads(options_json))
    try:
        conn.send_bytes(worker.endpoint().to_bytes())
        while True:
            try:
                command = json.loads(conn.recv_bytes())
            except EOFError:
                break
            op = command.get("op")
            if op == "close":
                break
            if op == "state":
                reply: Any = worker.state()
            elif op == "stats":
                reply = worker.transfer_stats(command["request_id"])
            elif op == "pids":  # the TP follower ranks this worker leads
                tp = worker.engine.tp
                reply = [process.pid for process in tp.processes] if tp is not None else []
            else:
                reply = {"error": f"unknown op {op!r}"}
            conn.send_bytes(json.dumps(reply).encode())
    finally:
        worker.close()
    conn.send_bytes(b'"closed"')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--provider", default="tcp;ofi_rxm")
    parser.add_argument("--node", default="127.0.0.1")
    parser.add_argument("--num-pages", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--endpoint-file", type=Path, default=None)
    args = parser.parse_args(argv)
    configure_logging()
    worker = build_prefill_worker(
        {
            "model_dir": args.model,
            "provider": args.provider,
            "node": args.node,
            "engine": {
                "num_pages": args.num_pages,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "tensor_parallel_size": args.tensor_parallel_size,
            },
        }
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    endpoint = worker.endpoint().to_bytes().hex()
    if args.endpoint_file is not None:
        args.endpoint_file.write_text(endpoint)
    else:
        print(endpoint, flush=True)  # the CLI's output
    try:
        while not stop.wait(0.5):  # a timed wait lets the signal handlers run promptly
            pass
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
