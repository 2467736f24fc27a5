"""Former path of :mod:`disttensor_nn.training.data`, kept as an alias."""

from .training.data import (
    Dataset,
    ImageNetSynthetic,
    Loader,
    MeshSynthetic,
    NpyDataset,
    Slices,  # noqa: F401 (a former public name outside __all__)
    save_npy_dataset,
)

__all__ = [
    "Dataset",
    "ImageNetSynthetic",
    "MeshSynthetic",
    "NpyDataset",
    "Loader",
    "save_npy_dataset",
]
