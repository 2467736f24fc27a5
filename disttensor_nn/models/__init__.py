"""Model definitions used to evaluate disttensor_nn: ResNets and the mesh-tangling FCN.

* :func:`resnet` (and :func:`resnet18`, :func:`resnet34`, :func:`resnet50`,
  :func:`resnet101`, :func:`resnet152`): torchvision's ImageNet ResNets;
* :func:`mesh_fcn`: the fully convolutional mesh-tangling network, with its
  :class:`DepthToSpace` output layer;
* :func:`unet`: U-Net and 3-D U-Net (same-padding, any depth, width and
  normalisation);
* :func:`cosmoflow`: the 3-D CNN of the MLPerf HPC CosmoFlow benchmark.

All return :class:`~disttensor_nn.Sequential` models that are deterministic
given ``seed`` and identical on every rank.
"""

from .cosmoflow import cosmoflow
from .mesh import DepthToSpace, mesh_fcn
from .resnet import RESNET_CONFIGS, resnet, resnet18, resnet34, resnet50, resnet101, resnet152
from .unet import NORMS, unet

__all__ = ["DepthToSpace", "NORMS", "RESNET_CONFIGS", "cosmoflow", "mesh_fcn", "resnet",
           "resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "unet"]
