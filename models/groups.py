"""Model groups: which architecture each client gets.

A group is an ordered list of architectures; client (partition) k gets
``architectures[k mod len(architectures)]`` (FedGH's authors' code: CNN-((k mod 5)+1)).
Every member of a group has the same representation size, so the server can know d
from the config alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from models.base import SplitModel
from models.cnn import CNN_SHAPES, REPRESENTATION_DIM, build_cnn


@dataclass(frozen=True)
class ModelGroup:
    """An ordered list of architecture names sharing one representation size ``feature_dim``."""

    architectures: tuple[str, ...]
    feature_dim: int
    builder: Callable[[str, int, int, int], SplitModel]

    def architecture_for(self, partition_id: int) -> str:
        """The architecture of client ``partition_id`` (index modulo the group size)."""
        return self.architectures[partition_id % len(self.architectures)]

    def build(self, partition_id: int, num_classes: int, in_channels: int, image_size: int,
              seed: int) -> SplitModel:
        """Build client ``partition_id``'s model, initialised from ``seed + partition_id``.

        The seed is per client so that two clients of the same architecture start from
        independent weights (spec fedgh.md P10) and every process builds the same model.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + partition_id)
            return self.builder(self.architecture_for(partition_id), num_classes, in_channels, image_size)


MODEL_GROUPS: dict[str, ModelGroup] = {
    "cnn1": ModelGroup(("cnn1",), REPRESENTATION_DIM, build_cnn),
    "hetero-cnn5": ModelGroup(tuple(CNN_SHAPES), REPRESENTATION_DIM, build_cnn),
}
