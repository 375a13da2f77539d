"""Scores of reconstructed images against a client's images, and a figure of them.

A reconstruction from a shared vector (:mod:`privacy.inversion`) is compared with every image it
could reveal (the client's training images); its best match is the one it resembles most (highest
PSNR). Units: pixels in [0, 1]; PSNR in dB with data range 1 (the same number as on 0-255 pixels
with data range 255); SSIM with torchmetrics' defaults (Gaussian window 11, sigma 1.5), in
[-1, 1]; MSE on the 0-255 pixel scale, as FedRE's privacy question (Q2) reports it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

#: pixels one scoring call holds at once (pairs x C x H x W), so a client's whole training split
#: fits in memory as references
_CHUNK_PIXELS = 1 << 22
#: characters of a caption line under a column of the reconstruction figure (2 inches at 6 pt)
_CAPTION_CHARS = 30


def _unit(images: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 -> float32 / 255; float -> float32, which must lie in [0, 1]; ValueError otherwise."""
    if images.dtype == torch.uint8:
        return images.float() / 255.0
    x = images.detach().float().cpu()
    if x.numel() and (x.min() < 0 or x.max() > 1 or x.isnan().any()):
        raise ValueError(f"{name} must be uint8 or float in [0, 1], got values in [{x.min():.4g}, {x.max():.4g}]")
    return x


def image_scores(reconstructions: torch.Tensor, references: torch.Tensor) -> dict[str, list]:
    """Each reconstruction against every reference image: its best match and the mean over references.

    Args:
        reconstructions: ``[n, C, H, W]``, float in [0, 1] or uint8.
        references: ``[m, C, H, W]``, float in [0, 1] or uint8 (m >= 1).

    Returns:
        lists of n entries, one per reconstruction:
        ``best_index`` (int, the reference with the highest PSNR; the first of ties),
        ``best_psnr`` (dB), ``best_ssim``, ``best_mse`` (0-255 scale) of that reference, and
        ``mean_psnr``, ``mean_ssim``, ``mean_mse``: the means over all m references.
        A reconstruction equal to a reference has MSE 0 and PSNR ``inf`` (not capped), and so
        has a mean PSNR of ``inf``.

    Raises:
        ValueError: either input not 4-D, their C, H, W differ (both shapes named), no
            references, or float pixels outside [0, 1].
    """
    rec, ref = _unit(reconstructions, "reconstructions"), _unit(references, "references").cpu()
    if rec.dim() != 4 or ref.dim() != 4 or rec.shape[1:] != ref.shape[1:] or len(ref) == 0:
        raise ValueError(
            "reconstructions [n, C, H, W] and references [m >= 1, C, H, W] must share C, H, W: "
            f"got reconstructions {tuple(rec.shape)} and references {tuple(ref.shape)}"
        )
    chunk = max(1, _CHUNK_PIXELS // ref[0].numel())
    keys = ("best_index", "best_psnr", "best_ssim", "best_mse", "mean_psnr", "mean_ssim", "mean_mse")
    out: dict[str, list] = {k: [] for k in keys}
    for r in rec:
        psnr, ssim, mse = [], [], []
        for i in range(0, len(ref), chunk):
            f = ref[i : i + chunk]
            pred = r.expand_as(f)
            psnr.append(peak_signal_noise_ratio(pred, f, data_range=1.0, reduction="none", dim=(1, 2, 3)))
            ssim.append(structural_similarity_index_measure(pred, f, data_range=1.0, reduction="none"))
            mse.append((pred - f).pow(2).mean((1, 2, 3)) * 255.0**2)
        psnr, ssim, mse = torch.cat(psnr), torch.cat(ssim), torch.cat(mse)
        best = int(torch.argmax(psnr))
        out["best_index"].append(best)
        for name, values in (("psnr", psnr), ("ssim", ssim), ("mse", mse)):
            out[f"best_{name}"].append(float(values[best]))
            out[f"mean_{name}"].append(float(values.double().mean()))
    return out


def own_image_scores(
    reconstructions: torch.Tensor,
    own: torch.Tensor,
    dataset_mean: torch.Tensor,
    class_means: torch.Tensor | None = None,
) -> dict[str, list[float]]:
    """Each reconstruction against the one image it was made from, beside two images that know nothing
    of it: a uniform mid-gray image and the data set's mean image.

    A best match over many references (:func:`image_scores`) rewards any smooth, flat image: a flat
    image's best PSNR over 32 CIFAR-10 images of a class is as high as a good reconstruction's (the
    calibration table ``results/privacy/calibration/``). Against its own image a reconstruction has to
    resemble that image, and the gray and mean images' scores on that same image are the floor.

    Args:
        reconstructions: ``[n, C, H, W]``, float in [0, 1] or uint8.
        own: ``[n, C, H, W]``, float in [0, 1] or uint8: row i is the image reconstruction i was made from.
        dataset_mean: ``[C, H, W]``, float in [0, 1]: the per-pixel mean of the data set (or of the
            victim's images: what an attacker could know without any payload).
        class_means: ``[n, C, H, W]``, float in [0, 1], or None: row i the pixel mean of image i's class,
            what a payload that shows the class and no example can give (on Fashion-MNIST it beats the
            gray and mean images on most images, ``results/privacy/calibration/fashion-mnist/``).

    Returns:
        lists of n floats: ``psnr_own`` (dB), ``ssim_own`` of each reconstruction to its image,
        ``gray_psnr_own``, ``gray_ssim_own`` of the mid-gray image (0.5) to it, and
        ``mean_image_psnr_own``, ``mean_image_ssim_own`` of ``dataset_mean`` to it, and with
        ``class_means`` ``class_mean_psnr_own``, ``class_mean_ssim_own`` of its class's mean.

    Raises:
        ValueError: shapes that differ (named), inputs not 4-D, float pixels outside [0, 1].
    """
    rec, ref = _unit(reconstructions, "reconstructions"), _unit(own, "own images")
    mean = _unit(dataset_mean, "dataset_mean")
    if rec.dim() != 4 or rec.shape != ref.shape or tuple(mean.shape) != tuple(ref.shape[1:]):
        raise ValueError(
            "reconstructions and own images must both be [n, C, H, W] and dataset_mean [C, H, W]: got "
            f"{tuple(rec.shape)}, {tuple(ref.shape)} and {tuple(mean.shape)}"
        )
    floors = [("", rec), ("gray_", torch.full_like(ref, 0.5)), ("mean_image_", mean.expand_as(ref))]
    if class_means is not None:
        means = _unit(class_means, "class_means")
        if means.shape != ref.shape:
            raise ValueError(f"class_means must be {tuple(ref.shape)} like the own images, got {tuple(means.shape)}")
        floors.append(("class_mean_", means))
    out: dict[str, list[float]] = {}
    for prefix, images in floors:
        psnr = peak_signal_noise_ratio(images, ref, data_range=1.0, reduction="none", dim=(1, 2, 3))
        ssim = structural_similarity_index_measure(images, ref, data_range=1.0, reduction="none")
        out[prefix + "psnr_own"] = [float(v) for v in psnr]
        out[prefix + "ssim_own"] = [float(v) for v in ssim]
    return out


def summarize(values: Sequence[float]) -> dict[str, float]:
    """Mean and population standard deviation (ddof 0) of per-image scores, and their count.

    Returns ``{"mean", "std", "n"}`` as floats; an ``inf`` score makes the mean ``inf`` and the
    std ``nan``. Raises ValueError for no values.
    """
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        raise ValueError("summarize needs at least one score")
    return {"mean": float(a.mean()), "std": float(a.std()), "n": float(a.size)}


def _hwc(image: torch.Tensor) -> np.ndarray:
    """``[C, H, W]`` uint8 or float in [0, 1] -> ``[H, W]`` (C = 1) or ``[H, W, C]`` float in [0, 1]."""
    x = _unit(image, "figure images")
    if x.dim() != 3:
        raise ValueError(f"figure images must be [C, H, W], got {tuple(x.shape)}")
    return x[0].numpy() if x.shape[0] == 1 else x.permute(1, 2, 0).numpy()


def reconstruction_figure(pairs: Sequence[tuple], path: str | Path, title: str) -> Path:
    """A PNG of originals (top row) over their reconstructions (bottom row), one column per pair.

    Args:
        pairs: ``(original, reconstruction)`` or ``(original, reconstruction, caption)``, the images
            ``[C, H, W]`` uint8 or float in [0, 1]; the caption (e.g. the PSNR) goes under the column.
        path: the PNG to write (its folder must exist).
        title: the figure's title.

    Returns:
        ``path`` as a ``Path``. Raises ValueError for no pairs or an image not ``[C, H, W]``.
    """
    from matplotlib.figure import Figure  # no pyplot: no global figure state, no GUI backend

    if not pairs:
        raise ValueError("reconstruction_figure needs at least one pair")
    fig = Figure(figsize=(2.0 * len(pairs) + 1.0, 3.3))
    axes = fig.subplots(2, len(pairs), squeeze=False)
    for j, (original, reconstruction, *caption) in enumerate(pairs):
        for row, image in enumerate((original, reconstruction)):
            ax = axes[row, j]
            ax.imshow(_hwc(image), cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
        if caption:  # wrapped to the column's width, so that neighbouring captions do not overlap
            lines = str(caption[0]).split("\n")
            axes[1, j].set_xlabel("\n".join(textwrap.fill(line, _CAPTION_CHARS) for line in lines), fontsize=6)
    axes[0, 0].set_ylabel("original", fontsize=8)
    axes[1, 0].set_ylabel("reconstruction", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.savefig(path, dpi=150, bbox_inches="tight")
    return Path(path)
