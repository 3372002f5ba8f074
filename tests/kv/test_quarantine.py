"""`PageQuarantine`: pages come back only when no write can still land in them; time alone
never frees them (a paused prefill process can post a write long after any deadline)."""

from __future__ import annotations

import pytest

from workers.kv.quarantine import PageQuarantine, QuarantinedPages

PEER = b"prefill-a"
OTHER = b"prefill-b"


def pages(imm: int, *ids: int, peer: bytes = PEER) -> QuarantinedPages:
    return QuarantinedPages(imm, f"req-{imm}", ids, peer)


def test_releases_when_all_expected_writes_arrived() -> None:
    q = PageQuarantine(resend_interval_s=5.0)
    assert q.hold(pages(1, 4, 5), num_writes_expected=10, num_writes_seen=7, now_s=0) == []
    assert q.num_pages == 2 and 1 in q and q.page_ids() == {4, 5}
    assert q.record_writes(1, 2) == []
    assert q.record_writes(1, 1) == [pages(1, 4, 5)]
    assert len(q) == 0 and q.record_writes(1, 1) == []


def test_an_acknowledgement_releases_only_once_that_many_writes_arrived() -> None:
    q = PageQuarantine(resend_interval_s=5.0)
    q.hold(pages(1, 7), num_writes_expected=10, num_writes_seen=2, now_s=0)
    assert q.acknowledge_abort(1, 4) == []  # 2 of 4 submitted writes landed: 2 can still land
    assert q.record_writes(1, 1) == []
    assert q.record_writes(1, 1) == [pages(1, 7)]
    # An acknowledgement for writes that all arrived already releases at once.
    q.hold(pages(2, 8), num_writes_expected=10, num_writes_seen=4, now_s=0)
    assert q.acknowledge_abort(2, 4) == [pages(2, 8)]
    assert q.acknowledge_abort(3, 0) == []  # not quarantined: ignored
    with pytest.raises(ValueError):
        q.acknowledge_abort(2, -1)


def test_several_acknowledgements_keep_the_smallest_count() -> None:
    q = PageQuarantine(resend_interval_s=5.0)
    q.hold(pages(1, 7), num_writes_expected=10, num_writes_seen=3, now_s=0)
    assert q.acknowledge_abort(1, 6) == []
    assert q.acknowledge_abort(1, 8) == []  # a larger count never loosens the bound
    assert q.record_writes(1, 2) == []
    assert q.acknowledge_abort(1, 5) == [pages(1, 7)]  # 5 landed


def test_time_passing_alone_never_releases() -> None:
    q = PageQuarantine(resend_interval_s=1.0)
    q.hold(pages(1, 1), num_writes_expected=4, num_writes_seen=0, now_s=0)
    for now in (1.0, 10.0, 1e6, 1e12):
        q.aborts_due(now)  # the only thing time does: schedule the next AbortPrefill
        assert q.record_writes(1, 0) == []
    assert 1 in q and q.num_pages == 1


def test_the_peer_gone_releases_its_entries_only() -> None:
    q = PageQuarantine(resend_interval_s=1.0)
    q.hold(pages(1, 1), num_writes_expected=4, num_writes_seen=1, now_s=0)
    q.hold(pages(2, 2, 3), num_writes_expected=4, num_writes_seen=0, now_s=0)
    q.hold(pages(3, 4, peer=OTHER), num_writes_expected=4, num_writes_seen=0, now_s=0)
    assert q.acknowledge_abort(2, 3) == []  # acknowledged but not landed: the peer's death frees
    assert q.peers() == {PEER, OTHER}
    assert q.peer_gone(PEER) == [pages(1, 1), pages(2, 2, 3)]
    assert q.peers() == {OTHER} and q.page_ids() == {4}
    assert q.peer_gone(PEER) == []


def test_aborts_are_due_at_once_then_every_interval() -> None:
    q = PageQuarantine(resend_interval_s=2.0)
    q.hold(pages(1, 1), num_writes_expected=4, num_writes_seen=0, now_s=10)
    assert q.aborts_due(10) == [pages(1, 1)]
    assert q.aborts_due(11.9) == []
    assert q.aborts_due(12) == [pages(1, 1)]
    q.hold(pages(2, 2), num_writes_expected=4, num_writes_seen=0, now_s=12.5)
    assert q.aborts_due(13) == [pages(2, 2)]
    assert q.aborts_due(14) == [pages(1, 1)]
    q.record_writes(1, 4)
    assert q.aborts_due(100) == [pages(2, 2)]  # released entries are no longer due


def test_rejects_bad_input_and_double_hold_and_releases_complete_transfers_at_once() -> None:
    q = PageQuarantine(resend_interval_s=1.0)
    assert q.hold(pages(1, 1), num_writes_expected=2, num_writes_seen=2, now_s=0) == [pages(1, 1)]
    q.hold(pages(2, 2), num_writes_expected=2, num_writes_seen=0, now_s=0)
    with pytest.raises(ValueError, match="already"):
        q.hold(pages(2, 3), num_writes_expected=2, num_writes_seen=0, now_s=0)
    with pytest.raises(ValueError):
        q.hold(pages(3, 3), num_writes_expected=2, num_writes_seen=-1, now_s=0)
    assert 3 not in q
    with pytest.raises(ValueError):
        PageQuarantine(-1)
