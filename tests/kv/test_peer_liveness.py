"""A peer's process is judged alive or gone on evidence, never on time.

- On ``tcp`` a killed peer's listening socket refuses connections, while a stopped one's still
  accepts (`workers.kv.peer_liveness.listener_refuses`); a probe leaves a live peer's fabric
  as it was.
- A message from a decoder the prefill fabric marked failed (an operation to it missed its
  deadline) proves it alive: the prefill side resolves it afresh and serves it.

Killed and stopped prefill processes end to end: `test_messenger_faults.py`,
`test_messenger_stall.py`.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.engine_helpers import make_engine, prompts_of_lengths, run_engine
from tests.kv.harness import wait_pools_full
from workers.engine.config import EngineConfig
from workers.engine.sampling_params import SamplingParams
from workers.fabric import OperationTimeoutError, TransferEngine
from workers.kv.decode_messenger import DecodeMessengerConfig
from workers.kv.peer_liveness import listener_refuses, tcp_address
from workers.service.kv_worker import DecodeWorker, PrefillWorker

PROVIDER = "tcp;ofi_rxm"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
DECODE_PAGES = 200
PREFILL_PAGES = 64


def test_tcp_names_parse_and_a_closed_port_is_refused() -> None:
    assert tcp_address("fi_sockaddr_in://127.0.0.1:4242") == ("127.0.0.1", 4242)
    assert tcp_address("fi_sockaddr_in6://[::1]:4242") == ("::1", 4242)
    assert tcp_address("fi_shm://1234:0:0") is None
    assert not listener_refuses("fi_shm://1234:0:0")  # not tcp: never judged gone
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert not listener_refuses(f"fi_sockaddr_in://127.0.0.1:{port}")
    assert listener_refuses(f"fi_sockaddr_in://127.0.0.1:{port}")  # closed with its owner


def test_probing_a_live_engine_leaves_its_progress_thread_asleep() -> None:
    """The probe resets its connection: closed with a FIN before the provider's handshake, it
    stayed readable for good in libfabric 1.17's tcp poll set, and the probed prefill worker's
    idle progress thread spun a core from then on (under load: slower prefill steps, until the
    engine dropped its wait fd for naps)."""
    engine = TransferEngine(PROVIDER, "127.0.0.1")
    try:
        name = engine.add_peer(engine.address).name
        for _ in range(3):
            assert not listener_refuses(name)
        # Longer than the engine takes to notice a wait fd that stays readable (~1 s).
        time.sleep(2.0)
        assert not engine.stats().progress.wait_fd_dropped
        assert engine.closed_reason() is None
    finally:
        engine.close()


@pytest.fixture
def pair(tiny_model_dir: Path) -> Iterator[tuple[PrefillWorker, DecodeWorker]]:
    prefill = PrefillWorker(
        tiny_model_dir, EngineConfig(num_pages=PREFILL_PAGES), provider=PROVIDER
    )
    decode = DecodeWorker(
        tiny_model_dir,
        EngineConfig(num_pages=DECODE_PAGES),
        provider=PROVIDER,
        messenger_config=DecodeMessengerConfig(transfer_timeout_s=5.0, drain_interval_s=0.2),
    )
    yield prefill, decode
    decode.close()
    prefill.close(drain_timeout_s=2.0)


@pytest.mark.slow
def test_a_decoder_marked_failed_is_resolved_again_when_it_sends(
    tiny_model_dir: Path, pair: tuple[PrefillWorker, DecodeWorker]
) -> None:
    prefill, decode = pair
    warm, *later = prompts_of_lengths([40, 41, 42], seed=9)
    expected = run_engine(make_engine(tiny_model_dir), later, GREEDY)
    endpoint = prefill.endpoint()
    assert decode.submit("warm", warm, GREEDY, endpoint).result(30)[1].error is None

    loop = prefill.fabric._loop
    peer = prefill.fabric.add_peer(decode.fabric.address)
    # NAMED FAULT INJECTION: the prefill fabric marks the decoder failed as its progress loop
    # does when an operation to it misses the operation deadline (a decoder stalled by SIGSTOP,
    # swap or a GC). The workers fix that deadline at 30 s, longer than a test can stall a
    # peer; the mark is the fabric's own, made on its progress thread.
    loop.call(lambda: loop.peers.fail(peer, OperationTimeoutError("injected: missed deadline")))
    assert isinstance(prefill.fabric.peer_failure(decode.fabric.address), OperationTimeoutError)

    # The decoder is alive: its next requests prove it, and are served.
    for index, (prompt, tokens) in enumerate(zip(later, expected, strict=True)):
        assert decode.submit(f"later{index}", prompt, GREEDY, endpoint).result(30)[0] == tokens
    assert prefill.fabric.peer_failure(decode.fabric.address) is None
    wait_pools_full(prefill, decode, prefill_pages=PREFILL_PAGES, decode_pages=DECODE_PAGES)
