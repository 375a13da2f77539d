"""The shape every client model has: a feature extractor followed by a linear head."""

from __future__ import annotations

import torch
from torch import nn


class SplitModel(nn.Module):
    """A client model = ``extractor`` (x -> representation) + ``head`` (representation -> logits).

    Args:
        extractor: module mapping images ``[B, C_in, H, W]`` float32 to representations
            ``[B, feature_dim]`` float32.
        feature_dim: the representation size d the extractor produces.
        num_classes: number of output logits C.
        head: representation -> logits; default ``nn.Linear(feature_dim, num_classes)``.

    With the default head the state-dict keys are ``head.weight`` [C, d] and ``head.bias``
    [C] for every architecture: methods that exchange a head (FedGH, FedRE) rely on that.
    """

    def __init__(self, extractor: nn.Module, feature_dim: int, num_classes: int, head: nn.Module | None = None) -> None:
        super().__init__()
        self.extractor = extractor
        self.head = head if head is not None else nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C]`` float32 for images ``x`` ``[B, C_in, H, W]``."""
        return self.head(self.extractor(x))
