"""The block cache: reuse only of unreferenced buffers, its limit, and layers that run on it
giving the same values as without it."""

from __future__ import annotations

import numpy as np
import pytest

import disttensor as dt
import disttensor_nn as nn
from disttensor.blockcache import BlockCache, block_cache, size_class
from disttensor_nn.kernels import use_kernels

MiB = 2**20


def test_size_classes_bound_the_slack():
    for n in [1, 7, 9, 1000, MiB, MiB + 1, 3 * MiB + 5, 2**30 - 3]:
        c = size_class(n)
        assert n <= c <= n * 1.125 + 1


def test_a_referenced_buffer_is_never_handed_out():
    cache = BlockCache()
    a = cache.empty((256, 1024), np.float32)
    a[...] = 1
    views = [a[3:5], a.reshape(-1), memoryview(a)]
    del a
    b = cache.empty((256, 1024), np.float32)  # the first buffer is still referenced
    b[...] = 2
    assert np.all(views[0] == 1) and cache.stats.misses == 2
    del views, b
    cache.empty((256, 1024), np.float32)
    assert cache.stats.hits == 1 and cache.stats.held_bytes == 2 * MiB


def test_limit_evicts_free_buffers_then_overflows():
    cache = BlockCache(limit=3 * MiB)
    keep = [cache.empty(MiB // 8, np.float64) for _ in range(3)]
    assert cache.stats.held_bytes == 3 * MiB
    extra = cache.empty(MiB // 8, np.float64)  # no room: allocated outside the cache
    assert cache.stats.overflows == 1 and extra.nbytes == MiB
    del keep
    cache.empty(2 * MiB, np.uint8)  # free buffers dropped to make room
    assert cache.stats.evictions >= 2 and cache.stats.held_bytes <= 3 * MiB


def test_nearby_sizes_share_a_buffer_and_zeros_are_zero_on_reuse():
    cache = BlockCache()
    a = cache.zeros((5 * MiB,), np.uint8)  # a fresh map reads as zeros
    assert not a.any()
    a[...] = 7
    del a
    b = cache.zeros((9 * MiB // 2,), np.uint8)  # a class below, within a quarter: shared
    assert cache.stats.hits == 1 and cache.stats.misses == 1 and not b.any()
    b[...] = 3
    del b
    c = cache.empty((3 * MiB,), np.uint8)  # far smaller: a buffer of its own
    assert cache.stats.misses == 2 and c.nbytes == 3 * MiB


def test_small_requests_and_bad_arguments():
    cache = BlockCache()
    cache.empty(10, np.float32)
    assert cache.stats.held_bytes == 0
    with pytest.raises(ValueError, match="limit"):
        BlockCache(limit=-1)


def test_backend_empty_uses_the_active_cache_only_inside_the_block():
    with block_cache() as cache:
        x = dt.DistArray.empty(dt.make_distribution((8, 64, 64, 16)), np.float64)
        assert cache.stats.misses == 1 and x.local.base is not None
    assert dt.blockcache.active_block_cache() is None


@pytest.mark.parallel([1, 2, 3])
@pytest.mark.parametrize("kernels", ["numpy", "torch"])
def test_layers_on_cached_blocks_match_fresh_ones(kernels):
    """Three steps of a conv/BN/ReLU/pool chain split over H (uneven blocks), each on
    blocks the earlier ones freed, equal bit for bit to the same steps without a cache."""
    if kernels == "torch":
        pytest.importorskip("torch")
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 37, 29)).astype(np.float32)
    dy = rng.standard_normal((2, 8, 18, 14)).astype(np.float32)
    grid = dt.ProcessGrid((comm.Get_size(),), comm)

    def run(cached):
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.MaxPool2d(2))
        wrng = np.random.default_rng(1)
        for prm in net.parameters():
            prm.data[...] = wrng.standard_normal(prm.shape) * 0.5
        net.set_layouts([nn.Layout(grid, (None, None, 0, None))] * 4)
        use_kernels(net, kernels)
        dist = dt.Distribution(x.shape, grid, (None, None, 0, None))
        out = []
        with block_cache(4 * MiB, min_bytes=1024) if cached else np.errstate():
            for _ in range(3):  # later steps reuse the blocks of earlier ones
                y = net(dt.DistArray.from_global(x, dist))
                dx = net.call_backward(dt.DistArray.from_global(dy, y.dist))
                out.append((y.to_global(), dx.to_global(),
                            net[0].weight.grad.copy()))
                net.zero_grad()
        return out

    for a, b in zip(run(False), run(True)):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(u, v)


@pytest.mark.parallel([1, 2])
def test_training_on_the_cache_reuses_blocks_within_its_limit_and_trains_alike():
    """The training driver's cache stays under its limit, serves warm steps from the
    buffers of the first, and leaves the losses bit for bit as without it."""
    from disttensor.testing import collective_assert
    from disttensor_nn.training import TrainConfig, train
    base = dict(model="mesh-demo", size=(128, 128), batch=2, steps=4, samples=8, metrics=None,
                machine="v100-nvlink-edr", progress=False, prefetch=0)
    cached = train(TrainConfig(**base))
    fresh = train(TrainConfig(**base, block_cache=False))
    bc = cached["block_cache"]
    collective_assert(fresh["block_cache"] is None)
    collective_assert(bc["peak_held_bytes"] <= bc["limit_bytes"] and bc["hits"] > 0)
    collective_assert(bc["misses_after_first_step"] <= bc["misses"] // 4, str(bc))
    collective_assert(cached["history"] == fresh["history"])  # the losses


def test_allocator_settings_refuse_bad_sizes_and_keep_scratch_warm():
    """keep_heap_top lets freed scratch at the heap's top serve the next allocation without
    faulting its pages in again (glibc); bad sizes are refused."""
    from disttensor_nn.memory import keep_heap_top, map_large_allocations, resident_bytes
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="number of bytes"):
            keep_heap_top(bad)
        with pytest.raises(ValueError, match="number of bytes"):
            map_large_allocations(bad if bad != 1.5 else 0)
    if not (map_large_allocations(2**22) and keep_heap_top(2**26)):
        pytest.skip("the C allocator has no mallopt")
    a = np.ones(3 * MiB // 8)  # 3 MiB: from the heap, below the 4 MiB mapping threshold
    del a
    before = resident_bytes()
    b = np.ones(3 * MiB // 8)  # the same pages again: resident already
    assert resident_bytes() - before < MiB, "the freed heap top was given back"
    del b


def test_the_training_heap_keeps_kernel_scratch_warm_across_the_per_step_trim():
    """With the block cache, scratch up to HEAP_TOP_KEPT comes from the heap and stays
    resident across the driver's per-step trim (which keeps the heap's top), where a 4 MiB
    mapping threshold faulted it in at every call; a full trim gives it back."""
    from disttensor_nn.memory import (
        HEAP_TOP_KEPT,
        MALLOPT_MAX,
        free_heap_bytes,
        keep_heap_top,
        map_large_allocations,
        release_free_memory,
        resident_bytes,
    )
    from disttensor_nn.training.loop import mapping_threshold
    assert mapping_threshold(True, None) == mapping_threshold(True, 2**30) == HEAP_TOP_KEPT
    assert mapping_threshold(True, None, 100.5 * MiB) == 100 * MiB + MiB // 2  # the plan's pass
    assert mapping_threshold(True, 2**30, 3e9) == MALLOPT_MAX  # what mallopt can take
    assert mapping_threshold(False, None) == 2**22 and mapping_threshold(False, 1e9) == 2**20
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="number of bytes"):
            release_free_memory(bad)
    if not (map_large_allocations(mapping_threshold(True, None)) and keep_heap_top()):
        pytest.skip("the C allocator has no mallopt")
    try:
        release_free_memory()
        a = np.ones(24 * MiB // 8)  # a oneDNN reorder's size: from the heap now
        del a
        release_free_memory(HEAP_TOP_KEPT)  # what the driver does before each step
        before = resident_bytes()
        b = np.ones(24 * MiB // 8)
        grown = resident_bytes() - before
        del b
        assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB faulted in again"
        release_free_memory()
        before = resident_bytes()
        c = np.ones(24 * MiB // 8)
        grown = resident_bytes() - before
        del c
        assert grown > 16 * MiB, f"a full trim kept {24 - grown / MiB:.1f} MiB"
        # given back only above a bound of free bytes (the driver's: what it keeps anyway)
        free = free_heap_bytes()
        if free is not None:
            d = np.ones(24 * MiB // 8)
            pad = np.ones(MiB // 8)  # a live array above it: d's pages lie below the top
            del d
            free = free_heap_bytes()
            assert free >= 24 * MiB
            assert not release_free_memory(0, if_above=free)  # no more free than that: kept
            before = resident_bytes()
            e = np.ones(24 * MiB // 8)
            grown = resident_bytes() - before
            del e
            assert grown < 4 * MiB, f"{grown / MiB:.1f} MiB faulted in again"
            # more free than 16 MiB less: given back
            assert release_free_memory(0, if_above=free_heap_bytes() - 16 * MiB)
            before = resident_bytes()
            e = np.ones(24 * MiB // 8)
            grown = resident_bytes() - before
            del e, pad
            assert grown > 16 * MiB, f"a trim kept {24 - grown / MiB:.1f} MiB"
    finally:
        map_large_allocations(2**22)
        release_free_memory()
