"""The dataset registry both halves import: each dataset's facts and the training recipe its pixels
get (run config keys ``dataset``, ``augment``, ``normalize``). No torch here: the launcher and the
config check read it without importing the data pipeline (``common.data``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.errors import ConfigError


@dataclass(frozen=True)
class DatasetInfo:
    """Static facts about an image-classification dataset, and the recipe its pixels get.

    ``mean``/``std`` are the per-channel normalisation constants in use for pixels in [0, 1]
    (by default FedGH's code's: ImageNet statistics for CIFAR-10, the dataset's own otherwise);
    ``dataset_mean``/``dataset_std`` are the dataset's own statistics. ``flip``, ``erase``,
    ``crop_padding`` (0: no crop) select the training augmentation. :func:`with_recipe` applies
    the run config keys ``augment`` and ``normalize``. ``train_size`` and ``test_size`` are the
    numbers of examples in the official splits (``RunConfig.pool_size``, the pool that is
    partitioned, is an upper bound on any client's data size).
    """

    hub_id: str
    image_column: str
    label_column: str
    num_classes: int
    channels: int
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    flip: bool
    erase: bool
    crop_padding: int
    dataset_mean: tuple[float, ...]
    dataset_std: tuple[float, ...]
    train_size: int
    test_size: int


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # MH-pFL's code
CIFAR100_MEAN, CIFAR100_STD = (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)

# Default recipe: FedGH's code (docs/methods/fedgh.md §8) for CIFAR; the digit and clothing datasets
# get random crops only (flipping a digit changes its meaning) and their own statistics.
DATASETS: dict[str, DatasetInfo] = {
    "cifar10": DatasetInfo(
        hub_id="uoft-cs/cifar10",
        image_column="img",
        label_column="label",
        num_classes=10,
        channels=3,
        image_size=32,
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        flip=True,
        erase=True,
        crop_padding=4,
        dataset_mean=CIFAR10_MEAN,
        dataset_std=CIFAR10_STD,
        train_size=50_000,
        test_size=10_000,
    ),
    "cifar100": DatasetInfo(
        hub_id="uoft-cs/cifar100",
        image_column="img",
        label_column="fine_label",
        num_classes=100,
        channels=3,
        image_size=32,
        mean=CIFAR100_MEAN,
        std=CIFAR100_STD,
        flip=True,
        erase=True,
        crop_padding=4,
        dataset_mean=CIFAR100_MEAN,
        dataset_std=CIFAR100_STD,
        train_size=50_000,
        test_size=10_000,
    ),
    "mnist": DatasetInfo(
        hub_id="ylecun/mnist",
        image_column="image",
        label_column="label",
        num_classes=10,
        channels=1,
        image_size=28,
        mean=(0.1307,),
        std=(0.3081,),
        flip=False,
        erase=False,
        crop_padding=2,
        dataset_mean=(0.1307,),
        dataset_std=(0.3081,),
        train_size=60_000,
        test_size=10_000,
    ),
    "fashion-mnist": DatasetInfo(
        hub_id="zalando-datasets/fashion_mnist",
        image_column="image",
        label_column="label",
        num_classes=10,
        channels=1,
        image_size=28,
        mean=(0.2860,),
        std=(0.3530,),
        flip=False,
        erase=False,
        crop_padding=2,
        dataset_mean=(0.2860,),
        dataset_std=(0.3530,),
        train_size=60_000,
        test_size=10_000,
    ),
}

#: run config ``augment``: ``auto`` = the dataset's default above; the others name what is applied
AUGMENTATIONS = ("auto", "none", "crop", "flip-crop", "flip-erase-crop")
#: run config ``normalize``: ``auto`` = the dataset's default; ``imagenet`` (FedGH/FedMRL code for
#: CIFAR-10), ``dataset`` (the dataset's own statistics, MH-pFL code), ``half`` (mean = std = 0.5,
#: HtFLlib/PFLlib code of FedTGP and FedRE)
NORMALIZATIONS = ("auto", "imagenet", "dataset", "half")


def with_recipe(info: DatasetInfo, augment: str = "auto", normalize: str = "auto") -> DatasetInfo:
    """``info`` with the training augmentation and normalisation of run config keys ``augment``/``normalize``.

    The crop keeps the dataset's padding (4 px for 32x32 images, 2 px for 28x28).

    Args:
        augment, normalize: values from :data:`AUGMENTATIONS` / :data:`NORMALIZATIONS` (validated
            by ``RunConfig``).

    Raises:
        ConfigError: ``imagenet`` statistics for a dataset that is not RGB.
    """
    if augment != "auto":
        info = replace(
            info,
            flip="flip" in augment,
            erase="erase" in augment,
            crop_padding=info.crop_padding if "crop" in augment else 0,
        )
    if normalize == "imagenet":
        if info.channels != 3:
            raise ConfigError(
                f"run config key 'normalize' = 'imagenet' needs RGB images; this dataset has "
                f"{info.channels} channel(s): allowed values are 'auto', 'dataset', 'half'"
            )
        info = replace(info, mean=IMAGENET_MEAN, std=IMAGENET_STD)
    elif normalize == "dataset":
        info = replace(info, mean=info.dataset_mean, std=info.dataset_std)
    elif normalize == "half":
        info = replace(info, mean=(0.5,) * info.channels, std=(0.5,) * info.channels)
    return info
