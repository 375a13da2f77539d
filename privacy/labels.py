"""Which classes a client holds, and in what proportions, from what it shares.

The label payloads:

- class ids: FedGH's ``lar_labels`` (int32 [k]), FedProto/FedTGP's prototype labels (int64
  [k]) and FD's ``logit_labels`` (int64 [k], the rows of its per-class mean logits
  ``logits`` [k, C]) name the classes of the uploaded per-class vectors, i.e. exactly the
  classes present at the client: :func:`from_class_ids` (a set, no counts).
- FedRE's soft label y ([1, C], or several rounds' [r, C]): :func:`from_soft_label`.
- a weight update's head change (any method that uploads a head or a whole model):
  :func:`from_head_update`.

Each gives a :class:`LabelInference`, scored against the client's true label counts by
:func:`label_set_scores` and :func:`distribution_l1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class LabelInference:
    """What an attacker infers about one client's labels.

    ``classes``: int64 [k], the predicted class set, ascending. ``distribution``: float64 [C],
    the predicted class distribution (non-negative, sums to 1), or None when the payload gives
    no counts.
    """

    classes: np.ndarray
    distribution: np.ndarray | None


def _array(values, name: str) -> np.ndarray:
    """A tensor or array as a float64 numpy array; ValueError for non-finite entries (named)."""
    out = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values, dtype=np.float64)
    if not np.isfinite(out).all():
        raise ValueError(f"{name} has non-finite entries")
    return out


def _counts(true_counts) -> np.ndarray:
    """True per-class counts as float64 [C]; ValueError if 1-D non-negative with a positive sum is not what they are."""
    counts = _array(true_counts, "true_counts")
    if counts.ndim != 1 or (counts < 0).any() or counts.sum() <= 0:
        raise ValueError(f"true_counts must be non-negative [C] with a positive sum, got {counts.tolist()}")
    return counts


def label_set_scores(pred_set, true_counts) -> tuple[float, float]:
    """Precision and recall of a predicted class set against the classes with a positive count.

    Args:
        pred_set: class ids (any int sequence/array); true_counts: per-class counts [C].

    Returns:
        ``(precision, recall)`` in [0, 1]; precision of an empty prediction is 1.0 (nothing
        wrongly claimed), recall is over the true classes (at least one).

    Raises:
        ValueError: bad counts, or a predicted id outside [0, C).
    """
    counts = _counts(true_counts)
    pred = {int(c) for c in np.asarray(pred_set).reshape(-1)}
    if any(c < 0 or c >= len(counts) for c in pred):
        raise ValueError(f"predicted classes {sorted(pred)} must lie in [0, {len(counts)})")
    true = set(np.nonzero(counts)[0].tolist())
    hits = len(pred & true)
    return (hits / len(pred) if pred else 1.0), hits / len(true)


def distribution_l1(pred_dist, true_counts) -> float:
    """L1 distance in [0, 2] between a predicted distribution [C] and true_counts / their sum.

    Raises:
        ValueError: shapes differ, bad counts, or ``pred_dist`` negative or not summing to 1
            (within 1e-6).
    """
    counts = _counts(true_counts)
    pred = _array(pred_dist, "pred_dist")
    if pred.shape != counts.shape or (pred < 0).any() or abs(pred.sum() - 1) > 1e-6:
        raise ValueError(f"pred_dist must be a distribution over {len(counts)} classes, got {pred.tolist()}")
    return float(np.abs(pred - counts / counts.sum()).sum())


def from_class_ids(ids, num_classes: int) -> LabelInference:
    """The set of uploaded class ids (FedGH ``lar_labels``, FedProto/FedTGP prototype labels, FD
    ``logit_labels``): each names a class present at the client. No distribution.

    Raises:
        ValueError: an id outside [0, num_classes).
    """
    classes = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
    if len(classes) and (classes[0] < 0 or classes[-1] >= num_classes):
        raise ValueError(f"class ids {classes.tolist()} must lie in [0, {num_classes})")
    return LabelInference(classes, None)


def from_class_counts(counts) -> LabelInference:
    """Uploaded per-class training counts (FedGen ``class_counts`` int64 [C]): the classes with a positive
    count, and the counts normalised as the distribution (exact, when the client reports its own).

    Raises:
        ValueError: bad counts (negative, not finite, or all zero).
    """
    values = _counts(counts)
    return LabelInference(np.flatnonzero(values).astype(np.int64), values / values.sum())


def from_soft_label(y) -> LabelInference:
    """FedRE's soft label(s): the classes with a positive entry, and the mean soft label as distribution.

    y = Σ_i α_i e_{y_i} (docs/methods/fedre.md §3, ``methods.fedre.entangling_weights``) with
    α_i > 0 for every sample in ``rap``, ``rap-fixed``, ``vap``, ``rar`` and ``var`` (almost surely
    for the random ones), so one round's support is exactly the client's class set.
    As an estimate of the class distribution n_c / n:

    - ``var``: α_i = 1/n, y is n_c / n exactly.
    - ``rar``: α_i = u_i / Σ u, u_i ~ U(0, 1) i.i.d.; by exchangeability E[α_i] = 1/n, so
      E[y_c] = n_c / n, and y concentrates on it as n grows (unbiased, one round suffices).
    - ``rap`` (the paper): y_c = w_c = u_c / Σ u over the m present classes, independent of
      the counts: E[y_c] = 1/m. Averaged over rounds, y converges to the uniform distribution
      over the present classes, which is the class distribution only of a balanced client.
      The counts do not leak (the set does).
    - ``rsp``/``rsr``: one class per round; averaged over rounds, uniform over the present
      classes (``rsp``) or n_c / n (``rsr``), each round's support a single class.

    Args:
        y: float [C] or [r, C] (one row per round, rows non-negative summing to 1).

    Returns:
        classes with a positive entry in any row; distribution = the row mean normalised.

    Raises:
        ValueError: a negative entry, a row summing to 0, or non-finite entries.
    """
    rows = _array(y, "soft label")
    rows = rows.reshape(1, -1) if rows.ndim == 1 else rows
    if rows.ndim != 2 or (rows < 0).any() or (rows.sum(1) <= 0).any():
        raise ValueError(f"soft labels must be non-negative rows [r, C] with positive sums, got shape {rows.shape}")
    mean = (rows / rows.sum(1, keepdims=True)).mean(0)
    return LabelInference(np.nonzero((rows > 0).any(0))[0].astype(np.int64), mean / mean.sum())


def from_head_update(delta_bias=None, delta_weight=None) -> LabelInference:
    """Label leakage from the change of a softmax-cross-entropy head over local training.

    With plain SGD at rate lr, one step on a batch of B samples changes the bias by
    ``Δb = -lr (p̄ - π)`` and the weight rows by ``ΔW_c = -lr (1/B) Σ_i (p_ic - [y_i = c]) h_i``,
    where p̄ is the batch's mean predicted distribution, π its label distribution and h_i the
    head's inputs. With non-negative h (ReLU, sigmoid) a present class's row moves up and an
    absent class's row down: Wainakh et al., "User-Level Label Leakage from Gradients in
    Federated Learning", PETS 2022 (LLG, Property 1: a negative gradient row sum marks a class
    in the batch; Property 2: its magnitude grows with the class's count); the bias carries
    the same sign pattern without depending on h. Over several steps the changes add up while
    the model learns the client's prior (p̄ moves towards π and the signal fades); momentum and
    weight decay change the scale more than the sign pattern. How well this survives real
    local training is measured (``tests/test_privacy_gradients.py``), not assumed.

    Score per class: ``s = Δb`` when given, else the row sums of ``ΔW`` (LLG). Predicted set:
    the classes with s > 0. Distribution: ``max(s, 0) / Σ max(s, 0)`` (LLG Property 2, count ∝
    magnitude; it ignores p̄, so it is biased towards the classes the start model predicted
    least), None when no score is positive (e.g. a zero update).

    Args:
        delta_bias: float [C], head bias after minus before; delta_weight: float [C, d], head
            weight after minus before (used only without ``delta_bias``).

    Raises:
        ValueError: neither given, ``delta_weight`` not 2-D, or non-finite entries.
    """
    if delta_bias is not None:
        score = _array(delta_bias, "delta_bias").reshape(-1)
    elif delta_weight is not None:
        weight = _array(delta_weight, "delta_weight")
        if weight.ndim != 2:
            raise ValueError(f"delta_weight must be [C, d], got shape {weight.shape}")
        score = weight.sum(1)
    else:
        raise ValueError("from_head_update needs delta_bias or delta_weight")
    positive = np.maximum(score, 0.0)
    distribution = positive / positive.sum() if positive.sum() > 0 else None
    return LabelInference(np.nonzero(score > 0)[0].astype(np.int64), distribution)
