"""Robust aggregation of one round's uploads (run config ``aggregation``), written once for every
method whose server step averages client models or heads (FML, FedKD, FedMRL, LG-FedAvg,
MH-pFedHNGD's global model); the vector-payload methods reuse :func:`bound_by_median`.

Inputs are the arrays the server sent this round (the *reference* w_sent), each valid upload's
arrays w_k (same names and shapes) and its weight n_k (``num-examples``, already bounded by the
client's handshake ``num-train``, which is bounded by the dataset). Rules (``common.config.AGGREGATIONS``):

- ``norm-bound`` (default): each upload's change δ_k = w_k − w_sent, flattened over all arrays of
  the payload, is scaled to ‖δ_k‖ <= M = median_j ‖δ_j‖ (the round's median L2 norm over the
  valid uploads: FLAME's clipping, Nguyen et al., "FLAME: Taming Backdoors in Federated
  Learning", USENIX Security 2022, §4.3), then w = w_sent + Σ n_k δ_k / Σ n_k. With honest
  majority the median is an honest norm, so no single upload moves the average by more than
  (n_k / Σ n) · M, however large it was. It bounds *magnitude only*: a direction chosen by an
  attacker within that norm (every round), label flipping, a zero or stale model (δ = −w_sent
  is bounded too, but still pulls) and sybils that hold the median itself all remain possible.
  The weight is the reply's ``num-examples``: an attacker that claimed a large ``num-train`` at
  the handshake (up to the dataset's size) keeps a large weight, so its bounded step can
  dominate the round's step, never exceed M.
- ``mean``: the papers' plain sample-weighted FedAvg (:func:`engine.aggregation.fedavg`),
  bit for bit as before this module existed.
- ``median``, ``trimmed-mean``, ``krum``, ``multi-krum``, ``bulyan``: Flower's own helpers
  (``flwr.server.strategy.aggregate``): coordinate-wise median (Yin et al. 2018); coordinate-wise
  trimmed mean cutting ``floor(trim-fraction · n)`` uploads from each end (Flower's
  ``_trim_mean``, as ``flwr.serverapp.strategy.fedtrimmedavg.trim_mean``); Krum (Blanchard et
  al. 2017) keeps the one upload with the smallest sum of squared distances to its n − f − 2
  nearest; Multi-Krum averages (sample-weighted) the n − f best by that score; Bulyan
  (El Mhamdi et al. 2018) selects n − 2f by Krum, then averages per coordinate the n − 4f
  values closest to their median. Weights are ignored except by Multi-Krum's average.

Krum and Multi-Krum need n > 2f + 2, Bulyan n > 4f + 2 (f = ``byzantine-clients``) uploads.
:func:`check_aggregation` refuses, before the run starts, a configuration whose sampled clients
per round cannot satisfy it; a round in which fewer valid uploads arrived (drops, timeouts)
falls back to ``norm-bound`` for that round, logged and counted as ``server-aggregation-fallback``.

Uploads with weight 0 carry no evidence and are left out; a round without any weight leaves the
state unchanged (None), as :func:`engine.aggregation.fedavg` does.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

import numpy as np
from flwr.server.strategy.aggregate import (
    aggregate_bulyan,
    aggregate_krum,
    aggregate_median,
    aggregate_trimmed_avg,
)

from common.config import ConfigError, RunConfig
from common.payload import ClientReply
from engine.aggregation import fedavg

log = logging.getLogger("flwr." + __name__)  # streamed with Flower's own log

#: the rules that select whole uploads by pairwise distance, and the least n - (factor * f) must exceed
SELECTING = {"krum": 2, "multi-krum": 2, "bulyan": 4}
#: round metric: uploads scaled (norm-bound) or left out as a whole (krum, multi-krum, bulyan)
BOUNDED = "server-bounded"
#: round metric: 1 when too few valid uploads arrived for the chosen rule and norm-bound ran instead
FALLBACK = "server-aggregation-fallback"


def bound_by_median(deltas: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """Scale every vector whose L2 norm exceeds the median of the norms down to that median.

    FLAME's clipping (Nguyen et al. 2022, §4.3) with the median of the round's norms as the
    bound: with an honest majority the bound is an honest norm, so one outlier (of 1e6 or of
    1e30) weighs no more than a typical upload. Vectors at or below the median are returned
    unchanged (the same objects), so an honest round changes at most the longer half.

    Args:
        deltas: arrays of any shape (each is treated as one flattened vector), float; for
            model uploads the change from what the server sent, for representation-like
            uploads the vectors themselves.

    Returns:
        (the bounded arrays, float64 for the scaled ones, each input's shape; how many were scaled).
        An empty input gives ``([], 0)``.
    """
    if not deltas:
        return [], 0
    return clip_to_norm(deltas, float(np.median(_norms(deltas))))


def clip_to_norm(vectors: Sequence[np.ndarray], bound: float) -> tuple[list[np.ndarray], int]:
    """Scale every vector whose L2 norm exceeds ``bound`` down to ``bound``, keeping its direction.

    Args:
        vectors: arrays of any shape (each treated as one flattened vector), float.
        bound: the largest L2 norm kept, >= 0 (e.g. a median of :func:`bound_by_median`, or one
            taken from other uploads of the round).

    Returns:
        (the arrays, float64 for the scaled ones, the others the same objects; how many were scaled).
    """
    out: list[np.ndarray] = []
    scaled = 0
    for d, norm in zip(vectors, _norms(vectors)):
        if norm > bound:
            out.append(np.asarray(d, np.float64) * (bound / norm))
            scaled += 1
        else:
            out.append(d)
    return out, scaled


def _norms(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """float64 [n]: the L2 norm of each array, flattened."""
    return np.array([float(np.linalg.norm(np.asarray(d, np.float64).ravel())) for d in vectors])


def require_aggregation(cfg: RunConfig, allowed: Sequence[str]) -> None:
    """Refuse before the run an ``aggregation`` that method ``cfg.method``'s server step cannot do.

    Raises:
        ConfigError: naming ``aggregation``, the method and the values ``allowed`` for it.
    """
    if cfg.aggregation not in allowed:
        raise ConfigError(
            f"run config key 'aggregation' = {cfg.aggregation!r} does not apply to method '{cfg.method}', "
            f"whose uploads are not models; allowed for it: {', '.join(repr(a) for a in allowed)}"
        )


def sampled_per_round(cfg: RunConfig) -> int | None:
    """The clients sampled per round, K = max(1, floor(fraction-train · N)) (``engine.roster``);
    None when ``num-clients`` is 0 (N is known only once the nodes connect)."""
    if cfg.num_clients <= 0:
        return None
    return max(1, math.floor(cfg.fraction_train * cfg.num_clients))


def least_uploads(rule: str, byzantine: int) -> int:
    """The fewest uploads ``rule`` is defined for with ``byzantine`` = f: 2f + 3 (Krum, Multi-Krum),
    4f + 3 (Bulyan), 1 otherwise."""
    return SELECTING[rule] * byzantine + 3 if rule in SELECTING else 1


def check_aggregation(cfg: RunConfig) -> None:
    """Refuse before the run a rule the sampled clients per round cannot satisfy.

    Raises:
        ConfigError: ``aggregation`` is krum or multi-krum and K <= 2f + 2, or bulyan and
            K <= 4f + 2, where K = :func:`sampled_per_round` and f = ``byzantine-clients``
            (nothing is checked when ``num-clients`` is 0; such a round falls back, see the module).
    """
    k = sampled_per_round(cfg)
    need = least_uploads(cfg.aggregation, cfg.byzantine_clients)
    if k is not None and k < need:
        factor = SELECTING[cfg.aggregation]
        raise ConfigError(
            f"run config key 'aggregation' = {cfg.aggregation!r} with 'byzantine-clients' = {cfg.byzantine_clients} "
            f"needs more than {factor}f + 2 = {need - 1} clients per round, but 'num-clients' = {cfg.num_clients} "
            f"and 'fraction-train' = {cfg.fraction_train} sample {k}: lower 'byzantine-clients', sample more "
            "clients, or choose 'norm-bound', 'median' or 'trimmed-mean'"
        )


class RobustAggregator:
    """The run's ``aggregation`` rule over one round's uploads (see the module docstring).

    Args:
        cfg: the run config (``aggregation``, ``byzantine-clients``, ``trim-fraction``).

    Raises:
        ConfigError: as :func:`check_aggregation`.
    """

    def __init__(self, cfg: RunConfig) -> None:
        check_aggregation(cfg)
        self.rule, self.byzantine, self.trim_fraction = cfg.aggregation, cfg.byzantine_clients, cfg.trim_fraction

    def replies(
        self, reference: Mapping[str, np.ndarray], replies: list[ClientReply]
    ) -> tuple[dict[str, np.ndarray] | None, dict[str, float]]:
        """The aggregate of the replies' arrays (names of ``reference``), weights their ``num-examples``.

        ``mean`` is :func:`engine.aggregation.fedavg` itself; the other rules go through
        :meth:`aggregate`.

        Returns:
            (name -> float32 array, or None to keep the state; round metrics, e.g. :data:`BOUNDED`).
        """
        if self.rule == "mean":
            return fedavg(replies, list(reference)), {}
        weights = [float(r.metrics.get("num-examples", 0)) for r in replies]
        return self.aggregate(reference, [r.arrays for r in replies], weights)

    def aggregate(
        self,
        reference: Mapping[str, np.ndarray],
        uploads: Sequence[Mapping[str, np.ndarray]],
        weights: Sequence[float],
    ) -> tuple[dict[str, np.ndarray] | None, dict[str, float]]:
        """The round's aggregate of ``uploads`` under this rule.

        Args:
            reference: name -> array the server sent this round (w_sent); for uploads that
                already are changes (MH-pFedHNGD's ``delta_w_g``) an all-zero reference.
            uploads: each valid upload's name -> array, at least the names of ``reference``,
                same shapes.
            weights: n_k >= 0 per upload (training examples).

        Returns:
            (name -> float32 array in ``reference``'s shapes, or None when no upload has a
            positive weight; metrics: :data:`BOUNDED` and, for a fallback, :data:`FALLBACK`).
        """
        keys = list(reference)
        kept = [(u, float(w)) for u, w in zip(uploads, weights) if w > 0]
        if not kept:
            return None, {BOUNDED: 0}
        ref = {k: np.asarray(reference[k], np.float64) for k in keys}
        flat = [[np.asarray(u[k], np.float64) for k in keys] for u, _ in kept]
        n = [w for _, w in kept]
        rule, metrics = self.rule, {}
        if len(kept) < least_uploads(rule, self.byzantine):
            log.warning(
                "aggregation %r needs at least %d uploads with byzantine-clients=%d, got %d: norm-bound this round",
                rule,
                least_uploads(rule, self.byzantine),
                self.byzantine,
                len(kept),
            )
            rule, metrics = "norm-bound", {FALLBACK: 1}
        if rule == "norm-bound":
            deltas = [np.concatenate([(a - ref[k]).ravel() for a, k in zip(arrays, keys)]) for arrays in flat]
            bounded, scaled = bound_by_median(deltas)
            step = sum(w * d for w, d in zip(n, bounded)) / sum(n)
            out, offset = {}, 0
            for k in keys:
                size = ref[k].size
                out[k] = ref[k] + step[offset : offset + size].reshape(ref[k].shape)
                offset += size
            metrics[BOUNDED] = scaled
        else:
            out = dict(zip(keys, self._flower(rule, [(arrays, w) for arrays, w in zip(flat, n)])))
            metrics[BOUNDED] = {"krum": len(kept) - 1, "multi-krum": self.byzantine, "bulyan": 2 * self.byzantine}.get(
                rule, 0
            )
        return {k: v.astype(np.float32) for k, v in out.items()}, metrics

    def _flower(self, rule: str, results: list[tuple[list[np.ndarray], float]]) -> list[np.ndarray]:
        """Flower's helper for ``rule`` over ``results`` = [(arrays, n_k)]."""
        if rule == "median":
            return aggregate_median(results)
        if rule == "trimmed-mean":
            return aggregate_trimmed_avg(results, self.trim_fraction)
        if rule == "krum":
            return aggregate_krum(results, self.byzantine, 0)
        if rule == "multi-krum":
            return aggregate_krum(results, self.byzantine, len(results) - self.byzantine)
        # bulyan: Krum as its selection rule; Flower's helper consumes the list it is given
        return aggregate_bulyan(list(results), self.byzantine, aggregate_krum, to_keep=0)
