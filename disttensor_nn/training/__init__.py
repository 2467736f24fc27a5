"""The training application built on the layer library.

* :mod:`~disttensor_nn.training.driver`: the training driver, :func:`train`
  configured by a :class:`TrainConfig` (plan, load data in the planned
  layout, train, checkpoint, report);
* :mod:`~disttensor_nn.training.loop`: the parts of a training run every
  driver shares (the step loop :func:`~disttensor_nn.training.loop.run_steps`
  with a driver's own step, threads, machine profile, summary, metrics);
* :mod:`~disttensor_nn.training.registry`: the named models the driver and
  the tools know (:func:`register_model`, :func:`build_model`);
* :mod:`~disttensor_nn.training.data`: data sets and the :class:`Loader`,
  each rank producing only its own block of a batch (synthetic, or read from
  HDF5, Zarr and ``.npy`` files: :func:`open_dataset`);
* :mod:`~disttensor_nn.training.inference`: distributed inference,
  :func:`predict` configured by a :class:`PredictConfig`;
* :mod:`~disttensor_nn.training.torch_driver`: a PyTorch model of the user's
  (``--model-file PATH.py:FUNCTION``) trained and planned by the driver's parts
  (needs PyTorch; not imported here);
* :mod:`~disttensor_nn.training.checkpoint`: collective, atomic checkpoints;
* :mod:`~disttensor_nn.training.plot`: plots of a run's metrics;
* :mod:`~disttensor_nn.training.cli`: the ``disttensor-train``,
  ``disttensor-plan``, ``disttensor-predict`` and ``disttensor-data`` command
  lines (not imported here).
"""

from .checkpoint import FORMAT, VERSION, CheckpointError, load_checkpoint, save_checkpoint
from .data import (
    ArrayDataset,
    Dataset,
    ImageNetSynthetic,
    Loader,
    MeshSynthetic,
    NoiseDataset,
    NpyDataset,
    Prefetcher,
    data_problem,
    open_dataset,
    save_dataset,
    save_npy_dataset,
)
from .driver import SetupError, TrainConfig, train
from .inference import PredictConfig, predict
from .plot import plot_main, plot_metrics, plot_scaling
from .registry import (
    ModelSpec,
    build_model,
    check_size,
    model_names,
    model_spec,
    register_model,
)

__all__ = [
    "FORMAT", "VERSION", "ArrayDataset", "CheckpointError", "Dataset", "ImageNetSynthetic",
    "Loader", "MeshSynthetic", "ModelSpec", "NoiseDataset", "NpyDataset", "PredictConfig",
    "Prefetcher", "TrainConfig",
    "build_model", "check_size", "data_problem", "load_checkpoint",
    "model_names", "model_spec", "open_dataset", "plot_main", "plot_metrics", "plot_scaling",
    "predict", "register_model", "save_checkpoint", "save_dataset", "save_npy_dataset",
    "SetupError", "train",
]
