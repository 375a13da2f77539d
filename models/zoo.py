"""The heterogeneous model zoo of FedTGP (docs/methods/fedtgp.md §7).

Every extractor ends with a fixed, parameter-free average pooling of its flattened output
``[B, D]`` to ``[B, K]`` (``nn.AdaptiveAvgPool1d(K)``): D = K is the identity, D > K
averages windows, D < K repeats values. It is not learned (§11 item 11).

- ``fedavgcnn``: Conv(32,5)+ReLU+MaxPool2, Conv(64,5)+ReLU+MaxPool2, Linear(->512)+ReLU.
- torchvision ``googlenet`` (aux_logits=False), ``mobilenet_v2``, ``resnet18/34/50/101/152``,
  randomly initialised (``weights=None``, no download), classifier removed, ImageNet stem kept.
- torchvision ``vit_b_16`` / ``vit_b_32`` built for the dataset's image size (32x32: 4 patches
  or 1 patch + class token; 12 layers, width 768), heads removed: the class token [B, 768]
  is the trunk output (docs/methods/fedre.md §7).
- ``resnet4/6/8/10``: torchvision's ResNet with one BasicBlock per stage and 1-4 stages.
- ``htcnn1..8`` (HtCNN8, for 1x28x28 input): 1 or 2 convs (5x5 valid + ReLU + MaxPool2, 32/64
  channels) and an FC stack ending at 512, every FC followed by ReLU.

Inputs other than 3 channels (MNIST) get the first convolution rebuilt for that many channels.
Heads: ``linear`` = Linear(K, C); the HtC4 heads ``mlp512``, ``mlp256``, ``mlp128`` =
Linear(K, h) + ReLU + Linear(h, C).
"""

from __future__ import annotations

import torch
from torch import nn

from models.base import SplitModel

# torchvision is imported where a torchvision architecture is built, not here: its import brings
# torch._dynamo, sympy and triton (torchvision/ops/roi_align.py imports torch._dynamo.utils), about
# 90 MiB of memory in every process that builds any model, also a ClientApp of FedAvgCNN or HtCNN8 only.


class FixedPool(nn.Module):
    """Parameter-free pooling ``[B, ...] -> [B, K]``: flatten, then AdaptiveAvgPool1d(K)."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool1d(k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(x.flatten(1).unsqueeze(1)).squeeze(1)


def _retarget_first_conv(model: nn.Module, in_channels: int) -> nn.Module:
    """Rebuild the first Conv2d of ``model`` for ``in_channels`` input channels (same shape otherwise)."""
    if in_channels == 3:
        return model
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(
                    parent,
                    name,
                    nn.Conv2d(
                        in_channels,
                        child.out_channels,
                        child.kernel_size,
                        child.stride,
                        child.padding,
                        bias=child.bias is not None,
                    ),
                )
                return model
    raise ValueError("model has no Conv2d")


def _conv_side(size: int, convs: int) -> int:
    for _ in range(convs):
        size = (size - 4) // 2
    return size


def fedavgcnn(in_channels: int, image_size: int) -> nn.Module:
    """The 4-layer FedAvgCNN up to its 512-d hidden layer."""
    side = _conv_side(image_size, 2)
    return nn.Sequential(
        nn.Conv2d(in_channels, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * side * side, 512),
        nn.ReLU(),
    )


#: HtCNN8: name -> (number of convs, FC widths after flatten), docs/methods/fedtgp.md §7
HTCNN8: dict[str, tuple[int, tuple[int, ...]]] = {
    "htcnn1": (1, (512,)),
    "htcnn2": (2, (512,)),
    "htcnn3": (1, (512, 512)),
    "htcnn4": (2, (512, 512)),
    "htcnn5": (1, (1024, 512)),
    "htcnn6": (2, (1024, 512)),
    "htcnn7": (1, (1024, 512, 512)),
    "htcnn8": (2, (1024, 512, 512)),
}


def htcnn(name: str, in_channels: int, image_size: int) -> nn.Module:
    """One HtCNN8 member (5x5 valid convs + ReLU + MaxPool2; FCs each followed by ReLU)."""
    convs, widths = HTCNN8[name]
    layers: list[nn.Module] = []
    channels = in_channels
    for out in (32, 64)[:convs]:
        layers += [nn.Conv2d(channels, out, 5), nn.ReLU(), nn.MaxPool2d(2)]
        channels = out
    layers.append(nn.Flatten())
    width = channels * _conv_side(image_size, convs) ** 2
    for out in widths:
        layers += [nn.Linear(width, out), nn.ReLU()]
        width = out
    return nn.Sequential(*layers)


def small_resnet(stages: int) -> nn.Module:
    """ResNet with one BasicBlock per stage and ``stages`` stages (4 -> ResNet10, 1 -> ResNet4)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    net = ResNet(BasicBlock, [1, 1, 1, 1])
    for name in ("layer4", "layer3", "layer2")[: 4 - stages]:
        setattr(net, name, nn.Identity())
    net.fc = nn.Identity()
    return net


def torchvision_trunk(name: str) -> nn.Module:
    """A randomly initialised torchvision classifier with its final Linear removed."""
    from torchvision import models as tvm

    if name == "googlenet":
        net = tvm.googlenet(weights=None, aux_logits=False, init_weights=True)
        net.fc = nn.Identity()  # keeps avgpool + flatten + Dropout(0.2)
    elif name == "mobilenet_v2":
        net = tvm.mobilenet_v2(weights=None)
        net.classifier[1] = nn.Identity()  # keeps Dropout(0.2)
    else:
        net = getattr(tvm, name)(weights=None)
        net.fc = nn.Identity()
    return net


def vit_trunk(name: str, image_size: int) -> nn.Module:
    """A randomly initialised torchvision ViT-B (``vit_b_16``/``vit_b_32``) for ``image_size``, heads removed.

    Raises:
        ValueError: if ``image_size`` is not a multiple of the patch size (e.g. 28x28 MNIST).
    """
    patch = int(name[-2:])
    if image_size % patch:
        raise ValueError(
            f"{name} needs an image size divisible by {patch}, got {image_size}; "
            "choose a model group without ViT for this dataset"
        )
    from torchvision import models as tvm

    net = getattr(tvm, name)(weights=None, image_size=image_size)
    net.heads = nn.Identity()
    return net


EXTRACTORS = (
    "fedavgcnn",
    "googlenet",
    "mobilenet_v2",
    "resnet4",
    "resnet6",
    "resnet8",
    "resnet10",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "vit_b_16",
    "vit_b_32",
    *HTCNN8,
)
HEADS = {"linear": None, "mlp512": 512, "mlp256": 256, "mlp128": 128}


def build_extractor(name: str, k: int, in_channels: int, image_size: int) -> nn.Module:
    """Extractor ``name`` followed by :class:`FixedPool` to ``k``: images -> ``[B, k]`` float32.

    Raises:
        KeyError: for an unknown name.
    """
    if name == "fedavgcnn":
        trunk = fedavgcnn(in_channels, image_size)
    elif name in HTCNN8:
        trunk = htcnn(name, in_channels, image_size)
    elif name.startswith("resnet") and int(name[6:]) <= 10:
        trunk = _retarget_first_conv(small_resnet({4: 1, 6: 2, 8: 3, 10: 4}[int(name[6:])]), in_channels)
    elif name.startswith("vit_"):
        trunk = _retarget_first_conv(vit_trunk(name, image_size), in_channels)
    elif name in EXTRACTORS:
        trunk = _retarget_first_conv(torchvision_trunk(name), in_channels)
    else:
        raise KeyError(name)
    return nn.Sequential(trunk, FixedPool(k))


def build_zoo_model(
    extractor: str, head: str, num_classes: int, k: int, in_channels: int, image_size: int
) -> SplitModel:
    """A :class:`SplitModel` of a zoo extractor (feature dim ``k``) and head ``head`` (see ``HEADS``)."""
    hidden = HEADS[head]
    head_module = (
        None if hidden is None else nn.Sequential(nn.Linear(k, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
    )
    return SplitModel(build_extractor(extractor, k, in_channels, image_size), k, num_classes, head_module)
