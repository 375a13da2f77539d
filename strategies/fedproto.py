"""FedProto: clients share class prototypes, the server averages them per class.

Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022;
specified as the baseline in the appendix of shared/specs/fedtgp.md (HtFLlib clientproto /
serverproto, aggregation as yuetan031/FedProto).

Payload:
- up (train): ``protos`` [C_i, K] float32, the mean train-mode representation of each class,
  collected during local training; ``proto_labels`` [C_i] int64. 4*C_i*K + 8*C_i bytes.
- down (train, evaluate): ``protos`` [C_avail, K] float32, the global prototypes of the classes
  uploaded this round, and ``mask`` [C] bool marking those classes: 4*K*C_avail + C bytes.
  Absent in round 1 (nothing uploaded yet).

Client step: CE + lambda * prototype regulariser (FedTGP's client objective, so that the
comparison isolates the server), inference by the nearest available global prototype.
Server step: unweighted per-class mean of the uploads (no per-class counts are sent); classes
nobody uploaded this round get no prototype and are never predicted.

This module also holds the client-side prototype machinery FedTGP reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from client_app.data import batches, normalize
from client_app.training import train_personal_model
from common.config import RunConfig, choice, number
from strategies.base import BASE_SCHEMAS, NO_PAYLOAD, ClientProcedure, ClientReply, HeteroStrategy
from strategies.payload import ROW_NORM_FACTOR, ArraySpec, PayloadError, PayloadSchema


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


UPLOAD, GLOBAL_SET = class_set_schemas("protos", "proto_labels", "d")
SCHEMAS = {**BASE_SCHEMAS, "train": (GLOBAL_SET, UPLOAD), "evaluate": (GLOBAL_SET, NO_PAYLOAD)}

REG_FORMS = ("mse-mean", "paper-l2")


@dataclass(frozen=True)
class RegularizerOptions:
    """Client prototype term (spec fedtgp.md section 11 item 1).

    ``mse-mean`` (official code, default): lambda * (1/(B*K)) * sum_b ||f(x_b) - P^{y_b}||^2.
    ``paper-l2`` (paper Eq. 11): lambda * mean over the batch's classes c of
    ||mean_{b: y_b = c} f(x_b) - P^c||_2. Rows whose class has no global prototype add 0.
    """

    lam: float
    form: str

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RegularizerOptions:
        """``<method>.lambda`` (default 10) and ``<method>.reg-form``.

        Raises:
            ConfigError: naming the key and its allowed values.
        """
        o = {"lambda": 10.0, "reg-form": "mse-mean", **cfg.method_options()}
        return cls(
            lam=number(f"{cfg.method}.lambda", o["lambda"], low=0),
            form=choice(f"{cfg.method}.reg-form", o["reg-form"], REG_FORMS),
        )


class PrototypeRegularizer:
    """The prototype term added to the client's CE loss; P is a constant (no gradient).

    Args:
        protos: float32 [C, K] global prototypes (rows of masked-out classes are ignored), or None.
        mask: bool [C], True where class c has a global prototype.
        options: lambda and form.
    """

    def __init__(self, protos: torch.Tensor | None, mask: torch.Tensor | None, options: RegularizerOptions) -> None:
        self.protos, self.mask, self.options = protos, mask, options

    def __call__(self, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The term for representations ``[B, K]`` and labels ``[B]`` (0 without prototypes)."""
        if self.protos is None or self.options.lam == 0:
            return features.new_zeros(())
        known = self.mask[labels]
        if self.options.form == "mse-mean":
            diff = (features - self.protos[labels]) * known[:, None]
            return self.options.lam * diff.pow(2).sum() / features.numel()
        distances = []
        for c in torch.unique(labels[known]):
            mean = features[labels == c].mean(0)
            distances.append((mean - self.protos[c]).pow(2).sum().clamp_min(1e-12).sqrt())
        if not distances:
            return features.new_zeros(())
        return self.options.lam * torch.stack(distances).mean()


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

    ŷ = argmin over classes with a prototype of ||f(x) - P^c||^2 (spec fedtgp.md section 6);
    the head is not used. Without prototypes nothing counts as correct (section 5).

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


def prototype_metrics(correct: int, n: int) -> dict[str, float]:
    """Evaluate-reply metrics for ``correct`` of ``n`` test samples."""
    return {"test-correct": correct, "num-examples": n, "test-acc": correct / max(n, 1)}


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


def class_average(
    replies: list[ClientReply], values: str, labels: str, num_classes: int, width: int
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per-class unweighted mean over the clients that uploaded a row for the class.

    FedProto's server step (prototypes), FD's (per-class logits).

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
    out = {values: (sums[mask] / counts[mask, None]).astype(np.float32), "mask": mask} if mask.any() else {}
    return out, {"server-num-rows": int(counts.sum()), "server-num-classes": int(mask.sum())}


class FedProtoStrategy(HeteroStrategy):
    """FedProto server: per-class unweighted mean of this round's uploads (no learned state)."""

    schemas = SCHEMAS
    checkpointed = ("global_set",)

    def __init__(self, cfg: RunConfig, results=None) -> None:
        super().__init__(cfg, results)
        RegularizerOptions.from_config(cfg)  # fail fast on bad client options
        self.global_set: dict[str, np.ndarray] = {}

    def global_arrays(self) -> dict[str, np.ndarray]:
        """``protos`` [C_avail, K] and ``mask`` [C] of the last round (empty before round 1's update)."""
        return dict(self.global_set)

    def eval_payload(self, node_id: int, server_round: int) -> dict[str, np.ndarray]:
        """Evaluation uses the global prototypes (nearest-prototype inference)."""
        return self.global_arrays()

    def server_update(self, server_round: int, replies: list[ClientReply]) -> dict[str, float]:
        """P̄^c = unweighted mean of the uploaded P_i^c for every class uploaded this round (:func:`class_average`).

        A round without a single valid reply keeps the previous global set: no upload is no
        evidence, and clients would otherwise train without the regulariser next round.
        """
        global_set, metrics = class_average(replies, "protos", "proto_labels", self.dims["C"], self.dims["d"])
        if replies:
            self.global_set = global_set
        return metrics


class FedProtoClient(ClientProcedure):
    """FedProto client: prototype-regularised training, prototypes collected during training."""

    schemas = SCHEMAS

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.options = RegularizerOptions.from_config(cfg)

    def train(self, client, payload, config):
        """Returns ``protos`` float32 [C_i, K] (train-mode means during training), ``proto_labels`` int64."""
        data = client.data
        protos, mask = unpack_global_set(payload, data.info.num_classes)
        device_protos = (protos.to(client.device), mask.to(client.device)) if protos is not None else (None, None)
        regularizer = PrototypeRegularizer(*device_protos, self.options)
        collector = ClassMeanCollector(data.info.num_classes)

        def regularize_and_collect(features, labels):
            collector.add(features, labels)  # train-mode, before this batch's update (appendix step 3)
            return regularizer(features, labels)

        stats = train_personal_model(client, config, regularize_and_collect)
        means, labels = collector.means(client.model.feature_dim)
        return {"protos": means, "proto_labels": labels}, stats

    def evaluate(self, client, payload, config):
        """Nearest-prototype accuracy over the classes that have a global prototype."""
        protos, mask = unpack_global_set(payload, client.data.info.num_classes)
        return {}, prototype_metrics(*nearest_prototype_correct(client, protos, mask))
