"""The transports' pool of message buffers: bounded by ``buffer_pool_bytes``.

Byte counts are checked against the buffers' sizes computed by hand and
against ``tracemalloc``; redistributed values against NumPy on the global
array.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import assert_equal, collective_assert
from disttensor.transport import Transport

comm = MPI.COMM_WORLD


@pytest.mark.parallel([1])
def test_pool_keeps_at_most_its_cap_least_recently_used_first_out():
    t = Transport(np, direct=True)
    kib = 1024
    with dt.options(buffer_pool_bytes=10 * kib):
        a = t._take((kib,), np.dtype(np.uint8), None)  # 1 KiB
        b = t._take((4 * kib,), np.dtype(np.uint8), None)  # 4 KiB
        c = t._take((6 * kib,), np.dtype(np.uint8), None)  # 6 KiB
        big = t._take((11 * kib,), np.dtype(np.uint8), None)  # over the cap
        t.release(a)
        t.release(b)
        assert t.pooled == 5 * kib
        t.release(big)  # freed, not kept: the others stay
        assert t.pooled == 5 * kib
        t.release(c)  # 11 KiB > 10: the least recently used (a) goes
        assert t.pooled == 10 * kib
        assert t._take((4 * kib,), np.dtype(np.uint8), None) is b  # reused
        assert t._take((kib,), np.dtype(np.uint8), None) is not a  # was dropped
        assert t.pooled == 6 * kib
    with dt.options(buffer_pool_bytes=0):
        t.release(b)
        assert t.pooled == 6 * kib  # keeps none beyond what it held


def test_buffer_pool_bytes_option_is_checked():
    before = dt.get_options()
    for bad in (-1, 1.5, True, "16MiB"):
        with pytest.raises(ValueError, match="buffer_pool_bytes"):
            dt.set_options(buffer_pool_bytes=bad)
    assert dt.get_options() == before


@pytest.mark.parallel([2, 3])
def test_packed_redistribution_keeps_no_buffer_over_the_cap():
    # (p*64, 5, 7) float32 moved from a split of dim 0 to a split of dim 2: every piece's
    # runs are 1-2 elements, so the messages are packed into pooled buffers
    p = comm.Get_size()
    shape = (64 * p, 5, 7)
    g = dt.ProcessGrid((p,))
    src = dt.Distribution(shape, g, axes=(0, None, None))
    dst = dt.Distribution(shape, g, axes=(None, None, 0))
    a = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    x = dt.DistArray.from_global(a, src)
    plan = dt.redistribution_plan(src, dst)
    collective_assert(plan.method == "pack", f"planned as {plan.method}")
    out = dt.DistArray.empty(dst, np.float32)
    t = dt.transport.transport_for(np)
    send = sum(int(np.prod([s.stop - s.start for s in sl])) for _, sl in plan.sends) * 4
    recv = sum(int(np.prod([s.stop - s.start for s in sl])) for _, sl in plan.recvs) * 4
    for cap, kept in ((0, 0), (min(send, recv) - 1, 0), (send + recv, send + recv)):
        with dt.options(buffer_pool_bytes=cap):
            t._pool.clear()
            t.pooled = 0
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            plan(x, out)
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            assert_equal(out.local, a[dst.local_slices()])
            # what stays allocated after the call is the pool, and only under its cap
            collective_assert(t.pooled == kept and kept <= held <= kept + 4096,
                              f"cap {cap}: pool {t.pooled}, held {held}, expected {kept}")
