"""Everything the prefill side checks in a `PrefillRequest` before it accepts it.

A request is refused (`RequestRejected` with a `RejectReason`) when it names another incarnation
of this worker (a stale endpoint: `workers.kv.endpoint`), when the two groups cannot be
mapped (page size, heads, MLA, TP sizes), the decoder's descriptors (those of each of its NICs
too) are not for this provider or are too small for the page ids it names, the context buffer cannot hold a hidden state, the
prompt can never fit, or the decoder's own write count disagrees with the plan; in checksum
mode also when the pools are device memory or the sums do not fit (`check_checksums`). Nothing
is allocated before every check passed.
"""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import dataclass

from workers.fabric import FabricError, MemoryRegionDescriptor
from workers.kv.checksum import ChecksumAccumulator, area_bytes, shard_order
from workers.kv.errors import KvTransferError
from workers.kv.pages import num_pages_for_tokens
from workers.kv.pools import layout_from_descriptor
from workers.kv.prefill_side import PrefillSide
from workers.kv.protocol import PrefillRequest, RejectReason
from workers.kv.sharding import TransferPlan, make_transfer_plan
from workers.kv.writes import PageIds, PoolLayout, expected_write_count_from_dst


class RequestRejected(KvTransferError):
    def __init__(self, reason: RejectReason, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class CheckedRequest:
    request: PrefillRequest
    plan: TransferPlan
    dst_descriptors: tuple[MemoryRegionDescriptor, ...]
    dst_layout: PoolLayout
    dst_pages: PageIds
    context: MemoryRegionDescriptor | None
    # The decoder's pools on each of its other NICs (`PrefillRequest.nic_descriptors`).
    nic_descriptors: tuple[tuple[MemoryRegionDescriptor, ...], ...] = ()

    def dst_slice(self, pages: range) -> PageIds:
        if isinstance(self.dst_pages, dict):
            return {rank: ids[pages.start : pages.stop] for rank, ids in self.dst_pages.items()}
        assert isinstance(self.dst_pages, list)
        return self.dst_pages[pages.start : pages.stop]


def check_request(request: PrefillRequest, side: PrefillSide, rng: random.Random) -> CheckedRequest:
    mine = side.sharding
    geometry = side.geometry
    engine = side.engine
    incompatible = RejectReason.INCOMPATIBLE
    meant_for = request.prefill_incarnation
    if meant_for and meant_for != side.incarnation:
        raise RequestRejected(
            incompatible,
            f"stale prefill endpoint: the request is for incarnation {meant_for:#x}, this worker "
            f"is {side.incarnation:#x} (it restarted; use its current endpoint)",
        )
    if request.page_size != geometry.page_size:
        raise RequestRejected(
            incompatible, f"page size {request.page_size} != {geometry.page_size}"
        )
    if (request.num_kv_heads, request.is_mla) != (mine.num_kv_heads, mine.is_mla):
        raise RequestRejected(incompatible, "KV heads / MLA differ from this model's")
    mtp_layers = geometry.num_layers - engine.model_config.num_layers
    if request.mtp_layers != mtp_layers:
        raise RequestRejected(
            incompatible,
            "the decoder drafts with mtp and needs the MTP layer's KV, which this prefill worker "
            "does not compute (mtp_kv)"
            if request.mtp_layers
            else "this prefill worker computes the MTP layer (mtp_kv) for decoders that draft "
            "with mtp; this decoder does not",
        )
    # The engine is given the prefilled tokens plus a stand-in last one (`PrefillMessenger.
    # _admit`) and wants room for one output token after them (`validate_request`): the same
    # bounds here, so a request accepted (and given pages, a row) is never refused at admission.
    num_prompt_tokens = len(request.token_ids) + 1
    if num_prompt_tokens >= engine.max_model_len:
        raise RequestRejected(RejectReason.TOO_LONG, f"{num_prompt_tokens} tokens")
    pool_tokens = engine.pool_tokens
    if num_prompt_tokens + 1 > pool_tokens:
        raise RequestRejected(
            RejectReason.TOO_LONG,
            f"{num_prompt_tokens} tokens leave no room in the KV pool ({pool_tokens} tokens)",
        )
    if max(request.token_ids) >= engine.model_config.vocab_size:
        raise RequestRejected(incompatible, "token id outside the vocabulary")
    page_bytes = side.pools.layout.page_bytes
    my_limit = side.fabric.max_pages_per_run(page_bytes)
    if my_limit is not None and not 0 < request.max_pages_per_run <= my_limit:
        raise RequestRejected(incompatible, f"runs longer than {my_limit} pages do not fit")
    try:
        plan = make_transfer_plan(
            mine,
            request.decode_sharding,
            geometry,
            rng=rng,
            source_sets=request.source_sets or None,
            coalesce_pages=request.coalesce_pages,
            segment_pages=request.segment_pages or None,
            max_pages_per_run=request.max_pages_per_run or None,
        )
        descriptors = tuple(MemoryRegionDescriptor.from_bytes(d) for d in request.dst_descriptors)
        # The same pools registered with each of the decoder's other NICs: checked alike.
        nic_descriptors = tuple(
            tuple(MemoryRegionDescriptor.from_bytes(d) for d in per_rank)
            for per_rank in request.nic_descriptors
        )
        every_descriptor = descriptors + tuple(d for nic in nic_descriptors for d in nic)
        layouts = {
            layout_from_descriptor(d, request.decode_sharding, geometry) for d in every_descriptor
        }
        context = (
            MemoryRegionDescriptor.from_bytes(request.context_descriptor)
            if request.context_descriptor
            else None
        )
    except (KvTransferError, FabricError) as error:
        raise RequestRejected(incompatible, str(error)) from error
    if any(d.provider != side.fabric.provider for d in every_descriptor):
        raise RequestRejected(incompatible, "descriptors are for another provider")
    if len(layouts) != 1:
        raise RequestRejected(incompatible, "decode ranks' pools differ in size")
    (dst_layout,) = layouts
    for pages in request.dst_page_ids:
        if pages and max(pages) >= dst_layout.num_pages:
            raise RequestRejected(incompatible, "a destination page id is outside the pool")
        if len(set(pages)) != len(pages):
            raise RequestRejected(incompatible, "destination page ids repeat")
    row_bytes = engine.model_config.hidden_size * engine.kv_cache.element_size()
    if context is not None and request.context_offset + row_bytes > context.length:
        raise RequestRejected(incompatible, "context buffer too small for the hidden state")
    dst_pages: PageIds = (
        list(request.dst_page_ids[0])
        if len(request.dst_page_ids) == 1
        else {rank: list(ids) for rank, ids in enumerate(request.dst_page_ids)}
    )
    if request.expected_write_count:
        try:
            mine_count = expected_write_count_from_dst(
                plan, dst_pages, geometry.num_layers, request.num_context_writes
            )
        except KvTransferError as error:
            raise RequestRejected(RejectReason.WRITE_COUNT_MISMATCH, str(error)) from error
        if mine_count != request.expected_write_count:
            raise RequestRejected(
                RejectReason.WRITE_COUNT_MISMATCH,
                f"decoder expects {request.expected_write_count} writes, plan has {mine_count}",
            )
    return CheckedRequest(
        request, plan, descriptors, dst_layout, dst_pages, context, nic_descriptors
    )


def check_checksums(
    checked: CheckedRequest,
    side: PrefillSide,
    max_checksum_shards: int,
    fault_flip_after_checksum: Collection[str] = (),
) -> ChecksumAccumulator | None:
    """Checksum mode's accumulator for an accepted request, None when it did not ask.

    ``max_checksum_shards``: the sums a context staging row has room for;
    ``fault_flip_after_checksum``: the named test fault of `PrefillMessengerConfig`."""
    request = checked.request
    if not request.checksum:
        return None
    incompatible = RejectReason.INCOMPATIBLE
    if not side.checksum_capable:
        raise RequestRejected(incompatible, "checksum mode needs host-memory KV pools")
    num_shards = len(checked.plan.shards)
    if num_shards > max_checksum_shards:
        raise RequestRejected(
            incompatible, f"checksums of {num_shards} shards exceed the staging row"
        )
    try:
        shard_order(checked.plan)
    except KvTransferError as error:
        raise RequestRejected(incompatible, str(error)) from error
    context = checked.context
    needed = side.hidden_bytes + area_bytes(num_shards)
    if context is None or request.context_offset + needed > context.length:
        raise RequestRejected(incompatible, "context buffer too small for the checksums")
    checksums = ChecksumAccumulator(
        side.geometry.num_layers,
        num_shards,
        num_pages_for_tokens(len(request.token_ids), side.geometry.page_size) - request.skip_pages,
    )
    checksums.flip_pending = request.request_id in fault_flip_after_checksum
    return checksums
