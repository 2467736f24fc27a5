"""Model definitions used to evaluate disttensor_nn: ResNets and the mesh-tangling FCN.

* :func:`resnet` (and :func:`resnet18`, :func:`resnet34`, :func:`resnet50`,
  :func:`resnet101`, :func:`resnet152`): torchvision's ImageNet ResNets;
* :func:`mesh_fcn`: the fully convolutional mesh-tangling network, with its
  :class:`DepthToSpace` output layer.

All return :class:`~disttensor_nn.Sequential` models that are deterministic
given ``seed`` and identical on every rank.
"""

from .mesh import DepthToSpace, mesh_fcn
from .resnet import RESNET_CONFIGS, resnet, resnet18, resnet34, resnet50, resnet101, resnet152

__all__ = ["DepthToSpace", "RESNET_CONFIGS", "mesh_fcn", "resnet", "resnet18", "resnet34",
           "resnet50", "resnet101", "resnet152"]
