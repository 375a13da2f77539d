"""Server-side averaging shared by the methods: sample-weighted means (FedAvg) and per-class means."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from common.payload import ClientReply


def sample_weighted_mean(values: Sequence[Any], weights: Sequence[float]) -> Any:
    """sum_k n_k * v_k / sum_k n_k, summed in the order given; the unweighted mean when every n_k is 0.

    ``values``: floats or equally shaped arrays (sum them in float64 for an exact FedAvg);
    ``weights``: the n_k, e.g. training-sample counts.
    """
    total = sum(weights)
    if total <= 0:
        return sum(values) / len(values)
    return sum(n * v for v, n in zip(values, weights)) / total


def fedavg(replies: list[ClientReply], keys: list[str]) -> dict[str, np.ndarray] | None:
    """FedAvg: the sample-weighted mean of the replies' arrays, weights their ``num-examples``
    (training samples), accumulated in float64 (McMahan et al. 2017; FedMRL Eq. 8).

    A reply that trained on no example has weight 0: it carries no evidence, so a round in which
    no reply trained on any example changes nothing (None), as a round without replies.

    Returns:
        name -> float32 array, for every name in ``keys``; None when the weights sum to 0 (the
        caller keeps its state).
    """
    weights = [float(r.metrics.get("num-examples", 0)) for r in replies]
    if sum(weights) <= 0:
        return None
    return {
        k: sample_weighted_mean([r.arrays[k].astype(np.float64) for r in replies], weights).astype(np.float32)
        for k in keys
    }


def class_average(
    replies: list[ClientReply],
    values: str,
    labels: str,
    num_classes: int,
    width: int,
    center: Callable[[np.ndarray], np.ndarray] | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per-class unweighted mean over the clients that uploaded a row for the class.

    FedProto's server step (prototypes, FedProto Eq. 4 without the count weights), FD's (per-class logits).

    Args:
        center: instead of the mean, a per-class statistic of the class's rows, float64 [m_c, width]
            -> [width] (a coordinate-wise median or trimmed mean, run config ``aggregation``).

    Returns:
        ``({values: float32 [a, width], "mask": bool [C]} or {} when nothing was uploaded,
        {"server-num-rows": uploaded rows, "server-num-classes": a})``.
    """
    sums = np.zeros((num_classes, width), np.float64)
    counts = np.zeros(num_classes, np.int64)
    for r in replies:
        np.add.at(sums, r.arrays[labels], r.arrays[values])
        np.add.at(counts, r.arrays[labels], 1)
    mask = counts > 0
    rows = sums[mask] / counts[mask, None]
    if center is not None and mask.any():
        uploaded = np.concatenate([r.arrays[values] for r in replies]).astype(np.float64)
        every = np.concatenate([r.arrays[labels] for r in replies])
        rows = np.stack([center(uploaded[every == c]) for c in np.flatnonzero(mask)])
    out = {values: rows.astype(np.float32), "mask": mask} if mask.any() else {}
    return out, {"server-num-rows": int(counts.sum()), "server-num-classes": int(mask.sum())}
