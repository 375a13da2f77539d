"""Class prototypes: per-class mean representations, the payload of FedProto and FedTGP (and, as
per-class mean logits, of FD).

- :func:`class_set_schemas`: the payload of a per-class set of rows, both ways;
- :class:`RegularizerOptions` and :class:`PrototypeRegularizer`: the client's prototype term
  (FedTGP Eq. 11 and its official-code form, which FedProto's client uses too);
- :class:`ClassMeanCollector`: exact class means of the representations seen in training;
- :func:`nearest_prototype_correct`: inference by the nearest global prototype;
- :func:`trusted_rows`: the received global rows a client trains towards (an extreme one left out);
- :func:`unpack_global_set`: a received per-class set as full [C, w] rows and a mask;
- :func:`bound_class_rows` and :func:`aggregate_class_sets`: run config ``aggregation`` for the
  per-class uploads (FedProto, FedTGP, FD, FedGH's LARs; FedRE's ``z`` uses :data:`MEDIAN_VOTES`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean

from common.config import RunConfig
from common.data import batches, normalize
from common.dp import dp_options
from common.errors import ConfigError
from common.options import option
from common.payload import (
    RECEIVED_PROTOTYPE_FACTOR,
    ROW_NORM_FACTOR,
    ArraySpec,
    ClientReply,
    PayloadError,
    PayloadSchema,
)
from engine.aggregation import class_average
from engine.robust import BOUNDED, clip_to_norm

#: the fewest norms whose median one upload cannot move outside the range of the others; with
#: fewer uploads (one of two may be the attacker) ``norm-bound`` leaves the rows as they are
MEDIAN_VOTES = 3
#: ``aggregation`` values of a server step that trains on the uploaded rows (FedRE, FedGH, FedTGP)
ROW_AGGREGATIONS = ("norm-bound", "mean")
#: ``aggregation`` values of a per-class average (FedProto, FD): also per-class coordinate-wise
#: median and trimmed mean; Krum and Bulyan select whole uploads, which hold different classes
CLASS_AGGREGATIONS = ("norm-bound", "mean", "median", "trimmed-mean")


def class_set_schemas(values: str, labels: str, width: str) -> tuple[PayloadSchema, PayloadSchema]:
    """Schemas of a per-class payload (FedProto's prototypes, FD's logits).

    Up: ``values`` [k, width] float32, one row per class the client holds, and ``labels``
    [k] int64 (unique class ids). Down: ``values`` [a, width] float32, the rows of the
    classes marked in ``mask`` [C] bool (``a`` = number of marked classes); optional, since
    nothing exists before the first upload.
    """

    def mask_matches_rows(arrays, dims) -> None:
        if int(arrays["mask"].sum()) != arrays[values].shape[0]:
            raise PayloadError(
                f"mask marks {int(arrays['mask'].sum())} classes but {arrays[values].shape[0]} "
                f"'{values}' rows were sent"
            )

    upload = PayloadSchema(
        {
            values: ArraySpec(("k", width), "float32", row_norm_factor=ROW_NORM_FACTOR),
            labels: ArraySpec(("k",), "int64", labels=True),
        }
    )
    global_set = PayloadSchema(
        {values: ArraySpec(("a", width), "float32"), "mask": ArraySpec(("C",), "bool")},
        optional=True,
        check=mask_matches_rows,
    )
    return upload, global_set


REG_FORMS = ("mse-mean", "paper-l2")


@dataclass(frozen=True)
class RegularizerOptions:
    """The client's prototype term, keys ``lambda`` and ``reg-form`` of FedProto's and FedTGP's tables.

    ``mse-mean`` (official code, default): lambda * (1/(B*K)) * sum_b ||f(x_b) - P^{y_b}||^2.
    ``paper-l2`` (FedTGP Eq. 11): lambda * mean over the batch's classes c of
    ||mean_{b: y_b = c} f(x_b) - P^c||_2. Rows whose class has no global prototype add 0.
    """

    lambda_: float = option(10.0, "weight of the prototype term (official code; the paper's: 0.1 with paper-l2)", low=0)
    reg_form: str = option(
        "mse-mean", "mse-mean: official code's squared error; paper-l2: FedTGP Eq. 11", choices=REG_FORMS
    )

    def require_per_example(self, cfg: RunConfig) -> None:
        """Raises ConfigError: ``reg-form`` = ``paper-l2`` with DP on. Its term is a distance between
        batch class means, so one example moves the other examples' gradients and DP-SGD's per-example
        clipping would not bound its influence."""
        if self.reg_form == "paper-l2" and dp_options(cfg).enabled:
            raise ConfigError(
                f"run config key '{cfg.method}.reg-form' = 'paper-l2' with 'dp.epsilon' > 0: its term couples the "
                "examples of a batch, which DP-SGD cannot bound per example; use 'mse-mean'"
            )


def trusted_rows(
    rows: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor, longest: float | torch.Tensor
) -> torch.Tensor:
    """Per example of a batch, whether the client trains it towards the received global row of its
    class: the row was sent (``mask``), is finite and is at most ``longest`` long.

    A global row comes from the server, which colluding clients can outvote for a class that fewer
    honest clients hold (docs/deployment.md); trained towards, a row of 1e5 in every entry made an
    honest client's loss 2.5e10, its reply was refused and the run ended. Leaving the row out drops
    that example's term (as for a class without a global row), never the client. ``longest`` is one
    bound for the batch or one per example (never the batch's rows together: DP-SGD bounds each
    example's gradient alone, so one example must not decide another's term).

    Args:
        rows: float [C, w] received rows (a prototype or a class's logits per class).
        mask: bool [C], the rows that were sent.
        labels: int64 [B], each example's class.
        longest: the longest row trusted, a float or float [B] (e.g. RECEIVED_ROW_FACTOR times
            each example's own logits' norm).

    Returns:
        bool [B].
    """
    with torch.no_grad():
        norms = rows.norm(dim=1)[labels]
        return mask[labels] & torch.isfinite(norms) & (norms <= longest)


#: (run config, partition) -> :func:`initial_representation_scale` in this process
_INITIAL_SCALES: dict[tuple, float] = {}
#: synthetic images of the batch that :func:`initial_representation_scale` measures
SCALE_BATCH = 8


def initial_representation_scale(client) -> float:
    """The longest representation (L2 norm) that the client's extractor *as initialised* gives a fixed
    batch of :data:`SCALE_BATCH` synthetic images (uniform pixels from a generator of seed 0), the
    anchor of the client's guard on received prototypes (``common.payload.RECEIVED_PROTOTYPE_FACTOR``
    times it). It reads no client data and training cannot move it: a prototype walked a bounded step
    a round, which the honest client's representations follow, is still caught once it is far from
    where any honest representation starts. Cached per process and partition (one model build).
    """
    cfg, info = client.cfg, client.info
    key = (cfg.model_group, cfg.seed, cfg.init, cfg.feature_dim, cfg.dataset, client.partition_id)
    if key not in _INITIAL_SCALES:
        generator = torch.Generator().manual_seed(0)
        shape = (SCALE_BATCH, info.channels, info.image_size, info.image_size)
        images = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            extractor = client.initial_model().extractor.eval()
            _INITIAL_SCALES[key] = float(extractor(normalize(images, info)).norm(dim=1).max())
    return _INITIAL_SCALES[key]


class PrototypeRegularizer:
    """The prototype term added to the client's CE loss; P is a constant (no gradient).

    An example whose received row is longer than ``longest`` (:func:`trusted_rows`; the client's
    :func:`guarded_regularizer` sets it) adds 0, as one of a class without a global prototype does.

    Args:
        protos: float32 [C, K] global prototypes (rows of masked-out classes are ignored), or None.
        mask: bool [C], True where class c has a global prototype.
        options: lambda and form.
        longest: the longest received prototype trained towards.
    """

    def __init__(
        self,
        protos: torch.Tensor | None,
        mask: torch.Tensor | None,
        options: RegularizerOptions,
        longest: float = float("inf"),
    ) -> None:
        self.protos, self.mask, self.longest = protos, mask, longest
        self.lam, self.form = options.lambda_, options.reg_form

    def __call__(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The term for representations ``[B, K]`` and labels ``[B]`` (0 without prototypes)."""
        if self.protos is None or self.lam == 0:
            return features.new_zeros(())
        known = trusted_rows(self.protos, self.mask, labels, self.longest)
        if self.form == "mse-mean":
            diff = torch.where(known[:, None], features - self.protos[labels], 0.0)
            return self.lam * diff.pow(2).sum() / features.numel()
        distances = []
        for c in torch.unique(labels[known]):
            mean = features[labels == c].mean(0)
            distances.append((mean - self.protos[c]).pow(2).sum().clamp_min(1e-12).sqrt())
        if not distances:
            return features.new_zeros(())
        return self.lam * torch.stack(distances).mean()


def guarded_regularizer(
    client, protos: torch.Tensor | None, mask: torch.Tensor | None, options: RegularizerOptions
) -> PrototypeRegularizer:
    """The client's prototype term, guarded: a received prototype over
    ``common.payload.RECEIVED_PROTOTYPE_FACTOR`` times :func:`initial_representation_scale` is not
    trained towards (FedProto's and FedTGP's clients)."""
    longest = RECEIVED_PROTOTYPE_FACTOR * initial_representation_scale(client) if protos is not None else float("inf")
    return PrototypeRegularizer(protos, mask, options, longest)


class ClassMeanCollector:
    """Accumulates per-class sums of representations (float64) and returns exact class means."""

    def __init__(self, num_classes: int) -> None:
        self.num_classes = num_classes
        self.sums: torch.Tensor | None = None
        self.counts = torch.zeros(num_classes, dtype=torch.float64)

    def add(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``features`` [B, K] (detached here), ``labels`` [B] int64."""
        f = features.detach().double().cpu()
        if self.sums is None:
            self.sums = torch.zeros(self.num_classes, f.shape[1], dtype=torch.float64)
        self.sums.index_add_(0, labels.cpu(), f)
        self.counts += torch.bincount(labels.cpu(), minlength=self.num_classes).double()

    def means(self, dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``(protos float32 [C_i, dim], labels int64 [C_i])`` for the classes seen; [0, dim] if none."""
        labels = torch.nonzero(self.counts).flatten()
        if self.sums is None or len(labels) == 0:
            return np.zeros((0, dim), np.float32), np.zeros(0, np.int64)
        return (self.sums[labels] / self.counts[labels, None]).float().numpy(), labels.numpy().astype(np.int64)


@torch.no_grad()
def nearest_prototype_correct(client, protos: torch.Tensor | None, mask: torch.Tensor | None) -> tuple[int, int]:
    """Top-1 correct count of the nearest-prototype rule on the local test split.

    ŷ = argmin over classes with a prototype of ||f(x) - P^c||^2 (FedProto/FedTGP inference);
    the head is not used. Without prototypes nothing counts as correct.

    Returns:
        ``(correct, n_test)``.
    """
    data = client.data
    if protos is None or not bool(mask.any()):
        return 0, len(data.test_y)
    extractor = client.model.extractor.eval()
    protos, mask = protos.to(client.device), mask.to(client.device)
    correct = 0
    for idx in batches(len(data.test_y), 512, None):
        feats = extractor(normalize(data.test_x[idx].to(client.device), data.info))
        dist = torch.cdist(feats, protos).masked_fill(~mask[None], float("inf"))
        correct += int((dist.argmin(1).cpu() == data.test_y[idx]).sum())
    return correct, len(data.test_y)


def unpack_global_set(
    payload: dict[str, np.ndarray], num_classes: int, values: str = "protos"
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A global class set (``values`` [C_avail, w], ``mask`` [C]) -> full [C, w] float32 (zeros where
    masked) and mask [C] bool; Nones if absent."""
    if not payload:
        return None, None
    mask = torch.from_numpy(payload["mask"].copy())
    full = torch.zeros(num_classes, payload[values].shape[1])
    full[mask] = torch.from_numpy(payload[values])
    return full, mask


def lower_median(values) -> float:
    """The lower median of ``values`` (float, at least one): the ⌈m/2⌉-th smallest of m. A bound on
    lengths is attacked from above, and the lower median stays an honest length while the longer
    values are at most half of them (with m even, np.median's mean of the middle two is not)."""
    ordered = np.sort(np.asarray(values, np.float64))
    return float(ordered[(len(ordered) - 1) // 2])


def bound_class_rows(
    replies: list[ClientReply],
    values: str,
    labels: str,
    reference: np.ndarray | None = None,
    per_class: bool = True,
    voted_only: bool = False,
) -> tuple[list[ClientReply], int]:
    """Bound each uploaded per-class row's change from what the server sent for its class
    (``reference``; zero without one): ``aggregation = "norm-bound"`` (``per_class``), and the same
    less the class median before a per-class median or trimmed mean (not ``per_class``).

    FLAME's clipping (Nguyen et al. 2022, §4.3) per class, on the change from the server's row as
    :mod:`engine.robust` bounds a model's change from the model sent. Two bounds, each an
    honest length while the attackers are fewer than the voters it is a median of:

    - the *upload vote* V: each upload votes once with the median ‖δ‖ of its rows, V = the lower
      median of the votes (:func:`lower_median`). Honest while the attackers are at most half of the
      round's uploads, whatever classes they claim.
    - the *class median* M_c: the lower median ‖δ‖ of the rows of class c, when at least
      :data:`MEDIAN_VOTES` uploads hold c. Honest while the attackers are at most as many as the
      class's honest holders.

    A row of a class fewer than :data:`MEDIAN_VOTES` uploads hold (under a pathological split most
    classes) is scaled to at most V: a median of two rows is their mean, so nothing else protects
    such a class. A row of a class more uploads hold is scaled to at most min(M_c, ROW_NORM_FACTOR · V)
    under ``per_class``, otherwise to ROW_NORM_FACTOR · V (:data:`common.payload.ROW_NORM_FACTOR`, the
    spread of honest rows' lengths, so an honest row is left as it is) before the class's median.
    The cap by V is what holds when colluders claim every class: two attackers of five outvote a
    class's one honest holder in M_c (its median is theirs; before the cap, rows of 1e5 went through
    whole) but not the five uploads' V.
    Directions are kept: a row within the bound pointing anywhere is not caught. Fewer than
    :data:`MEDIAN_VOTES` uploads with rows: nothing is bounded.

    Args:
        replies: the round's valid replies, each with ``values`` float [k_i, w] and ``labels``
            int [k_i] (unique class ids).
        reference: float [C, w], the row the server sent this round for each class (zeros where
            it sent none), or None: every reference zero, a bound on the rows' norms.
        per_class: bound by the class median as well (``norm-bound``); False: only the cap for the
            classes at least :data:`MEDIAN_VOTES` uploads hold (before a per-class median).
        voted_only: leave the rows of a class fewer than :data:`MEDIAN_VOTES` uploads hold as they
            are (FedTGP, whose step bounds such a row's pull itself: bounded to V, an attacker's row
            sits among the honest ones; ``results/byzantine/colluding-120x5/``).

    Returns:
        (the replies, those with a bounded row as copies whose ``values`` keep their dtype and whose
        other rows are unchanged; how many rows were scaled down).
    """
    rows = [r.arrays[values].astype(np.float64) for r in replies]
    if sum(len(x) > 0 for x in rows) < MEDIAN_VOTES:
        return replies, 0
    refs = [np.zeros_like(x) if reference is None else reference[r.arrays[labels]] for x, r in zip(rows, replies)]
    deltas = [x - ref for x, ref in zip(rows, refs)]
    vote = lower_median([np.median(np.linalg.norm(d, axis=1)) for d in deltas if len(d)])
    cap = ROW_NORM_FACTOR * vote
    places = [(i, j, int(c)) for i, r in enumerate(replies) for j, c in enumerate(r.arrays[labels])]
    scaled = 0
    for c in sorted({c for _, _, c in places}):
        where = [(i, j) for i, j, k in places if k == c]
        group = [deltas[i][j] for i, j in where]
        if len(group) < MEDIAN_VOTES:
            if voted_only:
                continue
            bound = vote
        elif per_class:
            bound = min(lower_median(np.linalg.norm(group, axis=1)), cap)
        else:
            bound = cap
        bounded, n = clip_to_norm(group, bound)
        for (i, j), delta, before in zip(where, bounded, group):
            if delta is not before:
                rows[i][j] = refs[i][j] + delta
        scaled += n
    if not scaled:
        return replies, 0
    return [
        replace(r, arrays={**r.arrays, values: x.astype(r.arrays[values].dtype)}) for r, x in zip(replies, rows)
    ], scaled


def aggregate_class_sets(
    replies: list[ClientReply],
    values: str,
    labels: str,
    num_classes: int,
    width: int,
    cfg: RunConfig,
    sent: dict[str, np.ndarray],
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """A per-class average of the round's rows under run config ``aggregation`` (FedProto, FD).

    ``mean``: :func:`engine.aggregation.class_average` as the papers; ``norm-bound``: the same
    over :func:`bound_class_rows` with the global set ``sent`` this round (``values``, ``mask``;
    empty in round 1) as the reference (the round metric ``server-bounded`` counts the scaled rows);
    ``median`` / ``trimmed-mean``: per class the coordinate-wise median / Flower's ``trim_mean``
    (cutting ``floor(trim-fraction * m_c)`` of the class's m_c rows from each end) instead of the
    mean, over rows first bounded by the uploads' vote (:func:`bound_class_rows` without
    ``per_class``). A class's median is an honest holder's value per coordinate while the attackers
    are fewer than its honest holders; with 2 rows of a class a median is their mean, so only
    classes that at least 3 uploads hold are protected that way, the others by the vote.

    Returns:
        as :func:`engine.aggregation.class_average`, plus ``server-bounded`` unless ``mean``.
    """
    bounded = {}
    if cfg.aggregation != "mean":
        full, _ = unpack_global_set(sent, num_classes, values)  # zero rows where nothing was sent
        reference = None if full is None else full.numpy().astype(np.float64)
        replies, bounded[BOUNDED] = bound_class_rows(
            replies, values, labels, reference, per_class=cfg.aggregation == "norm-bound"
        )
    centers = {
        "median": lambda rows: np.median(rows, axis=0),
        "trimmed-mean": lambda rows: trim_mean(rows, cfg.trim_fraction),
    }
    out, metrics = class_average(replies, values, labels, num_classes, width, centers.get(cfg.aggregation))
    return out, {**metrics, **bounded}
