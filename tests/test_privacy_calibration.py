"""The calibration of the privacy scores (``tools.privacy_calibration``): the committed table is what its
committed rows make, the new own-image rule tells a degraded copy of an image from images that know
nothing of it while the old best-of-references rule does not, and the score functions on known inputs."""

from __future__ import annotations

import json
import math

import pytest
import torch

from privacy.scores import own_image_scores
from tools.privacy_calibration import calibrate, fires_class, fires_new, fires_old, markdown, stand_ins
from tools.runconfig import ROOT

FOLDER = ROOT / "results" / "privacy" / "calibration"


@pytest.fixture(scope="module")
def rows():
    return json.loads((FOLDER / "calibration.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def fmnist_rows():
    return json.loads((FOLDER / "fashion-mnist" / "calibration.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("folder", [FOLDER, FOLDER / "fashion-mnist"])
def test_the_committed_table_is_its_rows(folder):
    rows = json.loads((folder / "calibration.json").read_text(encoding="utf-8"))
    assert (folder / "calibration.md").read_text(encoding="utf-8") == markdown(rows)
    assert markdown(rows) in (FOLDER / "README.md").read_text(encoding="utf-8")


def test_with_the_class_mean_among_the_floors_only_what_holds_the_image_fires(rows, fmnist_rows):
    """On Fashion-MNIST the class mean beats gray and the data-set mean on most images (the new rule fires
    for it); with the class mean among the floors no stand-in that knows only the class fires, on either
    data set, and the copies at 20 dB do."""
    assert share(fmnist_rows, "class mean", fires_new) > 0.5
    for data in (rows, fmnist_rows):
        for name in ("gray", "data-set mean", "class mean", "another image of the class"):
            assert share(data, name, fires_class) == 0.0, name
        assert share(data, "noise-20", fires_class) > 0.9


def share(rows, name, rule):
    group = [r for r in rows if r["stand_in"] == name]
    assert len(group) >= 50
    return sum(rule(r) for r in group) / len(group)


def test_the_own_image_rule_fires_on_degraded_copies_and_not_on_flat_images(rows):
    for name in ("noise-20", "down-4", "down-8"):
        assert share(rows, name, fires_new) == 1.0, name
    for name in ("gray", "data-set mean"):
        assert share(rows, name, fires_new) == 0.0, name
    assert share(rows, "another image of the class", fires_new) < 0.05
    # the old rule misses a noisy copy at 15 dB (a recognisable image) and a third of the x8 ones, and
    # fires for the class mean, which knows nothing of the image, as often as for the x8 copy
    assert share(rows, "noise-15", fires_old) < 0.2 < share(rows, "noise-15", fires_new)
    assert share(rows, "down-8", fires_old) < 0.6
    assert share(rows, "class mean", fires_old) > 0.4


def test_own_image_scores_by_hand():
    image = torch.rand(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    mean = torch.full((3, 16, 16), 0.25)
    got = own_image_scores(image, image, mean)
    assert got["psnr_own"] == [math.inf, math.inf] and got["ssim_own"] == pytest.approx([1.0, 1.0])
    for i in range(2):
        gray = -10 * math.log10(float((image[i] - 0.5).pow(2).mean()))
        flat = -10 * math.log10(float((image[i] - 0.25).pow(2).mean()))
        assert got["gray_psnr_own"][i] == pytest.approx(gray, rel=1e-5)
        assert got["mean_image_psnr_own"][i] == pytest.approx(flat, rel=1e-5)
    with pytest.raises(ValueError, match="dataset_mean"):
        own_image_scores(image, image[:1], mean)
    got = own_image_scores(image, image, mean, torch.full_like(image, 0.25))
    assert got["class_mean_psnr_own"] == pytest.approx(got["mean_image_psnr_own"])
    with pytest.raises(ValueError, match="class_means"):
        own_image_scores(image, image, mean, mean)


def test_stand_ins_have_the_stated_noise_and_calibrate_is_deterministic():
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(40, 3, 32, 32, generator=g) * 255).round().to(torch.uint8)
    labels = torch.arange(40) % 2
    x = 0.25 + 0.5 * images[0].float() / 255  # mid-range pixels: at 15 and 20 dB clipping is rare
    made = stand_ins(x, x, x, x, torch.Generator().manual_seed(1))
    for db in (10, 15, 20):
        psnr = own_image_scores(made[f"noise-{db}"][None], x[None], x)["psnr_own"][0]
        assert db - 0.3 < psnr < db + (3.0 if db == 10 else 0.5)  # clipping to [0, 1] only removes noise
    first = calibrate(images, labels, per_class=1, references=4, seed=3)
    assert first == calibrate(images, labels, per_class=1, references=4, seed=3)
    assert len(first) == 2 * len(made)
