"""``disttensor_nn.module`` still gives every public name it defined before the names moved
to modules of one job each (parameter, layout, shards, reduction, checks)."""

from __future__ import annotations

import disttensor_nn.module as module
from disttensor_nn import checks, layout, parameter, reduction, shards

HOMES = {
    parameter: ["Parameter"],
    layout: ["Layout", "full_array", "local_block"],
    shards: ["shard_range", "shard_counts", "gather_shards", "reduce_scatter_"],
    reduction: ["GradientBuckets", "no_sync", "reduce_gradients_", "split_axes_comm",
                "allreduce_", "DEFAULT_BUCKET_BYTES"],
    checks: ["check_input", "check_grad", "check_int", "check_kernels"],
}


def test_moved_names_are_the_same_objects_in_module():
    for home, names in HOMES.items():
        for name in names:
            assert getattr(module, name) is getattr(home, name), (home.__name__, name)


def test_module_all_keeps_its_former_names():
    former = [
        "Parameter", "Layer", "Layout", "RemovableHandle", "IncompatibleKeys",
        "GradientBuckets", "no_sync", "reduce_gradients_", "split_axes_comm", "check_input",
        "check_grad", "check_int", "check_kernels", "full_array", "local_block",
        "prefetch_weights"]
    assert module.__all__[:len(former)] == former
    assert module.__all__[len(former):] == ["derived"]  # new: the Layer's own decorator
    assert module.derived.__module__ == module.__name__
    for name in module.__all__:
        assert hasattr(module, name), name


def test_each_new_module_exports_what_it_defines():
    for home in HOMES:
        for name in home.__all__:
            assert getattr(home, name).__module__ == home.__name__, name
