from __future__ import annotations

import random

import pytest

from workers.kv.pages import coalesce_page_runs, num_pages_for_tokens, sendable_pages


def test_runs_need_both_sides_consecutive() -> None:
    src = [0, 1, 2, 5, 6, 9, 10]
    dst = [3, 4, 8, 9, 10, 11, 12]
    assert coalesce_page_runs(src, dst) == [(0, 3, 2), (2, 8, 1), (5, 9, 2), (9, 11, 2)]
    assert coalesce_page_runs([], []) == []
    assert coalesce_page_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]


def test_segments_cut_runs_at_request_page_multiples() -> None:
    pages = list(range(7))
    assert coalesce_page_runs(pages, pages, segment_pages=3) == [(0, 0, 3), (3, 3, 3), (6, 6, 1)]
    # A slice starting at request page 3 of a 3-page segmentation.
    assert coalesce_page_runs([3, 4, 5, 6], [3, 4, 5, 6], segment_pages=3, first_page_index=3) == [
        (3, 3, 3),
        (6, 6, 1),
    ]


def test_long_runs_are_split_from_their_start() -> None:
    src, dst = [0, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 10]
    assert coalesce_page_runs(src, dst, max_pages_per_run=2) == [
        (0, 5, 2),
        (2, 7, 2),
        (4, 9, 1),
        (9, 10, 1),
    ]
    # Segments cut first, then the limit applies inside each segment's run.
    pages = list(range(7))
    assert coalesce_page_runs(pages, pages, segment_pages=5, max_pages_per_run=3) == [
        (0, 0, 3),
        (3, 3, 2),
        (5, 5, 2),
    ]
    with pytest.raises(ValueError, match="max_pages_per_run"):
        coalesce_page_runs([1], [1], max_pages_per_run=0)


def test_runs_cover_every_page_once() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randrange(0, 30)
        src = rng.sample(range(64), n)
        dst = sorted(rng.sample(range(64), n))
        runs = coalesce_page_runs(
            src,
            dst,
            segment_pages=rng.choice([None, 1, 4]),
            max_pages_per_run=rng.choice([None, 1, 3]),
        )
        flat = [(s + i, d + i) for s, d, length in runs for i in range(length)]
        assert flat == list(zip(src, dst, strict=True))


def test_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="length"):
        coalesce_page_runs([1], [1, 2])
    with pytest.raises(ValueError, match="negative"):
        coalesce_page_runs([-1], [1])
    with pytest.raises(ValueError, match="segment_pages"):
        coalesce_page_runs([1], [1], segment_pages=0)


def test_num_pages_for_tokens() -> None:
    assert [num_pages_for_tokens(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_sendable_pages() -> None:
    assert sendable_pages(5, 10, 0, None) == range(0, 0)  # one run may span the request
    assert sendable_pages(10, 10, 0, None) == range(0, 10)
    assert sendable_pages(5, 10, 0, 2) == range(0, 4)
    assert sendable_pages(5, 10, 4, 2) == range(4, 4)
    assert sendable_pages(10, 10, 4, 2) == range(4, 10)
    with pytest.raises(ValueError):
        sendable_pages(3, 2, 0, 1)
