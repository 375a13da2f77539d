"""The model zoo of MH-pFedHN (docs/methods/mh-pfedhn.md §7, official ``models.py``).

Every conv and linear layer has a bias; every model ends in a 64-d representation and a
``Linear(64, C)`` head, so it is a :class:`SplitModel` like the rest of the zoo (the method
itself needs no split: it generates and exchanges all trainable parameters as one vector).

- ``lenet``: Conv 3->16 (3x3, pad 1), ReLU, MaxPool 2; Conv 16->32 (3x3, pad 1), ReLU,
  MaxPool 2; flatten; FC ->108, ReLU; FC 108->64, ReLU. Also MH-pFedHNGD's global model.
- ``vgg8``: [3->16, 16->16] pool [16->32, 32->32] pool [32->64, 64->64] pool (3x3 pad 1 +
  ReLU); flatten; Linear ->180, ReLU, Dropout(0.5); Linear 180->64, ReLU, Dropout(0.5).
- ``mhresnet10/12/18``: stem Conv 3->16 + BN + ReLU; basic blocks (conv, BN, ReLU, conv, BN,
  + shortcut, ReLU; the shortcut is a 1x1 stride-2 conv with bias when the width changes);
  blocks per width 16/32/64: 3/3/4, 1/5/6, 6/6/6; global average pooling to 64.
- ``mlp``: flatten, Linear ->128, ReLU, Linear 128->64, ReLU.

Generated parameter counts for 3x32x32 input (tested): CIFAR-10 234,006 / 268,814 / 347,178 /
523,242 / 565,386 for lenet / vgg8 / mhresnet10 / mhresnet12 / mhresnet18; CIFAR-100 239,856
... (spec table). The ResNets pool adaptively (the code's AvgPool(8) on the 8x8 map of a 32x32
input), so 28x28 MNIST works unchanged; the flatten sizes of the others follow the input size.
"""

from __future__ import annotations

import torch
from torch import nn

from models.base import SplitModel

FEATURE_DIM = 64
#: blocks per width (16, 32, 64), docs/methods/mh-pfedhn.md §7 / paper Table 19
RESNET_BLOCKS = {"mhresnet10": (3, 3, 4), "mhresnet12": (1, 5, 6), "mhresnet18": (6, 6, 6)}
MH_MODELS = ("lenet", "vgg8", *RESNET_BLOCKS, "mlp")


class BasicBlock(nn.Module):
    """conv3x3(stride) BN ReLU conv3x3 BN + shortcut, ReLU; convs with bias (the official code)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Conv2d(cin, cout, 1, stride) if (cin != cout or stride != 1) else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def _resnet(blocks: tuple[int, int, int], in_channels: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(in_channels, 16, 3, 1, 1), nn.BatchNorm2d(16), nn.ReLU()]
    cin = 16
    for width, count in zip((16, 32, 64), blocks):
        for j in range(count):
            layers.append(BasicBlock(cin, width, 2 if (j == 0 and width != cin) else 1))
            cin = width
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())


def build_mh_extractor(name: str, in_channels: int, image_size: int) -> nn.Module:
    """Extractor ``name`` of :data:`MH_MODELS`: images ``[B, C_in, S, S]`` -> ``[B, 64]`` float32.

    Raises:
        KeyError: for an unknown name.
    """
    if name == "lenet":
        side = image_size // 4
        return nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, 1, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, 1, 1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * side * side, 108),
            nn.ReLU(),
            nn.Linear(108, FEATURE_DIM),
            nn.ReLU(),
        )
    if name == "vgg8":
        layers: list[nn.Module] = []
        cin = in_channels
        for width in (16, 32, 64):
            layers += [
                nn.Conv2d(cin, width, 3, 1, 1),
                nn.ReLU(),
                nn.Conv2d(width, width, 3, 1, 1),
                nn.ReLU(),
                nn.MaxPool2d(2),
            ]
            cin = width
        side = image_size // 8
        return nn.Sequential(
            *layers,
            nn.Flatten(),
            nn.Linear(64 * side * side, 180),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(180, FEATURE_DIM),
            nn.ReLU(),
            nn.Dropout(0.5),
        )
    if name in RESNET_BLOCKS:
        return _resnet(RESNET_BLOCKS[name], in_channels)
    if name == "mlp":
        return nn.Sequential(
            nn.Flatten(),
            nn.Linear(in_channels * image_size * image_size, 128),
            nn.ReLU(),
            nn.Linear(128, FEATURE_DIM),
            nn.ReLU(),
        )
    raise KeyError(name)


def build_mh_model(name: str, num_classes: int, in_channels: int = 3, image_size: int = 32) -> SplitModel:
    """A :data:`MH_MODELS` member as a :class:`SplitModel` with d = 64 and head ``Linear(64, C)``."""
    return SplitModel(build_mh_extractor(name, in_channels, image_size), FEATURE_DIM, num_classes)
