"""Membership inference and label-count leakage for the privacy evaluation (``tools.privacy``).

Membership inference asks of one candidate example: was it in the victim's training data? Each test
gives every candidate a score (higher: more likely a member) and is read by the ROC curve over the
victim's training examples (members) and held-out examples of the same classes (non-members):
:func:`roc_summary` (AUC and TPR at 1 % FPR, the operating point Carlini et al. 2022 argue for).

- per-class vector payloads (FedGH's LARs, FedProto/FedTGP prototypes, FD's per-class logits, FedRE's
  entangled z): a payload row is the mean of its class's member vectors, so a member's own vector lies
  nearer to it than a non-member's. :func:`likelihood_ratio_scores`: the Gaussian log-likelihood ratio
  of a candidate's vector under "drawn around the payload row" against "drawn around the class's
  non-member mean" (estimated from public reference images), the offline, per-class analogue of LiRA's
  calibrated test (Carlini et al., "Membership Inference Attacks From First Principles", S&P 2022);
  :func:`distance_scores`: the plain distance to the row, the uncalibrated test beside it.
- shared models (LG-FedAvg's head, FML/FedKD/FedMRL's shared model, MH-pFedHN's generated weights plus
  their change): :func:`loss_scores`, the loss-threshold attack of Yeom et al., "Privacy Risk in Machine
  Learning: Analyzing the Connection to Overfitting", CSF 2018 (a member's loss is lower).

Label-count leakage (:func:`count_leakage`): how many of the victim's per-class example counts a
revealed class distribution gives away, exactly or within ±10 %, once multiplied by the victim's
example count n (which the handshake discloses, ``num-train``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from common.data import normalize

#: the false-positive rate at which the true-positive rate is reported (a fraction)
LOW_FPR = 0.01
#: a revealed count within this relative error of the true one counts as "within 10 %"
COUNT_TOLERANCE = 0.10


def roc_summary(members, nonmembers) -> dict[str, float]:
    """AUC and TPR at 1 % FPR of a membership score (higher: more likely a member).

    Computed with numpy (scikit-learn is no dependency of the default install). AUC is the
    Mann-Whitney statistic: the probability that a random member outscores a random non-member, ties
    counted one half (equal to ``sklearn.metrics.roc_auc_score``). TPR at 1 % FPR: the largest share of
    members scored at or above a threshold that at most 1 % of the non-members reach (the ROC curve's
    highest point with FPR <= 0.01, as ``sklearn.metrics.roc_curve`` gives it without interpolation).
    With m non-members the FPR moves in steps of 1/m and ⌊0.01 m⌋ false positives are allowed (none
    below 100), so a score that knows nothing (continuous, members and non-members drawn alike) gets
    (⌊0.01 m⌋ + 1) / (m + 1) on average: 0.02 with 100 non-members, 0.011 with 1,000.

    Args:
        members, nonmembers: float scores, 1-D (any array-like), each non-empty and finite.

    Returns:
        ``{"auc": ..., "tpr_at_1pct_fpr": ...}``, fractions in [0, 1]; 0.5 and the chance level above for
        a score that knows nothing.

    Raises:
        ValueError: an empty or non-finite side.
    """
    pos = np.asarray(members, dtype=np.float64).reshape(-1)
    neg = np.asarray(nonmembers, dtype=np.float64).reshape(-1)
    if len(pos) == 0 or len(neg) == 0:
        raise ValueError(f"need members and non-members, got {len(pos)} and {len(neg)}")
    if not (np.isfinite(pos).all() and np.isfinite(neg).all()):
        raise ValueError("membership scores must be finite")
    # ranks with ties averaged: the Mann-Whitney U of the members, normalised
    both = np.concatenate([pos, neg])
    order = np.argsort(both, kind="mergesort")
    ranks = np.empty(len(both))
    sorted_scores = both[order]
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], len(both)]
    for s, e in zip(starts, ends, strict=True):
        ranks[order[s:e]] = (s + e + 1) / 2  # the mean of the 1-based ranks s+1 .. e
    auc = (ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))
    # thresholds at every distinct score: FPR and TPR of "score >= t" (the share at or above t)
    # (counted in examples: 1 - 990/1000 is above 0.01 in floating point)
    thresholds = np.unique(both)
    false_positives = len(neg) - np.searchsorted(np.sort(neg), thresholds, side="left")
    tpr = 1 - np.searchsorted(np.sort(pos), thresholds, side="left") / len(pos)
    allowed = false_positives <= np.floor(LOW_FPR * len(neg) + 1e-9)
    return {"auc": float(auc), "tpr_at_1pct_fpr": float(tpr[allowed].max()) if allowed.any() else 0.0}


def likelihood_ratio_scores(vectors: torch.Tensor, payload: torch.Tensor, reference: torch.Tensor) -> np.ndarray:
    """Per candidate, ``||f - reference||² - ||f - payload||²``: twice σ² times the log-likelihood ratio of
    its vector f under N(payload, σ²I) (a member: the row averages it) against N(reference, σ²I) (a
    non-member of the class: ``reference`` is the class's mean vector over public non-member images).

    Up to a constant it is the projection of f onto the direction from the reference mean to the row,
    so a typical non-member (near the class's centre, hence near the row too) is not taken for a member,
    nor an atypical member for a non-member, as the plain distance (:func:`distance_scores`) takes them.

    Args:
        vectors: float ``[n, w]``, the candidates' vectors under the model that made the payload.
        payload: float ``[w]``, the uploaded row of their class.
        reference: float ``[w]``, the same class's mean vector over reference images.

    Returns:
        float64 ``[n]`` (units of the vectors squared; higher: more likely a member).
    """
    f = vectors.double()
    return ((f - reference.double()).pow(2).sum(1) - (f - payload.double()).pow(2).sum(1)).numpy()


def distance_scores(vectors: torch.Tensor, payload: torch.Tensor) -> np.ndarray:
    """Per candidate, minus the L2 distance of its vector ``[n, w]`` to the payload row ``[w]``: float64
    ``[n]`` (higher: nearer, more likely a member)."""
    return -(vectors.double() - payload.double()).norm(dim=1).numpy()


def loss_scores(
    model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, info, batch_size: int = 256
) -> np.ndarray:
    """Per example, minus the cross-entropy of ``model`` (eval mode) on it: Yeom et al. 2018's
    loss-threshold score (a model fits its training examples better). ``images``: uint8 ``[n, C, H, W]``,
    normalised as in training (``info``: ``common.datasets.DatasetInfo``); ``labels``: int64 ``[n]``.
    Returns float64 ``[n]`` (nats, negated; higher: more likely a member)."""
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(images), batch_size):
            logits = model(normalize(images[i : i + batch_size], info))
            out.append(-F.cross_entropy(logits, labels[i : i + batch_size], reduction="none").double())
    return torch.cat(out).numpy()


def count_leakage(distribution: np.ndarray | None, n: int, true_counts: np.ndarray) -> dict[str, float]:
    """How many of a victim's per-class counts a revealed class distribution gives away.

    The attacker's estimate of class c's count is ``n · distribution[c]`` (n: the victim's number of
    training examples, disclosed by the handshake). A payload that reveals no distribution (class ids
    only) reveals no count.

    Args:
        distribution: float ``[C]`` summing to 1 (``privacy.labels.LabelInference.distribution``) or None.
        n: the victim's training examples; true_counts: int ``[C]``, its per-class counts.

    Returns:
        ``counts_exact``: the share (fraction in [0, 1]) of the victim's held classes whose estimate
        rounds to the true count; ``counts_within_10pct``: the share within ±10 % of it;
        ``set_only_within_10pct``: the same share for n split evenly over the held classes, what knowing
        the class set alone scores (on a balanced client every count, so a count leak shows only as
        ``counts_within_10pct`` above it); ``classes_held``: their number.
    """
    counts = np.asarray(true_counts, dtype=np.float64)
    held = counts > 0

    def within(estimate: np.ndarray) -> float:
        return float((np.abs(estimate[held] - counts[held]) <= COUNT_TOLERANCE * counts[held]).mean())

    found = {"set_only_within_10pct": within(np.where(held, n / held.sum(), 0.0)), "classes_held": float(held.sum())}
    if distribution is None:
        return found | {"counts_exact": 0.0, "counts_within_10pct": 0.0}
    estimate = n * np.asarray(distribution, dtype=np.float64)
    return found | {
        "counts_exact": float((np.rint(estimate[held]) == counts[held]).mean()),
        "counts_within_10pct": within(estimate),
    }
