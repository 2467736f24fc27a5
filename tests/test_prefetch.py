"""Batches prepared ahead by a thread (Prefetcher) and what the driver reports of a step."""

from __future__ import annotations

import os
import threading

import mpi_helpers
import numpy as np
import pytest
from mpi4py import MPI

import disttensor as dt
from disttensor.testing import collective_assert
from disttensor_nn.layout import Layout
from disttensor_nn.training import TrainConfig, train
from disttensor_nn.training.data import Loader, MeshSynthetic, Prefetcher
from disttensor_nn.training.driver import prediction_warning
from disttensor_nn.training.loop import predicted_training_peak

V100 = "v100-nvlink-edr"


def loader(comm=MPI.COMM_SELF, n=10, batch=3) -> Loader:
    grid = dt.ProcessGrid((comm.Get_size(), 1, 1, 1), comm)
    return Loader(MeshSynthetic(n, (8, 8), channels=2, seed=3), batch,
                  Layout(grid, (0, None, None, None)), shuffle=True, seed=5)


def batches(source, k):
    out = []
    for _ in range(k):
        x, y = next(source)
        out.append((x.local.copy(), None if y is None else np.asarray(
            y.local if isinstance(y, dt.DistArray) else y).copy()))
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(p[0], q[0]) and (
        (p[1] is None and q[1] is None) or np.array_equal(p[1], q[1])) for p, q in zip(a, b))


def endless(ld: Loader):
    while True:
        yield from ld


@pytest.mark.parametrize("depth", [1, 2])
def test_prefetched_batches_are_the_loaders_in_order_across_epochs(depth):
    want = batches(endless(loader()), 7)  # 3 batches an epoch: over two epochs' boundary
    with Prefetcher(loader(), depth) as pre:
        got = batches(pre, 7)
    assert same(got, want)


def test_state_dict_is_the_position_after_the_batches_handed_out():
    plain = loader()
    it = endless(plain)
    pre = Prefetcher(loader(), 2)
    for k in range(1, 6):
        next(it)
        pre.next()
        assert pre.state_dict() == plain.state_dict(), (k, pre.state_dict())
    pre.close()
    # resuming a loader at that position continues with the next batch
    resumed = loader()
    resumed.load_state_dict(pre.state_dict())
    assert same(batches(iter(resumed), 1), batches(it, 1))


def test_an_error_while_loading_is_raised_by_next_and_close_ends_the_thread():
    class Broken(MeshSynthetic):
        def batch(self, indices, dist_x, dist_y=None):
            raise OSError("disk gone")

    grid = dt.ProcessGrid((1, 1, 1, 1), MPI.COMM_SELF)
    ld = Loader(Broken(4, (8, 8), channels=2), 2, Layout(grid, (0, None, None, None)))
    pre = Prefetcher(ld)
    with pytest.raises(OSError, match="disk gone"):
        pre.next()
    pre.close()
    pre = Prefetcher(loader(), 2)
    pre.close()
    assert not any(t.name == "disttensor-prefetch" and t.is_alive()
                   for t in threading.enumerate())
    with pytest.raises(ValueError, match="depth must be 1 or 2"):
        Prefetcher(loader(), 3)


def test_waiting_for_batches_is_counted():
    pre = Prefetcher(loader(), 1)
    pre.next()
    first = pre.take_wait()
    assert first > 0 and pre.waited == 0.0
    pre.close()


@pytest.mark.parallel([3])
def test_training_with_prefetching_gives_the_same_losses_as_without():
    comm = MPI.COMM_WORLD
    base = dict(model="mesh-demo", size=(64, 64), batch=4, steps=6, samples=12,
                metrics=None, machine=V100, progress=False)
    a = train(TrainConfig(prefetch=0, **base))["history"]
    b = train(TrainConfig(prefetch=2, **base))["history"]
    collective_assert(a == b, f"{a} vs {b}")
    tmp = mpi_helpers.shared_tmpdir("dt-prefetch-", comm)
    ckpt = os.path.join(tmp, "ck")
    train(TrainConfig(prefetch=2, checkpoint=ckpt, **dict(base, steps=3)))
    c = train(TrainConfig(prefetch=2, checkpoint=ckpt, resume=True, **base))["history"]
    collective_assert(c == a, f"resumed {c} vs {a}")


@pytest.mark.parallel([1, 2, 3])
def test_the_default_prefetches_only_where_each_rank_has_a_core_for_the_thread():
    from disttensor_nn.training.driver import prefetch_depth

    comm = MPI.COMM_WORLD
    local, cores = dt.node_share(comm)  # every rank of the test job is on one node
    collective_assert(local == comm.Get_size())
    for threads, want in ((1, int(2 * local <= cores)), (cores, 0)):
        got = prefetch_depth(TrainConfig(threads=threads), comm)
        collective_assert(got == want, f"threads {threads}: {got}, want {want}")
    collective_assert(prefetch_depth(TrainConfig(threads=cores, prefetch=2), comm) == 2)


@pytest.mark.parallel([1])
def test_bad_kernel_thread_and_prefetch_options_are_refused_before_any_work():
    from disttensor_nn.training.driver import SetupError

    base = dict(model="mesh-demo", size=(64, 64), steps=1, metrics=None, machine=V100,
                progress=False)
    for kw, words in ((dict(kernels="fast"), "--kernels fast"),
                      (dict(threads=0), "--threads must be a positive integer"),
                      (dict(prefetch=3), "prefetch must be 0, 1 or 2")):
        with pytest.raises(SetupError, match=words):
            train(TrainConfig(**base, **kw))


def test_prediction_warning_names_the_layers_that_account_for_the_difference():
    layers = [{"name": "0", "layer": "Conv2d", "predicted_s": 0.010, "measured_s": 0.011},
              {"name": "1", "layer": "BatchNorm2d", "predicted_s": 0.002, "measured_s": 0.012},
              {"name": "2", "layer": "ReLU", "predicted_s": 0.001, "measured_s": 0.003}]
    s = {"compute_time_per_iteration_s": 0.026, "predicted_time_per_iteration_s": 0.013,
         "layers": layers}
    w = prediction_warning(s, top=2)
    assert w.startswith("warning: the step took 2.00x its predicted time"), w
    assert "1 BatchNorm2d 12.0 ms measured / 2.0 ms predicted, 2 ReLU" in w, w
    assert "Conv2d" not in w
    s["compute_time_per_iteration_s"] = 0.016  # within 25%
    assert prediction_warning(s) is None
    assert prediction_warning({"compute_time_per_iteration_s": None}) is None


def test_the_printed_peak_holds_what_the_run_keeps_besides_the_plan():
    """The predicted training peak is the plan's and, apart, the cache's free blocks, the C
    heap's kept free top and the kept data, each counted once."""
    mib = 2**20
    s = {"predicted_peak_memory_bytes": 100 * mib, "predicted_cache_slack_bytes": None,
         "predicted_heap_slack_bytes": 64 * mib, "predicted_kept_data_bytes": 20 * mib}
    assert predicted_training_peak(s) == 184 * mib
    assert predicted_training_peak({"predicted_peak_memory_bytes": 5.0}) == 5.0


_GIVE_BACK_SCRIPT = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from test_prefetch import loader
from disttensor_nn.memory import (free_heap_bytes, keep_heap_top, map_large_allocations,
                                  release_free_memory, resident_bytes)
from disttensor_nn.training.loop import Batches
mib = 2**20
if free_heap_bytes() is None or not (map_large_allocations(256 * mib) and keep_heap_top()):
    print(json.dumps(None))
    sys.exit()

def grown_by_a_step():  # resident growth of a step taking 24 MiB of scratch
    before = resident_bytes()
    scratch = np.ones(24 * mib // 8)
    grown = resident_bytes() - before
    del scratch
    return grown / mib

release_free_memory()
below = np.ones(64 * mib // 8)
live = np.ones(mib // 8)  # a live array above it: its pages lie below the heap's top
del below  # 64 MiB free: more than the 8 MiB kept, as long as the run lasts
source = Batches(loader(), keep=8 * mib)
source.next()  # the first gives back: the 64 MiB below the top leave
first = grown_by_a_step()
warm = []
for _ in range(3):  # the same scratch again, step after step
    source.next()
    warm.append(grown_by_a_step())
more = [np.ones(32 * mib // 8) for _ in range(3)]  # beyond the free chunk: the top
above = np.ones(mib // 8)
del more  # 96 MiB more free below the top than at the last give-back: given back
source.next()
again = grown_by_a_step()
print(json.dumps([first, warm, again]))
"""


def test_the_per_step_give_back_leaves_what_a_step_takes_again_warm():
    """Batches give back the allocator's free memory before a step only where it grew by
    more than what they keep since the last give-back: the free bytes the allocator counts
    include pages already given back, so a bound on them alone gave back (and the next step
    faulted in anew) the same pages at every step once they passed it. In a process of its
    own: where the C heap's free chunks lie depends on all the process did before."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _GIVE_BACK_SCRIPT, os.path.dirname(__file__)],
                         capture_output=True, text=True, check=True).stdout
    got = json.loads(out.strip().splitlines()[-1])
    if got is None:
        pytest.skip("the C allocator says nothing of its free bytes, or has no mallopt")
    first, warm, again = got
    assert first > 16 and max(warm) < 4 and again > 16, \
        f"resident growth of each step (MiB): first {first:.1f}, then " \
        f"{[round(w, 1) for w in warm]}, after growth {again:.1f}"
