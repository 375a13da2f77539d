"""CNN-1 ... CNN-5 of FedGH (docs/methods/fedgh.md §7; authors' ``Models/CNNs.py``).

Layout: conv1 Conv(C_in->16, 5x5)+ReLU+MaxPool2, conv2 Conv(16->c2, 5x5)+ReLU+MaxPool2,
fc1 Linear(flatten->h1)+ReLU, fc2 Linear(h1->500)+ReLU (the 500-d, non-negative
representation), then the head Linear(500->C). Stride 1, no padding. For 3x32x32 input the
flattened size is 25*c2, as in the spec's table; other input sizes (1x28x28 MNIST: 16*c2)
follow from the same layers.
"""

from __future__ import annotations

from torch import nn

from models.base import SplitModel

REPRESENTATION_DIM = 500

#: name -> (c2, h1), docs/methods/fedgh.md §7 table.
CNN_SHAPES: dict[str, tuple[int, int]] = {
    "cnn1": (32, 2000),
    "cnn2": (16, 2000),
    "cnn3": (32, 1000),
    "cnn4": (32, 800),
    "cnn5": (32, 500),
}


def cnn_extractor(c2: int, h1: int, in_channels: int, image_size: int) -> nn.Sequential:
    """The CNN-i feature extractor: images ``[B, in_channels, S, S]`` -> ``[B, 500]`` float32, >= 0."""
    side = ((image_size - 4) // 2 - 4) // 2
    return nn.Sequential(
        nn.Conv2d(in_channels, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, c2, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * side * side, h1),
        nn.ReLU(),
        nn.Linear(h1, REPRESENTATION_DIM),
        nn.ReLU(),
    )


def build_cnn(name: str, num_classes: int, in_channels: int = 3, image_size: int = 32) -> SplitModel:
    """CNN-1..5 by name (``"cnn1"`` ... ``"cnn5"``) as a :class:`SplitModel` with d = 500.

    Raises:
        KeyError: for an unknown name.
    """
    c2, h1 = CNN_SHAPES[name]
    return SplitModel(cnn_extractor(c2, h1, in_channels, image_size), REPRESENTATION_DIM, num_classes)


class SmallCNN(nn.Module):
    """A CNN-i with a representation of size ``d`` and named layers: the shared homogeneous model.

    FedMRL's global small model G (docs/methods/fedmrl.md §7: CNN-5 with FC2 -> d1 in the
    heterogeneous setting, CNN-1 in the homogeneous one) and the shared "meme"/"mentee"
    model of FML and FedKD (the full CNN-5, d = 500). The layers are named as in the
    authors' ``Models/CNNs.py`` so the payload keys are ``conv1.weight`` ... ``fc3.bias``
    in ``state_dict`` order (docs/methods/fedmrl.md §2).

    Args:
        name: ``cnn1`` ... ``cnn5``: conv2 width and FC1 width h from :data:`CNN_SHAPES`.
        d: representation size (FC2 output, post-ReLU).
        num_classes: L, the header's output size.

    Raises:
        KeyError: for an unknown ``name``.
    """

    def __init__(self, name: str, d: int, num_classes: int, in_channels: int = 3, image_size: int = 32) -> None:
        super().__init__()
        c2, h1 = CNN_SHAPES[name]
        side = ((image_size - 4) // 2 - 4) // 2
        self.conv1 = nn.Conv2d(in_channels, 16, 5)
        self.conv2 = nn.Conv2d(16, c2, 5)
        self.fc1 = nn.Linear(c2 * side * side, h1)
        self.fc2 = nn.Linear(h1, d)
        self.fc3 = nn.Linear(d, num_classes)
        self.feature_dim, self.num_classes = d, num_classes

    @property
    def extractor(self) -> nn.Sequential:
        """conv1 ... fc2 + ReLU: images -> representations ``[B, d]`` float32, >= 0 (a view, not a copy)."""
        return nn.Sequential(
            self.conv1,
            nn.ReLU(),
            nn.MaxPool2d(2),
            self.conv2,
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            self.fc1,
            nn.ReLU(),
            self.fc2,
            nn.ReLU(),
        )

    @property
    def head(self) -> nn.Linear:
        """The header fc3: ``[B, d]`` -> logits ``[B, L]``."""
        return self.fc3

    def forward(self, x):
        """Logits ``[B, L]`` for images ``[B, C_in, H, W]``."""
        return self.fc3(self.extractor(x))
