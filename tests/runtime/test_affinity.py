"""Which cores each rank is bound to, and binding every thread of a process."""

from __future__ import annotations

import os
import threading

import pytest

from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus

FOUR = frozenset(range(4))


def test_ranks_sharing_a_pool_get_equal_contiguous_slices() -> None:
    pools = [FOUR, FOUR]
    assert cpu_share(pools, range(2), 0) == {0, 1}
    assert cpu_share(pools, range(2), 1) == {2, 3}


def test_a_remainder_is_left_unused_and_nodes_split_their_own_pools() -> None:
    five, other = frozenset(range(5)), frozenset(range(8, 13))
    pools = [five, five, other, other]
    assert [cpu_share(pools, range(2), r) for r in (0, 1)] == [{0, 1}, {2, 3}]
    assert [cpu_share(pools, range(2, 4), r) for r in (2, 3)] == [{8, 9}, {10, 11}]


@pytest.mark.parametrize(
    ("pools", "case"),
    [
        ([frozenset({0, 1}), frozenset({2, 3})], "already bound by a launcher"),
        ([frozenset({0}), frozenset({0})], "more ranks than cores"),
        ([None, None], "the OS does not say"),
        ([FOUR], "one rank on the node"),
    ],
)
def test_ranks_are_left_where_they_are(pools: list, case: str) -> None:
    assert all(cpu_share(pools, range(len(pools)), r) is None for r in range(len(pools))), case


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process that may run on 2 cores",
)
def test_every_thread_is_bound_and_new_threads_inherit_it() -> None:
    pool = current_cpus()
    assert pool is not None
    one = frozenset({min(pool)})
    ready, done = threading.Event(), threading.Event()
    running = threading.Thread(target=lambda: (ready.set(), done.wait(10)))
    running.start()
    ready.wait(10)
    seen: list[frozenset[int]] = []
    try:
        bind_threads(one)
        later = threading.Thread(target=lambda: seen.append(frozenset(os.sched_getaffinity(0))))
        later.start()
        later.join(10)
        assert frozenset(os.sched_getaffinity(running.native_id)) == one
        assert seen == [one]
    finally:
        bind_threads(pool)
        done.set()
        running.join(10)
    assert frozenset(os.sched_getaffinity(0)) == pool
