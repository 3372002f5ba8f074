"""`LanePicker` (`workers.kv.nic_lanes`) with real ``tcp`` engines on loopback addresses: the NIC
pairs requests take in turn, spread evenly over every NIC of both sides whatever their counts,
and the single-NIC lane that is exactly what a single-NIC worker used."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest

from workers.fabric import MemoryRegionDescriptor, NicSet, PeerHandle
from workers.kv.nic_lanes import LanePicker
from workers.kv.prefill_checks import CheckedRequest
from workers.kv.protocol import PrefillRequest

PROVIDER = "tcp;ofi_rxm"


@pytest.fixture
def nics() -> Iterator[tuple[NicSet, NicSet]]:
    prefill = NicSet.open(PROVIDER, ["127.0.0.2", "127.0.0.3"])
    decoder = NicSet.open(PROVIDER, ["127.0.0.4", "127.0.0.5", "127.0.0.6"])
    yield prefill, decoder
    prefill.close()
    decoder.close()


def descriptor(key: int) -> MemoryRegionDescriptor:
    return MemoryRegionDescriptor(PROVIDER, 0, 1 << 20, key, False)


def checked(decoder_nics: tuple[bytes, ...]) -> CheckedRequest:
    """A request from a decoder of one rank whose other NICs are ``decoder_nics``; NIC ``j``'s
    descriptor has key ``j``."""
    request = PrefillRequest(
        "r", 1, (1, 2, 3), 16, ((0,),), 1, 2, False, (), True, 0, 0, (b"d",), b"", 0, 0, 1000,
        nic_addresses=decoder_nics,
        nic_descriptors=tuple((descriptor(j + 1).to_bytes(),) for j in range(len(decoder_nics))),
    )  # fmt: skip
    nic_descriptors = tuple((descriptor(j + 1),) for j in range(len(decoder_nics)))
    # Only what a lane is picked by: no plan, no layout.
    return CheckedRequest(
        request,
        plan=None,  # type: ignore[arg-type]
        dst_descriptors=(descriptor(0),),
        dst_layout=None,  # type: ignore[arg-type]
        dst_pages=[0],
        context=None,
        nic_descriptors=nic_descriptors,
    )


def lanes(
    picker: LanePicker, request: CheckedRequest, peer: PeerHandle, count: int
) -> list[tuple[int, int]]:
    """(prefill NIC, decoder NIC by its descriptor's key) of ``count`` requests in turn."""
    picked = [picker.pick(request, peer) for _ in range(count)]
    return [(lane.nic, lane.dst_descriptors[0].key) for lane in picked]


def test_every_pair_of_nics_in_turn(nics: tuple[NicSet, NicSet]) -> None:
    prefill, decoder = nics
    picker = LanePicker(prefill.engines, random.Random(5))
    peer = prefill.primary.add_peer(decoder.primary.address)
    request = checked(decoder.addresses[1:])
    taken = lanes(picker, request, peer, 12)
    # lcm(2, 3) = 6 pairs, each once per round: every NIC of each side equally often.
    assert Counter(taken) == {(i % 2, i % 3): 2 for i in range(6)}
    assert taken[:6] == taken[6:]  # round-robin, from a random start
    for lane in (picker.pick(request, peer) for _ in range(6)):
        engine = prefill.engines[lane.nic]
        expected = decoder.addresses[lane.dst_descriptors[0].key]
        # The destination NIC as the lane's own engine knows it.
        assert lane.peer.address == expected and lane.peer is engine.add_peer(expected)


def test_one_prefill_nic_still_spreads_over_every_decoder_nic(
    nics: tuple[NicSet, NicSet],
) -> None:
    prefill, decoder = nics
    picker = LanePicker(prefill.engines[:1], random.Random(1))
    peer = prefill.primary.add_peer(decoder.primary.address)
    taken = lanes(picker, checked(decoder.addresses[1:]), peer, 6)
    assert Counter(taken) == {(0, 0): 2, (0, 1): 2, (0, 2): 2}


def test_one_nic_each_side_is_the_primary_pair_as_before(nics: tuple[NicSet, NicSet]) -> None:
    prefill, decoder = nics
    picker = LanePicker(prefill.engines[:1])
    peer = prefill.primary.add_peer(decoder.primary.address)
    request = checked(())
    for _ in range(3):
        lane = picker.pick(request, peer)
        assert lane.nic == 0 and lane.peer is peer
        assert lane.dst_descriptors is request.dst_descriptors
