"""Training-recipe keys: ``augment``, ``normalize``, ``init`` (each paper's own pipeline)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import ConfigError, RunConfig
from common.data import augment, normalize
from common.datasets import CIFAR10_MEAN, DATASETS, IMAGENET_MEAN, IMAGENET_STD, with_recipe
from conftest import client_runtime
from models.groups import MODEL_GROUPS

CIFAR = DATASETS["cifar10"]


def batch(n: int = 64) -> torch.Tensor:
    """A normalised-looking batch without zeros, so only padding and erasing can make a 0."""
    return 1.0 + torch.rand(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def windows(x: torch.Tensor, pad: int) -> torch.Tensor:
    """Every crop window of the zero-padded image ``x`` [C, H, W]: [(2 pad + 1)^2, C, H, W]."""
    padded = F.pad(x, (pad, pad, pad, pad))
    h, w = x.shape[1:]
    return torch.stack([padded[:, dy : dy + h, dx : dx + w] for dy in range(2 * pad + 1) for dx in range(2 * pad + 1)])


def best_window(out: torch.Tensor, x: torch.Tensor, pad: int, flips: bool) -> tuple[int, bool, torch.Tensor]:
    """(differing pixels, flipped, mask of differing positions) of the closest crop (and flip) of ``x``."""
    candidates = [(windows(x, pad), False)] + ([(windows(x.flip(-1), pad), True)] if flips else [])
    best = None
    for wins, flipped in candidates:
        diff = (wins != out).any(dim=1)  # [windows, H, W]
        k = int(diff.flatten(1).sum(1).argmin())
        if best is None or int(diff[k].sum()) < best[0]:
            best = (int(diff[k].sum()), flipped, diff[k])
    return best


def test_augment_none_gives_the_same_batch_for_any_draw():
    info = with_recipe(CIFAR, augment="none")
    x = batch()
    a = augment(x, info, torch.Generator().manual_seed(1))
    b = augment(x, info, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and torch.equal(a, x)
    # while the default recipe draws differently per generator
    assert not torch.equal(
        augment(x, CIFAR, torch.Generator().manual_seed(1)), augment(x, CIFAR, torch.Generator().manual_seed(2))
    )


def test_crop_only_shifts():
    x = batch(32)
    out = augment(x, with_recipe(CIFAR, augment="crop"), torch.Generator().manual_seed(3))
    found = [best_window(out[i], x[i], 4, flips=False) for i in range(len(x))]
    assert all(diff == 0 for diff, _, _ in found)  # every image is exactly a window of its padded self
    assert sum(not torch.equal(out[i], x[i]) for i in range(len(x))) > len(x) // 2  # and most are shifted


def test_flip_crop_flips_some_and_never_erases():
    x = batch(32)
    out = augment(x, with_recipe(CIFAR, augment="flip-crop"), torch.Generator().manual_seed(4))
    found = [best_window(out[i], x[i], 4, flips=True) for i in range(len(x))]
    assert all(diff == 0 for diff, _, _ in found)
    flipped = sum(f for _, f, _ in found)
    assert 0 < flipped < len(x)


def test_flip_erase_crop_erases_rectangles_in_some_images():
    x = batch(64)
    out = augment(x, with_recipe(CIFAR, augment="flip-erase-crop"), torch.Generator().manual_seed(5))
    erased = 0
    for i in range(len(x)):
        diff, _, mask = best_window(out[i], x[i], 4, flips=True)
        if diff:
            erased += 1
            assert (out[i][:, mask] == 0).all()  # only erased (zeroed) pixels differ
            rows, cols = mask.any(1).nonzero().flatten(), mask.any(0).nonzero().flatten()
            assert mask[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()  # a rectangle
    assert 0.25 * len(x) < erased < 0.75 * len(x)  # p = 0.5


def test_normalize_choices():
    assert with_recipe(CIFAR) == CIFAR and CIFAR.mean == IMAGENET_MEAN  # auto = today's default
    assert with_recipe(CIFAR, normalize="dataset").mean == CIFAR10_MEAN
    half = with_recipe(DATASETS["mnist"], normalize="half")
    assert half.mean == (0.5,) and half.std == (0.5,)
    x = torch.full((1, 1, 2, 2), 255, dtype=torch.uint8)
    assert torch.allclose(normalize(x, half), torch.ones(1, 1, 2, 2))  # (1 - 0.5) / 0.5
    imagenet = with_recipe(DATASETS["cifar100"], normalize="imagenet")
    assert imagenet.mean == IMAGENET_MEAN and imagenet.std == IMAGENET_STD
    with pytest.raises(ConfigError, match="'normalize' = 'imagenet'"):
        with_recipe(DATASETS["mnist"], normalize="imagenet")


def test_recipe_keys_are_validated(run_config):
    for key, value in (("augment", "flip"), ("normalize", "zscore"), ("init", "same")):
        with pytest.raises(ConfigError, match=f"'{key}'"):
            RunConfig.from_dict(run_config(**{key: value}))


def test_client_runtime_uses_the_recipe(run_config):
    client = client_runtime(run_config(augment="none", normalize="half"))
    assert client.data.info.mean == (0.5, 0.5, 0.5) and not (client.data.info.flip or client.data.info.crop_padding)


@pytest.mark.parametrize("group, same, other", [("hetero-cnn5", 5, 1), ("htfe2", 2, 1)])
def test_identical_init_gives_one_model_per_architecture(group, same, other):
    g = MODEL_GROUPS[group]
    assert g.architecture_for(0) == g.architecture_for(same) != g.architecture_for(other)

    def weights(pid, identical):
        return g.build(pid, 10, 3, 32, seed=7, k=64, identical=identical).state_dict()

    a, b = weights(0, True), weights(same, True)
    assert all(torch.equal(a[k], b[k]) for k in a)  # bit-identical
    c = weights(0, False), weights(same, False)
    assert not all(torch.equal(c[0][k], c[1][k]) for k in c[0] if c[0][k].is_floating_point())  # independent
    d = weights(other, True)
    assert set(a) != set(d) or any(a[k].shape != d[k].shape for k in a)  # another architecture


def test_identical_init_through_the_client_runtime(run_config):
    rc = run_config(init="identical", **{"num-clients": 6})
    a, b = client_runtime(rc, 0).model.state_dict(), client_runtime(rc, 5).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
