"""One decode-side transfer: the request it serves, its state machine once it holds pages, and
the `PrefillRequest` that asks a prefill worker for its KV (`RequestPlanner`).

Who knows the write count: without coalescing the decoder computes it alone
(`expected_write_count_from_dst`), arms its counter before the request goes and sends the count
for the prefill side to cross-check; with coalescing the runs depend on the prefill's page ids,
so it sends 0 and arms on `PrefillAccepted`. In checksum mode the decoder keeps the plan's
destination side, which it verifies the received pages against (`workers.kv.decode_context`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.engine.errors import HeadPlacementError
from workers.engine.sampling_params import SamplingParams
from workers.fabric import PeerHandle, TransferEngine
from workers.kv.decode_context import ContextRows
from workers.kv.endpoint import PrefillEndpoint
from workers.kv.errors import ShardingError
from workers.kv.pools import RegisteredPools
from workers.kv.protocol import PrefillRequest
from workers.kv.sharding import GroupSharding, PageGeometry, TransferPlan, make_transfer_plan
from workers.kv.transfer_state import DecodeTransfer
from workers.kv.writes import expected_write_count_from_dst


@dataclass
class Incoming:
    prompt: list[int]
    params: SamplingParams
    endpoint: PrefillEndpoint
    admission_deadline_s: float
    transfer: DecodeTransfer | None = None  # None while pending (no pages or slot yet)
    peer: PeerHandle | None = None
    armed: bool = False
    checksum_plan: TransferPlan | None = None  # checksum mode: the plan's destination side
    # The prompt's leading pages this decoder holds (its prefix cache): not transferred, shared
    # with the request from `_request` on (the transfer's pinned pages follow them).
    cached_pages: list[int] = field(default_factory=list)
    # The prompt's page names, kept while it waits: its cache lookup is retried every poll.
    page_hashes: list[bytes] = field(default_factory=list)


@dataclass(frozen=True)
class NicAdvert:
    """The decoder's NICs after its primary one, as every `PrefillRequest` names them: each
    one's fabric address and its registrations of the pools (one descriptor per rank)."""

    addresses: tuple[bytes, ...] = ()
    descriptors: tuple[tuple[bytes, ...], ...] = ()


@dataclass(frozen=True)
class PlannedRequest:
    message: PrefillRequest
    expected: int  # the write count the decoder computed; 0: it comes in PrefillAccepted
    checksum_plan: TransferPlan | None


class RequestPlanner:
    def __init__(
        self,
        fabric: TransferEngine,
        sharding: GroupSharding,
        geometry: PageGeometry,
        pools: RegisteredPools,
        context: ContextRows,
        *,
        coalesce_pages: bool,
        checksum: bool,
        transfer_timeout_s: float,
        rng: random.Random,
        mtp_layers: int = 0,
        extra_nics: NicAdvert | None = None,
    ) -> None:
        """``rng``: picks the source replica sets when the decoder plans alone (no
        coalescing). ``mtp_layers``: the pool's MTP layers, asked of the prefill worker.
        ``extra_nics``: the decoder's other NICs, named in every request (None: none)."""
        self._fabric = fabric
        self._sharding = sharding
        self._geometry = geometry
        self._pools = pools
        self._context = context
        self._coalesce = coalesce_pages
        self._checksum = checksum
        self._timeout_ms = max(1, int(transfer_timeout_s * 1000))
        self._rng = rng
        self._mtp_layers = mtp_layers
        self._nics = extra_nics or NicAdvert()

    def plan(
        self,
        request_id: str,
        imm: int,
        slot: int,
        prompt: Sequence[int],
        pages: Sequence[int],
        endpoint: PrefillEndpoint,
        decode_incarnation: int,
        skip_pages: int = 0,
    ) -> PlannedRequest:
        """The request for ``prompt``'s KV (all but its last token) into ``pages`` and the
        context row of ``slot``, counted under ``imm``, from the decoder's
        ``decode_incarnation``; the decoder holds the first ``skip_pages`` pages already, so
        ``pages`` hold the rest."""
        geometry = self._geometry
        source_sets: tuple[int, ...] = ()
        expected = 0
        checksum_plan = None
        try:
            src = GroupSharding(endpoint.tp_size, endpoint.num_kv_heads, endpoint.is_mla)
        except HeadPlacementError as error:  # the endpoint's claim: this request fails
            raise ShardingError(f"prefill group layout: {error}") from error
        if not self._coalesce:
            plan = make_transfer_plan(
                src, self._sharding, geometry, rng=self._rng, coalesce_pages=False
            )
            source_sets = plan.source_sets
            expected = expected_write_count_from_dst(plan, list(pages), geometry.num_layers, 1)
            if self._checksum:
                checksum_plan = plan
        elif self._checksum:
            # Only the destination side is used; it is the same whichever source replica set
            # the prefill worker picks, so any choice (the first) stands in for its.
            checksum_plan = make_transfer_plan(
                src,
                self._sharding,
                geometry,
                source_sets=(0,) * self._sharding.num_replica_sets,
            )
        max_run = self._fabric.max_pages_per_run(self._pools.layout.page_bytes) or 0
        message = PrefillRequest(
            request_id,
            imm,
            tuple(prompt[:-1]),
            geometry.page_size,
            (tuple(pages),),
            self._sharding.tp_size,
            self._sharding.num_kv_heads,
            self._sharding.is_mla,
            source_sets,
            self._coalesce,
            endpoint.segment_pages,
            max_run,
            self._pools.descriptor_bytes(),
            self._context.descriptor.to_bytes(),
            self._context.offset(slot),
            expected,
            self._timeout_ms,
            self._checksum,
            prefill_incarnation=endpoint.incarnation,
            decode_incarnation=decode_incarnation,
            mtp_layers=self._mtp_layers,
            skip_pages=skip_pages,
            nic_addresses=self._nics.addresses,
            nic_descriptors=self._nics.descriptors,
        )
        return PlannedRequest(message, expected, checksum_plan)
