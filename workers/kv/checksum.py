"""Checksum mode (off by default): the decoder verifies that the KV it received is the KV sent.

Counting stays the completion signal: the checksums ride in the context write, which is counted
like every other write, so when the decoder's counter fires they have landed too.

**What is summed.** Per shard of the `TransferPlan` and per layer ``l``: ``crc_l`` = CRC-32
streamed over exactly the bytes the shard moves at layer ``l``, page by page in request order,
inside a page span by span (the whole page, or its K part then its V part). A coalesced run is
the concatenation of its pages, so the prefill side streams over the rows it posts and the
decoder over its pages and gets the same value whatever the runs were. The shard's digest is
CRC-32 of the little-endian ``uint32`` array ``[crc_0 … crc_{L-1}]`` (one value per shard keeps
the area small; a single changed region always changes its ``crc_l`` and so the digest).

**Context payload** (checksum mode): the hidden-state row, then the checksum area of
`area_bytes` = ``4 · (2 + num_shards)`` bytes, little-endian ``uint32``::

    [num_shards, crc32(hidden row), digest(shard 0), …, digest(shard S-1)]

Shards are in plan order; their destination side (rank, head offsets, spans) does not depend on
which source replica set the prefill chose, so the decoder rebuilds it without knowing that.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from workers.kv.errors import KVChecksumError, KvTransferError, ShardingError
from workers.kv.sharding import GroupSharding, TransferPlan
from workers.kv.writes import PageIds, PoolLayout, pages_of_rank

HEADER_WORDS = 2  # num_shards, crc32 of the hidden-state row


def area_bytes(num_shards: int) -> int:
    """Bytes of the checksum area for a plan of ``num_shards`` shards."""
    return 4 * (HEADER_WORDS + num_shards)


def max_shards(dst: GroupSharding) -> int:
    """Most shards any prefill group can need to fill ``dst``: ``max(H, d)``.

    A plan has ``dst sets · max(source ranges, destination ranges)`` shards with at most ``H``
    ranges per set and ``max(1, d/H)`` destination sets, so at most ``max(H, d)``; under MLA
    one per destination rank (``d``), each from the source rank drawn for it.
    """
    return max(dst.num_kv_heads, dst.tp_size)


def byte_view(buffer: object) -> np.ndarray:
    """A flat ``uint8`` numpy view (no copy) of a host-memory pool; raises for device memory."""
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise KvTransferError("checksum mode needs contiguous host-memory KV pools")
        view: np.ndarray = buffer.detach().view(torch.uint8).reshape(-1).numpy()
        return view
    if isinstance(buffer, np.ndarray):
        return buffer.reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(buffer).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]


def fold(layer_crcs: np.ndarray) -> int:
    """A shard's digest from its per-layer CRCs (in layer order)."""
    return zlib.crc32(np.ascontiguousarray(layer_crcs, dtype="<u4").tobytes())


class ChecksumAccumulator:
    """Prefill side: per-(layer, shard) CRCs streamed by the push thread as it posts writes.

    A (layer, shard) stream sees its pages in request order: the push thread takes the passes in
    order and each pass's sendable pages follow the previous pass's. `complete` once every layer
    of every page was added.
    """

    def __init__(self, num_layers: int, num_shards: int, num_pages: int) -> None:
        self.crcs = np.zeros((num_layers, num_shards), dtype=np.uint32)
        self._remaining = num_layers * num_pages
        self.flip_pending = False  # test fault, see `PrefillMessengerConfig`

    @property
    def num_shards(self) -> int:
        return int(self.crcs.shape[1])

    @property
    def complete(self) -> bool:
        return self._remaining == 0

    def add(self, layer: int, shard: int, src: np.ndarray, rows: np.ndarray) -> None:
        """Stream the source bytes of ``rows`` (``src_offset, dst_offset, length``, in posting
        order) into (``layer``, ``shard``)."""
        crc = int(self.crcs[layer, shard])
        for offset, _, length in rows.tolist():
            crc = _crc(src[offset : offset + length], crc)
        self.crcs[layer, shard] = crc

    def pages_done(self, num_pages: int) -> None:
        """One layer of ``num_pages`` pages was added (over every shard)."""
        self._remaining -= num_pages

    def area(self, hidden_row: np.ndarray) -> bytes:
        words = [self.num_shards, _crc(hidden_row)]
        words += [fold(self.crcs[:, shard]) for shard in range(self.num_shards)]
        return np.asarray(words, dtype="<u4").tobytes()


def destination_crcs(
    plan: TransferPlan, dst_pages: PageIds, views: Sequence[np.ndarray], layout: PoolLayout
) -> np.ndarray:
    """Decoder side: ``[num_layers, num_shards]`` CRCs of the bytes each shard wrote here."""
    num_layers = plan.geometry.num_layers
    crcs = np.zeros((num_layers, len(plan.shards)), dtype=np.uint32)
    page_bytes = layout.page_bytes
    for index, shard in enumerate(plan.shards):
        pages = list(pages_of_rank(dst_pages, shard.dst_rank))
        view = views[shard.dst_rank]
        spans = plan.spans[index]
        whole = len(spans) == 1 and spans[0].length == page_bytes
        for layer in range(num_layers):
            crc = 0
            if whole:  # consecutive page ids are consecutive bytes: one call per stretch
                for start, count in _stretches(pages):
                    offset = layout.page_offset(layer, start)
                    crc = _crc(view[offset : offset + count * page_bytes], crc)
            else:
                for page in pages:
                    base = layout.page_offset(layer, page)
                    for span in spans:
                        at = base + span.dst_offset
                        crc = _crc(view[at : at + span.length], crc)
            crcs[layer, index] = crc
    return crcs


def verify(
    plan: TransferPlan,
    dst_pages: PageIds,
    views: Sequence[np.ndarray],
    layout: PoolLayout,
    hidden_row: np.ndarray,
    area: np.ndarray,
) -> None:
    """Compare what landed with the prefill's checksums; `KVChecksumError` names what differs."""
    words = np.frombuffer(area.tobytes(), dtype="<u4")
    num_shards = len(plan.shards)
    if len(words) < HEADER_WORDS + num_shards or int(words[0]) != num_shards:
        raise KVChecksumError(
            f"KV checksum area names {int(words[0]) if len(words) else 0} shards, "
            f"the plan has {num_shards}"
        )
    if int(words[1]) != _crc(hidden_row):
        raise KVChecksumError("KV checksum mismatch in the context (hidden-state) write")
    crcs = destination_crcs(plan, dst_pages, views, layout)
    bad = [
        index
        for index in range(num_shards)
        if fold(crcs[:, index]) != int(words[HEADER_WORDS + index])
    ]
    if bad:
        shards = ", ".join(
            f"prefill rank {plan.shards[i].src_rank} -> decode rank {plan.shards[i].dst_rank}"
            for i in bad
        )
        raise KVChecksumError(
            f"KV checksum mismatch in {len(bad)} of {num_shards} shards ({shards})"
        )


def shard_order(plan: TransferPlan) -> tuple[tuple[int, int], ...]:
    """The (source rank, destination rank) pair of each shard, in plan order; every pair is
    one shard (the push thread sums per pair)."""
    pairs = tuple((shard.src_rank, shard.dst_rank) for shard in plan.shards)
    if len(set(pairs)) != len(pairs):
        raise ShardingError("checksum mode needs one shard per (source, destination) rank pair")
    return pairs


def _crc(data: np.ndarray, crc: int = 0) -> int:
    # zlib streams (and releases the GIL on large buffers); ``.data`` is the array's buffer.
    return zlib.crc32(data.data, crc)


def _stretches(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``(first page id, count)`` of maximal stretches of consecutive ids, in order."""
    stretches: list[tuple[int, int]] = []
    for page in pages:
        if stretches and stretches[-1][0] + stretches[-1][1] == page:
            stretches[-1] = (stretches[-1][0], stretches[-1][1] + 1)
        else:
            stretches.append((page, 1))
    return stretches
