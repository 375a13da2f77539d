"""Model groups: which architecture (and head) each client gets.

A group is an ordered list of architectures; client (partition) k gets
``architectures[k mod len(architectures)]`` (FedGH's CNN-((k mod 5)+1), FedTGP's i mod X) and
``heads[k mod len(heads)]`` (FedTGP's HtC4 heads, i mod 4). Every member of a group has the
same representation size, so the server knows d from the config alone: 500 for CNN-1..5,
the run's ``feature-dim`` K for the zoo of FedTGP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from models.base import SplitModel
from models.cnn import CNN_SHAPES, REPRESENTATION_DIM, build_cnn
from models.mh import FEATURE_DIM as MH_FEATURE_DIM
from models.mh import MH_MODELS, build_mh_model

HTFE8 = ("fedavgcnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
HTC4 = ("linear", "mlp512", "mlp256", "mlp128")
#: FedRE's model-heterogeneous family in the authors' code order (docs/methods/fedre.md §7)
FEDRE10 = (*HTFE8, "vit_b_16", "vit_b_32")
#: CPU-scale stand-in for FEDRE10 (project choice, not from the paper, docs/methods/fedre.md §7):
#: FedAvgCNN and conv/FC variants of different width and depth, small ResNets and ResNet-18
FEDRE_PROXY = (
    "fedavgcnn",
    "htcnn1",
    "htcnn3",
    "htcnn4",
    "htcnn5",
    "htcnn6",
    "htcnn8",
    "resnet4",
    "resnet8",
    "resnet18",
)


@dataclass(frozen=True)
class ModelGroup:
    """Architectures and heads assigned round-robin; ``fixed_feature_dim`` None means K from the config."""

    architectures: tuple[str, ...]
    heads: tuple[str, ...] = ("linear",)
    fixed_feature_dim: int | None = None

    def feature_dim(self, k: int) -> int:
        """Representation size d of every member, given the run's ``feature-dim`` K."""
        return self.fixed_feature_dim or k

    def architecture_for(self, partition_id: int) -> str:
        """The extractor architecture of client ``partition_id``."""
        return self.architectures[partition_id % len(self.architectures)]

    def head_for(self, partition_id: int) -> str:
        """The head of client ``partition_id`` (``linear`` unless the group has HtC4 heads)."""
        return self.heads[partition_id % len(self.heads)]

    def build(
        self,
        partition_id: int,
        num_classes: int,
        in_channels: int,
        image_size: int,
        seed: int,
        k: int = 512,
        identical: bool = False,
        architecture: str | None = None,
    ) -> SplitModel:
        """Build client ``partition_id``'s model, initialised from ``seed + partition_id``, or from
        ``seed`` alone with ``identical`` (run config ``init``).

        Per client seeds make two clients of one architecture start from independent weights
        (FedGH's code, docs/methods/fedgh.md P10); ``identical`` gives every client of one architecture the
        same initial model, as HtFLlib/PFLlib (FedTGP, FedRE) do with ``manual_seed(0)`` before
        building each. Either way every process builds the same model. ``architecture`` overrides
        the round-robin member (``common.heldout.architecture_for``: held-out architectures).
        """
        arch = architecture or self.architecture_for(partition_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed if identical else seed + partition_id)
            if arch in CNN_SHAPES:
                return build_cnn(arch, num_classes, in_channels, image_size)
            if arch in MH_MODELS:
                return build_mh_model(arch, num_classes, in_channels, image_size)
            from models.zoo import build_zoo_model  # torchvision takes seconds to import: only for zoo groups

            return build_zoo_model(
                arch, self.head_for(partition_id), num_classes, self.feature_dim(k), in_channels, image_size
            )


MODEL_GROUPS: dict[str, ModelGroup] = {
    "cnn1": ModelGroup(("cnn1",), fixed_feature_dim=REPRESENTATION_DIM),
    "hetero-cnn5": ModelGroup(tuple(CNN_SHAPES), fixed_feature_dim=REPRESENTATION_DIM),
    "htfe2": ModelGroup(("fedavgcnn", "resnet18")),
    "htfe3": ModelGroup(("resnet10", "resnet18", "resnet34")),
    "htfe4": ModelGroup(("fedavgcnn", "googlenet", "mobilenet_v2", "resnet18")),
    "htfe8": ModelGroup(HTFE8),
    "htfe9": ModelGroup(
        ("resnet4", "resnet6", "resnet8", "resnet10", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
    ),
    "htcnn8": ModelGroup(tuple(f"htcnn{i}" for i in range(1, 9))),
    "fedavgcnn": ModelGroup(("fedavgcnn",)),
    "fedre10": ModelGroup(FEDRE10),
    "fedre-proxy": ModelGroup(FEDRE_PROXY),
    # MH-pFedHN's zoo (docs/methods/mh-pfedhn.md §7). The paper assigns contiguous equal blocks of
    # client ids; round-robin gives every architecture the same number of clients (remainder to
    # the first ones, as there) and needs no client count at build time.
    "mh-lenet": ModelGroup(("lenet",), fixed_feature_dim=MH_FEATURE_DIM),
    "mh-zoo": ModelGroup(("lenet", "vgg8", "mhresnet10", "mhresnet12", "mhresnet18"), fixed_feature_dim=MH_FEATURE_DIM),
    "htfe8-htc4": ModelGroup(HTFE8, heads=HTC4),
    "res34-htc4": ModelGroup(("resnet34",), heads=HTC4),
}
