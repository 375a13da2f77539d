"""What the privacy scores say about images whose content is known: ``python -m tools.privacy_calibration``.

A floor is only worth its name if an image that does resemble the victim's beats it and one that knows
nothing does not. This scores, on real test images of ``--dataset`` (CIFAR-10 by default) and with the
project's own score functions (:mod:`privacy.scores`), stand-ins whose information is known:

- knows nothing of the image: a mid-gray image, the data set's mean image, the mean image of its class,
  another image of its class;
- knows the image, degraded: the image plus Gaussian noise at 10, 15 and 20 dB PSNR, the image
  downsampled x4 and x8 (area averaging) and upsampled back (bilinear).

Each is scored by both rules: the old one (its best PSNR over the image and ``--references`` other
images of its class, the references a per-sample row was scored against, against the mid-gray image's
best over the same; it fires when it beats gray by ``tools.privacy_report.MARGIN_DB``) and the new one
(PSNR and SSIM to the image itself, :func:`privacy.scores.own_image_scores`; it fires when the PSNR beats
both the gray and the data-set mean image's on that image by the same margin). Also the mean PSNR over
the class's references, the score a class-mean payload is read by.

Writes ``<out>/calibration.json`` (one row per stand-in and image) and ``<out>/calibration.md`` (the
table, :func:`markdown`, made from those rows alone).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from common.files import atomic_write
from privacy import scores
from tools.privacy_report import MARGIN_DB
from tools.runconfig import ROOT

#: the stand-ins in table order (``noise-<dB>``, ``down-<factor>``: see :func:`stand_ins`)
#: the own-image scores of a row (:func:`privacy.scores.own_image_scores`)
OWN_KEYS = ("psnr_own", "ssim_own", "gray_psnr_own", "mean_image_psnr_own", "class_mean_psnr_own")
STAND_INS = (
    "gray",
    "data-set mean",
    "class mean",
    "another image of the class",
    "noise-10",
    "noise-15",
    "noise-20",
    "down-4",
    "down-8",
)


def test_split(dataset: str, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """A data set's official test split: uint8 ``[n, C, H, W]`` (its channels) and int64 labels ``[n]``.

    Reads ``<data_dir>/<dataset>/test.parquet`` (``common.data``'s checked loader); raises
    ``common.errors.ConfigError`` naming the file when it is missing or damaged.
    """
    from torchvision.io import ImageReadMode, decode_image

    from common.data import load_split
    from common.datasets import DATASETS

    info = DATASETS[dataset]
    ds = load_split(dataset, str(data_dir), "test")
    mode = ImageReadMode.RGB if info.channels == 3 else ImageReadMode.GRAY
    raw = [torch.frombuffer(bytearray(im["bytes"]), dtype=torch.uint8) for im in ds[info.image_column]]
    images = torch.stack([decode_image(b, mode) for b in raw])
    return images, torch.as_tensor(ds[info.label_column], dtype=torch.int64)


def stand_ins(
    image: torch.Tensor, other: torch.Tensor, class_mean: torch.Tensor, data_mean: torch.Tensor, g: torch.Generator
) -> dict[str, torch.Tensor]:
    """:data:`STAND_INS` for one image, each float32 ``[C, H, W]`` in [0, 1].

    Args:
        image: float ``[C, H, W]`` in [0, 1]; other: another image of its class, the same;
        class_mean, data_mean: the pixel means of its class and of the data set, the same;
        g: draws the noise.

    ``noise-<dB>``: ``image + N(0, s^2)`` with ``s = 10^(-dB/20)`` (PSNR dB before clipping, data range 1),
    clipped to [0, 1]; ``down-<f>``: the image averaged over f x f blocks, upsampled bilinearly.
    """
    out = {
        "gray": torch.full_like(image, 0.5),
        "data-set mean": data_mean,
        "class mean": class_mean,
        "another image of the class": other,
    }
    for db in (10, 15, 20):
        noise = torch.randn(image.shape, generator=g) * 10 ** (-db / 20)
        out[f"noise-{db}"] = (image + noise).clamp(0, 1)
    for f in (4, 8):
        low = F.avg_pool2d(image[None], f)
        out[f"down-{f}"] = F.interpolate(low, size=image.shape[-2:], mode="bilinear", align_corners=False)[0]
    return out


def calibrate(images: torch.Tensor, labels: torch.Tensor, per_class: int, references: int, seed: int) -> list[dict]:
    """One row per (image, stand-in) for ``per_class`` drawn images of each class of ``images`` (uint8
    ``[n, C, H, W]``, int64 ``labels`` ``[n]``).

    Each row: ``image`` (index), ``label``, ``stand_in``; the old rule's ``best_psnr`` and
    ``gray_best_psnr`` over the image and ``references`` other images of its class; ``mean_psnr`` over
    those; the new rule's ``psnr_own``, ``ssim_own``, ``gray_psnr_own``, ``mean_image_psnr_own`` (dB but
    SSIM). Deterministic given ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    pixels = images.float() / 255.0
    data_mean = pixels.mean(0)
    rows = []
    for c in sorted(int(v) for v in labels.unique()):
        members = torch.nonzero(labels == c).flatten()
        class_mean = pixels[members].mean(0)
        for i in members[torch.randperm(len(members), generator=g)[:per_class]].tolist():
            rest = members[members != i]
            picked = rest[torch.randperm(len(rest), generator=g)[: references + 1]]
            refs = torch.cat([images[i : i + 1], images[picked[1:]]])
            own = pixels[i : i + 1]
            gray = scores.image_scores(torch.full_like(own, 0.5), refs)["best_psnr"][0]
            for name, x in stand_ins(pixels[i], pixels[picked[0]], class_mean, data_mean, g).items():
                old = scores.image_scores(x[None], refs)
                new = scores.own_image_scores(x[None], own, data_mean, class_mean[None])
                rows.append(
                    {
                        "image": i,
                        "label": c,
                        "stand_in": name,
                        "best_psnr": old["best_psnr"][0],
                        "gray_best_psnr": gray,
                        "mean_psnr": old["mean_psnr"][0],
                        **{k: new[k][0] for k in OWN_KEYS},
                    }
                )
    return rows


def fires_old(row: dict[str, Any]) -> bool:
    """The old rule: the best PSNR over the references beats the gray image's best by :data:`MARGIN_DB`."""
    return row["best_psnr"] > row["gray_best_psnr"] + MARGIN_DB


def fires_class(row: dict[str, Any]) -> bool:
    """The rule the privacy report reads one image's input by: the PSNR to the image itself beats the gray,
    the data-set mean and the image's class mean image's PSNR to it by :data:`MARGIN_DB`."""
    return (
        row["psnr_own"] > max(row["gray_psnr_own"], row["mean_image_psnr_own"], row["class_mean_psnr_own"]) + MARGIN_DB
    )


def fires_new(row: dict[str, Any]) -> bool:
    """The new rule: the PSNR to the image itself beats both the gray and the data-set mean image's PSNR
    to it by :data:`MARGIN_DB`."""
    return row["psnr_own"] > max(row["gray_psnr_own"], row["mean_image_psnr_own"]) + MARGIN_DB


def markdown(rows: list[dict[str, Any]]) -> str:
    """The calibration table of ``rows`` (:func:`calibrate`): per stand-in the mean ± std over images and
    how often each rule fires."""

    def stat(group: list[dict], key: str, digits: int = 1) -> str:
        a = np.array([r[key] for r in group], dtype=np.float64)
        return f"{a.mean():.{digits}f} ± {a.std():.{digits}f}"

    lines = [
        "| stand-in | old: PSNR best of refs | old: gray PSNR best of refs | old rule fires | "
        "PSNR to the image | SSIM to the image | gray PSNR to the image | data-set mean PSNR to the image | "
        "new rule fires | class mean PSNR to the image | fires over the class mean too | "
        "PSNR mean over the class's refs |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in STAND_INS:
        group = [r for r in rows if r["stand_in"] == name]
        if not group:
            continue
        old = sum(fires_old(r) for r in group)
        new = sum(fires_new(r) for r in group)
        over_class = sum(fires_class(r) for r in group)
        lines.append(
            f"| {name} | {stat(group, 'best_psnr')} | {stat(group, 'gray_best_psnr')} | {old}/{len(group)} | "
            f"{stat(group, 'psnr_own')} | {stat(group, 'ssim_own', 3)} | {stat(group, 'gray_psnr_own')} | "
            f"{stat(group, 'mean_image_psnr_own')} | {new}/{len(group)} | {stat(group, 'class_mean_psnr_own')} | "
            f"{over_class}/{len(group)} | {stat(group, 'mean_psnr')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.privacy_calibration", description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", default="cifar10", help="a data set with a test split (default cifar10)")
    parser.add_argument(
        "--out",
        type=Path,
        help="output folder (default results/privacy/calibration, <dataset>/ below it but CIFAR-10's)",
    )
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    parser.add_argument("--per-class", type=int, default=5, help="images drawn per class (default 5)")
    parser.add_argument("--references", type=int, default=32, help="other images of the class (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = args.out or ROOT / "results" / "privacy" / "calibration" / ("" if args.dataset == "cifar10" else args.dataset)
    images, labels = test_split(args.dataset, args.data_dir)
    rows = calibrate(images, labels, args.per_class, args.references, args.seed)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "calibration.json", lambda f: f.write(json.dumps(rows, indent=1).encode("utf-8")))
    atomic_write(out / "calibration.md", lambda f: f.write(markdown(rows).encode("utf-8")))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
